"""Splash attention that skips the blocks two different sequences of a packed row meet in.

Splash's block tables (``MaskInfo``) come from its mask, which is static: a causal mask
over a 4,096-token row computes every block on or below the diagonal. Its segment ids
are applied inside each block, so a packed row's blocks where the queries of one
sequence meet the keys of an earlier one are computed and then masked whole: at the
length model about two fifths of the causal block pairs (``tools/step_estimate.py``'s
``splash_pair_share``). The kernel's own dynamic-mask path
cannot be built inside ``jit`` from traced segment ids (jax 0.10: its ``MaskInfo``
flag becomes a tracer the kernel branches on in Python).

So each row gets its own copy of the static tables with one change: an entry of
``block_mask`` whose query block and key block share no segment id is set to 0, the
kernel's "nothing to compute here". The kernel still applies the segment ids inside
the blocks it computes, so the result is the same: a skipped block's scores were all
masked, and a masked score adds exactly 0 once the row has seen one unmasked key
(every query sees itself, in its diagonal block, which is never skipped).

Which blocks share a segment is decided from each block's lowest and highest positive
id (ids <= 0 are padding, which only meets padding): two blocks whose ranges do not
intersect share none. That is exact for a packed row (its sequences' ids rise along
it) and only conservative elsewhere (a skipped pair is always masked).

The tables differ per row, so ``vmap`` over rows runs the kernel once per row in a
loop (Pallas batches scalar-prefetched operands with an explicit loop), where a static
table let it add a grid axis: the same blocks, in one call per row.

Shape letters: T query columns, S key columns, X query blocks, Y key blocks (a
table's leading head axis and its grid steps go unnamed: splash lays them out).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def block_ranges(ids_T: jax.Array, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each ``block``-column block's lowest and highest positive id and whether it holds
  padding (ids <= 0): ([X], [X], [X]). A block without sequences has lo > hi."""
  ids_XB = ids_T.reshape(-1, block)
  real_XB = ids_XB > 0
  big = jnp.iinfo(ids_XB.dtype).max
  lo = jnp.where(real_XB, ids_XB, big).min(axis=1)
  hi = jnp.where(real_XB, ids_XB, 0).max(axis=1)
  return lo, hi, (~real_XB).any(axis=1)


def _meet(q: tuple[jax.Array, ...], k: tuple[jax.Array, ...]) -> jax.Array:
  """Whether two blocks may share an id: their sequences' ranges intersect, or both
  hold padding (tail padding is one segment, 0, and must see itself)."""
  (q_lo, q_hi, q_pad), (k_lo, k_hi, k_pad) = q, k
  return ((q_lo <= k_hi) & (k_lo <= q_hi)) | (q_pad & k_pad)


def _skip(info: Any, q_ids_T: jax.Array, kv_ids_S: jax.Array, bq: int, bkv: int, dkv: bool) -> Any:
  """``info``'s ``block_mask`` with the blocks whose queries and keys share no id set to 0.

  Forward and dq tables are [A, X, J] (A heads or one, J grid steps), step j of query
  block x reading key block ``data_next[a, x, j]``; the dkv table is [A, J, Y], step j
  of key block y reading query block ``data_next[a, j, y]`` (splash's
  ``_next_nonzero``). Without ``data_next`` the steps are the blocks themselves.
  """
  if info is None or info.block_mask is None:
    return None
  q_X = block_ranges(q_ids_T, bq)
  k_Y = block_ranges(kv_ids_S, bkv)
  mask = info.block_mask
  _, n1, n2 = mask.shape
  step = None if info.data_next is None else info.data_next.astype(jnp.int32)
  if dkv:  # [A, J, Y]: the steps index query blocks
    x = jnp.arange(n1)[None, :, None] if step is None else step
    y = jnp.arange(n2)[None, None, :]
  else:  # [A, X, J]: the steps index key blocks
    x = jnp.arange(n1)[None, :, None]
    y = jnp.arange(n2)[None, None, :] if step is None else step
  meet = _meet(tuple(r[x] for r in q_X), tuple(r[y] for r in k_Y))
  return jnp.where(meet, mask, 0).astype(mask.dtype)


def tables(kernel: Any, q_ids_T: jax.Array, kv_ids_S: jax.Array) -> tuple[Any, Any, Any]:
  """The forward, dq and dkv ``block_mask`` of splash ``kernel`` (``make_splash_mha``'s)
  for one row: the blocks where its queries and keys share no segment id skipped."""
  sizes = kernel.kwargs["block_sizes"]
  return (
    _skip(kernel.fwd_mask_info, q_ids_T, kv_ids_S, sizes.block_q, sizes.block_kv, False),
    _skip(kernel.dq_mask_info, q_ids_T, kv_ids_S, sizes.block_q_dq, sizes.block_kv_dq, False),
    _skip(kernel.dkv_mask_info, q_ids_T, kv_ids_S, sizes.block_q_dkv, sizes.block_kv_dkv, True),
  )


def with_tables(kernel: Any, block_masks: tuple[Any, Any, Any]) -> Any:
  """A copy of ``kernel`` with ``tables``' block masks."""
  infos = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)
  new = [i if m is None else i._replace(block_mask=m) for i, m in zip(infos, block_masks)]
  return type(kernel)(*new, **kernel.kwargs)


# The scope the per-row kernels run in: the cost model (``hlo_ops.splash_flops``) counts
# a splash call under it at the length model's share of its causal pairs, any other
# (a program compiled before the tables were per row) at all of them.
SCOPE = "splash_row_blocks"


def per_row(kernel: Any, q_ids_T: jax.Array, kv_ids_S: jax.Array) -> Any:
  """A copy of ``kernel`` that skips the blocks of this row where queries and keys
  share no segment id."""
  return with_tables(kernel, tables(kernel, q_ids_T, kv_ids_S))
