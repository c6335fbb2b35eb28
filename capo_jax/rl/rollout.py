"""One RL step's data: prompts -> samples -> rewards -> log-probs -> advantages.

For a batch of Q questions and G samples each (B = Q * G rows, grouped by
question), ``collect`` orchestrates:

  ``Drawer.draw``: sampling (jit) and rewards (host, process pool), ``drawing``
  -> old / reference log-probs (jit, trainer forward) -> ``score_rollout`` (one
  jitted program: noise mask, advantages, their metrics; ``scoring``) ->
  ``Rollout.minibatches``: the PPO updates' batches.

The run's setup builds the ``RolloutContext`` once (its sampler and grader, the
log-prob pass, the updates' layout); ``collect`` only calls them.

What crosses between host and device: the completion tokens, their lengths
and truncation flags come to the host (to decode, grade and plan the rows);
the rewards and the updates' model rows, planned once per step
(``packing.plan_step``) with their index arrays, go to the devices in one
transfer; the log-prob passes and the train batches both read those rows. The
log-probs, masks, scores, advantages, every mini-batch's per-sequence arrays and
the logged metrics stay on the devices: ``Rollout.metrics`` holds device scalars
for the caller to read with the updates' own, in one ``jax.device_get`` once the
updates are dispatched.

Multi-host: each process reads and grades only its own questions; prompt
tokens and rewards are all-gathered (small arrays), so every process holds the
same global host arrays and builds the same global device arrays from them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from capo_jax.data.datasets import Example
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.rl import dynamic_sampling, logprob_pass, mismatch, packing
from capo_jax.rl.batch import Sequences, TrainBatch
from capo_jax.rl.drawing import Drawer, Graded, bucketed
from capo_jax.rl.logprob_pass import LogprobPass, UpdateRows
from capo_jax.rl.scoring import AdvantageSpec, score_metrics, score_rollout, scores
from capo_jax.runtime.host import put_global
from capo_jax.sampling import sampler as sampling
from capo_jax.types import Array
from models.config import Qwen2Config
from models.sharding import Layout


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """What ``collect`` needs to know besides the arrays (from the run's spec)."""

  num_samples: int
  max_prompt_len: int
  adv: AdvantageSpec
  old_from_sampler: bool
  simko_k: int = 0
  prompts_per_call: int = 0  # 0: all Q prompts in one sampler call
  dynamic_max_draws: int = 1  # > 1: dynamic sampling, at most this many batches of Q prompts
  # The sampler / trainer mismatch metrics, IS correction and truncated rows (default: none).
  mismatch: mismatch.MismatchSpec = mismatch.MismatchSpec(measure=False)

  @property
  def old_keys(self) -> tuple[str, ...]:
    """What the old policy's pass returns: nothing when the sampler's log-probs serve."""
    return (() if self.old_from_sampler else ("logp_BC",)) + (
      ("topk_ids_BCJ", "topk_logp_BCJ") if self.simko_k else ()
    )


@dataclasses.dataclass
class Rollout:
  """One step's rollout: what the host needs as host arrays (global, identical on
  every process), the trainer's per-sequence arrays [B, ...] on the devices."""

  prompt_tokens_BP: np.ndarray
  prompt_mask_BP: np.ndarray
  completion_tokens_BC: np.ndarray
  completion_mask_BC: np.ndarray
  rewards_QG: np.ndarray
  s_QG: Array  # device
  seqs: Sequences  # device arrays, B rows
  adv_QG: Array  # device
  updates: list[UpdateRows]  # device: each update's micro-batch rows (``Rollout.minibatches``)
  batch_sharding: jax.sharding.Sharding  # the train batches'
  metrics: dict[str, Any]  # host floats, and device scalars not yet read
  # The example of each group when this process drew it, else None (multi-host).
  examples_Q: list[Example | None]
  correct_QG: np.ndarray | None = None  # the binary labels (rewards_QG: the scalar reward)

  def minibatches(self) -> list[TrainBatch]:
    """Consecutive groups of questions, each one update's ``TrainBatch`` on the devices:
    the rows the rollout uploaded, per-sequence arrays gathered on the devices."""
    return [
      _device_batch(u.rows, u.index_MBC, u.take_MB, self.seqs, sharding=self.batch_sharding)
      for u in self.updates
    ]


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """How an update's sequences become a ``TrainBatch`` (the run's packing settings).

  Attributes:
    rows: the micro-batches' rows (``packing.RowLayout``).
    sharding: the train batch's sharding ([M, rows or slots, ...] on axis 1).
    prompts: questions per update (the PPO mini-batch).
  """

  rows: packing.RowLayout
  sharding: jax.sharding.Sharding
  prompts: int


@functools.partial(jax.jit, static_argnames="sharding")
def _device_batch(
  rows: Any, index_MBC: Array, take_MB: Array, seqs: Sequences, *, sharding: jax.sharding.Sharding
) -> TrainBatch:
  """An update's ``TrainBatch`` from its uploaded rows and the step's sequences, gathered
  into the micro-batches' slots on the devices."""
  seqs_MB = packing.regroup(seqs, take_MB)
  if seqs.old_topk_ids_BCJ is not None:  # SimKO: each target's old top-K ids
    rows = packing.scatter_topk(rows, index_MBC, seqs_MB)
  return jax.lax.with_sharding_constraint(TrainBatch(rows, index_MBC, seqs_MB), sharding)


@dataclasses.dataclass(frozen=True)
class RolloutContext:
  """The fixed parts of a run that every step's rollout uses (the run's setup builds it;
  ``drawer`` and ``replicated`` are made from it once, at the first step)."""

  spec: RolloutSpec
  model_cfg: Qwen2Config
  tokenizer: Tokenizer
  grader: Any  # .score(completions, golds) -> (rewards, RewardHealth)
  sampling: sampling.SamplingSpec  # the sampler's calls, stop and pad ids the tokenizer's
  sampling_layout: Layout  # the mesh and the sampling rules
  logprobs: LogprobPass  # the old / reference pass
  batches: BatchLayout  # the updates' micro-batches: planned and uploaded by ``collect``
  reward_fns: Any = None  # data.reward_fns.RewardFns: the scalar reward; None: reward = correct

  @functools.cached_property
  def drawer(self) -> Drawer:
    """The configured sampler and grader of one draw of prompts."""
    s = self.spec
    return Drawer(
      s.num_samples,
      s.max_prompt_len,
      s.prompts_per_call,
      self.model_cfg,
      self.tokenizer,
      self.grader,
      self.sampling,
      self.sampling_layout,
      self.reward_fns,
    )

  @functools.cached_property
  def replicated(self) -> NamedSharding:
    """The per-group arrays' sharding (rewards, labels: small, on every device)."""
    return NamedSharding(self.sampling_layout.mesh, PartitionSpec())


def collect(
  examples: Sequence[Example],
  ctx: RolloutContext,
  policy: PolicyArgs,
  *,
  step: int,
  rng: jax.Array,
  draw_more: Callable[[], Sequence[Example]] | None = None,
) -> Rollout:
  """Samples, grades and scores this step's questions (``examples``: this process's share).

  ``policy``: the weights each stage reads (``PolicyArgs``). ``draw_more``:
  returns this process's share of the next batch of prompts from the data
  stream; called only with dynamic sampling (``spec.dynamic_max_draws`` > 1),
  while fewer than Q drawn groups are mixed (``dynamic_sampling``). The
  reward-health counts cover every graded sample, the other metrics the Q groups kept.
  """
  spec, drawer = ctx.spec, ctx.drawer
  G = spec.num_samples
  t0 = time.perf_counter()
  drawn = [list(examples)]
  parts = [drawer.draw(examples, policy.sampling, rng)]
  Q = parts[0].rewards_QG.shape[0]
  while draw_more is not None and dynamic_sampling.needs_more(
    np.concatenate([p.rewards_QG for p in parts]), Q, len(parts), spec.dynamic_max_draws
  ):
    drawn.append(list(draw_more()))
    # Extra draws get their own keys; the first draw's stay those of a run without the filter.
    parts.append(
      drawer.draw(
        drawn[-1], policy.sampling, jax.random.fold_in(jax.random.fold_in(rng, 1 << 30), len(parts))
      )
    )
  idx_Q, n_mixed = dynamic_sampling.select_groups(np.concatenate([p.rewards_QG for p in parts]), Q)
  sel: Graded = parts[0] if len(parts) == 1 else drawer.select(parts, idx_Q)
  t_reward = sum(p.time_reward for p in parts)
  t_sample = time.perf_counter() - t0 - t_reward
  # This process's examples of the chosen groups (None: another process's group).
  Ql, p0 = len(examples), jax.process_index() * len(examples)
  examples_Q = [
    drawn[d][q - p0] if p0 <= q < p0 + Ql else None for d, q in (divmod(int(i), Q) for i in idx_Q)
  ]

  # Completion width: the longest sample of the step, bucketed (bounded compiles).
  C = bucketed(int(sel.lengths_B.max()), sel.comp_BC.shape[1])
  comp_BC, cmask_BC = sel.comp_BC[:, :C], sel.cmask_BC[:, :C]
  sampler_logp_BC, cmask_dev = sel.logp_dev[:, :C], sel.cmask_dev[:, :C]
  rewards_QG, lengths_B = sel.rewards_QG, sel.lengths_B
  if not np.isin(rewards_QG, (0.0, 1.0)).all():
    raise ValueError(
      f"the grader returned rewards other than 0 and 1: "
      f"{sorted(set(rewards_QG.ravel().tolist()) - {0.0, 1.0})[:5]}"
    )

  t2 = time.perf_counter()
  prompt_BP = np.repeat(sel.tokens_QP, G, axis=0)
  pmask_BP = np.repeat(sel.mask_QP, G, axis=0)
  old_keys = spec.old_keys
  # One plan and one upload of the step's rows: the passes and the updates read them.
  updates = logprob_pass.upload(
    packing.plan_step(
      prompt_BP, pmask_BP, comp_BC, cmask_BC, ctx.batches.rows, ctx.batches.prompts * G
    ),
    ctx.batches.sharding,
  )
  old = (
    ctx.logprobs.run(policy.train, updates, cmask_dev, old_keys, policy.adapters)
    if old_keys
    else {}
  )
  old_logp_BC = sampler_logp_BC if spec.old_from_sampler else old["logp_BC"]
  ref_logp_BC = None
  if policy.reference is not None:
    ref_logp_BC = ctx.logprobs.run(policy.reference, updates, cmask_dev, ("logp_BC",))["logp_BC"]

  s_QG = scores(old_logp_BC, cmask_dev).reshape(Q, G)
  ref_s_QG = scores(ref_logp_BC, cmask_dev).reshape(Q, G) if spec.adv.noise_mask else None
  replicated = ctx.replicated
  correct_QG = rewards_QG > 0.5
  rewards_dev, correct_dev = put_global((rewards_QG, correct_QG), replicated)
  labels_dev = None if sel.reward_QG is None else rewards_dev  # plug-ins: reward != labels
  if sel.reward_QG is not None:
    rewards_QG, rewards_dev = sel.reward_QG, put_global(sel.reward_QG, replicated)
  adv_QG, adv_metrics = score_rollout(
    rewards_dev, s_QG, ref_s_QG, step, spec=spec.adv, correct_QG=labels_dev
  )
  # Device scalars: the caller reads them with the updates' (no sync here).
  adv_metrics = {**adv_metrics, **score_metrics(s_QG, correct_dev)}
  t_logp = time.perf_counter() - t2

  seqs = Sequences(
    completion_mask_BC=cmask_dev,
    old_logp_BC=old_logp_BC,
    adv_B=adv_QG.reshape(-1),
    ref_logp_BC=ref_logp_BC,
    correct_B=put_global(correct_QG.reshape(-1), ctx.logprobs.index_sharding)
    if spec.simko_k
    else None,
    old_topk_ids_BCJ=old.get("topk_ids_BCJ"),
    old_topk_logp_BCJ=old.get("topk_logp_BCJ"),
  )
  seqs, mismatch_metrics = mismatch.correct(
    seqs, sampler_logp_BC, sel.truncated_B, spec.mismatch, ctx.logprobs.index_sharding
  )
  n_gen = int(sum(int(p.lengths_B.sum()) for p in parts))
  metrics = {
    "accuracy": float(correct_QG.mean()),
    "auc_mean": adv_metrics.pop("auc_mean"),
    "auc_questions": adv_metrics.pop("auc_questions"),
    "frac_all_correct": float(correct_QG.all(1).mean()),
    "frac_all_wrong": float((~correct_QG).all(1).mean()),
    "response_len": float(lengths_B.mean()),
    "truncation_rate": float(sel.truncated_B.mean()),
    **adv_metrics,
    **mismatch_metrics,
    "time_sample": t_sample,
    "time_reward": t_reward,
    "time_logprobs": t_logp,
    "sample_tokens_per_s": n_gen / max(t_sample, 1e-9),
    **{f"reward/{k}": float(v) for k, v in sel.health.items()},
    **({"reward_mean": float(rewards_QG.mean())} if sel.reward_QG is not None else {}),
  }
  if spec.dynamic_max_draws > 1:
    # Drawn: every prompt sampled this step; dropped: the drawn groups not trained on.
    metrics.update(
      prompts_drawn=float(Q * len(parts)),
      prompts_dropped=float(Q * len(parts) - Q),
      groups_degenerate=float(Q - n_mixed),
      accuracy_drawn=float(np.mean([p.rewards_QG.mean() for p in parts])),
    )
  return Rollout(
    prompt_BP,
    pmask_BP,
    comp_BC,
    cmask_BC,
    rewards_QG,
    s_QG,
    seqs,
    adv_QG,
    updates,
    ctx.batches.sharding,
    metrics,
    examples_Q,
    correct_QG,
  )


@dataclasses.dataclass(frozen=True)
class PolicyArgs:
  """The weights a rollout reads.

  Attributes:
    sampling: the policy in the sampler's dtype and shardings.
    train: the policy as trained (the old log-probs come from it); with LoRA
      the frozen base.
    reference: the frozen reference, or None when nothing needs it (LoRA: the
      base itself, one copy).
    adapters: LoRA's trained adapters (the policy is ``train`` with them), else None.
  """

  sampling: Any
  train: Any
  reference: Any = None
  adapters: Any = None
