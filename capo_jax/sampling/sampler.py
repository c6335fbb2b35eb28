"""Jitted sampler: one prefill, then a donated-cache decode ``lax.while_loop``.

``generate`` left-pads the prompts to a bucketed length, runs one jitted
prefill over the Q prompts, repeats the prompt cache G times (the G samples of
a prompt share one prefill) and decodes all B = Q*G rows in a single jitted
``lax.while_loop`` whose KV cache is preallocated and donated, so it is
updated in place and no token crosses to the host until the end. Rows stop at
any stop id or at ``max_new_tokens``; the loop exits when every row is done.

Token choice is a small frozen strategy (capo_jax.sampling.strategies, re-exported
here): ``Greedy``, ``Temperature``, ``TopK``, ``TopP``. The decode step itself
(per-layer caches laid out for decoding, vocab-major logits) is
capo_jax.sampling.decode.

Randomness: step t draws one uniform per row from ``fold_in(rng, t)`` (a
vector of B independent uniforms), so the same rng and batch give the same
samples and rows draw independently.

Compilations: prompt length P and the generation buffer C are rounded up
(``bucket_length``: powers of two up to 256, then multiples of 256), so a
stream of batches with varying lengths compiles at most once per (P bucket,
C bucket, batch shape, strategy). Temperature, top-k and top-p are static (a
new value compiles anew); stop ids, max_new_tokens and the rng are not.
``TRACE_COUNTS`` counts the traces of each jitted function.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from capo_jax.sampling import decode
from capo_jax.sampling.strategies import (  # noqa: F401  (re-exported)
    Greedy, Strategy, Temperature, TopK, TopP, inverse_cdf, make_strategy)
from models import kv_cache, qwen2
from models.config import Qwen2Config
from models.qwen2 import Params
from models.sharding import Layout

# Traces of each jitted function (one per compilation), for tests and logs.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


def _choose(strategy: Strategy, logits_VB: jax.Array, rng: jax.Array, step: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
  """Token and untempered log-prob per row from vocab-major logits; uniforms of step t."""
  u_B = jax.random.uniform(jax.random.fold_in(rng, step), (logits_VB.shape[1],), jnp.float32)
  return strategy.choose(logits_VB, u_B)


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
  step: jax.Array  # int32: tokens generated so far
  last_B: jax.Array  # int32: the token fed to the next decode step
  done_B: jax.Array  # bool: emitted a stop token
  tokens_BC: jax.Array
  logprobs_BC: jax.Array
  mask_BC: jax.Array


def _constrain(layout: Layout | None, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  return x if layout is None else layout.constrain(x, axes)


def _constrain_tree(layout: Layout | None, tree: Any) -> Any:
  """Rows over the batch axes, a cache's kv heads over theirs, scalars whole."""
  def one(x: jax.Array) -> jax.Array:
    axes = {0: (), 1: ("batch",), 4: ("batch", "kv_heads", None, None),
            5: (None, "batch", None, "kv_heads", None)}.get(x.ndim, ("batch", None))
    return _constrain(layout, x, axes) if axes else x
  return tree if layout is None else jax.tree.map(one, tree)


def _is_stop(tokens_B: jax.Array, stop_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens_B[:, None] == stop_ids[None, :], axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg", "strategy", "num_samples", "gen_len",
                                             "layout"))
def _prefill(params: Params, tokens_QP: jax.Array, mask_QP: jax.Array, rng: jax.Array,
             stop_ids: jax.Array, pad_id: jax.Array, *, cfg: Qwen2Config, strategy: Strategy,
             num_samples: int, gen_len: int, layout: Layout | None
             ) -> tuple[_State, decode.DecodeCache]:
  """Prompt cache for all B = Q*G rows (with ``gen_len`` free slots) and token 0."""
  TRACE_COUNTS["prefill"] += 1
  Q, P = tokens_QP.shape
  B = Q * num_samples
  cache = _constrain_tree(layout, kv_cache.init_cache(cfg, Q, P))
  h_QPD, cache = qwen2.hidden_states_with_cache(params, cfg, tokens_QP, mask_QP, cache)
  # Left padding puts every row's last prompt token at P - 1: unembed only it.
  logits_QV = qwen2.logits_from_hidden(params, cfg, h_QPD[:, -1:])[:, 0]
  caches = decode.DecodeCache.from_prefill(kv_cache.repeat_rows(cache, num_samples), gen_len)
  logits_VB = _constrain(layout, jnp.repeat(logits_QV, num_samples, axis=0).T,
                         ("vocab", "batch"))
  token_B, logprob_B = _choose(strategy, logits_VB, rng, jnp.zeros((), jnp.int32))
  state = _State(
      step=jnp.ones((), jnp.int32), last_B=token_B, done_B=_is_stop(token_B, stop_ids),
      tokens_BC=jnp.full((B, gen_len), pad_id, jnp.int32).at[:, 0].set(token_B),
      logprobs_BC=jnp.zeros((B, gen_len), jnp.float32).at[:, 0].set(logprob_B),
      mask_BC=jnp.zeros((B, gen_len), jnp.int32).at[:, 0].set(1))
  return _constrain_tree(layout, state), _constrain_tree(layout, caches)


@functools.partial(jax.jit, static_argnames=("cfg", "strategy", "layout"),
                   donate_argnames=("cache",))
def _decode(params: Params, state: _State, cache: decode.DecodeCache, rng: jax.Array,
            stop_ids: jax.Array, pad_id: jax.Array, max_new_tokens: jax.Array, *,
            cfg: Qwen2Config, strategy: Strategy, layout: Layout | None
            ) -> tuple[Samples, decode.DecodeCache]:
  """Decodes until every row stopped or ``max_new_tokens``; one device program."""
  TRACE_COUNTS["decode"] += 1
  weights = decode.prepare(params, cfg, cache.mask_BS.shape[1])

  def cond(carry: tuple[_State, decode.DecodeCache]) -> jax.Array:
    s, _ = carry
    return (s.step < max_new_tokens) & ~jnp.all(s.done_B)

  def body(carry: tuple[_State, decode.DecodeCache]) -> tuple[_State, decode.DecodeCache]:
    s, cache = carry
    logits_VB, cache = decode.step(weights, cfg, s.last_B, cache)
    logits_VB = _constrain(layout, logits_VB, ("vocab", "batch"))
    token_B, logprob_B = _choose(strategy, logits_VB, rng, s.step)
    active_B = ~s.done_B
    put = lambda buf, col: jax.lax.dynamic_update_slice(buf, col[:, None], (0, s.step))
    s = _State(
        step=s.step + 1, last_B=token_B, done_B=s.done_B | _is_stop(token_B, stop_ids),
        tokens_BC=put(s.tokens_BC, jnp.where(active_B, token_B, pad_id)),
        logprobs_BC=put(s.logprobs_BC, jnp.where(active_B, logprob_B, 0.0)),
        mask_BC=put(s.mask_BC, active_B.astype(jnp.int32)))
    return _constrain_tree(layout, s), _constrain_tree(layout, cache)

  state, cache = jax.lax.while_loop(cond, body, (state, cache))
  samples = Samples(tokens_BC=state.tokens_BC, mask_BC=state.mask_BC,
                    logprobs_BC=state.logprobs_BC, lengths_B=state.mask_BC.sum(-1),
                    truncated_B=~state.done_B)
  return samples, cache


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
    raise ValueError(f"prompt_tokens_QP {tokens.shape} and prompt_mask_QP {mask.shape} must be "
                     "2-D arrays of the same shape")
  if not np.isin(mask, (0, 1)).all():
    raise ValueError("prompt_mask_QP must hold only 0 and 1")
  bad = np.nonzero(np.any(np.diff(mask.astype(np.int32), axis=1) < 0, axis=1)
                   | (mask.sum(1) == 0))[0]
  if bad.size:
    raise ValueError(f"prompt row {int(bad[0])}: the mask must be left-padded (0...0 1...1) "
                     "with at least one real token")
  real = tokens[mask.astype(bool)]
  if real.size and (real.min() < 0 or real.max() >= vocab_size):
    raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got "
                     f"[{real.min()}, {real.max()}]")


def generate(params: Params, cfg: Qwen2Config, prompt_tokens_QP: Any, prompt_mask_QP: Any,
             rng: jax.Array, *, num_samples: int, max_new_tokens: int,
             strategy: Strategy = Temperature(1.0), stop_ids: Sequence[int] = (),
             pad_id: int = 0, layout: Layout | None = None) -> Samples:
  """Samples ``num_samples`` completions of each left-padded prompt.

  Ten arguments, all but the model, prompts and rng keyword-only knobs that
  callers set independently (a sampling-config object would only move them).

  Args:
    params, cfg: the Qwen2 policy.
    prompt_tokens_QP, prompt_mask_QP: [Q, P] left-padded prompts, mask 1 on
      real tokens.
    rng: a PRNG key; the same key gives the same samples.
    num_samples: G, samples per prompt; output row q*G + g is sample g of
      prompt q.
    max_new_tokens: C, the completion length limit (and the output width).
    strategy: token choice (``Greedy()``, ``Temperature(t)``, ``TopK``,
      ``TopP``; ``make_strategy(temperature, top_p, top_k)`` builds one from
      transformers-style values). Default: the policy's own distribution.
    stop_ids: token ids that end a row (e.g. EOS and ``<|im_end|>``); the
      stop token is part of the completion.
    pad_id: token written after a row's end.
    layout: optional ``models.sharding.Layout`` (mesh + rules, e.g.
      ``capo_jax.runtime.mesh.SAMPLING_RULES``): rows are split over the
      ``"batch"`` axes, params placed per the rules. Without one, runs unsharded.

  Returns:
    ``Samples`` of [Q*G, C] tokens / mask / logprobs and [Q*G] lengths /
    truncated.
  """
  if num_samples < 1 or max_new_tokens < 1:
    raise ValueError(f"num_samples ({num_samples}) and max_new_tokens ({max_new_tokens}) "
                     "must be >= 1")
  if layout is not None and any(t != AxisType.Auto for t in layout.mesh.axis_types):
    raise ValueError(f"mesh axis types {layout.mesh.axis_types}: the sampler states shardings "
                     "with constraints and needs AxisType.Auto axes "
                     "(capo_jax.runtime.mesh.make_mesh)")
  tokens = np.asarray(prompt_tokens_QP)
  mask = np.asarray(prompt_mask_QP)
  _check_prompts(tokens, mask, cfg.vocab_size)
  stops = np.asarray(list(stop_ids), np.int32).reshape(-1)
  if stops.size and (stops.min() < 0 or stops.max() >= cfg.vocab_size):
    raise ValueError(f"stop_ids {stops.tolist()} must be in [0, {cfg.vocab_size})")
  Q, P = tokens.shape
  longest = int(mask.sum(1).max()) + max_new_tokens
  if longest > cfg.max_position_embeddings:
    raise ValueError(f"longest prompt + max_new_tokens = {longest} exceeds "
                     f"max_position_embeddings={cfg.max_position_embeddings}")
  P_pad = bucket_length(P, PROMPT_BUCKET_MIN) - P
  gen_len = bucket_length(max_new_tokens, GEN_BUCKET_MIN)
  tokens = np.pad(tokens.astype(np.int32), ((0, 0), (P_pad, 0)), constant_values=pad_id)
  mask = np.pad(mask.astype(np.bool_), ((0, 0), (P_pad, 0)))
  if layout is not None:
    tokens, mask = layout.put(tokens, ("batch", None)), layout.put(mask, ("batch", None))
    params = jax.device_put(params, qwen2.param_shardings(cfg, layout))
  # -1 never matches a token; padding the stop list to 8 ids keeps its shape
  # (a jit argument) fixed across stop sets.
  width = max(8, -(-stops.size // 8) * 8)
  stops = np.pad(stops, (0, width - stops.size), constant_values=-1)
  stops_j, pad_j = jnp.asarray(stops), jnp.asarray(pad_id, jnp.int32)
  state, cache = _prefill(params, tokens, mask, rng, stops_j, pad_j, cfg=cfg, strategy=strategy,
                          num_samples=num_samples, gen_len=gen_len, layout=layout)
  samples, _ = _decode(params, state, cache, rng, stops_j, pad_j,
                       jnp.asarray(max_new_tokens, jnp.int32), cfg=cfg, strategy=strategy,
                       layout=layout)
  if gen_len == max_new_tokens:
    return samples
  return jax.tree.map(lambda x: x[:, :max_new_tokens] if x.ndim == 2 else x, samples)
