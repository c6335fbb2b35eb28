"""The engine's one-token decode step over N cache slots, each at its own column.

The prefill fills the model's stacked ``KVCache`` [L, Q, P, K, H] once per
prompt; the engine (capo_jax.sampling.engine) copies a prompt's keys / values
into a slot of a ``SlotCache`` when a row starts there, and every decode step
advances all N slots by one token (``step``):

- slot n holds one row: its left-padded prompt in columns [0, P), then its
  completion, token t's key / value at column P + t - 1. Each slot writes at
  its own column (a scatter), so rows of different ages share a step.
- attention reads only the filled part of the cache: blocks of ``block``
  columns up to the longest active slot (``num_blocks``, a traced value), with
  an online softmax. A block past a slot's end is all masked and changes
  nothing (max unchanged, rescale exactly 1, weights exactly 0), so a row's
  result does not depend on the other rows in the step.
- keys as [N, K, H, S] and values as [N, K, S, H], the operand layouts of the
  two attention matmuls, so no step transposes the cache (with the model's
  [B, S, K, H] layout XLA transposed every layer's whole cache every step),
  and one buffer per layer, not a slice of a stacked array (inside the
  model's layer scan XLA copies every layer's cache slice in and out).

Logits come out vocab-major [V, N] (``unembed_VD @ h_DN``), which XLA's CPU
dot ran faster than ``h_ND @ unembed_DV``; the strategies
(capo_jax.sampling.strategies) take it as is.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models import qwen2
from models.config import Qwen2Config
from models.qwen2 import Params

_NEG = float(jnp.finfo(jnp.float32).min)  # finite: a fully masked block stays NaN-free


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotCache:
  k: tuple[jax.Array, ...]  # per layer [N, K, H, S]
  v: tuple[jax.Array, ...]  # per layer [N, K, S, H]
  mask_NS: jax.Array  # bool: column holds a real token of the slot's row

  @classmethod
  def empty(cls, cfg: Qwen2Config, num_slots: int, num_cols: int) -> SlotCache:
    N, K, H, S = num_slots, cfg.num_kv_heads, cfg.head_dim, num_cols
    return cls(k=tuple(jnp.zeros((N, K, H, S), cfg.dtype) for _ in range(cfg.num_layers)),
               v=tuple(jnp.zeros((N, K, S, H), cfg.dtype) for _ in range(cfg.num_layers)),
               mask_NS=jnp.zeros((N, S), jnp.bool_))


@dataclasses.dataclass(frozen=True)
class DecodeWeights:
  """What every decode step reads, prepared once per loop (``prepare``).

  Per-layer slices of the stacked weights (sliced per layer per step, XLA
  would copy them every step), the output projection as [V, D] (the embedding
  itself when tied) and RoPE cos / sin [S, H/2] for every position a row can
  reach in the cache: computing them inside the step instead, XLA fused cos /
  sin into every layer's rotation, evaluated once per head and element.
  """
  embed_VD: jax.Array
  final_norm_D: jax.Array
  layers: list[Params]
  unembed_VD: jax.Array
  rope_Sh: tuple[jax.Array, jax.Array]


def prepare(params: Params, cfg: Qwen2Config, num_cols: int) -> DecodeWeights:
  """``DecodeWeights`` of ``params`` for a cache of ``num_cols`` columns."""
  unembed = params["embed"] if cfg.tie_word_embeddings else params["lm_head"].T
  cos, sin = qwen2.rope_tables(jnp.arange(num_cols)[None], cfg.head_dim, cfg.rope_theta)
  return DecodeWeights(
      embed_VD=params["embed"], final_norm_D=params["final_norm"],
      layers=[jax.tree.map(lambda w, l=l: w[l], params["layers"])
              for l in range(cfg.num_layers)],
      unembed_VD=unembed.astype(cfg.dtype), rope_Sh=(cos[0], sin[0]))


def attend_full(q_NKRH: jax.Array, k_NKHS: jax.Array, v_NKSH: jax.Array,
                mask_NS: jax.Array) -> jax.Array:
  """One query token per slot against every column; scores and softmax in float32."""
  H = q_NKRH.shape[-1]
  scores_NKRS = jnp.einsum("nkrh,nkhs->nkrs", q_NKRH, k_NKHS,
                           preferred_element_type=jnp.float32) * (H ** -0.5)
  scores_NKRS = jnp.where(mask_NS[:, None, None], scores_NKRS, _NEG)
  probs = jax.nn.softmax(scores_NKRS, axis=-1).astype(v_NKSH.dtype)
  return jnp.einsum("nkrs,nksh->nkrh", probs, v_NKSH)


def attend_blocks(q_NKRH: jax.Array, k_NKHS: jax.Array, v_NKSH: jax.Array, mask_NS: jax.Array,
                  num_blocks: jax.Array, block: int) -> jax.Array:
  """``attend_full`` over the first ``num_blocks`` blocks of ``block`` columns only.

  Online softmax (running max, normaliser and weighted sum in float32). A
  leading all-padding block is wiped out exactly when the first real score
  arrives (its rescale is exp(min - real) = 0), a trailing all-masked one is
  an exact no-op, so the result is the softmax over the slot's real columns
  whatever ``num_blocks`` (>= the slot's filled blocks) is.
  """
  N, K, R, H = q_NKRH.shape

  def body(b: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    m_NKR, l_NKR, acc_NKRH = carry
    s0 = b * block
    k_blk = jax.lax.dynamic_slice_in_dim(k_NKHS, s0, block, axis=3)
    v_blk = jax.lax.dynamic_slice_in_dim(v_NKSH, s0, block, axis=2)
    mask_blk = jax.lax.dynamic_slice_in_dim(mask_NS, s0, block, axis=1)
    s_NKRJ = jnp.einsum("nkrh,nkhj->nkrj", q_NKRH, k_blk,
                        preferred_element_type=jnp.float32) * (H ** -0.5)
    s_NKRJ = jnp.where(mask_blk[:, None, None], s_NKRJ, _NEG)
    m_new = jnp.maximum(m_NKR, s_NKRJ.max(-1))
    rescale = jnp.exp(m_NKR - m_new)
    p_NKRJ = jnp.exp(s_NKRJ - m_new[..., None])
    acc_NKRH = acc_NKRH * rescale[..., None] + jnp.einsum(
        "nkrj,nkjh->nkrh", p_NKRJ.astype(v_NKSH.dtype), v_blk,
        preferred_element_type=jnp.float32)
    return m_new, l_NKR * rescale + p_NKRJ.sum(-1), acc_NKRH

  init = (jnp.full((N, K, R), _NEG, jnp.float32), jnp.zeros((N, K, R), jnp.float32),
          jnp.zeros((N, K, R, H), jnp.float32))
  _, l_NKR, acc_NKRH = jax.lax.fori_loop(0, num_blocks, body, init)
  return (acc_NKRH / l_NKR[..., None]).astype(v_NKSH.dtype)


@dataclasses.dataclass(frozen=True)
class Where:
  """Per slot: the column its token is written at and that token's RoPE position;
  ``num_blocks``: the blocks of ``block`` columns that hold any active slot's tokens
  (ignored when the cache is one block or less: then attention reads it all)."""
  col_N: jax.Array
  pos_N: jax.Array
  num_blocks: jax.Array
  block: int


def step(w: DecodeWeights, cfg: Qwen2Config, tokens_N: jax.Array, cache: SlotCache,
         where: Where) -> tuple[jax.Array, SlotCache]:
  """Float32 logits [V, N] of the next token after ``tokens_N``, and the updated cache.

  ``qwen2.forward_with_cache`` for T = 1 (same positions, masking and
  numerics up to the blocked softmax), with the weights of ``prepare``.
  """
  N, S = cache.mask_NS.shape
  K, H = cfg.num_kv_heads, cfg.head_dim
  slot_N = jnp.arange(N)
  mask_NS = cache.mask_NS.at[slot_N, where.col_N].set(True)
  rope_N1 = tuple(t[where.pos_N][:, None] for t in w.rope_Sh)
  x_N1D = w.embed_VD.astype(cfg.dtype)[tokens_N[:, None]]
  ks, vs = list(cache.k), list(cache.v)
  blocked = S > where.block
  for l, p in enumerate(w.layers):

    def attend(q_N1NH, k_N1KH, v_N1KH, k_NKHS=ks[l], v_NKSH=vs[l]):
      # Each slot writes its token's key / value at its own column, in place.
      k_NKHS = k_NKHS.at[slot_N, :, :, where.col_N].set(k_N1KH[:, 0])
      v_NKSH = v_NKSH.at[slot_N, :, where.col_N, :].set(v_N1KH[:, 0])
      q_NKRH = q_N1NH.reshape(N, K, -1, H)
      if blocked:
        out_NKRH = attend_blocks(q_NKRH, k_NKHS, v_NKSH, mask_NS, where.num_blocks,
                                 where.block)
      else:
        out_NKRH = attend_full(q_NKRH, k_NKHS, v_NKSH, mask_NS)
      return out_NKRH.reshape(N, 1, -1, H), (k_NKHS, v_NKSH)

    x_N1D, (ks[l], vs[l]) = qwen2.layer(cfg, x_N1D, p, rope_N1, attend)
  h_ND = qwen2.rms_norm(x_N1D[:, 0], w.final_norm_D, cfg.rms_norm_eps)
  logits_VN = jnp.einsum("vd,nd->vn", w.unembed_VD, h_ND.astype(cfg.dtype),
                         preferred_element_type=jnp.float32)
  return logits_VN, SlotCache(tuple(ks), tuple(vs), mask_NS)
