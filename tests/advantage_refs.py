"""Shared test helpers of the advantage tests: CAPO's formula one pair at a time in NumPy
(the independent reference) and random groups with degenerate and invalid rows."""

from __future__ import annotations

import math

import numpy as np


def capo_loop(
  r: np.ndarray, s: np.ndarray, v: np.ndarray, u: np.ndarray, tau: float, norm: str = "group"
) -> np.ndarray:
  """CAPO's formula, one pair at a time, in float64: for i correct,
  A_i = (1/(n tau)) sum_{j wrong} sigmoid((s_j - s_i)/tau); for j wrong, minus the sum over i."""
  out = np.zeros(r.shape)
  for q in range(r.shape[0]):
    pos = [i for i in range(r.shape[1]) if v[q, i] and r[q, i] == 1]
    neg = [j for j in range(r.shape[1]) if v[q, j] and r[q, j] == 0]
    n = {"group": v[q].sum(), "pairs": len(pos) * len(neg), "none": 1}[norm]
    for i in pos:
      for j in neg:
        w = 1.0 / (1.0 + math.exp(-(s[q, j] - s[q, i]) / tau))
        out[q, i] += w / (n * tau)
        out[q, j] -= w / (n * tau)
  return np.where(u & v, out, 0.0)


def random_batch(seed: int, q: int = 12, g: int = 8, p_valid: float = 0.85):
  rng = np.random.default_rng(seed)
  r = (rng.random((q, g)) < 0.5).astype(np.float64)
  r[0] = 1.0  # all correct
  r[1] = 0.0  # all wrong
  s = -rng.gamma(2.0, 0.4, size=(q, g))
  v = rng.random((q, g)) < p_valid
  v[:2] = True
  return r, s, v
