"""The decode loop's slots: the row each holds (``Slots``), and how free slots take the
waiting rows (``refill``), their prompts' keys / values copied in from the prompt cache.

A prompt is left-padded to P columns, its n tokens in [P - n, P), so a refill copies
only the chunks of ``REFILL_CHUNK`` columns that hold them (about 200 of the 1.5B
run's P = 1,024); with the prompts split over devices, each chunk is taken from the
device that holds it (``prompt_chunk``), one all-reduce of the chunk.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from capo_jax.sampling import decode
from capo_jax.sampling.plans import FirstTokens, Plan, PromptCache
from models.sharding import Layout

# Prompt columns a refill copies at a time (P when it does not divide P): a TPU lane
# tile. The sampler's prompt lengths are powers of two up to 256, then multiples of 256
# (sampler.bucket_length), so it divides every P from 128 up.
REFILL_CHUNK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
  """The decode loop's W slots: the row each holds and how far it has got."""

  row_W: jax.Array  # int32: the row in the slot; B when it never had one
  t_W: jax.Array  # int32: tokens the row has so far (the next one's index)
  active_W: jax.Array  # bool: the row has not stopped
  last_W: jax.Array  # int32: the token fed to the next step
  next: jax.Array  # int32 scalar: waiting rows handed out so far


def refill(
  plan: Plan,
  prompts: PromptCache,
  first: FirstTokens,
  order_B: jax.Array,
  num_waiting: jax.Array,
  slots: Slots,
  cache: decode.SlotCache,
) -> tuple[Slots, decode.SlotCache]:
  """Free slots take the next waiting rows (in ``order_B``), their prompts' columns copied in.

  A left-padded prompt of n tokens fills columns [P - n, P): only the chunks of
  ``REFILL_CHUNK`` columns that cover them, counted from P, are copied, in one flat loop
  over (taken slot, chunk): tools/step_estimate.py weights the refill's loop by its
  trips, and would not count a loop nested in it. The mask row is set from n, not copied.

  Columns left of the chunks would keep the slot's last row's keys / values, masked.
  Both attentions weight a masked column by exactly 0 (the ragged kernel's where, the
  blocks' exp(min - max)), but 0 x NaN is NaN, and no row's values may reach another's
  result: so a slot's prompt columns hold its row's chunks and zeros only, the loop
  zeroing the last row's chunks that the new prompt's do not cover (a local write,
  nothing sent between chips). The decode step writes a completion column before it
  is unmasked.
  """
  G, B, K, L = plan.num_samples, order_B.shape[0], plan.cfg.num_kv_heads, len(cache.k)
  W, S = cache.mask_WS.shape
  free_W = ~slots.active_W & (jnp.arange(W) < plan.num_slots)
  idx_W = slots.next + jnp.cumsum(free_W, dtype=jnp.int32) - 1
  take_W = free_W & (idx_W < num_waiting)
  n_take = take_W.sum(dtype=jnp.int32)
  row_W = jnp.where(take_W, order_B[jnp.clip(idx_W, 0, B - 1)], slots.row_W)
  which_W = jnp.nonzero(take_W, size=W, fill_value=0)[0]
  P = prompts.mask_QP.shape[1]
  width = REFILL_CHUNK if P % REFILL_CHUNK == 0 else P
  length = lambda r_W: prompts.length_Q[jnp.minimum(r_W, B - 1) // G]
  col_S = jnp.arange(S)
  mask_WS = (col_S >= P - length(row_W)[:, None]) & (col_S < P)
  mask_WS = jnp.where(take_W[:, None], mask_WS, cache.mask_WS)
  # Chunks of each slot's new prompt and of its last row's (none: never had a row).
  new_W = -(-length(row_W) // width)
  old_W = jnp.where(slots.row_W < B, -(-length(slots.row_W) // width), 0)
  # Taken slot j (of ``which_W``) writes count_J[j] chunks: flat index i < end_J[-1].
  count_J = jnp.where(jnp.arange(W) < n_take, jnp.maximum(new_W, old_W)[which_W], 0)
  end_J = jnp.cumsum(count_J)
  axes = (1,) * 2 * L if cache.k[0].ndim == 3 else (3,) * L + (2,) * L  # column axes

  def copy(i: jax.Array, c: decode.SlotCache) -> decode.SlotCache:
    j = (end_J <= i).sum(dtype=jnp.int32)
    n, part = which_W[j], i - end_J[j] + count_J[j]
    col, srcs = P - width * (part + 1), prompts.k + prompts.v
    chunks = lambda: tuple(
      prompt_chunk(plan.layout, x, row_W[n] // G, col, width, a, K) for x, a in zip(srcs, axes)
    )
    zeros = lambda: tuple(jnp.zeros(_chunk(x, a, width), x.dtype) for x, a in zip(srcs, axes))
    parts = jax.lax.cond(part < new_W[n], chunks, zeros)
    kv = tuple(
      jax.lax.dynamic_update_slice(x, y, _at(x, n, col, a))
      for x, y, a in zip(c.k + c.v, parts, axes)
    )
    return decode.SlotCache(kv[:L], kv[L:], c.mask_WS)

  cache = jax.lax.fori_loop(0, end_J[-1], copy, cache)
  slots = Slots(
    row_W=row_W,
    t_W=jnp.where(take_W, 1, slots.t_W),
    active_W=slots.active_W | take_W,
    last_W=jnp.where(take_W, first.token_B[jnp.minimum(row_W, B - 1)], slots.last_W),
    next=slots.next + n_take,
  )
  return slots, decode.SlotCache(cache.k, cache.v, mask_WS)


def _chunk(x: jax.Array, axis: int, width: int) -> list[int]:
  """The shape of one row's ``width`` columns (on ``axis``) of ``x``."""
  return [1] + [width if a == axis else d for a, d in enumerate(x.shape) if a]


def _at(x: jax.Array, row: jax.Array, col: jax.Array, axis: int) -> list[jax.Array | int]:
  """The start of (row, column ``col`` on ``axis``) in ``x``."""
  return [row] + [col if a == axis else 0 for a in range(1, x.ndim)]


def prompt_chunk(
  layout: Layout | None,
  src: jax.Array,
  q: jax.Array,
  col: jax.Array,
  width: int,
  axis: int,
  num_kv_heads: int,
) -> jax.Array:
  """Columns [col, col + width) (on ``axis``) of prompt q of ``src`` [Q, ...], as [1, ...].

  With the prompts split over n devices, a dynamic slice at a run-time q on the split
  axis makes XLA all-gather the whole prompt cache (3.8 GB per copy for 1.5B on v4-32,
  by the TPU compiler), and a masked sum over the Q prompts reads every local prompt's
  row. So ``src`` is viewed as [n, Q / n, ...], the n axis over the same devices: each
  device slices its local prompt q % (Q / n), all but q's owner zero theirs, and the
  sum over n is one all-reduce of the chunk (exact: the other terms are 0).
  """
  Q, size = src.shape[0], _chunk(src, axis, width)
  if layout is None:
    return jax.lax.dynamic_slice(src, _at(src, q, col, axis), size)
  spec = decode.cache_spec(layout, src, num_kv_heads)
  per = NamedSharding(layout.mesh, spec).shard_shape(src.shape)[0]  # prompts a device holds
  if per == Q:
    return jax.lax.dynamic_slice(src, _at(src, q, col, axis), size)
  n = Q // per
  view = jax.lax.with_sharding_constraint(
    src.reshape(n, per, *src.shape[1:]),
    NamedSharding(layout.mesh, PartitionSpec(spec[0], None, *spec[1:])),
  )
  start: list[jax.Array | int] = [0, *_at(src, q % per, col, axis)]
  part = jax.lax.dynamic_slice(view, start, [n] + size)
  own = (jnp.arange(n) == q // per).reshape((n,) + (1,) * src.ndim)
  return jnp.where(own, part, jnp.zeros((), src.dtype)).sum(0)
