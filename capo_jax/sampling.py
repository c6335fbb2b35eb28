"""Jitted sampler: one prefill, then a donated-cache decode ``lax.while_loop``.

``generate`` left-pads the prompts to a bucketed length, runs one jitted
prefill over the Q prompts, repeats the prompt cache G times (the G samples of
a prompt share one prefill) and decodes all B = Q*G rows in a single jitted
``lax.while_loop`` whose KV cache is preallocated and donated, so it is
updated in place and no token crosses to the host until the end. Rows stop at
any stop id or at ``max_new_tokens``; the loop exits when every row is done.

Token choice is a small frozen strategy object with
``next_token(logits_BV, rng) -> tokens_B``: ``Greedy``, ``Temperature``,
``TopK``, ``TopP``. Sampling uses an inverse-CDF draw (one uniform per row
against the cumulative exp-logits, in two levels of 128-token blocks): on CPU
it costs a fraction of ``jax.random.categorical``'s Gumbel noise over the
whole vocabulary.

Randomness: row r at step t draws from ``fold_in(fold_in(rng, r), t)``, so
the same rng gives the same samples and rows are independent.

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
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models import kv_cache, qwen2, sharding
from models.config import Qwen2Config

Params = dict[str, Any]

# Traces of each jitted function (one per compilation), for tests and logs.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()

_BLOCK = 128  # vocabulary block of the two-level inverse-CDF draw


# --- token choice -------------------------------------------------------------


def _row_uniforms(rng: jax.Array, batch: int) -> jax.Array:
  """One uniform in [0, 1) per row; ``rng`` is one key or one key per row."""
  typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
  if rng.ndim == (0 if typed else 1):  # a single (typed or raw uint32[2]) key
    rng = jax.random.split(rng, batch)
  return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(rng)


def inverse_cdf(weights_BV: jax.Array, u_B: jax.Array) -> jax.Array:
  """Token i drawn with probability weights[i] / sum(weights) (weights >= 0).

  Returns the first token whose running sum exceeds ``u * total``. Two levels
  (block sums, then within the chosen block) keep the cumulative sums short.
  A zero-weight token never is: its running sum equals its predecessor's.
  """
  B, V = weights_BV.shape
  nb = -(-V // _BLOCK)
  w_BNK = jnp.pad(weights_BV, ((0, 0), (0, nb * _BLOCK - V))).reshape(B, nb, _BLOCK)
  cum_BN = jnp.cumsum(w_BNK.sum(-1), axis=-1)
  target_B = u_B * cum_BN[:, -1]
  block_B = jnp.sum(cum_BN <= target_B[:, None], axis=-1, dtype=jnp.int32)
  block_B = jnp.minimum(block_B, nb - 1)
  before_B = jnp.where(
      block_B > 0, jnp.take_along_axis(cum_BN, jnp.maximum(block_B - 1, 0)[:, None], 1)[:, 0],
      0.0)
  w_BK = jnp.take_along_axis(w_BNK, block_B[:, None, None], axis=1)[:, 0]
  inner_BK = jnp.cumsum(w_BK, axis=-1)
  idx_B = jnp.sum(inner_BK <= (target_B - before_B)[:, None], axis=-1, dtype=jnp.int32)
  # Rounding can push the index one past the block's mass: clamp to its last
  # positive-weight token so excluded (zero-weight) tokens stay excluded.
  last_B = jnp.max(jnp.where(w_BK > 0, jnp.arange(_BLOCK, dtype=jnp.int32), 0), axis=-1)
  return block_B * _BLOCK + jnp.minimum(idx_B, last_B)


def _exp_weights(logits_BV: jax.Array, temperature: float) -> jax.Array:
  """exp((logits - max) / T): unnormalised probabilities of softmax(logits / T)."""
  m_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
  z = logits_BV - m_B1
  return jnp.exp(z if temperature == 1.0 else z / temperature)


@dataclasses.dataclass(frozen=True)
class Greedy:
  """Argmax; ``generate(temperature=0)`` selects it."""

  def next_token(self, logits_BV: jax.Array, rng: jax.Array | None = None) -> jax.Array:
    del rng
    # max + first index reaching it: XLA's CPU argmax (a variadic reduce) is
    # several times slower than these two plain reductions.
    V = logits_BV.shape[-1]
    m_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    first_B = jnp.min(jnp.where(logits_BV == m_B1, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    return jnp.minimum(first_B, V - 1)  # V only if a row is all NaN


@dataclasses.dataclass(frozen=True)
class Temperature:
  """A draw from softmax(logits / temperature) over the whole vocabulary."""
  temperature: float = 1.0

  def __post_init__(self) -> None:
    if not self.temperature > 0:
      raise ValueError(f"temperature must be > 0 for sampling (use Greedy), got "
                       f"{self.temperature}")

  def weights(self, logits_BV: jax.Array) -> jax.Array:
    return _exp_weights(logits_BV, self.temperature)

  def next_token(self, logits_BV: jax.Array, rng: jax.Array) -> jax.Array:
    """``rng``: one key, or one key per row (rows then draw independently)."""
    return inverse_cdf(self.weights(logits_BV), _row_uniforms(rng, logits_BV.shape[0]))


@dataclasses.dataclass(frozen=True)
class TopK(Temperature):
  """A draw among the k largest logits (ties at the k-th value are kept)."""
  k: int = 50

  def __post_init__(self) -> None:
    super().__post_init__()
    if self.k < 1:
      raise ValueError(f"TopK.k must be >= 1, got {self.k}")

  def weights(self, logits_BV: jax.Array) -> jax.Array:
    w = _exp_weights(logits_BV, self.temperature)
    if self.k >= logits_BV.shape[-1]:
      return w
    kth_B1 = jax.lax.top_k(logits_BV, self.k)[0][:, -1:]
    return jnp.where(logits_BV >= kth_B1, w, 0.0)


@dataclasses.dataclass(frozen=True)
class TopP(Temperature):
  """Nucleus sampling: the smallest most-probable set with mass >= p.

  Applied after temperature and, when ``k`` > 0, after top-k (transformers'
  order). A token is kept when the mass strictly above it is < p.
  """
  p: float = 1.0
  k: int = 0

  def __post_init__(self) -> None:
    super().__post_init__()
    if not 0 < self.p <= 1:
      raise ValueError(f"TopP.p must be in (0, 1], got {self.p}")
    if self.k < 0:
      raise ValueError(f"TopP.k must be >= 0, got {self.k}")

  def weights(self, logits_BV: jax.Array) -> jax.Array:
    w = (TopK(self.temperature, self.k) if self.k else Temperature(self.temperature)).weights(
        logits_BV)
    if self.p >= 1:
      return w
    probs_BV = w / jnp.sum(w, axis=-1, keepdims=True)
    sorted_BV = -jnp.sort(-probs_BV, axis=-1)
    above_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV
    kept_B = jnp.sum(above_BV < self.p, axis=-1)
    threshold_B1 = jnp.take_along_axis(sorted_BV, kept_B[:, None] - 1, axis=-1)
    return jnp.where(probs_BV >= threshold_B1, w, 0.0)


Strategy = Greedy | Temperature | TopK | TopP


def make_strategy(temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> Strategy:
  """The strategy of transformers-style knobs; temperature 0 means greedy."""
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
  if temperature == 0:
    return Greedy()
  if top_p < 1:
    return TopP(temperature=float(temperature), p=float(top_p), k=int(top_k))
  if top_k:
    return TopK(temperature=float(temperature), k=int(top_k))
  return Temperature(float(temperature))


def untempered_logprobs(logits_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
  """log_softmax(logits)[token]: the policy's log-prob, whatever the strategy."""
  picked_B = jnp.take_along_axis(logits_BV, tokens_B[:, None], axis=-1)[:, 0]
  return picked_B - jax.nn.logsumexp(logits_BV, axis=-1)


def _choose(strategy: Strategy, logits_BV: jax.Array, rng: jax.Array, step: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
  """Token and untempered log-prob per row; row r at step t uses fold_in(rng, r, t)."""
  rows = jnp.arange(logits_BV.shape[0], dtype=jnp.uint32)
  keys_B = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(rng, r), step))(rows)
  tokens_B = strategy.next_token(logits_BV, keys_B)
  return tokens_B, untempered_logprobs(logits_BV, tokens_B)


# --- generation -----------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Samples:
  """Completions, rows grouped by prompt (the G samples of prompt 0 first).

  ``mask`` is 1 up to and including the stop token, 0 after; ``tokens`` hold
  the pad id where ``mask`` is 0 and ``logprobs`` hold 0 there. ``logprobs``
  are log_softmax of the raw logits at the sampled token (the untempered
  policy), whatever the temperature / top-k / top-p. ``truncated`` marks rows
  that reached ``max_new_tokens`` without a stop token.
  """
  tokens: jax.Array  # [B, C] int32
  mask: jax.Array  # [B, C] int32
  logprobs: jax.Array  # [B, C] float32
  lengths: jax.Array  # [B] int32
  truncated: jax.Array  # [B] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
  step: jax.Array  # int32: tokens generated so far
  last_B: jax.Array  # int32: the token fed to the next decode step
  done_B: jax.Array  # bool: emitted a stop token
  tokens_BC: jax.Array
  logprobs_BC: jax.Array
  mask_BC: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _LayerCaches:
  """The decode cache: one [B, S, K, H] key and one value buffer per layer.

  The prefill fills the model's stacked ``KVCache``; decoding splits it per
  layer and runs the layers unrolled, so each layer updates its own donated
  buffer in place and attends to it directly. Inside the model's layer scan,
  XLA copies every layer's cache slice (and weight slice) in and out each
  step: at the Qwen2.5-1.5B shape, B=256, S=640, on an H200,
  ``forward_with_cache`` alone took 13.5 ms per decode step, this sampler's
  whole step (token choice included) 4.8 ms; on the CPU benchmark model the
  per-layer step used ~17% less CPU time.
  """
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  mask_BS: jax.Array  # bool: slot holds a real token
  positions_B: jax.Array  # int32: RoPE position of each row's next token
  index: jax.Array  # int32: next slot to write


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static sharding context: no mesh means unsharded."""
  mesh: Mesh | None = None
  rules: tuple[tuple[str, Any], ...] = ()

  def constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    if self.mesh is None:
      return x
    spec = sharding.logical_to_spec(axes, self.rules, x.shape, self.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def constrain_tree(self, tree: Any) -> Any:
    """Rows over the batch axes, a cache's kv heads over theirs, scalars whole."""
    def one(x: jax.Array) -> jax.Array:
      axes = {0: (), 1: ("batch",), 4: ("batch", None, "kv_heads", None),
              5: (None, "batch", None, "kv_heads", None)}.get(x.ndim, ("batch", None))
      return self.constrain(x, axes) if axes else x
    return jax.tree.map(one, tree)


def _is_stop(tokens_B: jax.Array, stop_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens_B[:, None] == stop_ids[None, :], axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg", "strategy", "num_samples", "gen_len",
                                             "layout"))
def _prefill(params: Params, tokens_QP: jax.Array, mask_QP: jax.Array, rng: jax.Array,
             stop_ids: jax.Array, pad_id: jax.Array, *, cfg: Qwen2Config, strategy: Strategy,
             num_samples: int, gen_len: int, layout: _Layout
             ) -> tuple[_State, _LayerCaches]:
  """Prompt cache for all B = Q*G rows (with ``gen_len`` free slots) and token 0."""
  TRACE_COUNTS["prefill"] += 1
  Q, P = tokens_QP.shape
  B = Q * num_samples
  cache = layout.constrain_tree(kv_cache.init_cache(cfg, Q, P))
  h_QPD, cache = qwen2.hidden_states_with_cache(params, cfg, tokens_QP, mask_QP, cache)
  # Left padding puts every row's last prompt token at P - 1: unembed only it.
  logits_QV = qwen2.logits_from_hidden(params, cfg, h_QPD[:, -1:])[:, 0]
  cache = kv_cache.repeat_rows(cache, num_samples)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, gen_len), (0, 0), (0, 0)))
  caches = _LayerCaches(
      k=tuple(pad(cache.k_LBSKH[l]) for l in range(cfg.num_layers)),
      v=tuple(pad(cache.v_LBSKH[l]) for l in range(cfg.num_layers)),
      mask_BS=jnp.pad(cache.mask_BS, ((0, 0), (0, gen_len))),
      positions_B=cache.positions_B, index=cache.index)
  logits_BV = layout.constrain(jnp.repeat(logits_QV, num_samples, axis=0),
                               ("batch", "vocab"))
  token_B, logprob_B = _choose(strategy, logits_BV, rng, jnp.zeros((), jnp.int32))
  state = _State(
      step=jnp.ones((), jnp.int32), last_B=token_B, done_B=_is_stop(token_B, stop_ids),
      tokens_BC=jnp.full((B, gen_len), pad_id, jnp.int32).at[:, 0].set(token_B),
      logprobs_BC=jnp.zeros((B, gen_len), jnp.float32).at[:, 0].set(logprob_B),
      mask_BC=jnp.zeros((B, gen_len), jnp.int32).at[:, 0].set(1))
  return layout.constrain_tree(state), layout.constrain_tree(caches)


def _decode_step(params: Params, layers: list[Params], cfg: Qwen2Config, tokens_B: jax.Array,
                 cache: _LayerCaches) -> tuple[jax.Array, _LayerCaches]:
  """``qwen2.forward_with_cache`` for one token per row, over per-layer buffers."""
  B, S = cache.mask_BS.shape
  index = cache.index
  mask_BS = jax.lax.dynamic_update_slice_in_dim(cache.mask_BS, jnp.ones((B, 1), jnp.bool_),
                                                index, axis=1)
  mask_B1S = ((jnp.arange(S) <= index)[None] & mask_BS)[:, None, :]
  positions_B1 = cache.positions_B[:, None]
  x = params["embed"].astype(cfg.dtype)[tokens_B[:, None]]
  ks, vs = list(cache.k), list(cache.v)
  for l, p in enumerate(layers):
    x, ks[l], vs[l] = qwen2._layer(  # pylint: disable=protected-access
        cfg, x, p, positions_B1, ks[l], vs[l], mask_B1S, index)
  h = qwen2.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  logits_BV = qwen2.logits_from_hidden(params, cfg, h)[:, 0]
  return logits_BV, _LayerCaches(tuple(ks), tuple(vs), mask_BS, cache.positions_B + 1,
                                 index + 1)


@functools.partial(jax.jit, static_argnames=("cfg", "strategy", "layout"),
                   donate_argnames=("cache",))
def _decode(params: Params, state: _State, cache: _LayerCaches, rng: jax.Array,
            stop_ids: jax.Array, pad_id: jax.Array, max_new_tokens: jax.Array, *,
            cfg: Qwen2Config, strategy: Strategy, layout: _Layout
            ) -> tuple[Samples, _LayerCaches]:
  """Decodes until every row stopped or ``max_new_tokens``; one device program."""
  TRACE_COUNTS["decode"] += 1
  # Per-layer weights, sliced once per call rather than once per layer per step.
  layers = [jax.tree.map(lambda w, l=l: w[l], params["layers"]) for l in range(cfg.num_layers)]
  if cfg.tie_word_embeddings:
    # A [D, V] copy of the tied embedding, made once per call: the unembedding
    # runs ~20% faster on it than on the transposed [V, D] table (CPU; ~10% on GPU).
    params = dict(params, lm_head=params["embed"].T)
    cfg = cfg.replace(tie_word_embeddings=False)

  def cond(carry: tuple[_State, _LayerCaches]) -> jax.Array:
    s, _ = carry
    return (s.step < max_new_tokens) & ~jnp.all(s.done_B)

  def body(carry: tuple[_State, _LayerCaches]) -> tuple[_State, _LayerCaches]:
    s, cache = carry
    logits_BV, cache = _decode_step(params, layers, cfg, s.last_B, cache)
    token_B, logprob_B = _choose(strategy, logits_BV, rng, s.step)
    active_B = ~s.done_B
    put = lambda buf, col: jax.lax.dynamic_update_slice(buf, col[:, None], (0, s.step))
    s = _State(
        step=s.step + 1, last_B=token_B, done_B=s.done_B | _is_stop(token_B, stop_ids),
        tokens_BC=put(s.tokens_BC, jnp.where(active_B, token_B, pad_id)),
        logprobs_BC=put(s.logprobs_BC, jnp.where(active_B, logprob_B, 0.0)),
        mask_BC=put(s.mask_BC, active_B.astype(jnp.int32)))
    return layout.constrain_tree(s), layout.constrain_tree(cache)

  state, cache = jax.lax.while_loop(cond, body, (state, cache))
  samples = Samples(tokens=state.tokens_BC, mask=state.mask_BC, logprobs=state.logprobs_BC,
                    lengths=state.mask_BC.sum(-1), truncated=~state.done_B)
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
    raise ValueError(f"prompt_tokens_BP {tokens.shape} and prompt_mask_BP {mask.shape} must be "
                     "2-D arrays of the same shape")
  if not np.isin(mask, (0, 1)).all():
    raise ValueError("prompt_mask_BP must hold only 0 and 1")
  bad = np.nonzero(np.any(np.diff(mask.astype(np.int32), axis=1) < 0, axis=1)
                   | (mask.sum(1) == 0))[0]
  if bad.size:
    raise ValueError(f"prompt row {int(bad[0])}: the mask must be left-padded (0...0 1...1) "
                     "with at least one real token")
  real = tokens[mask.astype(bool)]
  if real.size and (real.min() < 0 or real.max() >= vocab_size):
    raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got "
                     f"[{real.min()}, {real.max()}]")


def generate(params: Params, cfg: Qwen2Config, prompt_tokens_BP: Any, prompt_mask_BP: Any,
             rng: jax.Array, *, num_samples: int, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             stop_ids: Sequence[int] = (), pad_id: int = 0, strategy: Strategy | None = None,
             mesh: Mesh | None = None, rules: sharding.Rules | None = None) -> Samples:
  """Samples ``num_samples`` completions of each left-padded prompt.

  Args:
    params, cfg: the Qwen2 policy.
    prompt_tokens_BP, prompt_mask_BP: [Q, P] left-padded prompts, mask 1 on
      real tokens.
    rng: a PRNG key; the same key gives the same samples.
    num_samples: G, samples per prompt; output row q*G + g is sample g of
      prompt q.
    max_new_tokens: C, the completion length limit (and the output width).
    temperature, top_p, top_k: as in transformers; temperature 0 is greedy,
      top_k 0 and top_p 1 are off. Ignored when ``strategy`` is given.
    stop_ids: token ids that end a row (e.g. EOS and ``<|im_end|>``); the
      stop token is part of the completion.
    pad_id: token written after a row's end.
    mesh, rules: optional device mesh and (logical, mesh axes) rules (e.g.
      ``capo_jax.mesh.SAMPLING_RULES``): rows are split over the ``"batch"``
      axes, params placed per the rules. Without a mesh, runs unsharded.

  Returns:
    ``Samples`` of [Q*G, C] tokens / mask / logprobs and [Q*G] lengths /
    truncated.
  """
  if num_samples < 1 or max_new_tokens < 1:
    raise ValueError(f"num_samples ({num_samples}) and max_new_tokens ({max_new_tokens}) "
                     "must be >= 1")
  if (mesh is None) != (rules is None):
    raise ValueError("pass both mesh and rules, or neither")
  if mesh is not None and any(t != AxisType.Auto for t in mesh.axis_types):
    raise ValueError(f"mesh axis types {mesh.axis_types}: the sampler states shardings with "
                     "constraints and needs AxisType.Auto axes (capo_jax.mesh.make_mesh)")
  strategy = strategy or make_strategy(temperature, top_p, top_k)
  tokens = np.asarray(prompt_tokens_BP)
  mask = np.asarray(prompt_mask_BP)
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
  layout = _Layout()
  if mesh is not None:
    layout = _Layout(mesh, tuple((name, tuple(ax) if isinstance(ax, list) else ax)
                                 for name, ax in rules))
    shard = lambda x, axes: jax.device_put(x, NamedSharding(
        mesh, sharding.logical_to_spec(axes, layout.rules, x.shape, mesh)))
    tokens, mask = shard(tokens, ("batch", None)), shard(mask, ("batch", None))
    specs = qwen2.param_specs(cfg, layout.rules, mesh)
    params = jax.device_put(params, jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))
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
