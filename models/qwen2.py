"""Qwen2 / Qwen2.5 / Qwen3 (dense) decoder as Flax linen modules, used pure-functionally.

Axis letters (array-name suffixes and einsum letters), the model's part of
the one legend in ``capo_jax/types.py``:
  B batch rows, T query length (this call's tokens), S key/value length (the
  cache's columns), D model dim, N query heads, K kv heads, R query heads per
  kv head (N = K*R), H head dim (h = H/2, RoPE's half), F MLP dim, V vocab,
  L layers.

``Qwen2(cfg).apply({"params": params}, ...)`` is a pure function of the
params: no mutable collections, and the KV cache is an explicit pytree passed
in and returned (``models.kv_cache``). The functions below (``forward``,
``forward_with_cache``, ...) wrap those applies with the signatures the rest of
the code uses. The layers are one ``nn.scan`` over a stacked leading L axis,
which keeps compile time independent of depth, optionally under ``nn.remat``.

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import attention as attention_lib
from models import lora, sharding
from models.config import Qwen2Config
from models.kv_cache import KVCache

Params = dict[str, Any]

ACT_BTD, ACT_BTNH, ACT_BTKH, ACT_BTF, ACT_BTV = (
  sharding.ACT_BTD,
  sharding.ACT_BTNH,
  sharding.ACT_BTKH,
  sharding.ACT_BTF,
  sharding.ACT_BTV,
)
_c = sharding.constrain

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


def _apply(module: nn.Module, params: Params, *args: Any, **kw: Any) -> Any:
  """``module.apply({"params": params}, ...)``: the output alone, no collection being
  mutable (flax types every apply's result as output | (output, mutated state))."""
  return module.apply({"params": params}, *args, **kw)


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
    x_BTD = x_BTD + self._lora(
      "o_kernel",
      attn_BTNH,
      jax.lax.dot_general(
        attn_BTNH.reshape(B, T, N * H),
        self._w("o_kernel").reshape(N * H, -1),
        (((2,), (0,)), ((), ())),
      ),
      n_in=2,
    )
    x_BTD = _c(x_BTD, ACT_BTD)
    h = rms_norm(x_BTD, self.mlp_norm, self.cfg.rms_norm_eps)
    gate = _c(self._lora("gate_kernel", h, _rows_dot(h, self._w("gate_kernel"))), ACT_BTF)
    up = _c(self._lora("up_kernel", h, _rows_dot(h, self._w("up_kernel"))), ACT_BTF)
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
      layer = nn.remat(layer, policy=jax.checkpoint_policies.nothing_saveable)
    self.layers = nn.scan(
      layer,
      length=c.num_layers,
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
    c = self.cfg
    x_BTD = _c(self.embed.astype(c.dtype)[tokens_BT], ACT_BTD)
    # RoPE tables once for all layers: left to each layer, XLA fused the cos /
    # sin into the rotation and evaluated them once per head and element.
    ctx = {
      "rope": rope_tables(positions_BT, c.head_dim, c.rope_theta),
      "mask_BTS": mask_BTS,
      "index": index,
      "segment_ids_BT": segment_ids_BT,
    }
    (x_BTD, kv), _ = self.layers((x_BTD, kv), jnp.arange(c.num_layers), ctx)
    return _c(rms_norm(x_BTD, self.final_norm, c.rms_norm_eps), ACT_BTD), kv

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


# --- params: creation, shapes, logical axes, shardings ------------------------


def _init_boxed(cfg: Qwen2Config, rng: jax.Array) -> Params:
  """Params with their ``nn.LogicallyPartitioned`` boxes (logical axis names)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  model = Qwen2(cfg)
  return model.init(rng, tokens, tokens, jnp.ones((1, 1, 1), jnp.bool_))["params"]


def init_params(cfg: Qwen2Config, rng: jax.Array) -> Params:
  """Random params (normal(0.02) kernels, zero biases, unit norms)."""
  return nn.unbox(_init_boxed(cfg, rng))


def param_shapes(cfg: Qwen2Config) -> Params:
  """ShapeDtypeStructs of the params, without allocating them."""
  return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def param_axes(cfg: Qwen2Config) -> Params:
  """Logical axis names of each param (a PartitionSpec of names), same tree as the params."""
  boxed = jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0))
  return nn.get_partition_spec(boxed)


def param_specs(cfg: Qwen2Config, rules: sharding.Rules, mesh: Mesh | None = None) -> Params:
  """Mesh PartitionSpecs of the params under a logical-axis rule list.

  Cached per (cfg, rules, mesh): tracing the Flax init for the axes and shapes
  costs ~0.1 s of host time, and the sampler asks on every ``generate`` call.
  The returned tree is shared; do not mutate it.
  """
  return _param_specs(cfg, sharding.hashable_rules(rules), mesh)


@functools.lru_cache(maxsize=64)
def _param_specs(cfg: Qwen2Config, rules: tuple[tuple[str, Any], ...], mesh: Mesh | None) -> Params:
  return sharding.tree_specs(param_axes(cfg), rules, param_shapes(cfg), mesh)


def param_shardings(cfg: Qwen2Config, layout: sharding.Layout) -> Params:
  """NamedShardings of the params on the layout's mesh."""
  return jax.tree.map(
    lambda s: NamedSharding(layout.mesh, s),
    param_specs(cfg, layout.rules, layout.mesh),
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def num_params(params_or_shapes: Params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params_or_shapes))


# --- pure functions over (params, cfg) -----------------------------------------


def positions_from_mask(mask_BT: jax.Array) -> jax.Array:
  """RoPE positions of a left-padded batch: 0 at each row's first real token."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def hidden_states(
  params: Params,
  cfg: Qwen2Config,
  tokens_BT: jax.Array,
  mask_BT: jax.Array,
  positions_BT: jax.Array | None = None,
  segment_ids_BT: jax.Array | None = None,
) -> jax.Array:
  """Final-norm hidden states [B, T, D] of a full (uncached) forward pass.

  ``segment_ids_BT`` (packed rows: 1, 2, ... per sequence, 0 on padding) keeps
  attention within each sequence; by default the mask is the one segment.
  """
  mask_BT = mask_BT.astype(jnp.bool_)
  if positions_BT is None:
    positions_BT = positions_from_mask(mask_BT)
  if segment_ids_BT is None:
    segment_ids_BT = mask_BT.astype(jnp.int32)
  h_BTD, _ = _apply(
    Qwen2(cfg), params, tokens_BT, positions_BT, None, segment_ids_BT=segment_ids_BT
  )
  return h_BTD


def unembed_matrix(params: Params, cfg: Qwen2Config) -> jax.Array:
  """The [D, V] output projection (the embedding, transposed, when tied)."""
  return _apply(Qwen2(cfg), params, method=Qwen2.unembed_matrix)


def logits_from_hidden(params: Params, cfg: Qwen2Config, h_BTD: jax.Array) -> jax.Array:
  """Float32 logits [B, T, V] of final-norm hidden states."""
  return _apply(Qwen2(cfg), params, h_BTD, method=Qwen2.logits)


def forward(
  params: Params,
  cfg: Qwen2Config,
  tokens_BT: jax.Array,
  mask_BT: jax.Array,
  positions_BT: jax.Array | None = None,
) -> jax.Array:
  """Float32 logits [B, T, V]. ``mask_BT`` is 1 on real tokens, 0 on padding.

  Positions are derived from the mask unless given, so left-padded rows get
  exactly the logits they would get unpadded.
  """
  h = hidden_states(params, cfg, tokens_BT, mask_BT, positions_BT)
  return logits_from_hidden(params, cfg, h)


def forward_with_cache(
  params: Params, cfg: Qwen2Config, tokens_BT: jax.Array, mask_BT: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
  """Prefill (T > 1) or decode (T = 1) against an explicit cache.

  Writes the T new tokens at columns ``[cache.index, cache.index + T)`` and
  returns float32 logits [B, T, V] with the updated cache. Padding tokens
  (mask 0) occupy columns but are never attended to and do not advance a
  row's RoPE position.
  """
  h_BTD, cache = hidden_states_with_cache(params, cfg, tokens_BT, mask_BT, cache)
  return logits_from_hidden(params, cfg, h_BTD), cache


def hidden_states_with_cache(
  params: Params, cfg: Qwen2Config, tokens_BT: jax.Array, mask_BT: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
  """``forward_with_cache`` stopping at the final-norm hidden states [B, T, D].

  A prefill that needs only the last position's logits unembeds just that
  position: XLA does not narrow a [B, T, V] logits matmul to a later slice.
  """
  mask_BT = mask_BT.astype(jnp.bool_)
  T = tokens_BT.shape[1]
  index = cache.index
  positions_BT = cache.positions_B[:, None] + positions_from_mask(mask_BT)
  kv_mask_BS = jax.lax.dynamic_update_slice_in_dim(cache.mask_BS, mask_BT, index, axis=1)
  causal_TS = jnp.arange(cache.max_len)[None, :] <= (index + jnp.arange(T))[:, None]
  mask_BTS = causal_TS[None] & kv_mask_BS[:, None, :]
  h_BTD, (k, v) = _apply(
    Qwen2(cfg), params, tokens_BT, positions_BT, mask_BTS, (cache.k_LBSKH, cache.v_LBSKH), index
  )
  return h_BTD, KVCache(
    k_LBSKH=k,
    v_LBSKH=v,
    mask_BS=kv_mask_BS,
    positions_B=cache.positions_B + mask_BT.sum(-1, dtype=jnp.int32),
    index=index + T,
  )


# attend(q_BTNH, k_BTKH, v_BTKH) -> (attn_BTNH, aux): the layer's attention over
# this call's (RoPE-rotated) keys / values and whatever context it keeps (the
# sampler's per-layer decode buffers); aux is returned.
Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def layer(
  cfg: Qwen2Config,
  x_BTD: jax.Array,
  layer_params: Params,
  rope_BT: tuple[jax.Array, jax.Array],
  attend: Attend,
) -> tuple[jax.Array, Any]:
  """One decoder layer with unstacked params (``params["layers"]`` sliced at l).

  For callers that run the layers themselves (the sampler's unrolled decode
  step); attention is ``attend``'s.
  """
  mod = DecoderLayer(cfg)
  q, k, v = _apply(mod, layer_params, x_BTD, rope_BT, method=DecoderLayer.attention_inputs)
  attn, aux = attend(q, k, v)
  return _apply(mod, layer_params, x_BTD, attn, method=DecoderLayer.attention_output), aux
