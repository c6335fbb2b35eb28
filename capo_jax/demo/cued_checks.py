"""The cued testbed's pre-registered checks (docs/studies/cued/README.md): the premise M
and the comparisons P1 / P2 at matched accuracy.

One implementation for the study's report (``studies/cued/report.py``: every warm start
and seed, t-intervals) and the demo's (``capo_jax/demo/report.py``: its own GRPO and
CAPO runs, one warm start and one seed, point estimates). Inputs are held-out
evaluations as ``run_rl`` returns them (step 0 is the warm start's evaluation).

- **M** (``premise_row`` for one warm start, ``premise`` over a study): the mean over
  the warm start's GRPO seeds at the final step against the warm start; trap accuracy
  falls by at least ``trap_accuracy_drop`` and the trap gap rises by at least
  ``trap_gap_rise``; M holds when both do on at least ``need`` premise warm starts.
- **Matched accuracy** (``matched_gap``): one arm's run against GRPO's run of the same
  warm start and seed. GRPO's evaluated checkpoints, the warm start included, joined in
  order of accuracy, form its frontier; each of the arm's checkpoints after step 0 whose
  accuracy lies within the frontier's range gives the arm's metric minus GRPO's
  interpolated at that accuracy (``capo_jax.demo.study.frontier_gaps``); the run pair's
  estimate is their mean.
- **P1 / P2** (``compare``): per warm start, the mean of its seeds' estimates; the mean
  over warm starts with a Student-t interval, df = W - 1 (``capo_jax.eval.paired``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from capo_jax.demo.study import frontier_gaps
from capo_jax.eval import paired

# (warm start, arm, seed) -> that run's held-out evaluations.
Runs = dict[tuple[int, str, int], list[dict[str, Any]]]
Evals = Sequence[Mapping[str, Any]]


def value(e: Mapping[str, Any], key: str) -> float:
  """``e[key]`` as a float; NaN when missing or None (a metric with nothing to average)."""
  v = e.get(key)
  return float("nan") if v is None else float(v)


def signed(v: Any) -> str:
  """Three signed decimals, "-" for a missing value (the study's table cells)."""
  return "-" if v is None or not np.isfinite(v) else f"{v:+.3f}"


def premise_row(
  start: Mapping[str, Any], finals: Sequence[Evals], margins: Mapping[str, Any]
) -> dict[str, Any]:
  """M on one warm start: ``start`` its evaluation, ``finals`` its GRPO runs' evaluations
  (the last of each is read), ``margins`` the design's ``premise`` section.

  Returns ``seeds``, ``trap_accuracy`` and ``trap_gap`` ([start, mean final]), their
  ``trap_accuracy_drop`` and ``trap_gap_rise``, and ``holds`` (both margins met; a NaN,
  no decoy copy or no correct trap answer, misses)."""
  acc = float(np.mean([value(ev[-1], "trap_accuracy") for ev in finals]))
  gap = float(np.mean([value(ev[-1], "trap_gap") for ev in finals]))
  drop = value(start, "trap_accuracy") - acc
  rise = gap - value(start, "trap_gap")
  return {
    "seeds": len(finals),
    "trap_accuracy": [value(start, "trap_accuracy"), acc],
    "trap_gap": [value(start, "trap_gap"), gap],
    "trap_accuracy_drop": drop,
    "trap_gap_rise": rise,
    "holds": bool(drop >= margins["trap_accuracy_drop"] and rise >= margins["trap_gap_rise"]),
  }


def premise(runs: Runs, design: Mapping[str, Any]) -> dict[str, Any]:
  """M per premise warm start and overall (the module docstring). ``decided``: every
  premise run has finished."""
  ref, rows, finished = design["reference"], [], True
  for w in design["premise_warm_starts"]:
    finals = [runs[(w, ref, k)] for k in design["seeds"] if (w, ref, k) in runs]
    finished &= len(finals) == len(design["seeds"])
    if not finals:
      rows.append({"warm_start": w, "seeds": 0, "holds": False})
      continue
    rows.append({"warm_start": w, **premise_row(finals[0][0], finals, design["premise"])})
  held = sum(r["holds"] for r in rows)
  return {
    "per_warm_start": rows,
    "held": held,
    "holds": held >= design["premise"]["need"],
    "decided": finished,
  }


def matched_gap(evals_arm: Evals, evals_ref: Evals, key: str) -> float:
  """The arm's ``key`` minus the reference's at matched accuracy (module docstring); NaN
  when no checkpoint of the arm lies within the reference's accuracy range."""
  ref = [(e["accuracy"], value(e, key)) for e in evals_ref]
  arm = [(e["accuracy"], value(e, key)) for e in evals_arm if e["step"] > 0]
  gaps = frontier_gaps([p for p in arm if np.isfinite(p[1])], [p for p in ref if np.isfinite(p[1])])
  return float(np.mean(gaps)) if gaps else float("nan")


def compare(runs: Runs, design: Mapping[str, Any], arm: str, key: str) -> dict[str, Any]:
  """``arm`` minus the reference on ``key`` at matched accuracy: each warm start's
  estimate (the mean over its seeds) and the t-interval over warm starts."""
  ref, per = design["reference"], []
  for w in design["warm_starts"]:
    seeds = {
      k: matched_gap(runs[(w, arm, k)], runs[(w, ref, k)], key)
      for k in design["seeds"]
      if (w, arm, k) in runs and (w, ref, k) in runs
    }
    finite = [v for v in seeds.values() if np.isfinite(v)]
    if seeds:
      est = float(np.mean(finite)) if finite else float("nan")
      per.append({"warm_start": w, "estimate": est, "seeds": seeds})
  t = paired.t_interval([p["estimate"] for p in per], design["compare"]["level"])
  return {"arm": arm, "key": key, "per_warm_start": per, **t}


def verdict(c: Mapping[str, Any], better: int = 1) -> str:
  """The paper's way (CAPO better: the interval wholly above 0 for ``better`` = 1, wholly
  below for -1), against it (wholly on the other side), or not shown."""
  if not np.isfinite(c["t_lo"]):
    return "not measured (fewer than 2 warm starts)"
  lo, hi = sorted((better * c["t_lo"], better * c["t_hi"]))
  if lo > 0:
    return "the paper's way"
  return "against the paper" if hi < 0 else "not shown (the interval holds 0)"


def interval_text(c: Mapping[str, Any]) -> str:
  """``compare``'s result in words: mean [t-interval] over W warm starts (each one's)."""
  per = ", ".join(f"ws{p['warm_start']} {signed(p['estimate'])}" for p in c["per_warm_start"])
  return (
    f"{signed(c['t_mean'])} [{signed(c['t_lo'])}, {signed(c['t_hi'])}] "
    f"over {c['clusters']} warm starts ({per or 'none'})"
  )


def single_run(
  grpo: Evals, capo: Evals, margins: Mapping[str, Any], keys: Mapping[str, str]
) -> dict[str, Any]:
  """The checks on one GRPO and one CAPO run from one warm start, with one seed each (the
  demo): ``premise`` (``premise_row`` of the GRPO run) and, for each ``name -> metric``
  of ``keys`` (e.g. ``{"p1": "auc_mean", "p2": "trap_auc"}``), CAPO minus GRPO at
  matched accuracy (``matched_gap``). Point estimates, no interval."""
  return {
    "premise": premise_row(grpo[0], [grpo], margins),
    **{name: matched_gap(capo, grpo, key) for name, key in keys.items()},
  }
