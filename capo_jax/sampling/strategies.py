"""Token choice: greedy, temperature, top-k and top-p as small frozen strategies.

Each strategy's ``choose(logits_VB, u_B)`` works on *vocab-major* logits
[V, B], as the decode step (capo_jax.sampling.decode) returns them, so
every reduction over the vocabulary runs down the columns.
``next_token(logits_BV, rng)`` is the batch-major
convenience form. ``choose`` returns the token and its log-probability under
the untempered policy, log_softmax(logits)[token], whatever the strategy.

Sampling is an inverse-CDF draw: one uniform per row against the cumulative
unnormalised probabilities, in two levels: X blocks of 128 vocabulary tokens
([X, V, B], V the block's tokens), then the tokens of the chosen block. On CPU it costs
a fraction of ``jax.random.categorical``'s Gumbel noise over the vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

BLOCK = 128  # vocabulary block of the two-level inverse-CDF draw


def _row_uniforms(rng: jax.Array, batch: int) -> jax.Array:
  """One uniform in [0, 1) per row; ``rng`` is one key or one key per row."""
  typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
  if rng.ndim == (0 if typed else 1):  # a single (typed or raw uint32[2]) key
    return jax.random.uniform(rng, (batch,), jnp.float32)
  return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(rng)


def _inverse_cdf_VB(
  x_VB: jax.Array, weight: Callable[[jax.Array], jax.Array], u_B: jax.Array, pad: float = 0.0
) -> tuple[jax.Array, jax.Array]:
  """Tokens drawn with probability weight(x) / its column sum, and that sum.

  ``weight`` is elementwise (it may close over per-row [1, B] values), so it
  is applied lazily: once inside the block sums, which XLA fuses into the
  reduction (the [V, B] weights are never written out), and again on the one
  chosen block. ``pad`` fills V up to whole blocks and must weigh 0.
  """
  V, B = x_VB.shape
  nb = -(-V // BLOCK)
  x_XVB = jnp.pad(x_VB, ((0, nb * BLOCK - V), (0, 0)), constant_values=pad)
  x_XVB = x_XVB.reshape(nb, BLOCK, B)
  cum_XB = jnp.cumsum(jnp.sum(weight(x_XVB), axis=1), axis=0)
  total_B = cum_XB[-1]
  target_B = u_B * total_B
  block_B = jnp.minimum(jnp.sum(cum_XB <= target_B, axis=0, dtype=jnp.int32), nb - 1)
  before_B = jnp.take_along_axis(cum_XB, jnp.maximum(block_B - 1, 0)[None], axis=0)[0]
  before_B = jnp.where(block_B > 0, before_B, 0.0)
  w_VB = weight(jnp.take_along_axis(x_XVB, block_B[None, None], axis=0)[0])
  inner_VB = jnp.cumsum(w_VB, axis=0)
  idx_B = jnp.sum(inner_VB <= (target_B - before_B), axis=0, dtype=jnp.int32)
  # Rounding can push the index one past the block's mass: clamp to its last
  # positive-weight token so excluded (zero-weight) tokens stay excluded.
  iota_V1 = jnp.arange(BLOCK, dtype=jnp.int32)[:, None]
  last_B = jnp.max(jnp.where(w_VB > 0, iota_V1, 0), axis=0)
  return block_B * BLOCK + jnp.minimum(idx_B, last_B), total_B


def inverse_cdf(weights_BV: jax.Array, u_B: jax.Array) -> jax.Array:
  """Token i drawn with probability weights[i] / sum(weights) (weights >= 0).

  Returns the first token whose running sum exceeds ``u * total``. Two levels
  (block sums, then within the chosen block) keep the cumulative sums short.
  A zero-weight token never is: its running sum equals its predecessor's.
  """
  return _inverse_cdf_VB(weights_BV.T, lambda w: w, u_B)[0]


def _pick(logits_VB: jax.Array, tokens_B: jax.Array) -> jax.Array:
  return jnp.take_along_axis(logits_VB, tokens_B[None], axis=0)[0]


def _logsumexp(logits_VB: jax.Array, max_1B: jax.Array) -> jax.Array:
  return max_1B[0] + jnp.log(jnp.sum(jnp.exp(logits_VB - max_1B), axis=0))


class _Strategy:
  """``next_token`` for batch-major logits, on top of a subclass's ``choose``."""

  def choose(self, logits_VB: jax.Array, u_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    raise NotImplementedError

  def next_token(self, logits_BV: jax.Array, rng: jax.Array | None = None) -> jax.Array:
    """``rng``: one key, or one key per row (rows then draw independently)."""
    B = logits_BV.shape[0]
    u_B = jnp.zeros((B,), jnp.float32) if rng is None else _row_uniforms(rng, B)
    return self.choose(logits_BV.T, u_B)[0]


@dataclasses.dataclass(frozen=True)
class Greedy(_Strategy):
  """Argmax (the first index of the maximum); ``make_strategy(temperature=0)`` selects it."""

  def choose(self, logits_VB: jax.Array, u_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    del u_B
    # max + first index reaching it: XLA's CPU argmax (a variadic reduce) is
    # several times slower than these two plain reductions.
    V = logits_VB.shape[0]
    m_1B = jnp.max(logits_VB, axis=0, keepdims=True)
    iota_V1 = jnp.arange(V, dtype=jnp.int32)[:, None]
    first_B = jnp.min(jnp.where(logits_VB == m_1B, iota_V1, V), axis=0)
    tokens_B = jnp.minimum(first_B, V - 1)  # V only if a row is all NaN
    return tokens_B, _pick(logits_VB, tokens_B) - _logsumexp(logits_VB, m_1B)


@dataclasses.dataclass(frozen=True)
class Temperature(_Strategy):
  """A draw from softmax(logits / temperature) over the whole vocabulary.

  Subclasses restrict the draw to tokens whose logit reaches a per-row
  ``threshold``; the kept tokens keep their softmax(logits / T) proportions.
  """

  temperature: float = 1.0

  def __post_init__(self) -> None:
    if not self.temperature > 0:
      raise ValueError(f"temperature must be > 0 for sampling (use Greedy), got {self.temperature}")

  def threshold(self, logits_VB: jax.Array, max_1B: jax.Array) -> jax.Array | None:
    """[1, B]: the least logit a token needs to be drawn; None keeps every token."""
    del logits_VB, max_1B
    return None

  def _weight_fn(
    self, max_1B: jax.Array, threshold_1B: jax.Array | None
  ) -> Callable[[jax.Array], jax.Array]:
    """Elementwise unnormalised probabilities exp((logit - max) / T), 0 if excluded."""

    def weight(logits: jax.Array) -> jax.Array:
      z = logits - max_1B
      w = jnp.exp(z if self.temperature == 1.0 else z / self.temperature)
      return w if threshold_1B is None else jnp.where(logits >= threshold_1B, w, 0.0)

    return weight

  def choose(self, logits_VB: jax.Array, u_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    m_1B = jnp.max(logits_VB, axis=0, keepdims=True)
    threshold_1B = self.threshold(logits_VB, m_1B)
    tokens_B, total_B = _inverse_cdf_VB(
      logits_VB, self._weight_fn(m_1B, threshold_1B), u_B, pad=-jnp.inf
    )
    if threshold_1B is None and self.temperature == 1.0:
      # The weights are exp(logits - max): their sum is the softmax normaliser.
      lse_B = m_1B[0] + jnp.log(total_B)
    else:
      lse_B = _logsumexp(logits_VB, m_1B)
    return tokens_B, _pick(logits_VB, tokens_B) - lse_B


@dataclasses.dataclass(frozen=True)
class TopK(Temperature):
  """A draw among the k largest logits (ties at the k-th value are kept)."""

  k: int = 50

  def __post_init__(self) -> None:
    super().__post_init__()
    if self.k < 1:
      raise ValueError(f"TopK.k must be >= 1, got {self.k}")

  def threshold(self, logits_VB: jax.Array, max_1B: jax.Array) -> jax.Array | None:
    if self.k >= logits_VB.shape[0]:
      return None
    return jax.lax.top_k(logits_VB.T, self.k)[0][:, -1][None]


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

  def threshold(self, logits_VB: jax.Array, max_1B: jax.Array) -> jax.Array | None:
    inner = TopK(self.temperature, self.k) if self.k else Temperature(self.temperature)
    top_k_1B = inner.threshold(logits_VB, max_1B)
    if self.p >= 1:
      return top_k_1B
    sorted_VB = -jnp.sort(-logits_VB, axis=0)
    w_VB = inner._weight_fn(max_1B, top_k_1B)(sorted_VB)  # pylint: disable=protected-access
    probs_VB = w_VB / jnp.sum(w_VB, axis=0)
    above_VB = jnp.cumsum(probs_VB, axis=0) - probs_VB
    kept_B = jnp.sum(above_VB < self.p, axis=0)
    return jnp.take_along_axis(sorted_VB, kept_B[None] - 1, axis=0)


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
