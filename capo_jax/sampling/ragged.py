"""Ragged decode attention: each slot reads its own cache columns only (a Pallas kernel).

One query token per slot against that slot's real columns ``[start_W, end_W)``
of its cache. A slot's real columns are one contiguous range: its left-padded
prompt ends at column P - 1 and its completion follows from column P on, so a
range is all the kernel needs, no mask. A slot with ``start >= end`` (an idle
slot) reads nothing and returns zeros.

The cache it reads is laid out [W, S, K*H] (X = K*H: a column's keys, or
values, of every kv head side by side), keys and values alike: a column is one
contiguous run, the layout the TPU compiler keeps a cache that the step writes
one column of per slot in. With the blocked attention's [W, K, H, S] / [W, K,
S, H] layouts it laid the carried cache out [W, S, K, H] (two-row tiles) and
copied every layer's whole cache into the kernel's layout every step.

The kernel's grid is the slots (one program per slot, all K kv heads at once);
inside, a loop over the slot's own blocks of ``block`` columns copies each
block's keys / values ([block, X], contiguous) from HBM into a double buffer
(the next block's copy runs while this one is computed) and folds it into an
online softmax (float32 running max, normaliser and weighted sum). So a step
reads each row's own KV (the ``align``-column tiles its range touches), not every
slot up to the longest row, in ``W`` programs per layer whose loops run the rows'
own block counts.

A slot's blocks are laid from its first column rounded down to ``align`` (128, a
lane tile), not from column 0, and its last block is cut to the ``align``-column
tiles that reach its end (one of ``block / align`` static copy sizes, chosen with
``pl.when``; the buffer rows past the cut are stale and zeroed in the values). For
a prompt of 200 tokens left-padded to 1,024 columns and blocks of 512, blocks laid
from column 0 copied 312 padding columns more every step, and whole last blocks
256 more on average. A block that would run past the cache's end is moved back to
end at column S (the copy keeps its size); its columns before the nominal block
start, already read by the previous block, are masked. So S need not be a
multiple of ``block``.

``interpret=True`` (the default off TPU) runs the same kernel through Pallas'
interpreter, ``pltpu.InterpretParams()`` through its TPU interpreter (DMAs and
semaphores as on the chip, scratch memory NaN until written): the CPU tests check
both against ``decode.attend_full``. Under a
``Layout`` the kernel runs in a ``shard_map`` over the slots and kv heads as
the layout splits the cache (``cache_spec``): XLA cannot partition a Pallas call.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from models.sharding import Layout

BLOCK = 512  # columns per copy: 256 KiB of bfloat16 keys per kv-head pair at H = 128
ALIGN = 128  # a slot's first block starts at its first column rounded down to this
_SUBLANES = 8  # the query heads of a group are padded to whole sublane tiles
LANES = 128  # a TPU vector's lanes: the kernel's column offsets are multiples


def platform(layout: Layout | None) -> str:
  """The platform a program is for: the layout's devices' (a TPU topology compiled ahead
  of time from a CPU host), else JAX's default backend."""
  return jax.default_backend() if layout is None else layout.mesh.devices.flat[0].platform


def _kernel(
  start_ref,  # SMEM [W] int32
  end_ref,  # SMEM [W] int32
  q_ref,  # VMEM [K, R, H]: this slot's queries
  k_hbm,  # HBM [W, S, X]
  v_hbm,  # HBM [W, S, X]
  o_ref,  # VMEM [K, R, H]
  k_buf,  # VMEM [2, block, X]
  v_buf,  # VMEM [2, block, X]
  sem,  # DMA semaphores [2, 2]: (k / v, buffer)
  *,
  block: int,
  num_cols: int,
  align: int,
):
  w = pl.program_id(0)
  start, end = start_ref[w], end_ref[w]
  # lax.div / rem: the columns are >= 0, and jnp's floor division lowers through
  # sign(), which Mosaic only lowers when it can query a TPU. ``align`` divides
  # ``block`` (``_local``), so the first block holds ``start``.
  base = jax.lax.div(start, align) * align
  n = jnp.where(end > start, jax.lax.div(end - base - 1, block) + 1, 0)
  K, R, H = q_ref.shape

  def size(i):
    """Columns block i copies: a whole block, the last one cut to the ``align``-column
    tiles that reach ``end`` (one of block / align static sizes)."""
    need = end - (base + i * block)
    return jnp.minimum(block, (jax.lax.div(need - 1, align) + 1) * align)

  def copies(i, buf, cols: int):
    # A copy's first column must be a whole number of tiles: tell Mosaic it is.
    s0 = pl.multiple_of(jnp.minimum(base + i * block, num_cols - cols), align)
    return tuple(
      pltpu.make_async_copy(x.at[w, pl.ds(s0, cols)], b.at[buf, pl.ds(0, cols)], sem.at[j, buf])
      for j, (x, b) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))
    )

  def each_size(i, buf, cols_i, act):  # ``act`` on the copies of block i, cols_i wide
    for cols in range(align, block + 1, align):

      @pl.when(cols_i == cols)
      def _():
        for c in copies(i, buf, cols):
          act(c)

  @pl.when(n > 0)
  def _():
    each_size(0, 0, size(0), lambda c: c.start())

  q_KRH = q_ref[...]

  def body(i, carry):
    buf = jax.lax.rem(i, 2)

    @pl.when(i + 1 < n)
    def _():
      each_size(i + 1, 1 - buf, size(i + 1), lambda c: c.start())

    cols_i = size(i)
    each_size(i, buf, cols_i, lambda c: c.wait())
    b0 = base + i * block
    s0 = jnp.minimum(b0, num_cols - cols_i)
    col_1S = s0 + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    valid_1S = (col_1S >= jnp.maximum(start, b0)) & (col_1S < end)
    # A cut block leaves the buffer's last rows stale (or never written): out of the
    # scores by the columns' mask, and zeroed in the values, where 0 x NaN is still NaN.
    copied_S1 = jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0) < cols_i
    out = []
    for k, (m_R1, l_R1, acc_RH) in enumerate(carry):
      head = pl.ds(k * H, H)
      s_RS = jax.lax.dot_general(
        q_KRH[k], k_buf[buf, :, head], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
      ) * (H**-0.5)
      s_RS = jnp.where(valid_1S, s_RS, -jnp.inf)
      m_new = jnp.maximum(m_R1, s_RS.max(-1, keepdims=True))
      p_RS = jnp.where(valid_1S, jnp.exp(s_RS - m_new), 0.0)
      rescale = jnp.exp(m_R1 - m_new)
      pv_RH = jax.lax.dot_general(
        p_RS.astype(v_buf.dtype),
        jnp.where(copied_S1, v_buf[buf, :, head], 0),
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
      )
      out.append((m_new, l_R1 * rescale + p_RS.sum(-1, keepdims=True), acc_RH * rescale + pv_RH))
    return tuple(out)

  # Every block holds a valid column, so the running max is finite after the first one
  # and exp(-inf - m) = 0 wipes out the initial state exactly.
  init = tuple(
    (
      jnp.full((R, 1), -jnp.inf, jnp.float32),
      jnp.zeros((R, 1), jnp.float32),
      jnp.zeros((R, H), jnp.float32),
    )
    for _ in range(K)
  )
  final = jax.lax.fori_loop(0, n, body, init)
  for k, (_, l_R1, acc_RH) in enumerate(final):
    safe_R1 = jnp.where(l_R1 > 0, l_R1, 1.0)  # an idle slot: zeros, not 0 / 0
    o_ref[k] = (acc_RH / safe_R1).astype(o_ref.dtype)


def _local(
  q_WKRH: jax.Array,
  k_WSX: jax.Array,
  v_WSX: jax.Array,
  start_W: jax.Array,
  end_W: jax.Array,
  block: int,
  align: int,
  interpret: bool | pltpu.InterpretParams,
) -> jax.Array:
  W, K, R, H = q_WKRH.shape
  S, X = k_WSX.shape[1:]
  if X != K * H or v_WSX.shape != k_WSX.shape:
    raise ValueError(
      f"ragged.attend: k {k_WSX.shape} and v {v_WSX.shape} must be [W, S, K*H] for q {q_WKRH.shape}"
    )
  block = min(block, S)
  align = math.gcd(align, block)  # at most a block: the first block holds the first column
  if not interpret and (S % LANES or block % LANES or align % LANES):
    # Mosaic copies whole lane tiles: a column offset must be a multiple of 128.
    raise ValueError(
      f"ragged.attend on TPU: cache columns ({S}), block ({block}) and align ({align}) "
      f"must be multiples of {LANES}"
    )
  R_pad = -(-R // _SUBLANES) * _SUBLANES
  q = jnp.pad(q_WKRH, ((0, 0), (0, 0), (0, R_pad - R), (0, 0)))
  dt = v_WSX.dtype
  heads = pl.BlockSpec((None, K, R_pad, H), lambda w, *_: (w, 0, 0, 0))
  out = pl.pallas_call(
    functools.partial(_kernel, block=block, num_cols=S, align=align),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(W,),
      in_specs=[heads, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=heads,
      scratch_shapes=[
        pltpu.VMEM((2, block, X), k_WSX.dtype),
        pltpu.VMEM((2, block, X), dt),
        pltpu.SemaphoreType.DMA((2, 2)),
      ],
    ),
    out_shape=jax.ShapeDtypeStruct((W, K, R_pad, H), dt),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    interpret=interpret,
  )(start_W.astype(jnp.int32), end_W.astype(jnp.int32), q.astype(dt), k_WSX, v_WSX)
  return out[:, :, :R]


def cache_spec(layout: Layout, num_slots: int, num_kv_heads: int) -> PartitionSpec:
  """The [W, S, K*H] cache's split: slots over the attention's row axes ("attn_batch"),
  the last axis over the kv-head axes when they divide K (whole heads per device), as
  the layout splits [W, K]."""
  rows, heads = layout.spec(("attn_batch", "kv_heads"), (num_slots, num_kv_heads), "ragged cache")
  return PartitionSpec(rows, None, heads)


def attend(
  q_WKRH: jax.Array,
  k_WSX: jax.Array,
  v_WSX: jax.Array,
  start_W: jax.Array,
  end_W: jax.Array,
  *,
  block: int = BLOCK,
  align: int = ALIGN,
  layout: Layout | None = None,
  interpret: bool | pltpu.InterpretParams | None = None,
) -> jax.Array:
  """Attention [W, K, R, H] of each slot's query over its columns ``[start_W, end_W)``.

  ``decode.attend_full`` under the mask ``start_W <= s < end_W``, reading only
  those columns (blocks laid from ``start_W`` rounded down to a multiple of
  gcd(``align``, ``block``), the last cut to such a multiple past ``end_W``), from keys
  and values laid out [W, S, K*H].
  ``interpret`` None: on any platform but TPU (``platform``).
  """
  if interpret is None:
    interpret = platform(layout) != "tpu"
  local = functools.partial(_local, block=block, align=align, interpret=interpret)
  if layout is None:
    return local(q_WKRH, k_WSX, v_WSX, start_W, end_W)
  cache = cache_spec(layout, q_WKRH.shape[0], q_WKRH.shape[1])
  heads = PartitionSpec(cache[0], cache[2])
  rows = PartitionSpec(cache[0])
  return jax.shard_map(
    local,
    mesh=layout.mesh,
    in_specs=(heads, cache, cache, rows, rows),
    out_specs=heads,
    check_vma=False,
  )(q_WKRH, k_WSX, v_WSX, start_W, end_W)
