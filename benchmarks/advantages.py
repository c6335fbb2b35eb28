"""CAPO advantage kernel: jitted `jax.vmap` kernel against two NumPy peers.

Peers, measured in the same run on the same inputs (Q questions x G samples,
half correct on average, every row valid):
  * numpy-loop: CAPO's formula (docs/algorithms.md) as a double loop over (correct, wrong) pairs;
  * numpy-vec: the same maths broadcast over [Q, G, G] in NumPy.
The JAX kernel is timed with `block_until_ready` after a warm-up (compile)
call; every timing is the median of `--repeats` calls, JAX and numpy-vec
interleaved so machine load hits them alike; the slow loop gets
`--loop_repeats` calls right after. Ratios are peer time / JAX time.

  python -m benchmarks.advantages [--q 128] [--g 8 16 64] [--repeats 21]
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Callable

import jax
import numpy as np

from capo_jax.rl import advantages


def capo_numpy_loop(r_QG: np.ndarray, s_QG: np.ndarray, tau: float) -> np.ndarray:
  """The straightforward double loop (all rows valid, norm "group")."""
  q_n, g_n = r_QG.shape
  out = np.zeros((q_n, g_n))
  for q in range(q_n):
    pos = [i for i in range(g_n) if r_QG[q, i] == 1]
    neg = [j for j in range(g_n) if r_QG[q, j] == 0]
    scale = 1.0 / (g_n * tau)
    for i in pos:
      for j in neg:
        w = scale / (1.0 + math.exp(-(s_QG[q, j] - s_QG[q, i]) / tau))
        out[q, i] += w
        out[q, j] -= w
  return out


def capo_numpy_vec(r_QG: np.ndarray, s_QG: np.ndarray, tau: float) -> np.ndarray:
  """The same maths broadcast over [Q, G, G]."""
  pos_QG = r_QG == 1
  pair_QGG = pos_QG[:, :, None] & ~pos_QG[:, None, :]
  w_QGG = 1.0 / (1.0 + np.exp(-(s_QG[:, None, :] - s_QG[:, :, None]) / tau))
  w_QGG = np.where(pair_QGG, w_QGG, 0.0)
  return (w_QGG.sum(2) - w_QGG.sum(1)) / (r_QG.shape[1] * tau)


def _median_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
  times: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  return {k: 1e6 * float(np.median(v)) for k, v in times.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--q", type=int, default=128)
  parser.add_argument("--g", type=int, nargs="+", default=[8, 16, 64])
  parser.add_argument("--tau", type=float, default=0.6)
  parser.add_argument("--repeats", type=int, default=21)
  parser.add_argument(
    "--loop_repeats", type=int, default=5, help="repeats of the slow Python double loop"
  )
  args = parser.parse_args()

  kernel = jax.jit(lambda r, s, v: advantages.capo(r, s, v, tau=args.tau))
  print(
    f"device: {jax.devices()[0].device_kind}, Q = {args.q}, tau = {args.tau}, "
    f"median of {args.repeats} (loop: {args.loop_repeats}) calls"
  )
  header = (
    f"{'G':>4} {'jax jit+vmap us':>16} {'numpy-vec us':>13} {'numpy-loop us':>14} "
    f"{'vec/jax':>8} {'loop/jax':>9}"
  )
  print(header)
  rng = np.random.default_rng(0)
  for g in args.g:
    r = (rng.random((args.q, g)) < 0.5).astype(np.float32)
    s = (-rng.gamma(2.0, 0.3, (args.q, g))).astype(np.float32)
    v = np.ones((args.q, g), bool)
    r_d, s_d, v_d = jax.device_put(r), jax.device_put(s), jax.device_put(v)
    got = np.asarray(kernel(r_d, s_d, v_d))  # compiles
    want = capo_numpy_loop(r.astype(np.float64), s.astype(np.float64), args.tau)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(capo_numpy_vec(r, s, args.tau), want, rtol=1e-4, atol=1e-6)
    fast = _median_us(
      {
        "jax": lambda: kernel(r_d, s_d, v_d).block_until_ready(),
        "vec": lambda: capo_numpy_vec(r, s, args.tau),
      },
      args.repeats,
    )
    slow = _median_us({"loop": lambda: capo_numpy_loop(r, s, args.tau)}, args.loop_repeats)
    print(
      f"{g:>4} {fast['jax']:>16.1f} {fast['vec']:>13.1f} {slow['loop']:>14.0f} "
      f"{fast['vec'] / fast['jax']:>8.1f} {slow['loop'] / fast['jax']:>9.0f}"
    )


if __name__ == "__main__":
  main()
