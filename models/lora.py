"""LoRA: low-rank adapters on the frozen Qwen2 projections, written in the model code.

A targeted kernel ``W`` [in..., out...] gets ``A`` [in..., rank] and
``B`` [rank, out...]; the layer computes ``x @ W + (alpha / rank) * (x @ A) @ B``
(``DecoderLayer`` adds ``delta`` after each projection). ``B`` starts at zero,
so a fresh adapter leaves the model exactly as it was; ``A`` starts
uniform(+-1/sqrt(fan_in)), PEFT's and qwix's default (he-uniform up to a constant).

The adapter tree is separate from the base params and mirrors their layout,
with qwix's names::

  {"layers": {"q_kernel_lora_a": [L, D, rank], "q_kernel_lora_b": [L, rank, N, H], ...}}

so the optimizer state and the checkpoints hold only adapters, and the
frozen base is a plain (non-donated) jit argument. ``with_adapters(base,
adapters, lcfg)`` is the param tree the model reads (a dict view, no copy):
the scanned layers slice the adapters with the base kernels and find them
with ``get_variable``. The base alone is the reference policy (adapters
off). ``merge`` folds the adapters into the kernels: the sampler's weights
(merged once per step) and the HF export.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

Params = dict[str, Any]

# Target name -> (kernel in params["layers"], input dims it contracts).
TARGETS = {
  "q": ("q_kernel", 1),
  "k": ("k_kernel", 1),
  "v": ("v_kernel", 1),
  "o": ("o_kernel", 2),
  "gate": ("gate_kernel", 1),
  "up": ("up_kernel", 1),
  "down": ("down_kernel", 1),
}
ALL_TARGETS = ",".join(TARGETS)
SCALE = "lora_scale"  # the per-layer alpha / rank that ``with_adapters`` adds for the layers
RANK_AXIS = "lora_rank"  # logical axis of the rank: no rule names it, so it is never sharded


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Rank, alpha (the delta is scaled by alpha / rank) and the targeted projections."""

  rank: int
  alpha: float
  targets: tuple[str, ...] = tuple(TARGETS)

  def __post_init__(self) -> None:
    if self.rank < 1:
      raise ValueError(f"LoraConfig.rank={self.rank} must be >= 1")
    if self.alpha <= 0:
      raise ValueError(f"LoraConfig.alpha={self.alpha} must be > 0")
    bad = [t for t in self.targets if t not in TARGETS]
    if bad or not self.targets:
      raise ValueError(
        f"LoraConfig.targets={','.join(self.targets)!r}: unknown target(s) "
        f"{bad}; expected a non-empty subset of {ALL_TARGETS}"
      )

  @classmethod
  def parse(cls, rank: int, alpha: float, targets: str) -> LoraConfig:
    """From the config strings: ``targets`` is comma-separated, e.g. "q,k,v,o"."""
    return cls(rank, alpha, tuple(t.strip() for t in targets.split(",") if t.strip()))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def kernels(self) -> tuple[str, ...]:
    return tuple(TARGETS[t][0] for t in self.targets)

  def to_json(self) -> dict[str, Any]:
    return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


def _n_in(kernel: str) -> int:
  return next(n for k, n in TARGETS.values() if k == kernel)


def adapter_shapes(base_shapes: Params, lcfg: LoraConfig) -> Params:
  """ShapeDtypeStructs (float32) of the adapters of a base with these param shapes."""
  out = {}
  for kernel in lcfg.kernels:
    w = base_shapes["layers"][kernel]  # [L, *in, *out]
    n = 1 + _n_in(kernel)
    out[f"{kernel}_lora_a"] = jax.ShapeDtypeStruct(w.shape[:n] + (lcfg.rank,), jnp.float32)
    out[f"{kernel}_lora_b"] = jax.ShapeDtypeStruct(
      (w.shape[0], lcfg.rank) + w.shape[n:], jnp.float32
    )
  return {"layers": out}


def adapter_axes(base_axes: Params, lcfg: LoraConfig) -> Params:
  """Logical axis names of the adapters: A keeps W's input axes, B its output axes."""
  out = {}
  for kernel in lcfg.kernels:
    axes = tuple(base_axes["layers"][kernel])  # ("layers", *in, *out)
    n = 1 + _n_in(kernel)
    out[f"{kernel}_lora_a"] = PartitionSpec(*axes[:n], RANK_AXIS)
    out[f"{kernel}_lora_b"] = PartitionSpec(axes[0], RANK_AXIS, *axes[n:])
  return {"layers": out}


def init_adapters(base_shapes: Params, lcfg: LoraConfig, rng: jax.Array) -> Params:
  """Fresh float32 adapters: A uniform(+-1/sqrt(fan_in)), B zero (delta exactly 0)."""
  shapes = adapter_shapes(base_shapes, lcfg)["layers"]
  out = {}
  for i, kernel in enumerate(lcfg.kernels):
    a = shapes[f"{kernel}_lora_a"]
    fan_in = math.prod(a.shape[1:-1])
    bound = 1.0 / math.sqrt(fan_in)
    out[f"{kernel}_lora_a"] = jax.random.uniform(
      jax.random.fold_in(rng, i), a.shape, jnp.float32, -bound, bound
    )
    out[f"{kernel}_lora_b"] = jnp.zeros(shapes[f"{kernel}_lora_b"].shape, jnp.float32)
  return {"layers": out}


def with_adapters(base: Params, adapters: Params, lcfg: LoraConfig) -> Params:
  """The param tree of base + adapters that the model applies (no weight is copied).

  The scale rides along as an [L] array, so the layer scan hands each layer
  its own scalar; ``delta`` casts to the compute dtype where it multiplies.
  """
  layers = base["layers"]
  L = layers[lcfg.kernels[0]].shape[0]
  return {
    **base,
    "layers": {**layers, **adapters["layers"], SCALE: jnp.full((L,), lcfg.scale, jnp.float32)},
  }


def delta(module: nn.Module, kernel: str, x: jax.Array, n_in: int) -> jax.Array | None:
  """``scale * (x @ A) @ B`` of ``kernel`` when the module's params hold its adapters.

  ``x`` ends in the kernel's ``n_in`` input dims. None without adapters (the
  base alone: the reference policy, or a run without LoRA).
  """
  if not module.has_variable("params", f"{kernel}_lora_a"):
    return None
  dt = module.cfg.dtype
  a: jax.Array = module.get_variable("params", f"{kernel}_lora_a").astype(dt)
  b: jax.Array = module.get_variable("params", f"{kernel}_lora_b").astype(dt)
  scale: jax.Array = module.get_variable("params", SCALE).astype(dt)
  xa = jnp.tensordot(x.astype(dt), a, axes=n_in)  # [B, T, rank]
  return jnp.tensordot(xa * scale, b, axes=1)


def merge(base: Params, adapters: Params, lcfg: LoraConfig, dtype: Any = None) -> Params:
  """The base with ``W + scale * A @ B`` in each targeted kernel (float32 sum).

  ``dtype``: of every merged param (default: each base param's own).
  """

  def one_layer(w_a_b: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    w, a, b = w_a_b
    ab = jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)
    return (w.astype(jnp.float32) + lcfg.scale * ab).astype(w.dtype)

  layers = dict(base["layers"])
  for kernel in lcfg.kernels:
    # One layer at a time: the float32 product of all layers would outweigh the weights.
    layers[kernel] = jax.lax.map(
      one_layer,
      (
        layers[kernel],
        adapters["layers"][f"{kernel}_lora_a"],
        adapters["layers"][f"{kernel}_lora_b"],
      ),
    )
  out = {**base, "layers": layers}
  return out if dtype is None else jax.tree.map(lambda p: p.astype(dtype), out)
