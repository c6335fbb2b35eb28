"""One RL step's data: prompts -> samples -> rewards -> log-probs -> advantages.

For a batch of Q questions and G samples each (B = Q * G rows, grouped by
question), ``collect`` calls what the run's setup built (``RolloutContext``):

  ``Drawer.draw_groups``: sampling (jit) and rewards (host, process pool), as
  many draws as dynamic sampling needs (``drawing``) -> ``Uploader.to_devices``:
  the step's host -> device transfer (``uploader``) -> old / reference
  log-probs (``LogprobPass``: the trainer's forward) -> ``score_rollout`` (one
  jitted program: noise mask, advantages, their metrics; ``scoring``) -> the
  mismatch correction (``MismatchSpec.correct``) -> ``Rollout.minibatches``:
  the PPO updates' batches.

What crosses between host and device: the completion tokens, their lengths
and truncation flags come to the host (to decode, grade and plan the rows);
the rewards and the updates' model rows, planned once per step
(``microbatches.plan_step``) with their index arrays, go to the devices in one
upload; the log-prob passes and the train batches both read those rows. The
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

from capo_jax.data.datasets import Example
from capo_jax.rl import microbatches, mismatch
from capo_jax.rl.batch import Sequences, TrainBatch
from capo_jax.rl.drawing import Drawer
from capo_jax.rl.logprob_pass import LogprobPass, UpdateRows
from capo_jax.rl.scoring import AdvantageSpec, score_metrics, score_rollout, scores
from capo_jax.rl.uploader import Uploader
from capo_jax.types import Array


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


@functools.partial(jax.jit, static_argnames="sharding")
def _device_batch(
  rows: Any, index_MBC: Array, take_MB: Array, seqs: Sequences, *, sharding: jax.sharding.Sharding
) -> TrainBatch:
  """An update's ``TrainBatch`` from its uploaded rows and the step's sequences, gathered
  into the micro-batches' slots on the devices."""
  seqs_MB = microbatches.regroup(seqs, take_MB)
  if seqs.old_topk_ids_BCJ is not None:  # SimKO: each target's old top-K ids
    rows = microbatches.scatter_topk(rows, index_MBC, seqs_MB)
  return jax.lax.with_sharding_constraint(TrainBatch(rows, index_MBC, seqs_MB), sharding)


@dataclasses.dataclass(frozen=True)
class RolloutContext:
  """What every step's rollout calls, built once by the run's setup
  (``capo_jax.run.programs.rollout_context``).

  Attributes:
    spec: the rollout's settings.
    drawer: samples and grades the step's prompts (``drawing.Drawer``).
    uploader: plans the updates' rows and places the step's arrays on the devices.
    logprobs: the old / reference log-prob pass.
  """

  spec: RolloutSpec
  drawer: Drawer
  uploader: Uploader
  logprobs: LogprobPass


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
  spec = ctx.spec
  t0 = time.perf_counter()
  draws = ctx.drawer.draw_groups(examples, policy.sampling, rng, draw_more)
  parts, sel = draws.parts, draws.selected.trimmed()
  t_reward = sum(p.time_reward for p in parts)
  t_sample = time.perf_counter() - t0 - t_reward
  if not np.isin(sel.rewards_QG, (0.0, 1.0)).all():
    raise ValueError(
      f"the grader returned rewards other than 0 and 1: "
      f"{sorted(set(sel.rewards_QG.ravel().tolist()) - {0.0, 1.0})[:5]}"
    )

  t2 = time.perf_counter()
  Q, G = sel.rewards_QG.shape
  dev = ctx.uploader.to_devices(sel)
  old_keys = spec.old_keys
  old = (
    ctx.logprobs.run(policy.train, dev.updates, sel.cmask_dev, old_keys, policy.adapters)
    if old_keys
    else {}
  )
  old_logp_BC = sel.logp_dev if spec.old_from_sampler else old["logp_BC"]
  ref_logp_BC = None
  if policy.reference is not None:
    ref_logp_BC = ctx.logprobs.run(policy.reference, dev.updates, sel.cmask_dev, ("logp_BC",))[
      "logp_BC"
    ]

  s_QG = scores(old_logp_BC, sel.cmask_dev).reshape(Q, G)
  ref_s_QG = scores(ref_logp_BC, sel.cmask_dev).reshape(Q, G) if spec.adv.noise_mask else None
  adv_QG, adv_metrics = score_rollout(
    dev.reward_QG, s_QG, ref_s_QG, step, spec=spec.adv, correct_QG=dev.labels_QG
  )
  # Device scalars: the caller reads them with the updates' (no sync here).
  adv_metrics = {**adv_metrics, **score_metrics(s_QG, dev.correct_QG)}
  t_logp = time.perf_counter() - t2

  seqs = Sequences(
    completion_mask_BC=sel.cmask_dev,
    old_logp_BC=old_logp_BC,
    adv_B=adv_QG.reshape(-1),
    ref_logp_BC=ref_logp_BC,
    correct_B=dev.correct_B,
    old_topk_ids_BCJ=old.get("topk_ids_BCJ"),
    old_topk_logp_BCJ=old.get("topk_logp_BCJ"),
  )
  seqs, mismatch_metrics = spec.mismatch.correct(seqs, sel.logp_dev, dev.keep_B)
  correct_QG = sel.rewards_QG > 0.5
  rewards_QG = sel.rewards_QG if sel.reward_QG is None else sel.reward_QG
  lengths_B = sel.lengths_B
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
      groups_degenerate=float(Q - draws.num_mixed),
      accuracy_drawn=float(np.mean([p.rewards_QG.mean() for p in parts])),
    )
  return Rollout(
    *sel.prompts_BP(),
    sel.comp_BC,
    sel.cmask_BC,
    rewards_QG,
    s_QG,
    seqs,
    adv_QG,
    dev.updates,
    ctx.uploader.batches.sharding,
    metrics,
    draws.examples_Q,
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
