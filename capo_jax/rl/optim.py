"""AdamW with warmup, global-norm clipping and weight decay (the paper: lr 1e-6, clip 1.0).

``make_optimizer(OptimConfig(...))`` returns an ``optax.GradientTransformation``
(clip by global norm -> Adam moments -> decoupled weight decay -> -lr);
``lr_schedule(cfg)`` is the step -> learning-rate function, also used for
logging. The step counted by the schedule is the optimizer's own update
count, so skipped (non-finite) train steps do not advance it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """Optimizer hyper-parameters; defaults follow the paper (lr 1e-6, clip 1.0).

  Attributes:
    learning_rate: peak learning rate, reached after ``warmup_steps``.
    warmup_steps: linear warmup over this many updates (0: none); update u < warmup
      uses peak * (u + 1) / warmup_steps, so the first update already moves.
    schedule: after warmup, "constant", "cosine" (to ``end_lr_frac`` * peak at
      ``total_steps``) or "linear" (likewise, linearly).
    total_steps: length of the decay for "cosine" / "linear" (warmup included).
    end_lr_frac: final learning rate as a fraction of the peak.
    b1, b2, eps: Adam moments.
    weight_decay: decoupled (AdamW) decay, multiplied by the learning rate.
    decay_norms_and_biases: whether norm scales and biases are decayed too
      (verl / torch AdamW default: yes; HF Trainer: no).
    grad_clip: maximum global gradient norm; 0 disables clipping.
  """

  learning_rate: float = 1e-6
  warmup_steps: int = 0
  schedule: str = "constant"
  total_steps: int = 0
  end_lr_frac: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.01
  decay_norms_and_biases: bool = True
  grad_clip: float = 1.0

  def __post_init__(self) -> None:
    if self.schedule not in SCHEDULES:
      raise ValueError(f"OptimConfig.schedule={self.schedule!r} is not one of {SCHEDULES}")
    for name in (
      "learning_rate",
      "warmup_steps",
      "weight_decay",
      "grad_clip",
      "eps",
      "end_lr_frac",
    ):
      if getattr(self, name) < 0:
        raise ValueError(f"OptimConfig.{name}={getattr(self, name)} must be >= 0")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"OptimConfig.{name}={getattr(self, name)} must lie in [0, 1)")
    if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
      raise ValueError(
        f"OptimConfig.total_steps={self.total_steps} must exceed "
        f"warmup_steps={self.warmup_steps} for schedule={self.schedule!r}"
      )

  def replace(self, **changes: Any) -> OptimConfig:
    return dataclasses.replace(self, **changes)


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Learning rate as a function of the update count (0-based)."""
  peak, warm = cfg.learning_rate, cfg.warmup_steps
  end = peak * cfg.end_lr_frac
  decay_steps = max(cfg.total_steps - warm, 1)

  def schedule(count: jax.Array) -> jax.Array:
    step = jnp.asarray(count, jnp.float32)
    # Step 0 already gets a non-zero rate: (count + 1) / warm, reaching peak at warm - 1.
    warm_lr = peak * jnp.minimum((step + 1.0) / max(warm, 1), 1.0)
    frac = jnp.clip((step - warm) / decay_steps, 0.0, 1.0)
    if cfg.schedule == "constant":
      after = jnp.asarray(peak, jnp.float32)
    elif cfg.schedule == "cosine":
      after = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    else:
      after = peak + (end - peak) * frac
    return jnp.where(step < warm, warm_lr, after)

  return schedule


def _decay_mask(params: Any) -> Any:
  """True on weights that weight decay applies to (no norm scales, no biases)."""

  def keep(path: tuple[Any, ...], _: Any) -> bool:
    name = str(getattr(path[-1], "key", path[-1]))
    return not (name.endswith("norm") or name.endswith("bias"))

  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on the scheduled learning rate."""
  mask = None if cfg.decay_norms_and_biases else _decay_mask
  parts = []
  if cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  parts.append(
    optax.adamw(
      lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask
    )
  )
  return optax.chain(*parts)


def current_lr(cfg: OptimConfig, opt_state: Any) -> jax.Array:
  """The learning rate the next update of ``opt_state`` will use."""
  counts = [
    s.count
    for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))
    if isinstance(s, optax.ScaleByScheduleState)
  ]
  if not counts:
    raise ValueError("current_lr: no ScaleByScheduleState in the optimizer state")
  return lr_schedule(cfg)(counts[0])
