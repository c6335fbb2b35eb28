"""Qwen2 / Qwen2.5 model configuration with named presets.

The presets carry the numbers of the released Hugging Face checkpoints, so a
full-size model can be shape-checked (``jax.eval_shape``) without weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_ATTENTIONS = ("auto", "reference", "xla", "flash", "splash")  # models.attention


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Hyper-parameters of a Qwen2-architecture decoder.

  Frozen and hashable so it can be a static argument of ``jax.jit``.
  ``param_dtype`` is the dtype params are created / loaded in;
  ``compute_dtype`` the dtype of activations and matmul inputs (attention
  softmax, norms and logits stay float32 either way).
  """

  vocab_size: int
  hidden_size: int  # D
  intermediate_size: int  # F
  num_layers: int  # L
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int = 0  # H; 0 means hidden_size // num_heads
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  remat: bool = False  # rematerialise each layer in the backward pass
  attention: str = "auto"  # the full forward's attention: models.attention.IMPLEMENTATIONS
  attention_block: int = 128  # key / query block of the "flash" attention

  def __post_init__(self) -> None:
    if self.head_dim == 0:
      if self.hidden_size % self.num_heads:
        raise ValueError(
            f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
            "set head_dim explicitly")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"Qwen2Config.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.attention not in _ATTENTIONS or self.attention_block < 1:
      raise ValueError(f"Qwen2Config.attention={self.attention!r} / attention_block="
                       f"{self.attention_block}: expected one of {_ATTENTIONS} and a block >= 1")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"Qwen2Config.{name}={getattr(self, name)!r}; expected one of "
                         f"{sorted(_DTYPES)}")

  @property
  def dtype(self) -> Any:
    return _DTYPES[self.compute_dtype]

  @property
  def weight_dtype(self) -> Any:
    return _DTYPES[self.param_dtype]

  def replace(self, **changes: Any) -> Qwen2Config:
    return dataclasses.replace(self, **changes)

  # --- presets: numbers of the released checkpoints -------------------------

  @classmethod
  def qwen2p5_0p5b(cls, **kw: Any) -> Qwen2Config:
    return cls(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
               num_heads=14, num_kv_heads=2, tie_word_embeddings=True, **kw)

  @classmethod
  def qwen2p5_1p5b(cls, **kw: Any) -> Qwen2Config:
    return cls(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
               num_heads=12, num_kv_heads=2, tie_word_embeddings=True,
               max_position_embeddings=131072, **kw)

  @classmethod
  def qwen2p5_3b(cls, **kw: Any) -> Qwen2Config:
    return cls(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36,
               num_heads=16, num_kv_heads=2, tie_word_embeddings=True, **kw)

  @classmethod
  def qwen2p5_7b(cls, **kw: Any) -> Qwen2Config:
    return cls(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
               num_heads=28, num_kv_heads=4, tie_word_embeddings=False,
               max_position_embeddings=131072, **kw)

  @classmethod
  def qwen2p5_math_1p5b(cls, **kw: Any) -> Qwen2Config:
    return cls(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
               num_heads=12, num_kv_heads=2, rope_theta=10000.0, tie_word_embeddings=True,
               max_position_embeddings=4096, **kw)

  @classmethod
  def qwen2p5_math_7b(cls, **kw: Any) -> Qwen2Config:
    return cls(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
               num_heads=28, num_kv_heads=4, rope_theta=10000.0, tie_word_embeddings=False,
               max_position_embeddings=4096, **kw)

  @classmethod
  def tiny(cls, **kw: Any) -> Qwen2Config:
    """A few-hundred-thousand-parameter model for tests and CPU demos."""
    defaults = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, rope_theta=10000.0, tie_word_embeddings=True,
                    max_position_embeddings=2048)
    defaults.update(kw)
    return cls(**defaults)

  # --- Hugging Face config.json ---------------------------------------------

  @classmethod
  def from_hf(cls, dict_or_path: dict[str, Any] | str | os.PathLike, **kw: Any) -> Qwen2Config:
    """Reads a HF ``config.json`` (a dict, the file, or its directory).

    Both spellings of the RoPE base are accepted: top-level ``rope_theta``
    (transformers < 5) and ``rope_parameters: {"rope_theta": ...}`` (>= 5).
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
    if model_type != "qwen2":
      raise ValueError(f"{source}: model_type={model_type!r}, expected 'qwen2'")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise NotImplementedError(f"{source}: rope_type={rope_type!r} is not supported "
                                "(only the default RoPE)")
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
      raise KeyError(f"{source}: neither 'rope_theta' nor 'rope_parameters.rope_theta' is set")
    if hf.get("use_sliding_window", False):
      raise NotImplementedError(f"{source}: use_sliding_window=true is not supported")
    num_heads = need("num_attention_heads")
    args = dict(
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim") or 0,
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
    )
    args.update(kw)
    return cls(**args)

  def to_hf(self) -> dict[str, Any]:
    """The ``config.json`` dict that ``transformers`` reads as a Qwen2 model."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": self.max_position_embeddings,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,  # old spelling, read by transformers < 5
        "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        "tie_word_embeddings": self.tie_word_embeddings,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "torch_dtype": self.param_dtype,
    }


PRESETS = {
    "qwen2p5_0p5b": Qwen2Config.qwen2p5_0p5b,
    "qwen2p5_1p5b": Qwen2Config.qwen2p5_1p5b,
    "qwen2p5_3b": Qwen2Config.qwen2p5_3b,
    "qwen2p5_7b": Qwen2Config.qwen2p5_7b,
    "qwen2p5_math_1p5b": Qwen2Config.qwen2p5_math_1p5b,
    "qwen2p5_math_7b": Qwen2Config.qwen2p5_math_7b,
    "tiny": Qwen2Config.tiny,
}
