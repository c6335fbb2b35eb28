"""Ragged decode attention: each slot reads its own cache columns only (a Pallas kernel).

One query token per slot against that slot's real columns ``[start_W, end_W)``
of the slot cache (capo_jax.sampling.decode: keys [W, K, H, S], values
[W, K, S, H]). A slot's real columns are one contiguous range: its left-padded
prompt ends at column P - 1 and its completion follows from column P on, so a
range is all the kernel needs, no mask. A slot with ``start >= end`` (an idle
slot) reads nothing and returns zeros.

The kernel's grid is the slots (one program per slot, all K kv heads at once);
inside, a loop over the slot's own blocks of ``block`` columns copies each
block's keys / values from HBM into a double buffer (the next block's copy runs
while this one is computed) and folds it into an online softmax (float32
running max, normaliser and weighted sum). So a step reads each row's KV up to
its own length (rounded up to a block), not every slot up to the longest row,
in ``W`` programs per layer whose loops run the rows' own block counts.

A block that would run past the cache's end is moved back to end at column S
(the copy keeps its static size); its columns before the nominal block start,
already read by the previous block, are masked. So S need not be a multiple of
``block``.

``interpret=True`` (the default off TPU) runs the same kernel through Pallas'
interpreter: the CPU tests check it against ``decode.attend_full``. Under a
``Layout`` the kernel runs in a ``shard_map`` over the slots and kv heads as
the layout splits the cache: XLA cannot partition a Pallas call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from models.sharding import Layout

BLOCK = 512  # columns per copy: 256 KiB of bfloat16 keys per kv-head pair at H = 128
_SUBLANES = 8  # the query heads of a group are padded to whole sublane tiles
_LANES = 128


def platform(layout: Layout | None) -> str:
  """The platform a program is for: the layout's devices' (a TPU topology compiled ahead
  of time from a CPU host), else JAX's default backend."""
  return jax.default_backend() if layout is None else layout.mesh.devices.flat[0].platform


def _kernel(
  start_ref,  # SMEM [W] int32
  end_ref,  # SMEM [W] int32
  q_ref,  # VMEM [K, R, H]: this slot's queries
  k_hbm,  # HBM [W, K, H, S]
  v_hbm,  # HBM [W, K, S, H]
  o_ref,  # VMEM [K, R, H]
  k_buf,  # VMEM [2, K, H, block]
  v_buf,  # VMEM [2, K, block, H]
  sem,  # DMA semaphores [2, 2]: (k / v, buffer)
  *,
  block: int,
  num_cols: int,
):
  w = pl.program_id(0)
  start, end = start_ref[w], end_ref[w]
  # lax.div / rem: the columns are >= 0, and jnp's floor division lowers through
  # sign(), which Mosaic only lowers when it can query a TPU.
  first = jax.lax.div(start, block)
  n = jnp.where(end > start, jax.lax.div(end - 1, block) - first + 1, 0)
  K, R, H = q_ref.shape

  def copies(i, buf):
    s0 = jnp.minimum((first + i) * block, num_cols - block)
    return (
      pltpu.make_async_copy(k_hbm.at[w, :, :, pl.ds(s0, block)], k_buf.at[buf], sem.at[0, buf]),
      pltpu.make_async_copy(v_hbm.at[w, :, pl.ds(s0, block), :], v_buf.at[buf], sem.at[1, buf]),
    )

  @pl.when(n > 0)
  def _():
    for c in copies(0, 0):
      c.start()

  q_KRH = q_ref[...]

  def body(i, carry):
    buf = jax.lax.rem(i, 2)

    @pl.when(i + 1 < n)
    def _():
      for c in copies(i + 1, 1 - buf):
        c.start()

    for c in copies(i, buf):
      c.wait()
    b0 = (first + i) * block
    s0 = jnp.minimum(b0, num_cols - block)
    col_1S = s0 + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    valid_1S = (col_1S >= jnp.maximum(start, b0)) & (col_1S < end)
    out = []
    for k, (m_R1, l_R1, acc_RH) in enumerate(carry):
      s_RS = jax.lax.dot_general(
        q_KRH[k], k_buf[buf, k], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
      ) * (H**-0.5)
      s_RS = jnp.where(valid_1S, s_RS, -jnp.inf)
      m_new = jnp.maximum(m_R1, s_RS.max(-1, keepdims=True))
      p_RS = jnp.where(valid_1S, jnp.exp(s_RS - m_new), 0.0)
      rescale = jnp.exp(m_R1 - m_new)
      pv_RH = jax.lax.dot_general(
        p_RS.astype(v_buf.dtype),
        v_buf[buf, k],
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
  k_WKHS: jax.Array,
  v_WKSH: jax.Array,
  start_W: jax.Array,
  end_W: jax.Array,
  block: int,
  interpret: bool,
) -> jax.Array:
  W, K, R, H = q_WKRH.shape
  S = k_WKHS.shape[-1]
  block = min(block, S)
  if not interpret and (S % _LANES or block % _LANES):
    # Mosaic copies whole lane tiles: a column offset must be a multiple of 128.
    raise ValueError(
      f"ragged.attend on TPU: cache columns ({S}) and block ({block}) must be multiples of {_LANES}"
    )
  R_pad = -(-R // _SUBLANES) * _SUBLANES
  q = jnp.pad(q_WKRH, ((0, 0), (0, 0), (0, R_pad - R), (0, 0)))
  dt = v_WKSH.dtype
  heads = pl.BlockSpec((None, K, R_pad, H), lambda w, *_: (w, 0, 0, 0))
  out = pl.pallas_call(
    functools.partial(_kernel, block=block, num_cols=S),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(W,),
      in_specs=[heads, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=heads,
      scratch_shapes=[
        pltpu.VMEM((2, K, H, block), k_WKHS.dtype),
        pltpu.VMEM((2, K, block, H), dt),
        pltpu.SemaphoreType.DMA((2, 2)),
      ],
    ),
    out_shape=jax.ShapeDtypeStruct((W, K, R_pad, H), dt),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    interpret=interpret,
  )(start_W.astype(jnp.int32), end_W.astype(jnp.int32), q.astype(dt), k_WKHS, v_WKSH)
  return out[:, :, :R]


def attend(
  q_WKRH: jax.Array,
  k_WKHS: jax.Array,
  v_WKSH: jax.Array,
  start_W: jax.Array,
  end_W: jax.Array,
  *,
  block: int = BLOCK,
  layout: Layout | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """Attention [W, K, R, H] of each slot's query over its columns ``[start_W, end_W)``.

  ``decode.attend_full`` under the mask ``start_W <= s < end_W``, reading
  only those columns (whole blocks). ``interpret`` None: on any platform but
  TPU (the layout's devices' when given, so an ahead-of-time TPU compile from
  a CPU host gets the kernel).
  """
  if interpret is None:
    interpret = platform(layout) != "tpu"
  local = functools.partial(_local, block=block, interpret=interpret)
  if layout is None:
    return local(q_WKRH, k_WKHS, v_WKSH, start_W, end_W)
  cache = layout.spec(("batch", "kv_heads", None, None), k_WKHS.shape, "ragged attention k/v")
  rows = PartitionSpec(cache[0])
  return jax.shard_map(
    local,
    mesh=layout.mesh,
    in_specs=(cache, cache, cache, rows, rows),
    out_specs=cache,
    check_vma=False,
  )(q_WKRH, k_WKHS, v_WKSH, start_W, end_W)
