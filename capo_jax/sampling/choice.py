"""Where a token is chosen: inside the vocabulary shards when the draw allows it.

With the sampler's weights split over a tensor group, the unembedding's logits come
out split over the vocabulary ("vocab"), each chip holding V / t of every row's
logits. ``Strategy.choose`` wants whole vocabulary rows, so the general path
(``_whole_rows``) exchanges them all-to-all first, every decode step: for the TPU
compiler's count of what that sends, see docs/sampling.md.

The greedy and plain-temperature draws need no whole row (``choose``):

* greedy: the maximum and the first index reaching it are reductions whose result
  does not depend on their order, so each shard reduces its own logits and the group
  combines t numbers a row: the token whole rows give, bit for bit;
* temperature: the two-level inverse-CDF draw of ``strategies`` runs on blocks of 128
  tokens cut inside each shard (the shard's last block padded with weight 0), so each
  chip sums its own blocks' weights, the group all-gathers the [t x blocks, B] block
  sums (1 / 128 of the logits), every chip finds the chosen block, and its owner's 128
  logits reach the group by a masked sum. In exact arithmetic the token is the one
  whole rows give; in float32 the block sums are grouped differently, so a uniform
  within rounding of a token boundary may pick its neighbour, as any change of the
  summation order would. The log-probability is log_softmax of the raw logits, as
  ever.

Top-k and top-p need a per-row threshold over the whole vocabulary (a sort or a top-k),
so they keep the exchange.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from capo_jax.sampling import strategies
from capo_jax.sampling.strategies import Greedy, Strategy, Temperature
from models.sharding import Layout

_BLOCK = strategies.BLOCK


def _whole_rows(layout: Layout | None, logits_VB: jax.Array) -> jax.Array:
  """The logits as whole vocabulary rows, the rows over every device (the sampling
  rules' "choice_rows": each chip draws 1 / group of its rows' tokens).

  Pinned vocab-split first: else XLA moves the exchange into the unembedding and
  gathers the whole table every step."""
  if layout is None:
    return logits_VB
  logits_VB = layout.constrain(logits_VB, ("vocab", "batch"))
  return layout.constrain(logits_VB, (None, "choice_rows"))


def vocab_shards(strategy: Strategy, layout: Layout | None, vocab: int) -> int:
  """The shards ``choose`` draws inside: the vocabulary's split for the greedy and
  plain-temperature draws when it divides the vocabulary, else 1 (whole rows)."""
  t = 1 if layout is None else layout.shards("vocab")
  drawable = type(strategy) in (Greedy, Temperature)
  return t if t > 1 and drawable and vocab % t == 0 else 1


def choose(
  strategy: Strategy, logits_VB: jax.Array, u_B: jax.Array, layout: Layout | None
) -> tuple[jax.Array, jax.Array]:
  """``strategy.choose`` on the step's vocab-major logits [V, B] (split over "vocab"
  under ``layout``): inside the vocabulary shards where ``vocab_shards`` allows,
  else on whole rows. Tokens and log-probs come out over the rows' own axis
  ("batch") inside the shards, over "choice_rows" otherwise."""
  V, B = logits_VB.shape
  t = vocab_shards(strategy, layout, V)
  if t == 1:
    return strategy.choose(_whole_rows(layout, logits_VB), u_B)
  assert layout is not None
  x_TVB = layout.constrain(logits_VB.reshape(t, V // t, B), ("vocab", None, "batch"))
  if isinstance(strategy, Greedy):
    return _greedy(x_TVB)
  return _temperature(strategy, x_TVB, u_B, layout)


def _lse(x_TVB: jax.Array, m_11B: jax.Array) -> jax.Array:
  """Each row's log-sum-exp [B] around its largest logit ``m_11B``, shard by shard."""
  return m_11B[0, 0] + jnp.log(jnp.sum(jnp.exp(x_TVB - m_11B), axis=(0, 1)))


def _greedy(x_TVB: jax.Array) -> tuple[jax.Array, jax.Array]:
  t, Vt, _ = x_TVB.shape
  m_11B = jnp.max(x_TVB, axis=(0, 1), keepdims=True)
  token_TV1 = (jnp.arange(t, dtype=jnp.int32)[:, None] * Vt + jnp.arange(Vt, dtype=jnp.int32))[
    ..., None
  ]
  first_B = jnp.min(jnp.where(x_TVB == m_11B, token_TV1, t * Vt), axis=(0, 1))
  token_B = jnp.minimum(first_B, t * Vt - 1)  # t * Vt only if a row is all NaN
  # The logit at the first maximum is the maximum itself (Greedy's _pick).
  return token_B, m_11B[0, 0] - _lse(x_TVB, m_11B)


def _temperature(
  strategy: Temperature, x_TVB: jax.Array, u_B: jax.Array, layout: Layout
) -> tuple[jax.Array, jax.Array]:
  t, Vt, B = x_TVB.shape
  nb = -(-Vt // _BLOCK)
  x_TXVB = jnp.pad(x_TVB, ((0, 0), (0, nb * _BLOCK - Vt), (0, 0)), constant_values=-jnp.inf)
  x_TXVB = layout.constrain(x_TXVB.reshape(t, nb, _BLOCK, B), ("vocab", None, None, "batch"))
  m_11B = jnp.max(x_TVB, axis=(0, 1), keepdims=True)
  weight = strategy._weight_fn(m_11B[0], None)  # pylint: disable=protected-access
  # Each shard's block sums, then the group's: [t * nb, B], blocks in vocabulary order.
  sums_TXB = jnp.sum(weight(x_TXVB), axis=2)
  sums_KB = layout.constrain(sums_TXB, (None, None, "batch")).reshape(t * nb, B)
  cum_KB = jnp.cumsum(sums_KB, axis=0)
  total_B = cum_KB[-1]
  target_B = u_B * total_B
  block_B = jnp.minimum(jnp.sum(cum_KB <= target_B, axis=0, dtype=jnp.int32), t * nb - 1)
  before_B = jnp.take_along_axis(cum_KB, jnp.maximum(block_B - 1, 0)[None], axis=0)[0]
  before_B = jnp.where(block_B > 0, before_B, 0.0)
  # The chosen block's logits from its owner: every shard takes its block of that
  # local index, the others' are zeroed and the group sums (exact: one term is not 0).
  shard_B, local_B = block_B // nb, block_B % nb
  mine_TVB = jnp.take_along_axis(x_TXVB, local_B[None, None, None], axis=1)[:, 0]
  own_T11 = (jnp.arange(t)[:, None] == shard_B[None])[:, None]
  x_VB = jnp.sum(jnp.where(own_T11, mine_TVB, 0.0), axis=0)
  x_VB = layout.constrain(x_VB, (None, "batch"))
  w_VB = weight(x_VB)
  inner_VB = jnp.cumsum(w_VB, axis=0)
  idx_B = jnp.sum(inner_VB <= (target_B - before_B), axis=0, dtype=jnp.int32)
  # As in strategies: rounding can push the index one past the block's mass; the
  # shard's padding weighs 0, so it is never the last positive-weight token.
  iota_V1 = jnp.arange(_BLOCK, dtype=jnp.int32)[:, None]
  last_B = jnp.max(jnp.where(w_VB > 0, iota_V1, 0), axis=0)
  idx_B = jnp.minimum(idx_B, last_B)
  token_B = shard_B * Vt + local_B * _BLOCK + idx_B
  picked_B = jnp.take_along_axis(x_VB, idx_B[None], axis=0)[0]
  if strategy.temperature == 1.0:  # as in strategies: the weights' sum is the normaliser
    lse_B = m_11B[0, 0] + jnp.log(total_B)
  else:
    lse_B = _lse(x_TVB, m_11B)
  return token_B, picked_B - lse_B
