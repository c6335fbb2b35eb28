"""How a Hugging Face Qwen2 / Qwen3 checkpoint's tensors map onto capo-jax params.

Each of our params has a ``TensorMap``: the HF tensor name (per layer for the stacked
``layers`` params), and the view and transpose that turn the HF tensor into our array.
``models.hf_weights`` reads and writes checkpoints with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from models.config import Qwen2Config


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """How one of our params relates to a HF tensor (per layer for stacked params).

  The HF tensor, with each dim split into ``groups[i]`` factors, is the "view";
  our array is ``view.transpose(perm)``.
  """

  hf_name: str  # "{l}" is the layer index
  view: Callable[[Qwen2Config], tuple[int, ...]]
  groups: tuple[int, ...]
  perm: tuple[int, ...]


def _maps(cfg: Qwen2Config) -> dict[str, Any]:
  """Our param tree with a ``TensorMap`` at each leaf."""
  attn = "model.layers.{l}.self_attn."
  mlp = "model.layers.{l}.mlp."
  D, F, N, K, H, V = (
    cfg.hidden_size,
    cfg.intermediate_size,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    cfg.vocab_size,
  )
  layers = {
    "attn_norm": TensorMap("model.layers.{l}.input_layernorm.weight", lambda c: (D,), (1,), (0,)),
    "mlp_norm": TensorMap(
      "model.layers.{l}.post_attention_layernorm.weight", lambda c: (D,), (1,), (0,)
    ),
    "q_kernel": TensorMap(attn + "q_proj.weight", lambda c: (N, H, D), (2, 1), (2, 0, 1)),
    "k_kernel": TensorMap(attn + "k_proj.weight", lambda c: (K, H, D), (2, 1), (2, 0, 1)),
    "v_kernel": TensorMap(attn + "v_proj.weight", lambda c: (K, H, D), (2, 1), (2, 0, 1)),
    "o_kernel": TensorMap(attn + "o_proj.weight", lambda c: (D, N, H), (1, 2), (1, 2, 0)),
    "gate_kernel": TensorMap(mlp + "gate_proj.weight", lambda c: (F, D), (1, 1), (1, 0)),
    "up_kernel": TensorMap(mlp + "up_proj.weight", lambda c: (F, D), (1, 1), (1, 0)),
    "down_kernel": TensorMap(mlp + "down_proj.weight", lambda c: (D, F), (1, 1), (1, 0)),
  }
  if cfg.qkv_bias:  # Qwen2
    layers["q_bias"] = TensorMap(attn + "q_proj.bias", lambda c: (N, H), (2,), (0, 1))
    layers["k_bias"] = TensorMap(attn + "k_proj.bias", lambda c: (K, H), (2,), (0, 1))
    layers["v_bias"] = TensorMap(attn + "v_proj.bias", lambda c: (K, H), (2,), (0, 1))
  if cfg.qk_norm:  # Qwen3
    layers["q_norm"] = TensorMap(attn + "q_norm.weight", lambda c: (H,), (1,), (0,))
    layers["k_norm"] = TensorMap(attn + "k_norm.weight", lambda c: (H,), (1,), (0,))
  maps: dict[str, Any] = {
    "embed": TensorMap("model.embed_tokens.weight", lambda c: (V, D), (1, 1), (0, 1)),
    "layers": layers,
    "final_norm": TensorMap("model.norm.weight", lambda c: (D,), (1,), (0,)),
  }
  if not cfg.tie_word_embeddings:
    maps["lm_head"] = TensorMap("lm_head.weight", lambda c: (V, D), (1, 1), (1, 0))
  return maps


def hf_shape(m: TensorMap, cfg: Qwen2Config) -> tuple[int, ...]:
  """The HF tensor's shape (one layer's, for stacked params)."""
  view, shape, i = m.view(cfg), [], 0
  for g in m.groups:
    shape.append(int(np.prod(view[i : i + g])))
    i += g
  return tuple(shape)


def leaves(cfg: Qwen2Config) -> list[tuple[tuple[str, ...], TensorMap]]:
  """(tree path, map) of every param, in canonical order."""
  maps = _maps(cfg)
  out: list[tuple[tuple[str, ...], TensorMap]] = [(("embed",), maps["embed"])]
  out += [(("layers", k), m) for k, m in maps["layers"].items()]
  out.append((("final_norm",), maps["final_norm"]))
  if "lm_head" in maps:
    out.append((("lm_head",), maps["lm_head"]))
  return out


def expected_tensors(cfg: Qwen2Config) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> shape of a checkpoint of ``cfg`` (lm_head only when untied)."""
  out = {}
  for path, m in leaves(cfg):
    layers = range(cfg.num_layers) if path[0] == "layers" else [None]
    for l in layers:
      out[m.hf_name.format(l=l)] = hf_shape(m, cfg)
  return out
