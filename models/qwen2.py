"""Pure-functional Qwen2 / Qwen2.5 decoder.

Axis legend (array-name suffixes and einsum letters):
  B batch, T query length, S key/value length, D model dim, N query heads,
  K kv heads, G query heads per kv head (N = K*G), H head dim, F MLP dim,
  V vocab, L layers.

Params are a plain nested dict of arrays passed to every function (never
closed over); per-layer weights are stacked on a leading L axis and the
layers run under ``lax.scan``, which keeps compile time independent of depth.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from models import sharding
from models.config import PRESETS, Qwen2Config  # noqa: F401  (re-exported)
from models.kv_cache import KVCache, init_cache  # noqa: F401  (re-exported)

Params = dict[str, Any]

# Logical axis names of every parameter; ``layers`` is the stacked-layer axis.
_LAYER_AXES = {
    "attn_norm": ("layers", "norm"),
    "q_kernel": ("layers", "embed", "q_heads", "head_dim"),
    "q_bias": ("layers", "q_heads", "head_dim"),
    "k_kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "k_bias": ("layers", "kv_heads", "head_dim"),
    "v_kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "v_bias": ("layers", "kv_heads", "head_dim"),
    "o_kernel": ("layers", "q_heads", "head_dim", "embed"),
    "mlp_norm": ("layers", "norm"),
    "gate_kernel": ("layers", "embed", "mlp"),
    "up_kernel": ("layers", "embed", "mlp"),
    "down_kernel": ("layers", "mlp", "embed"),
}


def param_axes(cfg: Qwen2Config) -> Params:
  """Logical axis names of each parameter, same tree structure as the params."""
  axes: Params = {"embed": ("vocab", "embed"), "layers": dict(_LAYER_AXES),
                  "final_norm": ("norm",)}
  if not cfg.tie_word_embeddings:
    axes["lm_head"] = ("embed", "vocab")
  return axes


def param_specs(cfg: Qwen2Config, rules: sharding.Rules, mesh: jax.sharding.Mesh | None = None
                ) -> Params:
  """PartitionSpecs of the params under a logical-axis rule list."""
  return sharding.tree_specs(param_axes(cfg), rules, param_shapes(cfg), mesh)


def param_shapes(cfg: Qwen2Config) -> Params:
  """ShapeDtypeStructs of the params, without allocating them."""
  return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def init_params(cfg: Qwen2Config, rng: jax.Array) -> Params:
  """Random params (normal(0.02) kernels, zero biases, unit norms)."""
  D, F, L, N, K, H, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                         cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
  shapes = {
      "q_kernel": (L, D, N, H), "k_kernel": (L, D, K, H), "v_kernel": (L, D, K, H),
      "o_kernel": (L, N, H, D), "gate_kernel": (L, D, F), "up_kernel": (L, D, F),
      "down_kernel": (L, F, D),
  }
  keys = jax.random.split(rng, len(shapes) + 2)
  dt = cfg.weight_dtype
  normal = lambda k, s: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dt)
  layers = {name: normal(k, s) for k, (name, s) in zip(keys[2:], shapes.items())}
  layers.update(
      q_bias=jnp.zeros((L, N, H), dt), k_bias=jnp.zeros((L, K, H), dt),
      v_bias=jnp.zeros((L, K, H), dt), attn_norm=jnp.ones((L, D), dt),
      mlp_norm=jnp.ones((L, D), dt))
  params: Params = {"embed": normal(keys[0], (V, D)), "layers": layers,
                    "final_norm": jnp.ones((D,), dt)}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = normal(keys[1], (D, V))
  return params


def rms_norm(x_BTD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  # Normalise in float32 and cast back before the scale, as transformers does.
  x = x_BTD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return scale_D.astype(x_BTD.dtype) * x.astype(x_BTD.dtype)


def rope_tables(positions_BT: jax.Array, head_dim: int, theta: float
                ) -> tuple[jax.Array, jax.Array]:
  """cos and sin [B, T, H/2] of the rotary angles, for ``apply_rope``."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
  return jnp.cos(angles_BTh), jnp.sin(angles_BTh)


def apply_rope(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array) -> jax.Array:
  """Rotary embedding in the rotate-half layout of the HF checkpoints."""
  cos, sin = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
  x = x_BTNH.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)


def attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
              mask_BTS: jax.Array) -> jax.Array:
  """Grouped-query attention; scores and softmax in float32."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  scores = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH,
                      preferred_element_type=jnp.float32) * (H ** -0.5)
  # A finite minimum keeps fully-masked (padding) query rows free of NaNs.
  scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKH.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BSKH)
  return out.reshape(B, T, N, H)


# attend(q_BTNH, k_BTKH, v_BTKH) -> (attn_BTNH, aux): the layer's attention over
# this call's (RoPE-rotated) keys/values and whatever context it keeps (none,
# a stacked cache, the sampler's per-layer decode buffers); aux is returned.
Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def layer(cfg: Qwen2Config, x_BTD: jax.Array, p: Params,
          rope_BT: tuple[jax.Array, jax.Array], attend: Attend) -> tuple[jax.Array, Any]:
  """One decoder layer (unstacked params ``p``); attention is ``attend``'s.

  ``rope_BT`` is ``rope_tables`` of the tokens' positions, computed once for all
  layers: left to each layer, XLA fused the cos / sin into the rotation and
  evaluated them once per head and element, in every layer.
  """
  dt = cfg.dtype
  w = lambda name: p[name].astype(dt)
  h = rms_norm(x_BTD, p["attn_norm"], cfg.rms_norm_eps)
  q = jnp.einsum("btd,dnh->btnh", h, w("q_kernel")) + w("q_bias")
  k = jnp.einsum("btd,dkh->btkh", h, w("k_kernel")) + w("k_bias")
  v = jnp.einsum("btd,dkh->btkh", h, w("v_kernel")) + w("v_bias")
  q = apply_rope(q, *rope_BT)
  k = apply_rope(k, *rope_BT)
  attn, aux = attend(q, k, v)
  # One [N*H, D] matmul: with "btnh,nhd" XLA's CPU backend re-laid out the
  # kernel on every call of the sampler's decode loop (~0.3 ms of a 14 ms step).
  B, T, N, H = attn.shape
  x_BTD = x_BTD + jnp.einsum("bte,ed->btd", attn.reshape(B, T, N * H),
                             w("o_kernel").reshape(N * H, -1))
  h = rms_norm(x_BTD, p["mlp_norm"], cfg.rms_norm_eps)
  gate = jnp.einsum("btd,df->btf", h, w("gate_kernel"))
  up = jnp.einsum("btd,df->btf", h, w("up_kernel"))
  x_BTD = x_BTD + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w("down_kernel"))
  return x_BTD, aux


def positions_from_mask(mask_BT: jax.Array) -> jax.Array:
  """RoPE positions of a left-padded batch: 0 at each row's first real token."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def hidden_states(params: Params, cfg: Qwen2Config, tokens_BT: jax.Array, mask_BT: jax.Array,
                  positions_BT: jax.Array | None = None) -> jax.Array:
  """Final-norm hidden states [B, T, D] of a full (uncached) forward pass."""
  mask_BT = mask_BT.astype(jnp.bool_)
  if positions_BT is None:
    positions_BT = positions_from_mask(mask_BT)
  T = tokens_BT.shape[1]
  causal_TS = jnp.tril(jnp.ones((T, T), jnp.bool_))
  mask_BTS = causal_TS[None] & mask_BT[:, None, :]
  x = params["embed"].astype(cfg.dtype)[tokens_BT]

  rope_BT = rope_tables(positions_BT, cfg.head_dim, cfg.rope_theta)

  def body(x_BTD, layer_params):
    attend = lambda q, k, v: (attention(q, k, v, mask_BTS), None)
    return layer(cfg, x_BTD, layer_params, rope_BT, attend)

  if cfg.remat:
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
  x, _ = jax.lax.scan(body, x, params["layers"])
  return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def unembed_matrix(params: Params, cfg: Qwen2Config) -> jax.Array:
  """The [D, V] output projection (the embedding, transposed, when tied)."""
  if cfg.tie_word_embeddings:
    return params["embed"].T
  return params["lm_head"]


def logits_from_hidden(params: Params, cfg: Qwen2Config, h_BTD: jax.Array) -> jax.Array:
  """Float32 logits; the matmul accumulates in float32 on the bfloat16 path."""
  w_DV = unembed_matrix(params, cfg).astype(cfg.dtype)
  return jnp.einsum("btd,dv->btv", h_BTD.astype(cfg.dtype), w_DV,
                    preferred_element_type=jnp.float32)


def forward(params: Params, cfg: Qwen2Config, tokens_BT: jax.Array, mask_BT: jax.Array,
            positions_BT: jax.Array | None = None) -> jax.Array:
  """Float32 logits [B, T, V]. ``mask_BT`` is 1 on real tokens, 0 on padding.

  Positions are derived from the mask unless given, so left-padded rows get
  exactly the logits they would get unpadded.
  """
  h = hidden_states(params, cfg, tokens_BT, mask_BT, positions_BT)
  return logits_from_hidden(params, cfg, h)


def forward_with_cache(params: Params, cfg: Qwen2Config, tokens_BT: jax.Array,
                       mask_BT: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Prefill (T > 1) or decode (T = 1) against an explicit cache.

  Writes the T new tokens at slots ``[cache.index, cache.index + T)`` and
  returns float32 logits [B, T, V] with the updated cache. Padding tokens
  (mask 0) occupy slots but are never attended to and do not advance a
  row's RoPE position.
  """
  h_BTD, cache = hidden_states_with_cache(params, cfg, tokens_BT, mask_BT, cache)
  return logits_from_hidden(params, cfg, h_BTD), cache


def hidden_states_with_cache(params: Params, cfg: Qwen2Config, tokens_BT: jax.Array,
                             mask_BT: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
  """``forward_with_cache`` stopping at the final-norm hidden states [B, T, D].

  A prefill that needs only the last position's logits unembeds just that
  position: XLA does not narrow a [B, T, V] logits matmul to a later slice.
  """
  mask_BT = mask_BT.astype(jnp.bool_)
  B, T = tokens_BT.shape
  S = cache.max_len
  index = cache.index
  positions_BT = cache.positions_B[:, None] + positions_from_mask(mask_BT)
  slot_mask_BS = jax.lax.dynamic_update_slice_in_dim(cache.mask_BS, mask_BT, index, axis=1)
  query_slot_T = index + jnp.arange(T)
  causal_TS = jnp.arange(S)[None, :] <= query_slot_T[:, None]
  mask_BTS = causal_TS[None] & slot_mask_BS[:, None, :]
  x = params["embed"].astype(cfg.dtype)[tokens_BT]
  rope_BT = rope_tables(positions_BT, cfg.head_dim, cfg.rope_theta)

  # The cache rides in the scan carry (not xs/ys) so each step updates the
  # donated buffer in place instead of materialising a fresh copy per layer.
  def body(carry, inputs):
    x_BTD, k_all, v_all = carry
    layer_params, l = inputs

    def attend(q, k, v):
      # Write this call's keys/values at the shared slot index, attend over all slots.
      k_l = jax.lax.dynamic_update_slice_in_dim(k_all[l], k, index, axis=1)
      v_l = jax.lax.dynamic_update_slice_in_dim(v_all[l], v, index, axis=1)
      return attention(q, k_l, v_l, mask_BTS), (k_l, v_l)

    x_BTD, (k_l, v_l) = layer(cfg, x_BTD, layer_params, rope_BT, attend)
    k_all = jax.lax.dynamic_update_index_in_dim(k_all, k_l, l, axis=0)
    v_all = jax.lax.dynamic_update_index_in_dim(v_all, v_l, l, axis=0)
    return (x_BTD, k_all, v_all), None

  (x, k_all, v_all), _ = jax.lax.scan(
      body, (x, cache.k_LBSKH, cache.v_LBSKH),
      (params["layers"], jnp.arange(cfg.num_layers)))
  h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  new_cache = KVCache(k_LBSKH=k_all, v_LBSKH=v_all, mask_BS=slot_mask_BS,
                      positions_B=cache.positions_B + mask_BT.sum(-1, dtype=jnp.int32),
                      index=index + T)
  return h, new_cache


def num_params(params_or_shapes: Params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params_or_shapes))
