"""Qwen2 / Qwen2.5 / Qwen3 (dense) as pure functions of (params, cfg).

``Qwen2(cfg).apply({"params": params}, ...)`` (the Flax modules of
``models.decoder``) is a pure function of the params: no mutable collections, and
the KV cache is an explicit pytree passed in and returned (``models.kv_cache``).
The functions below (``forward``, ``forward_with_cache``, ...) wrap those applies
with the signatures the rest of the code uses; ``init_params``, ``param_shapes``,
``param_axes``, ``param_specs`` and ``param_shardings`` give the param tree, its
shapes, logical axis names and shardings under a rule list (``models.sharding``).
Axis letters are ``models.decoder``'s.
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
from models import sharding, shared_prefix
from models.config import Qwen2Config
from models.decoder import DecoderLayer, Qwen2, rope_tables
from models.kv_cache import KVCache

Params = dict[str, Any]


def _apply(module: nn.Module, params: Params, *args: Any, **kw: Any) -> Any:
  """``module.apply({"params": params}, ...)``: the output alone, no collection being
  mutable (flax types every apply's result as output | (output, mutated state))."""
  return module.apply({"params": params}, *args, **kw)


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


def hidden_states_at(
  params: Params,
  cfg: Qwen2Config,
  tokens_BT: jax.Array,
  positions_BT: jax.Array,
  segment_ids_BT: jax.Array,
  cols_BZ: jax.Array,
) -> jax.Array:
  """``hidden_states`` of rows with segment ids, at columns ``cols_BZ`` only: [B, Z, D].

  With ``cfg.trim_last_layer`` the last layer's queries, output projection and MLP
  run at those columns alone: its keys and values cover every column, and nothing
  after it reads the other columns, so the result is the same up to float rounding.
  """
  take = lambda x: jnp.take_along_axis(  # noqa: E731
    x, cols_BZ.reshape(cols_BZ.shape + (1,) * (x.ndim - 2)), axis=1
  )
  if not cfg.trim_last_layer:
    return take(
      hidden_states(params, cfg, tokens_BT, segment_ids_BT > 0, positions_BT, segment_ids_BT)
    )
  L = cfg.num_layers
  if L > 1:  # the first L - 1 layers as a model of their own (their params sliced)
    head_cfg = cfg.replace(num_layers=L - 1, layer_unroll=min(cfg.layer_unroll, L - 1))
    head = {**params, "layers": jax.tree.map(lambda p: p[: L - 1], params["layers"])}
    x_BTD, _ = _apply(
      Qwen2(head_cfg), head, tokens_BT, positions_BT, None, None, None, segment_ids_BT,
      method=Qwen2.residual,
    )  # fmt: skip
  else:
    x_BTD = _apply(Qwen2(cfg), params, tokens_BT, method=Qwen2.embed_tokens)
  last = jax.tree.map(lambda p: p[L - 1], params["layers"])
  mod = DecoderLayer(cfg)
  cos_BTh, sin_BTh = rope_tables(positions_BT, cfg.head_dim, cfg.rope_theta)
  # Two calls: XLA drops the queries of the first and the keys / values of the second.
  _, k_BTKH, v_BTKH = _apply(
    mod, last, x_BTD, (cos_BTh, sin_BTh), method=DecoderLayer.attention_inputs
  )
  x_BZD = take(x_BTD)
  q_BZNH, _, _ = _apply(
    mod, last, x_BZD, (take(cos_BTh), take(sin_BTh)), method=DecoderLayer.attention_inputs
  )
  T = tokens_BT.shape[1]
  # Causal within the segment, as models.attention.segment_mask's rows at cols_BZ (or
  # the tree's, models.shared_prefix).
  mask_BZS = (cols_BZ[:, :, None] >= jnp.arange(T)) & (
    take(segment_ids_BT)[:, :, None] == segment_ids_BT[:, None, :]
  )
  if cfg.shared_prompts:
    mask_BZS = shared_prefix.mask_at(segment_ids_BT, cols_BZ)
  attn_BZNH = attention_lib.reference(q_BZNH, k_BTKH, v_BTKH, mask_BZS)
  x_BZD = _apply(mod, last, x_BZD, attn_BZNH, method=DecoderLayer.attention_output)
  return _apply(Qwen2(cfg), params, x_BZD, method=Qwen2.final_norm_of)


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
