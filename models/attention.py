"""Causal, segment-aware attention of the full (uncached) forward: four implementations.

Every implementation computes the same thing: query t of a row attends to key s
of the same row when ``s <= t`` (column order) and ``segment_ids_BT[t] ==
segment_ids_BT[s]``. An unpacked left-padded row has segment 1 on its real
tokens and 0 on padding; a packed row (``capo_jax.rl.packing``) numbers its
sequences 1, 2, ... and gives its tail padding 0. Padding is a segment of its
own, so every query sees at least itself and no row is ever fully masked
(nothing to guard against NaNs), and real queries never see padding.

  reference  the float32 [B, N, T, S] score matrix, softmax, matmul (``reference``).
  xla        ``jax.nn.dot_product_attention`` with a boolean [B, 1, T, S] mask
             (cuDNN on GPU when it takes the shape, else XLA's own; on CPU it
             builds the full score matrix too; see docs/packing.md).
  flash      blocked online-softmax attention in plain JAX with a hand-written
             backward (``jax.custom_vjp``): it holds one [B, K, R, T, S] float32
             score block (a block of each) at a time, forward and backward, and skips the key
             blocks above the diagonal and those of other segments.
  splash     the Pallas TPU splash-attention kernel with ``SegmentIds``, each row with
             its own block tables that skip the blocks two of its sequences meet in
             (``models/splash_blocks.py``; ``interpret=True`` off TPU, for tests).
  auto       splash on TPU (the platform of the program's layout, so a TPU program
             compiled ahead of time from a CPU host gets it too); elsewhere flash
             when the row is longer than one block, else reference (a single
             block: the same memory, less overhead).

Shape letters as in ``capo_jax/types.py`` (B, T, S, N, K, R, H), plus X (blocks) for
the blocked implementation: a query block keeps the letter T and a key block S
(``width`` long each).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from models import sharding, splash_blocks

IMPLEMENTATIONS = ("auto", "reference", "xla", "flash", "splash")
DEFAULT_BLOCK = 128  # flash: small blocks skip more of a packed row's masked pairs
SPLASH_BLOCK = 512  # the kernel's own default block
# The name of splash's residuals (its output and log-sum-exp): the "projections" remat
# policy keeps them, so a layer's backward does not run the forward kernel again.
SPLASH_RESIDUALS = "splash_residuals"
# Finite, so exp(masked - running max) is 0 without inf - inf = NaN.
_NEG = -1e30


def segment_mask(segment_ids_BT: jax.Array) -> jax.Array:
  """The boolean [B, T, T] mask: causal (by column) and within one segment."""
  T = segment_ids_BT.shape[1]
  causal_TS = jnp.tril(jnp.ones((T, T), jnp.bool_))
  return causal_TS[None] & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])


def reference(
  q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask_BTS: jax.Array
) -> jax.Array:
  """Grouped-query attention under any boolean mask; scores and softmax in float32."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BTKRH = q_BTNH.reshape(B, T, K, N // K, H)
  scores = jnp.einsum("btkrh,bskh->bkrts", q_BTKRH, k_BSKH, preferred_element_type=jnp.float32) * (
    H**-0.5
  )
  # A finite minimum keeps fully-masked (padding) query rows free of NaNs.
  scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKH.dtype)
  out = jnp.einsum("bkrts,bskh->btkrh", probs, v_BSKH)
  return out.reshape(B, T, N, H)


def xla(
  q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BT: jax.Array
) -> jax.Array:
  """``jax.nn.dot_product_attention`` (GQA native) under the segment mask."""
  mask_B1TS = segment_mask(segment_ids_BT)[:, None]
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_B1TS)


# --- blocked (flash-style) attention -----------------------------------------


def _block_scores(q_BTKRH, k_BSKH, seg_q_BT, seg_k_BS, i, j, width):
  """Masked float32 scores [B, K, R, T, S] of query block i against key block j."""
  H = q_BTKRH.shape[-1]
  s = jnp.einsum("btkrh,bskh->bkrts", q_BTKRH, k_BSKH, preferred_element_type=jnp.float32) * (
    H**-0.5
  )
  causal_TS = (i * width + jnp.arange(width))[:, None] >= (j * width + jnp.arange(width))[None, :]
  mask_BTS = causal_TS[None] & (seg_q_BT[:, :, None] == seg_k_BS[:, None, :])
  return jnp.where(mask_BTS[:, None, None], s, _NEG), mask_BTS


def _blk(x: jax.Array, i: jax.Array, width: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, i * width, width, axis=1)


def _block_overlap(seg, width):
  """overlap(i, j): some row's query block i and key block j may share a segment.

  A range test on each block's (min, max) segment id: exact for packed rows
  (segments increase along the row), conservative otherwise. Blocks that fail
  it are fully masked and skipped, forward and backward.
  """
  B, T = seg.shape
  seg_BXT = seg.reshape(B, T // width, width)
  lo, hi = seg_BXT.min(-1), seg_BXT.max(-1)
  return lambda i, j: jnp.any((lo[:, i] <= hi[:, j]) & (lo[:, j] <= hi[:, i]))


def _skip_unless(pred, fn, carry):
  """``fn(carry)`` where ``pred``, else ``carry`` unchanged (only one branch runs)."""
  return jax.lax.cond(pred, fn, lambda c: c, carry)


def _flash_forward(q, k, v, seg, width):
  """out [B, T, K, R, H] and the log-sum-exp [X, B, K, R, T] (a block of T) of the softmax."""
  B, T, K, R, H = q.shape
  X = T // width
  overlap = _block_overlap(seg, width)

  def query_block(i):
    q_i, sq_i = _blk(q, i, width), _blk(seg, i, width)

    def update(j, carry):
      m, l, acc = carry
      s, _ = _block_scores(q_i, _blk(k, j, width), sq_i, _blk(seg, j, width), i, j, width)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum(
        "bkrts,bskh->bkrth",
        p.astype(v.dtype),
        _blk(v, j, width),
        preferred_element_type=jnp.float32,
      )
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    key_block = lambda j, carry: _skip_unless(overlap(i, j), lambda c: update(j, c), carry)

    init = (
      jnp.full((B, K, R, width), _NEG, jnp.float32),
      jnp.zeros((B, K, R, width), jnp.float32),
      jnp.zeros((B, K, R, width, H), jnp.float32),
    )
    # Key blocks past the diagonal are fully masked: the loop stops at i.
    m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
    out = jnp.einsum("bkrth->btkrh", acc / l[..., None]).astype(q.dtype)
    return out, m + jnp.log(l)

  out_XBTKRH, lse_XBKRT = jax.lax.map(query_block, jnp.arange(X))
  return jnp.moveaxis(out_XBTKRH, 0, 1).reshape(B, T, K, R, H), lse_XBKRT


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, width):
  return _flash_forward(q, k, v, seg, width)[0]


def _flash_fwd(q, k, v, seg, width):
  out, lse = _flash_forward(q, k, v, seg, width)
  return out, (q, k, v, seg, out, lse)


def _flash_bwd(width, res, d_out):
  """FlashAttention-2's backward: each block's probabilities recomputed from the lse."""
  q, k, v, seg, out, lse_XBKRT = res
  B, T, K, R, H = q.shape
  X = T // width
  scale = H**-0.5
  overlap = _block_overlap(seg, width)
  # D = rowsum(dO * O), the softmax-Jacobian term; [B, K, R, T].
  delta_BKRT = jnp.einsum("btkrh,btkrh->bkrt", d_out.astype(jnp.float32), out.astype(jnp.float32))

  def probs_and_ds(i, j):
    q_i, k_j, v_j = _blk(q, i, width), _blk(k, j, width), _blk(v, j, width)
    s, mask = _block_scores(q_i, k_j, _blk(seg, i, width), _blk(seg, j, width), i, j, width)
    p = jnp.where(mask[:, None, None], jnp.exp(s - lse_XBKRT[i][..., None]), 0.0)
    do_i = _blk(d_out, i, width).astype(jnp.float32)
    dp = jnp.einsum("btkrh,bskh->bkrts", do_i, v_j.astype(jnp.float32))
    d_i = jax.lax.dynamic_slice_in_dim(delta_BKRT, i * width, width, axis=3)
    return p, p * (dp - d_i[..., None]) * scale, do_i

  def dq_block(i):
    def update(j, dq):
      _, ds, _ = probs_and_ds(i, j)
      return dq + jnp.einsum("bkrts,bskh->btkrh", ds, _blk(k, j, width).astype(jnp.float32))

    body = lambda j, dq: _skip_unless(overlap(i, j), lambda c: update(j, c), dq)
    return jax.lax.fori_loop(0, i + 1, body, jnp.zeros((B, width, K, R, H), jnp.float32))

  def dkv_block(j):
    def update(i, carry):
      dk, dv = carry
      p, ds, do_i = probs_and_ds(i, j)
      dv = dv + jnp.einsum("bkrts,btkrh->bskh", p, do_i)
      dk = dk + jnp.einsum("bkrts,btkrh->bskh", ds, _blk(q, i, width).astype(jnp.float32))
      return dk, dv

    body = lambda i, c: _skip_unless(overlap(i, j), lambda c_: update(i, c_), c)
    zeros = jnp.zeros((B, width, K, H), jnp.float32)
    return jax.lax.fori_loop(j, X, body, (zeros, zeros))

  unblock = lambda x_X: jnp.moveaxis(x_X, 0, 1).reshape((B, T) + x_X.shape[3:])
  dq = unblock(jax.lax.map(dq_block, jnp.arange(X)))
  dk_X, dv_X = jax.lax.map(dkv_block, jnp.arange(X))
  return (
    dq.astype(q.dtype),
    unblock(dk_X).astype(k.dtype),
    unblock(dv_X).astype(v.dtype),
    np.zeros(seg.shape, jax.dtypes.float0),
  )


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_rows(x: jax.Array, T_pad: int, value: int | float = 0) -> jax.Array:
  pad = [(0, 0), (0, T_pad - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x, pad, constant_values=value)


def flash(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  segment_ids_BT: jax.Array,
  block: int = DEFAULT_BLOCK,
) -> jax.Array:
  """Blocked attention in X = ceil(T / ``block``) blocks of ``width`` <= ``block`` columns
  (a multiple of 8 where that stays under ``block``); T is padded to X * width.

  Padding columns get segment id -1: no real query sees them.
  """
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  X = -(-T // block)
  width = -(-T // X)
  width = min(-(-width // 8) * 8, max(block, width))
  T_pad = X * width
  q = _pad_rows(q_BTNH, T_pad).reshape(B, T_pad, K, N // K, H)
  k, v = _pad_rows(k_BSKH, T_pad), _pad_rows(v_BSKH, T_pad)
  seg = _pad_rows(segment_ids_BT.astype(jnp.int32), T_pad, -1)
  return _flash(q, k, v, seg, width).reshape(B, T_pad, N, H)[:, :T]


# --- splash (Pallas, TPU) ------------------------------------------------------


def _splash_kernel(N: int, T: int, block: int, interpret: bool):
  # Built inside each trace (not cached): the kernel holds the mask's block tables as
  # arrays, which a cached kernel would leak from one trace into the next.
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  mask = sa.MultiHeadMask([sa.CausalMask((T, T)) for _ in range(N)])
  sizes = sa.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  return sa.make_splash_mha(
    mask,
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    residual_checkpoint_name=SPLASH_RESIDUALS,
    interpret=interpret,
  )


def splash(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  segment_ids_BT: jax.Array,
  block: int = SPLASH_BLOCK,
  interpret: bool | None = None,
) -> jax.Array:
  """The splash kernel (a causal ``MultiHeadMask`` plus ``SegmentIds``), vmapped over rows.

  Its blocks must be multiples of 128 columns: width is ``block`` or T rounded up
  to 128, whichever is smaller, and T is padded to a multiple of width (segment -1).
  The kernel does not scale the scores, so q is scaled first.

  Under an activation layout (``models.sharding.activations``) the kernel runs in
  a ``shard_map`` over the rows and heads as the layout splits them: XLA cannot
  partition a Pallas call, and left to itself gathers every row onto every chip.
  """
  if interpret is None:
    interpret = sharding.platform() != "tpu"
  local = functools.partial(_splash_local, block=block, interpret=interpret)
  return in_row_shards(local, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)


def in_row_shards(
  local: Any, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, *ids_BT: jax.Array
) -> jax.Array:
  """``local(q, k, v, *ids)`` (a Pallas call per row) on the rows and heads each device
  holds under the active layout, in a ``shard_map``; called whole without one. Each
  shard holds whole GQA groups (heads whole when q and k would split differently)."""
  layout = sharding.active_layout()
  if layout is None:
    return local(q_BTNH, k_BSKH, v_BSKH, *ids_BT)
  q_spec = layout.spec(sharding.ACT_BTNH, q_BTNH.shape, "splash q")
  kv_spec = layout.spec(sharding.ACT_BTKH, k_BSKH.shape, "splash k/v")
  if q_spec[2] != kv_spec[2]:  # each shard must hold whole GQA groups: heads whole
    q_spec = PartitionSpec(*q_spec[:2], None, None)
    kv_spec = PartitionSpec(*kv_spec[:2], None, None)
  ids_spec = PartitionSpec(*q_spec[:2])
  return jax.shard_map(
    local,
    mesh=layout.mesh,
    in_specs=(q_spec, kv_spec, kv_spec) + (ids_spec,) * len(ids_BT),
    out_specs=q_spec,
    check_vma=False,
  )(q_BTNH, k_BSKH, v_BSKH, *ids_BT)


def splash_width(T: int, block: int) -> int:
  """The splash blocks' width for rows of T columns: ``block`` in whole 128-column tiles,
  or T rounded up to a tile, whichever is smaller."""
  return min(max(block // 128, 1) * 128, -(-T // 128) * 128)


def splash_inputs(
  q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BT: jax.Array, width: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The kernel's operands: q scaled (the kernel does not scale the scores), q, k, v as
  [B, heads, T_pad, H], and the segment ids, T padded to a multiple of ``width`` (the
  padding its own segment, -1)."""
  T_pad = -(-q_BTNH.shape[1] // width) * width
  H = q_BTNH.shape[-1]
  q = jnp.swapaxes(_pad_rows(q_BTNH * jnp.asarray(H**-0.5, q_BTNH.dtype), T_pad), 1, 2)
  k = jnp.swapaxes(_pad_rows(k_BSKH, T_pad), 1, 2)
  v = jnp.swapaxes(_pad_rows(v_BSKH, T_pad), 1, 2)
  return q, k, v, _pad_rows(segment_ids_BT.astype(jnp.int32), T_pad, -1)


def _splash_local(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  segment_ids_BT: jax.Array,
  block: int,
  interpret: bool,
) -> jax.Array:
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  B, T, N, H = q_BTNH.shape
  width = splash_width(T, block)
  q, k, v, seg = splash_inputs(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, width)
  kernel = _splash_kernel(N, seg.shape[1], width, interpret)
  # Each row's own block tables: the blocks two of its sequences meet in are skipped.
  one = lambda q_NTH, k_KSH, v_KSH, seg_T: splash_blocks.per_row(kernel, seg_T, seg_T)(
    q_NTH, k_KSH, v_KSH, segment_ids=sa.SegmentIds(q=seg_T, kv=seg_T)
  )
  with jax.named_scope(splash_blocks.SCOPE):
    out_BNTH = jax.vmap(one)(q, k, v, seg)
  return jnp.swapaxes(out_BNTH, 1, 2)[:, :T]


# --- dispatch -------------------------------------------------------------------


def resolve(implementation: str, T: int, block: int = DEFAULT_BLOCK) -> str:
  """The concrete implementation "auto" stands for at row length T on this backend."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {implementation!r} is not one of {IMPLEMENTATIONS}")
  if implementation != "auto":
    return implementation
  if sharding.platform() == "tpu":
    return "splash"
  return "flash" if T > block else "reference"


def attend(
  implementation: str,
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  segment_ids_BT: jax.Array,
  block: int = DEFAULT_BLOCK,
) -> jax.Array:
  """Causal same-segment attention [B, T, N, H] with the named implementation."""
  impl = resolve(implementation, q_BTNH.shape[1], block)
  if impl == "reference":
    return reference(q_BTNH, k_BSKH, v_BSKH, segment_mask(segment_ids_BT))
  if impl == "xla":
    return xla(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
  if impl == "flash":
    return flash(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, block)
  return splash(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
