"""Reward scoring throughput: the process pool (`Grader`) against in-process `score_serial`.

Pairs are built from MATH500 reference solutions, cycling over three kinds: the solution as is
(usually decided by the fast path), the solution with a digit of its boxed answer changed (a
wrong answer; math-verify decides unless both are plain numbers), and the boxed answer rewritten
as "x = <answer>" (math-verify decides). Both paths score the same pairs, block by block in
alternating order (shared machines drift); pool start-up is timed separately. CPU seconds are
reported too: where the scheduler shares CPU per session (Linux autogroup on a shared box),
more processes get no more CPU, and only the CPU cost per pair tells how the pool would scale.

  python -m benchmarks.rewards [--n 10000] [--workers N] [--data ../shared/data/math500.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import time

import numpy as np

from capo_jax.data import rewards

_DEFAULT_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "math500.jsonl"


def _replace_box(solution: str, new: str) -> str:
  old = rewards.extract_boxed(solution)
  i = solution.rfind(old) if old else -1
  return solution[:i] + new + solution[i + len(old) :] if i >= 0 else solution + f"\\boxed{{{new}}}"


def _perturb(answer: str) -> str:
  digits = [m.start() for m in re.finditer(r"\d", answer)]
  if not digits:
    return answer + "+1"
  i = digits[-1]
  return answer[:i] + str((int(answer[i]) + 1) % 10) + answer[i + 1 :]


def build_pairs(path: pathlib.Path, n: int) -> tuple[list[str], list[str]]:
  rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
  comps, golds = [], []
  for k in range(n):
    row = rows[(k // 3) % len(rows)]
    boxed = rewards.extract_boxed(row["solution"]) or row["answer"]
    kind = k % 3
    if kind == 0:
      comps.append(row["solution"])
    elif kind == 1:
      comps.append(_replace_box(row["solution"], _perturb(boxed)))
    else:
      comps.append(_replace_box(row["solution"], f"x = {boxed}"))
    golds.append(row["answer"])
  return comps, golds


def _cpu_seconds(pids: list[int]) -> float:
  """User + system CPU seconds of live processes (Linux /proc; 0 elsewhere)."""
  total = 0.0
  for pid in pids:
    try:
      fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
      total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
      pass
  return total


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=int, default=10_000)
  ap.add_argument(
    "--blocks",
    type=int,
    default=4,
    help="alternate serial/pool over this many blocks, so load drift hits both",
  )
  ap.add_argument("--workers", type=int, default=None, help="default: all cores")
  ap.add_argument("--timeout", type=float, default=5.0)
  ap.add_argument("--data", type=pathlib.Path, default=_DEFAULT_DATA)
  args = ap.parse_args()

  comps, golds = build_pairs(args.data, args.n)
  slow = sum(rewards._prepare(c, g)[0] is None for c, g in zip(comps, golds))
  rewards._warmup()  # math-verify import and first-call costs, out of the serial timing
  wall = {"serial": 0.0, "pool": 0.0}
  cpu = {"serial": 0.0, "pool parent": 0.0, "pool workers": 0.0}
  r_serial, r_pool = np.zeros(args.n, np.float32), np.zeros(args.n, np.float32)
  h_serial, h_pool = rewards.RewardHealth(), rewards.RewardHealth()
  with rewards.Grader(args.workers, args.timeout) as grader:
    t0 = time.perf_counter()
    grader.score(comps[:1], ["x"])  # starts and warms the workers
    t_start = time.perf_counter() - t0
    bounds = np.linspace(0, args.n, args.blocks + 1).astype(int)
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      for path in ("serial", "pool") if b % 2 == 0 else ("pool", "serial"):
        rewards._key.cache_clear()  # the fast path's cache is shared by both paths
        pids = grader._pool.worker_pids()
        w0, c0, t0 = _cpu_seconds(pids), time.process_time(), time.perf_counter()
        if path == "serial":
          r_serial[lo:hi], h = rewards.score_serial(comps[lo:hi], golds[lo:hi])
          h_serial += h
        else:
          r_pool[lo:hi], h = grader.score(comps[lo:hi], golds[lo:hi])
          h_pool += h
          cpu["pool workers"] += _cpu_seconds(pids) - w0
        wall[path] += time.perf_counter() - t0
        cpu["serial" if path == "serial" else "pool parent"] += time.process_time() - c0
    workers = grader._pool.num_workers

  agree = float((r_serial == r_pool).mean())
  print(
    f"pairs: {args.n} from {args.data.name}; {slow / args.n:.0%} need math-verify; "
    f"accuracy {r_serial.mean():.3f}; cores {os.cpu_count()}; "
    f"load average {os.getloadavg()[0]:.1f}"
  )
  print(
    f"serial (score_serial, 1 process): {args.n / wall['serial']:7.0f} pairs/s "
    f"({wall['serial']:.1f} s wall, {cpu['serial']:.1f} CPU-s)"
  )
  print(
    f"pool (Grader, {workers} workers):       {args.n / wall['pool']:7.0f} pairs/s "
    f"({wall['pool']:.1f} s wall, CPU-s: parent {cpu['pool parent']:.1f}, "
    f"workers {cpu['pool workers']:.1f}; start-up {t_start:.1f} s not included)"
  )
  print(
    f"ratio pool/serial (pairs/s): {wall['serial'] / wall['pool']:.2f}x; "
    f"CPU per pair pool/serial: "
    f"{(cpu['pool parent'] + cpu['pool workers']) / max(cpu['serial'], 1e-9):.2f}; "
    f"agreement {agree:.4f}"
  )
  print(f"health serial {h_serial.as_dict()}")
  print(f"health pool   {h_pool.as_dict()}")
  if agree < 1.0:
    idx = np.flatnonzero(r_serial != r_pool)[:5]
    print(
      "disagreements (pool timeouts?):", [(golds[i], rewards.extract_boxed(comps[i])) for i in idx]
    )


if __name__ == "__main__":
  main()
