"""Hugging Face ``config.json`` in and out for ``Qwen2Config``.

``from_hf`` reads what transformers writes for Qwen2 / Qwen2.5 and Qwen3 (dense), and
stops with the file and field for what this decoder does not implement (sliding-window
attention, scaled RoPE, Qwen3's o_proj bias); ``to_hf`` writes a ``config.json`` that
transformers loads as the same architecture. ``Qwen2Config.from_hf`` / ``.to_hf`` call
these.
"""

from __future__ import annotations

import json
import os
from typing import Any

from models.config import MODEL_TYPES, Qwen2Config

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def from_hf(dict_or_path: dict[str, Any] | str | os.PathLike, **kw: Any) -> Qwen2Config:
  """Reads a HF ``config.json`` (a dict, the file, or its directory).

  Both spellings of the RoPE base are accepted: top-level ``rope_theta``
  (transformers < 5) and ``rope_parameters: {"rope_theta": ...}`` (>= 5).
  ``model_type`` "qwen2" (the default when absent) or "qwen3" (dense).
  """
  source = "config dict"
  if isinstance(dict_or_path, dict):
    hf = dict_or_path
  else:
    path = os.fspath(dict_or_path)
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    source = path
    try:
      with open(path, encoding="utf-8") as f:
        hf = json.load(f)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"no HF config at {path}") from e
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e

  def need(key: str) -> Any:
    if key not in hf:
      raise KeyError(f"{source}: missing field {key!r}")
    return hf[key]

  model_type = hf.get("model_type", "qwen2")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"{source}: model_type={model_type!r}, expected one of {list(MODEL_TYPES)}")
  if model_type == "qwen3" and hf.get("attention_bias", False):
    # transformers' Qwen3 then biases o_proj too, which this decoder does not have.
    raise NotImplementedError(f"{source}: attention_bias=true is not supported for qwen3")
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise NotImplementedError(
      f"{source}: rope_type={rope_type!r} is not supported (only the default RoPE)"
    )
  theta = rope.get("rope_theta", hf.get("rope_theta"))
  if theta is None:
    raise KeyError(f"{source}: neither 'rope_theta' nor 'rope_parameters.rope_theta' is set")
  if hf.get("use_sliding_window", False) or "sliding_attention" in (hf.get("layer_types") or ()):
    raise NotImplementedError(
      f"{source}: sliding-window attention (use_sliding_window, "
      "layer_types 'sliding_attention') is not supported"
    )
  num_heads = need("num_attention_heads")
  # transformers' Qwen3Config defaults head_dim to 128; Qwen2's derives it.
  head_dim = hf.get("head_dim") or (128 if model_type == "qwen3" else 0)
  args = dict(
    vocab_size=need("vocab_size"),
    hidden_size=need("hidden_size"),
    intermediate_size=need("intermediate_size"),
    num_layers=need("num_hidden_layers"),
    num_heads=num_heads,
    num_kv_heads=hf.get("num_key_value_heads", num_heads),
    head_dim=head_dim,
    rope_theta=float(theta),
    rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
    model_type=model_type,
  )
  args.update(kw)
  return Qwen2Config(**args)


def to_hf(cfg: Qwen2Config) -> dict[str, Any]:
  """The ``config.json`` dict that ``transformers`` reads as a Qwen2 / Qwen3 model."""
  extra = {"attention_bias": False} if cfg.model_type == "qwen3" else {}
  return {
    "architectures": [_ARCHITECTURES[cfg.model_type]],
    "model_type": cfg.model_type,
    **extra,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_position_embeddings,
    "rms_norm_eps": cfg.rms_norm_eps,
    "rope_theta": cfg.rope_theta,  # old spelling, read by transformers < 5
    "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
    "tie_word_embeddings": cfg.tie_word_embeddings,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "torch_dtype": cfg.param_dtype,
  }
