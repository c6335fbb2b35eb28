"""The optimizer (capo_jax.rl.optim): learning-rate schedules and AdamW against NumPy."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capo_jax.rl.optim import OptimConfig, lr_schedule, make_optimizer


def test_lr_schedules_by_hand():
  peak, warm, total, end = 1e-3, 4, 10, 0.1
  for kind in ("constant", "cosine", "linear"):
    f = lr_schedule(
      OptimConfig(
        learning_rate=peak, warmup_steps=warm, schedule=kind, total_steps=total, end_lr_frac=end
      )
    )
    for step in range(14):
      if step < warm:
        want = peak * (step + 1) / warm
      elif kind == "constant":
        want = peak
      else:
        frac = min((step - warm) / (total - warm), 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1 - frac
        want = peak * end + (peak - peak * end) * shape
      assert float(f(step)) == pytest.approx(want, rel=1e-5), (kind, step)
  with pytest.raises(ValueError, match="total_steps"):
    OptimConfig(schedule="cosine", total_steps=0)
  with pytest.raises(ValueError, match="schedule"):
    OptimConfig(schedule="step")


def test_adamw_matches_numpy():
  cfg = OptimConfig(
    learning_rate=0.1,
    weight_decay=0.05,
    grad_clip=1.0,
    b1=0.8,
    b2=0.9,
    decay_norms_and_biases=False,
  )
  rng = np.random.default_rng(0)
  params = {
    "w_kernel": rng.normal(size=(3, 2)),
    "w_bias": rng.normal(size=(2,)),
    "final_norm": rng.normal(size=(2,)),
  }
  opt = make_optimizer(cfg)
  p_jax = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  state = opt.init(p_jax)
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(x) for k, x in params.items()}
  p_np = dict(params)
  for t in range(1, 4):
    grads = {k: rng.normal(size=x.shape) * (3.0 if t == 2 else 0.1) for k, x in params.items()}
    norm = math.sqrt(sum((g**2).sum() for g in grads.values()))
    scale = min(1.0, cfg.grad_clip / norm)
    for k in p_np:
      g = grads[k] * scale
      m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g
      v[k] = cfg.b2 * v[k] + (1 - cfg.b2) * g * g
      step = (m[k] / (1 - cfg.b1**t)) / (np.sqrt(v[k] / (1 - cfg.b2**t)) + cfg.eps)
      decay = cfg.weight_decay * p_np[k] if k == "w_kernel" else 0.0
      p_np[k] = p_np[k] - cfg.learning_rate * (step + decay)
    upd, state = opt.update(jax.tree.map(jnp.asarray, grads), state, p_jax)
    p_jax = jax.tree.map(lambda a, b: a + b, p_jax, upd)
  for k in params:
    np.testing.assert_allclose(np.asarray(p_jax[k]), p_np[k], rtol=2e-5, atol=2e-6)
