"""Qwen2 / Qwen2.5 / Qwen3 (dense) model configuration with named presets.

The presets carry the numbers of the released Hugging Face checkpoints, so a
full-size model can be shape-checked (``jax.eval_shape``) without weights.
Qwen3 dense is the Qwen2 decoder with two changes, chosen by ``model_type``:
no bias on the q / k / v projections, and an RMSNorm over the head dim of
each query and key head (before RoPE). Its ``head_dim`` is set on its own
(0.6B: hidden 1024, 16 heads of 128).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MODEL_TYPES = ("qwen2", "qwen3")  # HF config.json ``model_type`` values we read and write
_ATTENTIONS = ("auto", "reference", "xla", "flash", "splash")  # models.attention
# What a remat'd layer keeps for the backward (``models.decoder.REMAT_POLICIES``).
REMAT_POLICIES = ("full", "projections")


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Hyper-parameters of a Qwen2-architecture decoder (Qwen2 / Qwen2.5 or Qwen3 dense).

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
  # With remat, what each layer keeps: "full" nothing (its forward runs again in the
  # backward: train FLOPs about 8N a token), "projections" its q / k / v / o / gate / up
  # outputs (the backward recomputes norms, activations and attention only: about 6N a
  # token, for those outputs held per token and layer; models.decoder.REMAT_POLICIES).
  remat_policy: str = "full"
  model_type: str = "qwen2"  # "qwen3": no q/k/v bias, per-head q/k RMSNorm
  attention: str = "auto"  # the full forward's attention: models.attention.IMPLEMENTATIONS
  attention_block: int = 128  # key / query block of the "flash" attention
  # Packed rows whose completions share their prompt (models.shared_prefix): segment ids
  # carry the tree; splash reads each row's prompts gathered into this many keys.
  shared_prompts: bool = False
  shared_prompt_cols: int = 512
  # Layers per iteration of the layer scan (``nn.scan``'s unroll). Unrolled, the backward
  # keeps each layer's residuals instead of stacked [L, ...] buffers: for a few small layers
  # that bookkeeping was a third of the CPU train step. Equal up to float rounding.
  layer_unroll: int = 1
  # Where a few columns of each row are unembedded (``qwen2.hidden_states_at``), the last
  # layer's queries, output projection and MLP run at those columns only (keys and values at
  # all); reference attention, for short rows. Equal up to float rounding.
  trim_last_layer: bool = False

  def __post_init__(self) -> None:
    if self.model_type not in MODEL_TYPES:
      raise ValueError(
        f"Qwen2Config.model_type={self.model_type!r}; expected one of {list(MODEL_TYPES)}"
      )
    if self.head_dim == 0:
      if self.hidden_size % self.num_heads:
        raise ValueError(
          f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
          "set head_dim explicitly"
        )
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
    ):
      if getattr(self, name) <= 0:
        raise ValueError(f"Qwen2Config.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} must be a multiple of "
        f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.attention not in _ATTENTIONS or self.attention_block < 1:
      raise ValueError(
        f"Qwen2Config.attention={self.attention!r} / attention_block="
        f"{self.attention_block}: expected one of {_ATTENTIONS} and a block >= 1"
      )
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(
        f"Qwen2Config.remat_policy={self.remat_policy!r}; expected one of {list(REMAT_POLICIES)}"
      )
    if self.remat_policy != "full" and not self.remat:
      raise ValueError(
        f"Qwen2Config.remat_policy={self.remat_policy!r} says what a remat'd layer keeps: "
        "it needs remat=True"
      )
    if not 1 <= self.layer_unroll <= self.num_layers:
      raise ValueError(
        f"Qwen2Config.layer_unroll={self.layer_unroll}: expected 1 to num_layers={self.num_layers}"
      )
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(
          f"Qwen2Config.{name}={getattr(self, name)!r}; expected one of {sorted(_DTYPES)}"
        )

  @property
  def dtype(self) -> Any:
    return _DTYPES[self.compute_dtype]

  @property
  def weight_dtype(self) -> Any:
    return _DTYPES[self.param_dtype]

  @property
  def qkv_bias(self) -> bool:
    """Qwen2 has biases on the q / k / v projections; Qwen3 has none."""
    return self.model_type == "qwen2"

  @property
  def qk_norm(self) -> bool:
    """Qwen3 RMS-normalises each query and key head over its head dim, before RoPE."""
    return self.model_type == "qwen3"

  def replace(self, **changes: Any) -> Qwen2Config:
    return dataclasses.replace(self, **changes)

  # --- presets: numbers of the released checkpoints -------------------------

  @classmethod
  def qwen2p5_0p5b(cls, **kw: Any) -> Qwen2Config:
    return cls(
      vocab_size=151936,
      hidden_size=896,
      intermediate_size=4864,
      num_layers=24,
      num_heads=14,
      num_kv_heads=2,
      tie_word_embeddings=True,
      **kw,
    )

  @classmethod
  def qwen2p5_1p5b(cls, **kw: Any) -> Qwen2Config:
    return cls(
      vocab_size=151936,
      hidden_size=1536,
      intermediate_size=8960,
      num_layers=28,
      num_heads=12,
      num_kv_heads=2,
      tie_word_embeddings=True,
      max_position_embeddings=131072,
      **kw,
    )

  @classmethod
  def qwen2p5_3b(cls, **kw: Any) -> Qwen2Config:
    return cls(
      vocab_size=151936,
      hidden_size=2048,
      intermediate_size=11008,
      num_layers=36,
      num_heads=16,
      num_kv_heads=2,
      tie_word_embeddings=True,
      **kw,
    )

  @classmethod
  def qwen2p5_7b(cls, **kw: Any) -> Qwen2Config:
    return cls(
      vocab_size=152064,
      hidden_size=3584,
      intermediate_size=18944,
      num_layers=28,
      num_heads=28,
      num_kv_heads=4,
      tie_word_embeddings=False,
      max_position_embeddings=131072,
      **kw,
    )

  @classmethod
  def qwen2p5_math_1p5b(cls, **kw: Any) -> Qwen2Config:
    return cls(
      vocab_size=151936,
      hidden_size=1536,
      intermediate_size=8960,
      num_layers=28,
      num_heads=12,
      num_kv_heads=2,
      rope_theta=10000.0,
      tie_word_embeddings=True,
      max_position_embeddings=4096,
      **kw,
    )

  @classmethod
  def qwen2p5_math_7b(cls, **kw: Any) -> Qwen2Config:
    return cls(
      vocab_size=152064,
      hidden_size=3584,
      intermediate_size=18944,
      num_layers=28,
      num_heads=28,
      num_kv_heads=4,
      rope_theta=10000.0,
      tie_word_embeddings=False,
      max_position_embeddings=4096,
      **kw,
    )

  # Qwen3 dense (Qwen/Qwen3-*): head_dim 128 throughout, 8 kv heads, rope base 1e6,
  # 40960 positions; tied embeddings up to 4B.

  @classmethod
  def _qwen3(cls, **kw: Any) -> Qwen2Config:
    defaults = dict(
      vocab_size=151936,
      num_kv_heads=8,
      head_dim=128,
      rope_theta=1_000_000.0,
      max_position_embeddings=40960,
      model_type="qwen3",
    )
    return cls(**{**defaults, **kw})

  @classmethod
  def qwen3_0p6b(cls, **kw: Any) -> Qwen2Config:
    return cls._qwen3(
      hidden_size=1024,
      intermediate_size=3072,
      num_layers=28,
      num_heads=16,
      tie_word_embeddings=True,
      **kw,
    )

  @classmethod
  def qwen3_1p7b(cls, **kw: Any) -> Qwen2Config:
    return cls._qwen3(
      hidden_size=2048,
      intermediate_size=6144,
      num_layers=28,
      num_heads=16,
      tie_word_embeddings=True,
      **kw,
    )

  @classmethod
  def qwen3_4b(cls, **kw: Any) -> Qwen2Config:
    return cls._qwen3(
      hidden_size=2560,
      intermediate_size=9728,
      num_layers=36,
      num_heads=32,
      tie_word_embeddings=True,
      **kw,
    )

  @classmethod
  def qwen3_8b(cls, **kw: Any) -> Qwen2Config:
    return cls._qwen3(
      hidden_size=4096,
      intermediate_size=12288,
      num_layers=36,
      num_heads=32,
      tie_word_embeddings=False,
      **kw,
    )

  @classmethod
  def qwen3_14b(cls, **kw: Any) -> Qwen2Config:
    return cls._qwen3(
      hidden_size=5120,
      intermediate_size=17408,
      num_layers=40,
      num_heads=40,
      tie_word_embeddings=False,
      **kw,
    )

  @classmethod
  def qwen3_32b(cls, **kw: Any) -> Qwen2Config:
    return cls._qwen3(
      hidden_size=5120,
      intermediate_size=25600,
      num_layers=64,
      num_heads=64,
      tie_word_embeddings=False,
      **kw,
    )

  @classmethod
  def tiny(cls, **kw: Any) -> Qwen2Config:
    """A few-hundred-thousand-parameter model for tests and CPU demos."""
    defaults: dict[str, Any] = dict(
      vocab_size=256,
      hidden_size=64,
      intermediate_size=128,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      rope_theta=10000.0,
      tie_word_embeddings=True,
      max_position_embeddings=2048,
    )
    defaults.update(kw)
    return cls(**defaults)

  # --- Hugging Face config.json (models.hf_config) -----------------------------

  @classmethod
  def from_hf(cls, dict_or_path: dict[str, Any] | str | os.PathLike, **kw: Any) -> Qwen2Config:
    """Reads a HF ``config.json`` (a dict, the file, or its directory): ``hf_config.from_hf``."""
    from models import hf_config  # pylint: disable=import-outside-toplevel  (it imports us)

    return hf_config.from_hf(dict_or_path, **kw)

  def to_hf(self) -> dict[str, Any]:
    """The ``config.json`` dict that ``transformers`` reads as a Qwen2 / Qwen3 model."""
    from models import hf_config  # pylint: disable=import-outside-toplevel  (it imports us)

    return hf_config.to_hf(self)


PRESETS = {
  "qwen2p5_0p5b": Qwen2Config.qwen2p5_0p5b,
  "qwen2p5_1p5b": Qwen2Config.qwen2p5_1p5b,
  "qwen2p5_3b": Qwen2Config.qwen2p5_3b,
  "qwen2p5_7b": Qwen2Config.qwen2p5_7b,
  "qwen2p5_math_1p5b": Qwen2Config.qwen2p5_math_1p5b,
  "qwen2p5_math_7b": Qwen2Config.qwen2p5_math_7b,
  "qwen3_0p6b": Qwen2Config.qwen3_0p6b,
  "qwen3_1p7b": Qwen2Config.qwen3_1p7b,
  "qwen3_4b": Qwen2Config.qwen3_4b,
  "qwen3_8b": Qwen2Config.qwen3_8b,
  "qwen3_14b": Qwen2Config.qwen3_14b,
  "qwen3_32b": Qwen2Config.qwen3_32b,
  "tiny": Qwen2Config.tiny,
}
