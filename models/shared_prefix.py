"""Attention where the completions of one prompt share the prompt's keys (a packed tree).

The G completions of a prompt begin with the same prompt tokens. Laid once in a row, the
prompt is forwarded once for all of them: each completion attends to its group's prompt
and to its own tokens, never to a sibling's. Two ids per token say which:
``segment_ids_BT`` (the group: its prompt and completions, 0 for padding, as in
``models.attention``) and ``branch_ids_BT`` (0 for the prompt, 1, 2, ... for each
completion of the group). Query t attends to key s of its row when ``s <= t``, the
segments match, and key s is the prompt's or t's own branch (``tree_mask``). With every
branch id 0 this is ``models.attention``'s causal same-segment attention.

Splash attention masks only by equal segment ids, so the tree is two calls merged by
their log-sum-exps:

  own     each branch its own segment (the prompt one, each completion one): causal;
  prompt  the row's prompt columns gathered into ``prompt_cols`` keys, seen by the
          completions of their group (the prompt precedes them: no causal mask).

A completion's output is the softmax over both key sets: a_t o_own + b_t o_prompt, with
a_t, b_t each call's share of the total exp-sum (from their log-sum-exps); a prompt or
padding token keeps ``own``. Splash's backward ignores a cotangent of its log-sum-exp,
so the merge has its own: each call's backward runs with the merged output as its
residual and its share times dO. For row t and a key s of the own call that gives
ds = a_t p_own(t, s) (dO_t . v_s - dO_t . o_t) = p(t, s) (dO_t . v_s - dO_t . o_t), the
gradient of the softmax over both key sets (the prompt call alike).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models import attention, sharding, splash_blocks

# Key segment of a gathered column that holds no prompt token: no query's segment.
_NO_KEY = -2
# A packed row's segment ids carry the tree (``tree_ids``): the group above these bits,
# the branch in them. Without branches they compare as the groups do.
BRANCH_BITS = 12


def tree_ids(segment_ids: Any, branch_ids: Any) -> Any:
  """One id a token for the model's ``segment_ids``: group << BRANCH_BITS | branch
  (NumPy or jax arrays). Positive exactly where the group is (padding stays 0)."""
  if (branch_ids >= 1 << BRANCH_BITS).any():
    raise ValueError(f"shared_prefix.tree_ids: a branch id >= {1 << BRANCH_BITS}")
  return (segment_ids << BRANCH_BITS) | branch_ids


def split_ids(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``tree_ids``' (group, branch)."""
  return ids >> BRANCH_BITS, ids & ((1 << BRANCH_BITS) - 1)


def tree_mask(segment_ids_BT: jax.Array, branch_ids_BT: jax.Array) -> jax.Array:
  """The boolean [B, T, T] mask: causal, one segment, the prompt or one's own branch."""
  T = segment_ids_BT.shape[1]
  causal_TS = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
  same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  br_q, br_k = branch_ids_BT[:, :, None], branch_ids_BT[:, None, :]
  return causal_TS[None] & same_BTS & ((br_k == 0) | (br_k == br_q))


def reference(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  segment_ids_BT: jax.Array,
  branch_ids_BT: jax.Array,
) -> jax.Array:
  """The tree attention with the full [T, T] score matrix (``attention.reference``)."""
  return attention.reference(q_BTNH, k_BSKH, v_BSKH, tree_mask(segment_ids_BT, branch_ids_BT))


def attend(
  implementation: str,
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  ids_BT: jax.Array,
  prompt_cols: int,
) -> jax.Array:
  """The tree attention of rows whose segment ids are ``tree_ids``: splash where
  ``implementation`` resolves to it (TPU), else the full score matrix under
  ``tree_mask`` (the blocked "flash" path has no tree yet)."""
  seg, branch = split_ids(ids_BT)
  if attention.resolve(implementation, q_BTNH.shape[1]) == "splash":
    return splash(q_BTNH, k_BSKH, v_BSKH, seg, branch, prompt_cols)
  return reference(q_BTNH, k_BSKH, v_BSKH, seg, branch)


def mask_at(ids_BT: jax.Array, cols_BZ: jax.Array) -> jax.Array:
  """``tree_mask``'s rows at query columns ``cols_BZ``: [B, Z, T] (the trimmed last layer)."""
  seg, branch = split_ids(ids_BT)
  T = ids_BT.shape[1]
  take = lambda x: jnp.take_along_axis(x, cols_BZ, axis=1)[:, :, None]  # noqa: E731
  br_k = branch[:, None, :]
  same = take(seg) == seg[:, None, :]
  return (cols_BZ[:, :, None] >= jnp.arange(T)) & same & ((br_k == 0) | (br_k == take(branch)))


def own_segments(segment_ids_BT: jax.Array, branch_ids_BT: jax.Array) -> jax.Array:
  """A segment id per (group, branch): each branch of the tree its own causal segment."""
  T = segment_ids_BT.shape[1]
  return segment_ids_BT.astype(jnp.int32) * (T + 1) + branch_ids_BT.astype(jnp.int32)


def splash(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  segment_ids_BT: jax.Array,
  branch_ids_BT: jax.Array,
  prompt_cols: int,
  block: int = attention.SPLASH_BLOCK,
  interpret: bool | None = None,
) -> jax.Array:
  """The tree attention as two splash calls per row (module doc), vmapped over rows.

  ``prompt_cols``: a multiple of 128 at least the prompt tokens of any row (a row's
  prompt columns are gathered into that many keys). T is padded as ``attention.splash``
  pads it. Under an activation layout the calls run in a ``shard_map`` over the rows and
  heads as the layout splits them, as ``attention.splash``'s do.
  """
  if prompt_cols % 128:
    raise ValueError(f"shared_prefix.splash: prompt_cols={prompt_cols} is not a multiple of 128")
  if interpret is None:
    interpret = sharding.platform() != "tpu"
  local = functools.partial(_local, prompt_cols=prompt_cols, block=block, interpret=interpret)
  return attention.in_row_shards(local, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, branch_ids_BT)


def _local(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  segment_ids_BT: jax.Array,
  branch_ids_BT: jax.Array,
  prompt_cols: int,
  block: int,
  interpret: bool,
) -> jax.Array:
  """``splash`` on the rows and heads one device holds."""
  B, T, N, H = q_BTNH.shape
  width = attention.splash_width(T, block)
  q, k, v, seg = attention.splash_inputs(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, width)
  T_pad = seg.shape[1]
  branch = attention._pad_rows(branch_ids_BT.astype(jnp.int32), T_pad)  # noqa: SLF001
  kernels = _Kernels(N, T_pad, prompt_cols, min(width, prompt_cols), width, interpret)
  with jax.named_scope(splash_blocks.SCOPE):
    out_BNTH = jax.vmap(functools.partial(_row, kernels, prompt_cols))(q, k, v, seg, branch)
  return jnp.swapaxes(out_BNTH, 1, 2)[:, :T]


def _row(
  kernels: _Kernels,
  prompt_cols: int,
  q_NTH: jax.Array,
  k_KTH: jax.Array,
  v_KTH: jax.Array,
  seg_T: jax.Array,
  branch_T: jax.Array,
) -> jax.Array:
  """One row: the two calls' inputs, then their merge."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  is_prompt_T = (branch_T == 0) & (seg_T > 0)
  (col_P,) = jnp.nonzero(is_prompt_T, size=prompt_cols, fill_value=0)
  held_P = jnp.arange(prompt_cols) < is_prompt_T.sum()
  kv_seg_P = jnp.where(held_P, seg_T[col_P], _NO_KEY)
  # A completion sees its group's prompt; every other query sees the first gathered key's
  # segment (it sees some key, and its output from this call is not used).
  use_T = (branch_T > 0) & (seg_T > 0)
  q_seg_T = jnp.where(use_T, seg_T, kv_seg_P[0])
  own = own_segments(seg_T[None], branch_T[None])[0]
  return _merged(
    kernels,
    q_NTH,
    k_KTH,
    v_KTH,
    k_KTH[:, col_P],
    v_KTH[:, col_P],
    sa.SegmentIds(q=own, kv=own),
    sa.SegmentIds(q=q_seg_T, kv=kv_seg_P),
    use_T,
    # The own call's tables skip the blocks two branches or groups meet in.
    splash_blocks.tables(kernels.own, own, own),
  )


class _Kernels:
  """The two splash kernels of a row (built per trace: they hold their block tables)."""

  def __init__(self, N: int, T: int, P: int, block_p: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    def sizes(bkv: int) -> Any:
      return sa.BlockSizes(
        block_q=block,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=block,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=block,
        block_kv_dq=bkv,
      )

    make = functools.partial(sa.make_splash_mha, head_shards=1, q_seq_shards=1, interpret=interpret)
    self.own = make(sa.MultiHeadMask([sa.CausalMask((T, T))] * N), block_sizes=sizes(block))
    self.prompt = make(sa.MultiHeadMask([sa.FullMask((T, P))] * N), block_sizes=sizes(block_p))


def _internals(kernel: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

  kw = dict(kernel.kwargs)
  static = {
    "save_residuals": False,
    "mask_value": kw["mask_value"],
    "is_mqa": kw["is_mqa"],
    "block_sizes": kw["block_sizes"],
    "residual_checkpoint_name": kw["residual_checkpoint_name"],
    "mask_function": kw["mask_function"],
    "attn_logits_soft_cap": kw["attn_logits_soft_cap"],
    "interpret": kw["interpret"],
  }
  return sk, (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info), static


def _call_fwd(kernel: Any, q: jax.Array, k: jax.Array, v: jax.Array, seg: Any) -> tuple:
  sk, infos, static = _internals(kernel)
  return sk._splash_attention_fwd(*infos, q, k, v, seg, None, **static)  # noqa: SLF001


def _call_bwd(kernel: Any, res: tuple, do: jax.Array) -> tuple[jax.Array, ...]:
  sk, _, s = _internals(kernel)
  grads = sk._splash_attention_bwd(  # noqa: SLF001
    s["save_residuals"],
    s["mask_value"],
    s["is_mqa"],
    s["block_sizes"],
    s["residual_checkpoint_name"],
    s["mask_function"],
    s["attn_logits_soft_cap"],
    s["interpret"],
    res,
    do,
  )
  return grads[3], grads[4], grads[5]  # dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _merged(kernels: _Kernels, *args: Any) -> jax.Array:
  """The merged output; ``args`` as ``_merged_fwd`` names them."""
  return _merged_fwd(kernels, *args)[0]


def _merged_fwd(
  kernels: _Kernels,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  k_p: jax.Array,
  v_p: jax.Array,
  seg_own: Any,
  seg_prompt: Any,
  use_T: jax.Array,
  own_tables: tuple,
) -> tuple[jax.Array, tuple]:
  own = splash_blocks.with_tables(kernels.own, own_tables)
  o_a, res_a = _call_fwd(own, q, k, v, seg_own)
  o_b, res_b = _call_fwd(kernels.prompt, q, k_p, v_p, seg_prompt)
  # What the backward reads of the calls, the two log-sum-exps and the merged output, is
  # named: the "projections" remat policy keeps it, so the backward runs neither kernel
  # again (nothing it reads may come from a kernel's unnamed outputs).
  name = lambda x: checkpoint_name(x, attention.SPLASH_RESIDUALS)  # noqa: E731
  lse_a, lse_b_all = name(res_a[6]), name(res_b[6])  # [N, T]
  lse_b = jnp.where(use_T[None], lse_b_all, -jnp.inf)
  lse = jnp.logaddexp(lse_a, lse_b)
  a, b = jnp.exp(lse_a - lse), jnp.exp(lse_b - lse)
  o = a[..., None] * o_a.astype(jnp.float32) + b[..., None] * o_b.astype(jnp.float32)
  o = name(jnp.where(use_T[None, :, None], o, o_a.astype(jnp.float32)).astype(q.dtype))
  # Each call's backward runs with the merged output as its residual (module doc).
  res_a = res_a[:5] + (o, lse_a) + res_a[7:]
  res_b = res_b[:5] + (o, lse_b_all) + res_b[7:]
  return o, (res_a, res_b, a, b, use_T, own_tables)


def _merged_bwd(kernels: _Kernels, saved: tuple, do: jax.Array) -> tuple:
  res_a, res_b, a, b, use_T, own_tables = saved
  # Each call's backward with its share of dO.
  do32 = do.astype(jnp.float32)
  do_a = (a[..., None] * do32).astype(do.dtype)
  do_b = jnp.where(use_T[None, :, None], b[..., None] * do32, 0.0).astype(do.dtype)
  dq_a, dk, dv = _call_bwd(splash_blocks.with_tables(kernels.own, own_tables), res_a, do_a)
  dq_b, dk_p, dv_p = _call_bwd(kernels.prompt, res_b, do_b)
  return dq_a + dq_b, dk, dv, dk_p, dv_p, None, None, None, None  # ids, flags, tables: none


_merged.defvjp(_merged_fwd, _merged_bwd)
