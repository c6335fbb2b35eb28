"""The Qwen2 / Qwen2.5 / Qwen3 (dense) decoder as Flax linen modules.

Axis letters (array-name suffixes and einsum letters), the model's part of
the one legend in ``capo_jax/types.py``:
  B batch rows, T query length (this call's tokens), S key/value length (the
  cache's columns), D model dim, N query heads, K kv heads, R query heads per
  kv head (N = K*R), H head dim (h = H/2, RoPE's half), F MLP dim, V vocab,
  L layers.

``Qwen2`` is the decoder: embedding, one ``nn.scan`` of ``DecoderLayer`` over a
stacked leading L axis (which keeps compile time independent of depth), optionally
under ``nn.remat``, final norm. ``models.qwen2`` uses it pure-functionally: params
in, no mutable collections, the KV cache an explicit pytree.

The param tree is ``{"embed", "layers": {"attn_norm", "q_kernel", ...},
"final_norm"[, "lm_head"]}``; a Qwen2 layer has ``q_bias`` / ``k_bias`` /
``v_bias``, a Qwen3 layer ``q_norm`` / ``k_norm`` instead. Each param carries
logical axis names (``nn.with_logical_partitioning``; the scan adds
``"layers"``), from which ``models.sharding`` derives shardings under a rule list.
Activations name theirs too (``models.sharding.constrain``; ``ACT_*`` below) at the
layer boundary and inside attention, the MLP and the unembedding: under a program's
layout (``models.sharding.activations``) the rows stay split over the batch mesh
axes, and fsdp-sharded weights are gathered layer by layer inside the scan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models import attention as attention_lib
from models import lora, sharding, shared_prefix
from models.config import Qwen2Config

ACT_BTD, ACT_BTNH, ACT_BTKH, ACT_BTF, ACT_BTV = (
  sharding.ACT_BTD,
  sharding.ACT_BTNH,
  sharding.ACT_BTKH,
  sharding.ACT_BTF,
  sharding.ACT_BTV,
)
_c = sharding.constrain

# ``Qwen2Config.remat_policy``: what a remat'd layer saves for its backward. The
# projections are saved by name, not as "dots without batch dims": under
# ``mesh.reduce_once`` the model runs vmapped over per-shard weight copies, which gives
# every projection a batch dim.
# With them, the attention's output and log-sum-exp where splash computes them (on TPU),
# so the backward does not run the forward kernel again.
_SAVED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_gate", "mlp_up")
REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "projections": jax.checkpoint_policies.save_only_these_names(
    *_SAVED_PROJECTIONS, attention_lib.SPLASH_RESIDUALS
  ),
}

# Logical axes of a layer's kernels.
_AXES = {
  "q_kernel": ("embed", "q_heads", "head_dim"),
  "k_kernel": ("embed", "kv_heads", "head_dim"),
  "v_kernel": ("embed", "kv_heads", "head_dim"),
  "o_kernel": ("q_heads", "head_dim", "embed"),
  "gate_kernel": ("embed", "mlp"),
  "up_kernel": ("embed", "mlp"),
  "down_kernel": ("mlp", "embed"),
}


def _gathered(w: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """A weight constrained whole along ``embed`` (its fsdp storage axis), split as its
  other axes say: the all-gather happens here, once per use, not inside the matmul
  (left to itself, XLA's SPMD partitioner chose a windowed collective matmul that
  re-reads and re-writes the [rows, T, F] accumulator at every step of the ring)."""
  return _c(w, tuple(None if a == "embed" else a for a in axes))


_normal = nn.initializers.normal(stddev=0.02)


def _param(
  module: nn.Module,
  name: str,
  init: Callable[..., jax.Array],
  shape: tuple[int, ...],
  axes: tuple[str, ...],
) -> jax.Array:
  """A param of the module's weight dtype whose dimensions carry logical ``axes``."""
  boxed = nn.with_logical_partitioning(init, axes)
  # Flax types the result as the init's LogicallyPartitioned box; param() unboxes it.
  return module.param(name, boxed, shape, module.cfg.weight_dtype)  # type: ignore[return-value]


def rms_norm(x_BTD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  # Normalise in float32 and cast back before the scale, as transformers does.
  x = x_BTD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return scale_D.astype(x_BTD.dtype) * x.astype(x_BTD.dtype)


def rope_tables(
  positions_BT: jax.Array, head_dim: int, theta: float
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


# Grouped-query attention under a boolean mask (the cached paths); the full
# forward's implementations are in ``models.attention``.
attention = attention_lib.reference


def _rows_dot(x_BTI: jax.Array, w_IO: jax.Array) -> jax.Array:
  """``x @ w`` over the tokens as [B * T, I] rows. Written "btd,df->btf", XLA's CPU
  backend fused the MLP gradient's elementwise ops into a strided transpose of each
  [B, T, F] activation: over half of the demo model's train step, 1.7x its time."""
  B, T, I = x_BTI.shape
  return (x_BTI.reshape(B * T, I) @ w_IO).reshape(B, T, -1)


class DecoderLayer(nn.Module):
  """One pre-norm decoder layer, split where attention plugs in.

  ``attention_inputs`` gives the RoPE-rotated q / k / v, ``attention_output``
  the rest of the layer given the attention result: the full forward, the
  stacked-cache path and the sampler's per-layer decode step each attend in
  their own way between the two.
  """

  cfg: Qwen2Config

  def setup(self) -> None:
    c = self.cfg
    D, F, N, K, H = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim)
    p = functools.partial(_param, self)
    ones, zeros = nn.initializers.ones, nn.initializers.zeros
    self.attn_norm = p("attn_norm", ones, (D,), ("norm",))
    # Creation order fixes each param's init rng (Flax counts draws): Qwen2's is unchanged.
    bias = c.qkv_bias  # Qwen2; Qwen3 has none
    self.q_kernel = p("q_kernel", _normal, (D, N, H), _AXES["q_kernel"])
    self.q_bias = p("q_bias", zeros, (N, H), ("q_heads", "head_dim")) if bias else None
    self.k_kernel = p("k_kernel", _normal, (D, K, H), _AXES["k_kernel"])
    self.k_bias = p("k_bias", zeros, (K, H), ("kv_heads", "head_dim")) if bias else None
    self.v_kernel = p("v_kernel", _normal, (D, K, H), _AXES["v_kernel"])
    self.v_bias = p("v_bias", zeros, (K, H), ("kv_heads", "head_dim")) if bias else None
    if c.qk_norm:  # Qwen3: one [H] scale shared by every head
      self.q_norm = p("q_norm", ones, (H,), ("norm",))
      self.k_norm = p("k_norm", ones, (H,), ("norm",))
    self.o_kernel = p("o_kernel", _normal, (N, H, D), _AXES["o_kernel"])
    self.mlp_norm = p("mlp_norm", ones, (D,), ("norm",))
    self.gate_kernel = p("gate_kernel", _normal, (D, F), _AXES["gate_kernel"])
    self.up_kernel = p("up_kernel", _normal, (D, F), _AXES["up_kernel"])
    self.down_kernel = p("down_kernel", _normal, (F, D), _AXES["down_kernel"])

  def attention_inputs(
    self, x_BTD: jax.Array, rope_BT: tuple[jax.Array, jax.Array]
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, N, H] and k, v [B, T, K, H] of this call's tokens, RoPE applied."""
    c, dt = self.cfg, self.cfg.dtype
    h = rms_norm(x_BTD, self.attn_norm, c.rms_norm_eps)
    q = _c(self._lora("q_kernel", h, jnp.einsum("btd,dnh->btnh", h, self._w("q_kernel"))), ACT_BTNH)
    k = _c(self._lora("k_kernel", h, jnp.einsum("btd,dkh->btkh", h, self._w("k_kernel"))), ACT_BTKH)
    v = _c(self._lora("v_kernel", h, jnp.einsum("btd,dkh->btkh", h, self._w("v_kernel"))), ACT_BTKH)
    if c.qkv_bias:  # setup() made the three biases exactly when qkv_bias
      assert self.q_bias is not None and self.k_bias is not None and self.v_bias is not None
      q, k, v = (q + self.q_bias.astype(dt), k + self.k_bias.astype(dt), v + self.v_bias.astype(dt))
    q, k, v = (
      checkpoint_name(q, "q_proj"),
      checkpoint_name(k, "k_proj"),
      checkpoint_name(v, "v_proj"),
    )
    if c.qk_norm:  # over the head dim of each head, before RoPE (as transformers' Qwen3)
      q, k = rms_norm(q, self.q_norm, c.rms_norm_eps), rms_norm(k, self.k_norm, c.rms_norm_eps)
    return apply_rope(q, *rope_BT), apply_rope(k, *rope_BT), v

  def _w(self, name: str) -> jax.Array:
    """Kernel ``name`` in the compute dtype, whole over the axes that shard only its
    storage (``embed`` over fsdp): under a layout each layer's weights are gathered
    where they are used, in the compute dtype, and the rows stay split."""
    return _gathered(getattr(self, name).astype(self.cfg.dtype), _AXES[name])

  def _lora(self, kernel: str, x: jax.Array, y: jax.Array, n_in: int = 1) -> jax.Array:
    """``y = x @ kernel`` plus the LoRA delta when the params carry adapters (models.lora)."""
    d = lora.delta(self, kernel, x, n_in)
    return y if d is None else y + d

  def attention_output(self, x_BTD: jax.Array, attn_BTNH: jax.Array) -> jax.Array:
    """The residual stream after the output projection and the MLP."""
    attn_BTNH = _c(attn_BTNH, ACT_BTNH)
    B, T, N, H = attn_BTNH.shape
    # One [N*H, D] matmul: with "btnh,nhd" XLA's CPU backend re-laid out the
    # kernel on every call of the sampler's decode loop.
    o_BTD = self._lora(
      "o_kernel",
      attn_BTNH,
      jax.lax.dot_general(
        attn_BTNH.reshape(B, T, N * H),
        self._w("o_kernel").reshape(N * H, -1),
        (((2,), (0,)), ((), ())),
      ),
      n_in=2,
    )
    x_BTD = x_BTD + checkpoint_name(o_BTD, "o_proj")
    x_BTD = _c(x_BTD, ACT_BTD)
    h = rms_norm(x_BTD, self.mlp_norm, self.cfg.rms_norm_eps)
    gate = _c(self._lora("gate_kernel", h, _rows_dot(h, self._w("gate_kernel"))), ACT_BTF)
    up = _c(self._lora("up_kernel", h, _rows_dot(h, self._w("up_kernel"))), ACT_BTF)
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    act = jax.nn.silu(gate) * up
    return _c(
      x_BTD + self._lora("down_kernel", act, _rows_dot(act, self._w("down_kernel"))), ACT_BTD
    )

  def __call__(
    self, carry: tuple[jax.Array, Any], l: jax.Array, ctx: dict[str, Any]
  ) -> tuple[tuple[jax.Array, Any], None]:
    """The scan body: layer ``l`` on the carried residual stream (and stacked cache).

    ``carry`` is ``(x_BTD, None)`` for a full forward, where attention covers
    this call's tokens, or ``(x_BTD, (k_LBSKH, v_LBSKH))`` with a cache: this
    call's keys / values go in at column ``ctx["index"]`` of layer ``l`` and
    attention covers every column. The cache rides in the carry (not the scan's
    xs / ys) so each layer updates the donated buffer in place instead of
    materialising a fresh copy.
    """
    x_BTD, kv = carry
    x_BTD = _c(x_BTD, ACT_BTD)
    q, k, v = self.attention_inputs(x_BTD, ctx["rope"])
    if kv is not None:
      k_all, v_all = kv
      k = jax.lax.dynamic_update_slice_in_dim(k_all[l], k, ctx["index"], axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(v_all[l], v, ctx["index"], axis=1)
      kv = (
        jax.lax.dynamic_update_index_in_dim(k_all, k, l, axis=0),
        jax.lax.dynamic_update_index_in_dim(v_all, v, l, axis=0),
      )
    if ctx["segment_ids_BT"] is None:
      attn = attention(q, k, v, ctx["mask_BTS"])
    elif self.cfg.shared_prompts:  # packed trees: each completion sees its prompt
      attn = shared_prefix.attend(
        self.cfg.attention, q, k, v, ctx["segment_ids_BT"], self.cfg.shared_prompt_cols
      )
    else:  # the full forward: causal within segments, by model.attention
      attn = attention_lib.attend(
        self.cfg.attention, q, k, v, ctx["segment_ids_BT"], self.cfg.attention_block
      )
    x_BTD = self.attention_output(x_BTD, attn)
    return (x_BTD, kv), None


class Qwen2(nn.Module):
  """The decoder: embedding, ``num_layers`` scanned ``DecoderLayer``s, final norm.

  ``__call__`` returns the final-norm hidden states [B, T, D] (and the cache's k / v);
  ``logits`` unembeds hidden states. Splitting the two lets callers unembed
  only the positions they need.
  """

  cfg: Qwen2Config

  def setup(self) -> None:
    c = self.cfg
    D, V = c.hidden_size, c.vocab_size
    self.embed = _param(self, "embed", _normal, (V, D), ("vocab", "embed"))
    layer = DecoderLayer
    if c.remat:
      layer = nn.remat(layer, policy=REMAT_POLICIES[c.remat_policy])
    self.layers = nn.scan(
      layer,
      length=c.num_layers,
      unroll=c.layer_unroll,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=(0, nn.broadcast),
      metadata_params={nn.PARTITION_NAME: "layers"},
    )(c)
    self.final_norm = _param(self, "final_norm", nn.initializers.ones, (D,), ("norm",))
    if not c.tie_word_embeddings:
      self.lm_head = _param(self, "lm_head", _normal, (D, V), ("embed", "vocab"))

  def __call__(
    self,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    mask_BTS: jax.Array | None,
    kv: tuple[jax.Array, jax.Array] | None = None,
    index: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """Hidden states [B, T, D]; with a stacked cache ``kv`` (k_LBSKH, v_LBSKH), writes
    this call's keys / values at column ``index`` and returns the updated pair.

    Without a cache, ``segment_ids_BT`` (instead of ``mask_BTS``) makes attention
    causal within segments, by ``cfg.attention`` (``models.attention``)."""
    x_BTD, kv = self.residual(tokens_BT, positions_BT, mask_BTS, kv, index, segment_ids_BT)
    return self.final_norm_of(x_BTD), kv

  def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
    return _c(self.embed.astype(self.cfg.dtype)[tokens_BT], ACT_BTD)

  def final_norm_of(self, x_BTD: jax.Array) -> jax.Array:
    return _c(rms_norm(x_BTD, self.final_norm, self.cfg.rms_norm_eps), ACT_BTD)

  def residual(
    self,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    mask_BTS: jax.Array | None,
    kv: tuple[jax.Array, jax.Array] | None = None,
    index: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """``__call__`` without the final norm: the residual stream after the last layer."""
    c = self.cfg
    x_BTD = self.embed_tokens(tokens_BT)
    # RoPE tables once for all layers: left to each layer, XLA fused the cos /
    # sin into the rotation and evaluated them once per head and element.
    ctx = {
      "rope": rope_tables(positions_BT, c.head_dim, c.rope_theta),
      "mask_BTS": mask_BTS,
      "index": index,
      "segment_ids_BT": segment_ids_BT,
    }
    (x_BTD, kv), _ = self.layers((x_BTD, kv), jnp.arange(c.num_layers), ctx)
    return x_BTD, kv

  def unembed_matrix(self) -> jax.Array:
    """The [D, V] output projection (the embedding, transposed, when tied)."""
    return self.embed.T if self.cfg.tie_word_embeddings else self.lm_head

  def logits(self, h_BTD: jax.Array) -> jax.Array:
    """Float32 logits; the matmul accumulates in float32 on the bfloat16 path."""
    dt = self.cfg.dtype
    w_DV = _gathered(self.unembed_matrix().astype(dt), ("embed", "vocab"))
    return _c(
      jnp.einsum("btd,dv->btv", h_BTD.astype(dt), w_DV, preferred_element_type=jnp.float32), ACT_BTV
    )
