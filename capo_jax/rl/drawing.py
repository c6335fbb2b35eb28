"""A step's draws: Q prompts -> G samples each -> their grades (``Drawer``).

``Drawer.draw`` encodes this process's prompts, samples them (the sampler's
tokens, lengths and truncation come to the host; its log-probs and mask stay
on the devices), grades this process's own rows and shares the rewards, so
every process holds the same global host arrays. ``Drawer.draw_groups`` draws
until dynamic sampling has its groups (``dynamic_sampling``) and keeps them
(``select``). ``rollout.collect`` builds the step from what it returns.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from capo_jax.data import reward_fns
from capo_jax.data.datasets import Example
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.rl import dynamic_sampling
from capo_jax.runtime.host import gather_rows
from capo_jax.sampling import sampler as sampling
from capo_jax.types import Array
from models.config import Qwen2Config
from models.sharding import Layout, to_host

LENGTH_BUCKET = 16  # prompt / completion widths are rounded up to a multiple of this


def bucketed(width: int, limit: int) -> int:
  """``width`` (at least 1) rounded up to ``LENGTH_BUCKET``, at most ``limit``: few shapes."""
  return min(-(-max(width, 1) // LENGTH_BUCKET) * LENGTH_BUCKET, limit)


def draw_key(rng: jax.Array, i: int) -> jax.Array:
  """The key of a step's draw ``i``: the first draw's is the step's own (as in a run
  without dynamic sampling); the extra draws get keys of their own."""
  return rng if i == 0 else jax.random.fold_in(jax.random.fold_in(rng, 1 << 30), i)


def _trim_left(tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Drops all-padding columns of a left-padded batch, keeping a bucketed width."""
  width = bucketed(int(mask.sum(1).max()), tokens.shape[1])
  return tokens[:, -width:], mask[:, -width:]


@dataclasses.dataclass
class Graded:
  """One batch of drawn prompts, sampled and graded (host arrays; ``*_dev`` on devices)."""

  tokens_QP: np.ndarray
  mask_QP: np.ndarray
  comp_BC: np.ndarray
  cmask_BC: np.ndarray
  lengths_B: np.ndarray
  truncated_B: np.ndarray
  rewards_QG: np.ndarray  # the binary labels (correct)
  health: dict[str, int]
  logp_dev: Array
  cmask_dev: Array
  time_reward: float = 0.0
  reward_QG: np.ndarray | None = None  # the scalar reward (None: the labels)

  def trimmed(self) -> Graded:
    """The completions cut to the longest sample's width, bucketed (bounded compiles)."""
    C = bucketed(int(self.lengths_B.max()), self.comp_BC.shape[1])
    return dataclasses.replace(
      self,
      comp_BC=self.comp_BC[:, :C],
      cmask_BC=self.cmask_BC[:, :C],
      logp_dev=self.logp_dev[:, :C],
      cmask_dev=self.cmask_dev[:, :C],
    )

  def prompts_BP(self) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of each row's prompt: each group's prompt repeated G times."""
    G = self.comp_BC.shape[0] // self.tokens_QP.shape[0]
    return np.repeat(self.tokens_QP, G, axis=0), np.repeat(self.mask_QP, G, axis=0)


@dataclasses.dataclass(frozen=True)
class Draws:
  """A step's draws (``Drawer.draw_groups``).

  Attributes:
    parts: every draw, in order.
    selected: the Q groups the step trains on (``parts[0]`` itself without extra draws).
    examples_Q: each kept group's example where this process drew it, else None.
    num_mixed: how many of the kept groups are mixed.
  """

  parts: list[Graded]
  selected: Graded
  examples_Q: list[Example | None]
  num_mixed: int


@dataclasses.dataclass(frozen=True)
class Drawer:
  """The sampler and the grader of a run, configured once (``rollout.RolloutContext``).

  Attributes:
    num_samples: G, samples per prompt.
    max_prompt_len: the prompts' padded width before trimming (equal on every process).
    prompts_per_call: prompts per sampler call (0: all Q in one call).
    model_cfg: the sampler's architecture.
    tokenizer: encodes the prompts, decodes the completions.
    grader: ``.score(completions, golds) -> (rewards, RewardHealth)``.
    sampling: the sampler's calls, stop and pad ids the tokenizer's.
    layout: the mesh and the sampling rules.
    reward_fns: ``data.reward_fns.RewardFns``, the scalar reward; None: reward = correct.
    max_draws: > 1: dynamic sampling, at most this many batches of Q prompts a step.
  """

  num_samples: int
  max_prompt_len: int
  prompts_per_call: int
  model_cfg: Qwen2Config
  tokenizer: Tokenizer
  grader: Any
  sampling: sampling.SamplingSpec
  layout: Layout
  reward_fns: Any = None
  max_draws: int = 1

  def draw_groups(
    self,
    examples: Sequence[Example],
    params: Any,
    rng: jax.Array,
    draw_more: Callable[[], Sequence[Example]] | None = None,
  ) -> Draws:
    """Draws ``examples`` (this process's share) and, with dynamic sampling, the batches
    ``draw_more`` returns while fewer than Q of the groups drawn are mixed; keeps Q."""
    drawn: list[list[Example]] = []
    parts: list[Graded] = []
    batch = examples
    while True:
      drawn.append(list(batch))
      parts.append(self.draw(batch, params, draw_key(rng, len(parts))))
      rewards_QG = np.concatenate([p.rewards_QG for p in parts])
      Q = parts[0].rewards_QG.shape[0]
      if draw_more is None or not dynamic_sampling.needs_more(
        rewards_QG, Q, len(parts), self.max_draws
      ):
        break
      batch = draw_more()
    idx_Q, n_mixed = dynamic_sampling.select_groups(rewards_QG, Q)
    # This process's examples of the chosen groups (None: another process's group).
    Ql, p0 = len(examples), jax.process_index() * len(examples)
    examples_Q = [
      drawn[d][q - p0] if p0 <= q < p0 + Ql else None for d, q in (divmod(int(i), Q) for i in idx_Q)
    ]
    selected = parts[0] if len(parts) == 1 else self.select(parts, idx_Q)
    return Draws(parts, selected, examples_Q, n_mixed)

  def draw(self, examples: Sequence[Example], params: Any, rng: jax.Array) -> Graded:
    """Samples and grades this process's ``examples`` under the sampler's ``params``."""
    tokenizer, G = self.tokenizer, self.num_samples
    tok_local, mask_local = tokenizer.encode_prompts(
      [e.problem for e in examples], self.max_prompt_len
    )
    # Equal widths on every process, so the all-gather stacks cleanly.
    pad = self.max_prompt_len - tok_local.shape[1]
    tok_local = np.pad(tok_local, ((0, 0), (pad, 0)), constant_values=tokenizer.pad_id)
    mask_local = np.pad(mask_local, ((0, 0), (pad, 0)))
    tokens_QP, mask_QP = _trim_left(gather_rows(tok_local), gather_rows(mask_local))
    Q = tokens_QP.shape[0]

    # Several sampler calls bound the KV cache when the whole rollout does not fit.
    per_call = self.prompts_per_call or Q
    host, dev = [], []
    for i, start in enumerate(range(0, Q, per_call)):
      samples = sampling.generate(
        params,
        self.model_cfg,
        tokens_QP[start : start + per_call],
        mask_QP[start : start + per_call],
        jax.random.fold_in(rng, i),
        self.sampling,
        layout=self.layout,
      )
      # The host needs the tokens (to decode), lengths and truncation; the sampler's
      # log-probs and mask stay on the devices (the mask is 1 up to each row's length).
      host.append([to_host(x) for x in (samples.tokens_BC, samples.lengths_B, samples.truncated_B)])
      dev.append((samples.logprobs_BC, samples.mask_BC))
    comp_BC, lengths_B, truncated_B = (np.concatenate(xs) for xs in zip(*host))
    cmask_BC = (np.arange(comp_BC.shape[1])[None] < lengths_B[:, None]).astype(np.int32)
    logp_dev, cmask_dev = (x[0] if len(x) == 1 else jnp.concatenate(x) for x in zip(*dev))

    # Grade this process's own rows only; share the rewards.
    t0 = time.perf_counter()
    n_local = len(examples) * G
    local_rows = slice(jax.process_index() * n_local, (jax.process_index() + 1) * n_local)
    texts = tokenizer.decode_completions(comp_BC[local_rows], cmask_BC[local_rows])
    correct_local, reward_local, health = reward_fns.grade(
      self.grader,
      self.reward_fns,
      texts,
      [e for e in examples for _ in range(G)],
      lengths_B[local_rows],
    )
    rewards_QG, reward_QG = (
      gather_rows(np.asarray(x, np.float32)).reshape(Q, G) for x in (correct_local, reward_local)
    )
    health_counts = gather_rows(np.asarray([list(health.values())], np.int64)).sum(0)
    return Graded(
      tokens_QP,
      mask_QP,
      comp_BC,
      cmask_BC,
      lengths_B,
      truncated_B,
      rewards_QG,
      dict(zip(health.keys(), health_counts.tolist())),
      logp_dev,
      cmask_dev,
      time.perf_counter() - t0,
      reward_QG if self.reward_fns is not None else None,
    )

  def select(self, parts: list[Graded], idx_Q: np.ndarray) -> Graded:
    """The chosen groups (indices into the draws' concatenated groups), prompts re-padded."""
    G, pad_id = self.num_samples, self.tokenizer.pad_id
    P = max(p.tokens_QP.shape[1] for p in parts)
    left = lambda x, v: np.pad(x, ((0, 0), (P - x.shape[1], 0)), constant_values=v)  # noqa: E731
    cat = lambda f: np.concatenate([f(p) for p in parts])  # noqa: E731
    rows_B = (idx_Q[:, None] * G + np.arange(G)).reshape(-1)
    health = {k: sum(p.health[k] for p in parts) for k in parts[0].health}
    dev = [
      jnp.concatenate([getattr(p, f) for p in parts])[rows_B] for f in ("logp_dev", "cmask_dev")
    ]
    comp_BC, cmask_BC, lengths_B, truncated_B = (
      cat(lambda p, f=f: getattr(p, f))[rows_B]
      for f in ("comp_BC", "cmask_BC", "lengths_B", "truncated_B")
    )
    return Graded(
      tokens_QP=cat(lambda p: left(p.tokens_QP, pad_id))[idx_Q],
      mask_QP=cat(lambda p: left(p.mask_QP, 0))[idx_Q],
      comp_BC=comp_BC,
      cmask_BC=cmask_BC,
      lengths_B=lengths_B,
      truncated_B=truncated_B,
      rewards_QG=cat(lambda p: p.rewards_QG)[idx_Q],
      health=health,
      logp_dev=dev[0],
      cmask_dev=dev[1],
      reward_QG=None if parts[0].reward_QG is None else cat(lambda p: p.reward_QG)[idx_Q],
    )
