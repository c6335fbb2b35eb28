"""The sampler's one-token decode step, over per-layer buffers laid out for it.

The prefill fills the model's stacked ``KVCache`` [L, B, S, K, H]; decoding
re-lays it out once per ``generate`` call (``DecodeCache.from_prefill``) and
runs the layers unrolled (``qwen2.layer``, the model's own ``DecoderLayer``)
over one donated buffer per layer:

- keys as [B, K, H, S] and values as [B, K, S, H], the operand layouts of the
  two attention matmuls, so no step transposes the cache (with the model's
  [B, S, K, H] layout XLA transposed every layer's whole cache every step).
- one buffer per layer, not a slice of a stacked array: inside the model's
  layer scan XLA copies every layer's cache slice (and weight slice) in and
  out each step.

Logits come out vocab-major [V, B] (``unembed_VD @ h_DB``), which XLA's CPU
dot ran faster than ``h_BD @ unembed_DV``; the strategies
(capo_jax.sampling.strategies) take it as is. The README's benchmark table
has the measured effect of each of these layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from models import kv_cache, qwen2
from models.config import Qwen2Config
from models.qwen2 import Params



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCache:
  k: tuple[jax.Array, ...]  # per layer [B, K, H, S]
  v: tuple[jax.Array, ...]  # per layer [B, K, S, H]
  mask_BS: jax.Array  # bool: slot holds a real token
  positions_B: jax.Array  # int32: RoPE position of each row's next token
  index: jax.Array  # int32: next slot to write

  @classmethod
  def from_prefill(cls, cache: kv_cache.KVCache, free_slots: int) -> DecodeCache:
    """The prefilled stacked cache, split per layer, re-laid out, ``free_slots`` appended."""
    pad_S = lambda x_BSKH: jnp.pad(x_BSKH, ((0, 0), (0, free_slots), (0, 0), (0, 0)))
    L = cache.k_LBSKH.shape[0]
    return cls(
        k=tuple(pad_S(cache.k_LBSKH[l]).transpose(0, 2, 3, 1) for l in range(L)),
        v=tuple(pad_S(cache.v_LBSKH[l]).transpose(0, 2, 1, 3) for l in range(L)),
        mask_BS=jnp.pad(cache.mask_BS, ((0, 0), (0, free_slots))),
        positions_B=cache.positions_B, index=cache.index)


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


def prepare(params: Params, cfg: Qwen2Config, num_slots: int) -> DecodeWeights:
  """``DecodeWeights`` of ``params`` for a cache of ``num_slots`` slots."""
  unembed = params["embed"] if cfg.tie_word_embeddings else params["lm_head"].T
  cos, sin = qwen2.rope_tables(jnp.arange(num_slots)[None], cfg.head_dim, cfg.rope_theta)
  return DecodeWeights(
      embed_VD=params["embed"], final_norm_D=params["final_norm"],
      layers=[jax.tree.map(lambda w, l=l: w[l], params["layers"])
              for l in range(cfg.num_layers)],
      unembed_VD=unembed.astype(cfg.dtype), rope_Sh=(cos[0], sin[0]))


def _attend_one(q_BKRH: jax.Array, k_BKHS: jax.Array, v_BKSH: jax.Array,
                mask_BS: jax.Array) -> jax.Array:
  """One query token per row against all slots; scores and softmax in float32."""
  H = q_BKRH.shape[-1]
  scores_BKRS = jnp.einsum("bkrh,bkhs->bkrs", q_BKRH, k_BKHS,
                           preferred_element_type=jnp.float32) * (H ** -0.5)
  scores_BKRS = jnp.where(mask_BS[:, None, None], scores_BKRS, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores_BKRS, axis=-1).astype(v_BKSH.dtype)
  return jnp.einsum("bkrs,bksh->bkrh", probs, v_BKSH)


def step(w: DecodeWeights, cfg: Qwen2Config, tokens_B: jax.Array, cache: DecodeCache
         ) -> tuple[jax.Array, DecodeCache]:
  """Float32 logits [V, B] of the next token after ``tokens_B``, and the updated cache.

  ``qwen2.forward_with_cache`` for T = 1 (same positions, masking and
  numerics), with the weights of ``prepare``.
  """
  B, S = cache.mask_BS.shape
  K, H = cfg.num_kv_heads, cfg.head_dim
  index = cache.index
  mask_BS = jax.lax.dynamic_update_slice(cache.mask_BS, jnp.ones((B, 1), jnp.bool_),
                                         (0, index))
  # Slots past ``index`` are free (stale values of nothing): never attended.
  visible_BS = mask_BS & (jnp.arange(S) <= index)[None]
  rope_B1 = tuple(t[cache.positions_B][:, None] for t in w.rope_Sh)
  x_B1D = w.embed_VD.astype(cfg.dtype)[tokens_B[:, None]]
  ks, vs = list(cache.k), list(cache.v)
  for l, p in enumerate(w.layers):

    def attend(q_B1NH, k_B1KH, v_B1KH, k_BKHS=ks[l], v_BKSH=vs[l]):
      # Write this token's key / value at slot ``index``, attend over all slots.
      k_BKHS = jax.lax.dynamic_update_slice(k_BKHS, k_B1KH[:, 0, :, :, None], (0, 0, 0, index))
      v_BKSH = jax.lax.dynamic_update_slice(v_BKSH, v_B1KH.transpose(0, 2, 1, 3),
                                            (0, 0, index, 0))
      out_BKRH = _attend_one(q_B1NH.reshape(B, K, -1, H), k_BKHS, v_BKSH, visible_BS)
      return out_BKRH.reshape(B, 1, -1, H), (k_BKHS, v_BKSH)

    x_B1D, (ks[l], vs[l]) = qwen2.layer(cfg, x_B1D, p, rope_B1, attend)
  h_BD = qwen2.rms_norm(x_B1D[:, 0], w.final_norm_D, cfg.rms_norm_eps)
  logits_VB = jnp.einsum("vd,bd->vb", w.unembed_VD, h_BD.astype(cfg.dtype),
                         preferred_element_type=jnp.float32)
  return logits_VB, DecodeCache(tuple(ks), tuple(vs), mask_BS, cache.positions_B + 1, index + 1)
