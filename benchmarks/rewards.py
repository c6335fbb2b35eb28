"""Reward scoring throughput: the process pool (`Grader`) against in-process `score_serial`.

Pairs are built from MATH500 reference solutions, cycling over three kinds: the solution as is
(usually decided by the fast path), the solution with a digit of its boxed answer changed (a
wrong answer; math-verify decides unless both are plain numbers), and the boxed answer rewritten
as "x = <answer>" (math-verify decides). Both paths score the same pairs with cold caches;
pool start-up is timed separately.

  python benchmarks/rewards.py [--n 10000] [--workers N] [--data ../shared/data/math500.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import time

import numpy as np

from capo_jax import rewards

_DEFAULT_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "math500.jsonl"


def _replace_box(solution: str, new: str) -> str:
  old = rewards.extract_boxed(solution)
  i = solution.rfind(old) if old else -1
  return solution[:i] + new + solution[i + len(old):] if i >= 0 else solution + f"\\boxed{{{new}}}"


def _perturb(answer: str) -> str:
  digits = [m.start() for m in re.finditer(r"\d", answer)]
  if not digits:
    return answer + "+1"
  i = digits[-1]
  return answer[:i] + str((int(answer[i]) + 1) % 10) + answer[i + 1:]


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


def _clear_caches() -> None:
  rewards._key.cache_clear()
  rewards._mv_parse_gold.cache_clear()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=int, default=10_000)
  ap.add_argument("--workers", type=int, default=None, help="default: all cores")
  ap.add_argument("--timeout", type=float, default=5.0)
  ap.add_argument("--data", type=pathlib.Path, default=_DEFAULT_DATA)
  args = ap.parse_args()

  comps, golds = build_pairs(args.data, args.n)
  slow = sum(rewards._prepare(c, g)[0] is None for c, g in zip(comps, golds))
  rewards._warmup()  # math-verify import and first-call costs, out of the serial timing
  _clear_caches()
  t0 = time.perf_counter()
  r_serial, h_serial = rewards.score_serial(comps, golds)
  t_serial = time.perf_counter() - t0

  _clear_caches()
  with rewards.Grader(args.workers, args.timeout) as grader:
    t0 = time.perf_counter()
    grader.score(comps[:1], ["x"])  # starts and warms the workers
    t_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    r_pool, h_pool = grader.score(comps, golds)
    t_pool = time.perf_counter() - t0
    workers = grader._pool.num_workers

  agree = float((r_serial == r_pool).mean())
  print(f"pairs: {args.n} from {args.data.name}; {slow / args.n:.0%} need math-verify; "
        f"accuracy {r_serial.mean():.3f}; cores {os.cpu_count()}")
  print(f"serial (score_serial, 1 process): {args.n / t_serial:8.0f} pairs/s  ({t_serial:.1f} s)")
  print(f"pool (Grader, {workers} workers):       {args.n / t_pool:8.0f} pairs/s  ({t_pool:.1f} s; "
        f"start-up {t_start:.1f} s not included)")
  print(f"ratio pool/serial: {t_serial / t_pool:.2f}x   agreement {agree:.4f}")
  print(f"health serial {h_serial.as_dict()}")
  print(f"health pool   {h_pool.as_dict()}")
  if agree < 1.0:
    idx = np.flatnonzero(r_serial != r_pool)[:5]
    print("disagreements (pool timeouts?):", [(golds[i], rewards.extract_boxed(comps[i]))
                                              for i in idx])


if __name__ == "__main__":
  main()
