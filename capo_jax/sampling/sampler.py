"""``generate``: checks and pads the prompts, then runs the rollout engine.

``generate(params, cfg, tokens_QP, mask_QP, rng, spec)`` left-pads the
prompts to a bucketed length and runs the two jitted programs of
capo_jax.sampling.engine: one prefill over the Q prompts (the G samples of a
prompt share it) and one ``lax.while_loop`` that decodes the B = Q*G rows
over a KV cache of W = ``spec.max_active_rows`` slots (all B rows when None).
When a row stops, its slot takes the next waiting row, so the work follows the
tokens generated, not B x the longest row; no token crosses to the host until
the end. Rows stop at any stop id or at ``max_new_tokens``.

Token choice is a small frozen strategy (capo_jax.sampling.strategies, re-exported
here) in the ``SamplingSpec``: ``Greedy``, ``Temperature``, ``TopK``, ``TopP``.

Randomness: token t of row b draws one uniform from
``fold_in(fold_in(rng, b), t)``, so the same rng gives the same samples
whatever W, the slot or the step a row ran in.

Compilations: prompt length P and the generation buffer C are rounded up
(``bucket_length``: powers of two up to 256, then multiples of 256), so a
stream of batches with varying lengths compiles at most once per (P bucket,
C bucket, batch shape, W, strategy). Temperature, top-k and top-p are static (a
new value compiles anew); stop ids, max_new_tokens and the rng are not.
``TRACE_COUNTS`` counts the traces of each jitted function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from capo_jax.sampling import decode, engine, plans
from capo_jax.sampling.strategies import Strategy, Temperature
from models import qwen2
from models.config import Qwen2Config
from models.qwen2 import Params
from models.sharding import Layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Samples:
  """Completions, rows grouped by prompt (the G samples of prompt 0 first).

  ``mask_BC`` is 1 up to and including the stop token, 0 after; ``tokens_BC``
  hold the pad id where the mask is 0 and ``logprobs_BC`` hold 0 there. The
  log-probs are log_softmax of the raw logits at the sampled token (the
  untempered policy), whatever the strategy. ``truncated_B`` marks rows
  that reached ``max_new_tokens`` without a stop token.
  """

  tokens_BC: jax.Array  # int32
  mask_BC: jax.Array  # int32
  logprobs_BC: jax.Array  # float32
  lengths_B: jax.Array  # int32
  truncated_B: jax.Array  # bool


def bucket_length(n: int, minimum: int, step: int = 256) -> int:
  """``n`` rounded up to a power of two below ``step``, to a multiple of ``step`` above.

  Bounds the number of distinct shapes (compilations) to log2(step) + max/step
  while wasting at most half a bucket on short lengths and < ``step`` on long ones.
  """
  if n > step:
    return -(-n // step) * step
  return max(minimum, 1 << max(n - 1, 0).bit_length())


PROMPT_BUCKET_MIN = 16
GEN_BUCKET_MIN = 16


def _check_prompts(tokens: np.ndarray, mask: np.ndarray, vocab_size: int) -> None:
  if tokens.ndim != 2 or mask.shape != tokens.shape:
    raise ValueError(
      f"prompt_tokens_QP {tokens.shape} and prompt_mask_QP {mask.shape} must be "
      "2-D arrays of the same shape"
    )
  if not np.isin(mask, (0, 1)).all():
    raise ValueError("prompt_mask_QP must hold only 0 and 1")
  bad = np.nonzero(np.any(np.diff(mask.astype(np.int32), axis=1) < 0, axis=1) | (mask.sum(1) == 0))[
    0
  ]
  if bad.size:
    raise ValueError(
      f"prompt row {int(bad[0])}: the mask must be left-padded (0...0 1...1) "
      "with at least one real token"
    )
  real = tokens[mask.astype(bool)]
  if real.size and (real.min() < 0 or real.max() >= vocab_size):
    raise ValueError(
      f"prompt token ids must be in [0, {vocab_size}), got [{real.min()}, {real.max()}]"
    )


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  """What to sample, apart from the model, the prompts and the rng.

  num_samples: G, samples per prompt; output row q*G + g is sample g of
    prompt q.
  max_new_tokens: C, the completion length limit (and the output width).
  strategy: token choice (``Greedy()``, ``Temperature(t)``, ``TopK``, ``TopP``;
    ``make_strategy(temperature, top_p, top_k)`` builds one from
    transformers-style values). Default: the policy's own distribution.
  stop_ids: token ids that end a row (e.g. EOS and ``<|im_end|>``); the stop
    token is part of the completion.
  pad_id: token written after a row's end.
  max_active_rows: W, the rows decoded at once and the KV cache's slots
    (continuous batching: a stopped row's slot takes the next waiting row;
    once none waits, the active rows move to caches of W/4 and W/16 slots as
    they fit, ``plans.Plan.phases``). None: all Q*G rows at once. The samples
    are the same whatever W.
  """

  num_samples: int
  max_new_tokens: int
  strategy: Strategy = Temperature(1.0)
  stop_ids: Sequence[int] = ()
  pad_id: int = 0
  max_active_rows: int | None = None

  def __post_init__(self) -> None:
    if self.num_samples < 1 or self.max_new_tokens < 1:
      raise ValueError(
        f"num_samples ({self.num_samples}) and max_new_tokens ({self.max_new_tokens}) must be >= 1"
      )
    if self.max_active_rows is not None and self.max_active_rows < 1:
      raise ValueError(
        f"max_active_rows must be >= 1 (or None: all rows), got {self.max_active_rows}"
      )
    object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))


def engine_plan(
  cfg: Qwen2Config, spec: SamplingSpec, layout: Layout | None, num_prompts: int
) -> plans.Plan:
  """The static shape of the engine's programs for one call of ``num_prompts`` prompts:
  what ``generate`` runs, and what the ahead-of-time compile lowers."""
  B = num_prompts * spec.num_samples
  W = B if spec.max_active_rows is None else min(spec.max_active_rows, B)
  devices = jax.devices() if layout is None else layout.mesh.devices.flat
  # XLA:CPU rounds row reductions by row count below 8 rows (decode.MIN_ROWS_CPU).
  cpu = next(iter(devices)).platform == "cpu"
  # The tail moves to smaller caches once a quarter of the slots hold the active rows,
  # also with every row in a slot at once (W = B) on an accelerator: by the TPU
  # compiler, 7B on v4-64 (docs/tpu.md). On CPU, W = B stays one loop: each tail loop
  # is one more compile of the decode step, in every test and demo run.
  return plans.Plan(
    cfg=cfg,
    strategy=spec.strategy,
    num_samples=spec.num_samples,
    num_slots=W,
    gen_len=bucket_length(spec.max_new_tokens, GEN_BUCKET_MIN),
    layout=layout,
    block=plans.KV_BLOCK,
    min_slots=decode.MIN_ROWS_CPU if cpu else 1,
    shrink=W < B or not cpu,
    attention=plans.ATTENTION,
    ragged_block=plans.RAGGED_BLOCK,
    ragged_align=plans.RAGGED_ALIGN,
  )


def generate(
  params: Params,
  cfg: Qwen2Config,
  prompt_tokens_QP: Any,
  prompt_mask_QP: Any,
  rng: jax.Array,
  spec: SamplingSpec,
  layout: Layout | None = None,
) -> Samples:
  """Samples ``spec.num_samples`` completions of each left-padded prompt.

  Args:
    params, cfg: the Qwen2 policy.
    prompt_tokens_QP, prompt_mask_QP: [Q, P] left-padded prompts, mask 1 on
      real tokens.
    rng: a PRNG key; the same key gives the same samples.
    spec: samples per prompt, length limit, strategy, stop / pad ids and
      slots (``SamplingSpec``).
    layout: optional ``models.sharding.Layout`` (mesh + rules, e.g.
      ``capo_jax.runtime.mesh.SAMPLING_RULES``): rows and cache slots are split
      over the ``"batch"`` axes, params placed per the rules. Without one,
      runs unsharded.

  Returns:
    ``Samples`` of [Q*G, C] tokens / mask / logprobs and [Q*G] lengths /
    truncated.
  """
  max_new_tokens, pad_id = spec.max_new_tokens, spec.pad_id
  if layout is not None and any(t != AxisType.Auto for t in layout.mesh.axis_types):
    raise ValueError(
      f"mesh axis types {layout.mesh.axis_types}: the sampler states shardings "
      "with constraints and needs AxisType.Auto axes "
      "(capo_jax.runtime.mesh.make_mesh)"
    )
  tokens = np.asarray(prompt_tokens_QP)
  mask = np.asarray(prompt_mask_QP)
  _check_prompts(tokens, mask, cfg.vocab_size)
  stops = np.asarray(spec.stop_ids, np.int32).reshape(-1)
  if stops.size and (stops.min() < 0 or stops.max() >= cfg.vocab_size):
    raise ValueError(f"stop_ids {stops.tolist()} must be in [0, {cfg.vocab_size})")
  Q, P = tokens.shape
  longest = int(mask.sum(1).max()) + max_new_tokens
  if longest > cfg.max_position_embeddings:
    raise ValueError(
      f"longest prompt + max_new_tokens = {longest} exceeds "
      f"max_position_embeddings={cfg.max_position_embeddings}"
    )
  P_pad = bucket_length(P, PROMPT_BUCKET_MIN) - P
  gen_len = bucket_length(max_new_tokens, GEN_BUCKET_MIN)
  tokens_QP: np.ndarray | jax.Array = np.pad(
    tokens.astype(np.int32), ((0, 0), (P_pad, 0)), constant_values=pad_id
  )
  mask_QP: np.ndarray | jax.Array = np.pad(mask.astype(np.bool_), ((0, 0), (P_pad, 0)))
  if layout is not None:
    rows = ("batch", None)
    tokens_QP, mask_QP = layout.put(tokens_QP, rows), layout.put(mask_QP, rows)
    params = jax.device_put(params, qwen2.param_shardings(cfg, layout))
  # -1 never matches a token; padding the stop list to 8 ids keeps its shape
  # (a jit argument) fixed across stop sets.
  width = max(8, -(-stops.size // 8) * 8)
  stops = np.pad(stops, (0, width - stops.size), constant_values=-1)
  ends = plans.Ends(
    stop_ids=jnp.asarray(stops),
    pad_id=jnp.asarray(pad_id, jnp.int32),
    max_new_tokens=jnp.asarray(max_new_tokens, jnp.int32),
  )
  plan = engine_plan(cfg, spec, layout, Q)
  prompts, first = engine.prefill(params, tokens_QP, mask_QP, rng, plan=plan.prefill_plan)
  tokens_BC, logprobs_BC, mask_BC, stopped_B = engine.decode_loop(
    params, prompts, first, rng, ends, plan=plan
  )
  if gen_len != max_new_tokens:
    tokens_BC, logprobs_BC, mask_BC = (
      x[:, :max_new_tokens] for x in (tokens_BC, logprobs_BC, mask_BC)
    )
  return Samples(
    tokens_BC=tokens_BC,
    mask_BC=mask_BC,
    logprobs_BC=logprobs_BC,
    lengths_B=mask_BC.sum(-1),
    truncated_B=~stopped_B,
  )
