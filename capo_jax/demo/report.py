"""The demo's printed results: the tables, the curves, the recorded study.

``capo_jax.demo.run`` runs the warm start and the RL runs; this module turns their
held-out evaluations into what the main command prints: ``side_by_side`` (warm start
and each method's final step, with ``compare_runs``' difficulty buckets and paired
ΔAUC), ``plot_curves`` and ``recorded_study`` (what held across warm starts in the
recorded demo study).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from capo_jax.demo import compare, study
from capo_jax.eval import calibration, traps

# The demo study v3's recorded results, one summary per box (the first box's study and
# its replicate on a second box, each from its own warm starts), package data that
# ``python -m studies.demo_v3.run --record`` writes from the study's reports: the main
# command prints what held across warm starts beside its own run.
STUDY_RESULTS = os.path.join(os.path.dirname(__file__), "study_v3_recorded.json")
REPORT_KEYS = ("accuracy", "auc_mean", "pooled_auc", "auc_mostly_wrong", "entropy", "mean_length")


def _fmt(v: Any) -> str:
  return "nan" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.3f}"


def report(evals: list[dict[str, float]]) -> str:
  """A before / after table of one run's held-out metrics."""
  first, last = evals[0], evals[-1]
  lines = [f"{'held-out metric':<20} {'warm start':>11} {'step ' + str(last['step']):>11}"]
  for k in REPORT_KEYS:
    lines.append(f"{k:<20} {_fmt(first.get(k)):>11} {_fmt(last.get(k)):>11}")
  return "\n".join(lines)


def _heldout_arrays(path: str) -> tuple[np.ndarray, np.ndarray]:
  with np.load(path) as z:
    return z["s_QG"], z["correct_QG"]


def compare_runs(
  workdir: str, runs: dict[str, list[dict[str, float]]], a: str = "capo", b: str = "grpo"
) -> dict[str, Any]:
  """Final-step numbers of each run on the warm start's difficulty buckets, and the
  paired per-question ΔAUC (``a`` minus ``b``, bootstrap over questions)."""
  s0, c0 = _heldout_arrays(os.path.join(workdir, "warm_start_heldout.npz"))
  bucket_Q, labels = compare.difficulty_buckets(c0)
  out: dict[str, Any] = {
    "labels": labels,
    "warm start": compare.summary(s0, c0, bucket_Q, len(labels)),
  }
  auc: dict[str, np.ndarray] = {}
  for name, evals in runs.items():
    step = evals[-1]["step"]
    s, c = _heldout_arrays(os.path.join(workdir, name, "heldout", f"step_{step:06d}.npz"))
    out[name] = compare.summary(s, c, bucket_Q, len(labels))
    auc[name] = calibration.auc_per_question(s, c)
  if a in auc and b in auc:
    out["paired"] = compare.paired_delta_auc(auc[a], auc[b])
  return out


def side_by_side(
  runs: dict[str, list[dict[str, float]]], cmp: dict[str, Any], a: str = "capo", b: str = "grpo"
) -> str:
  """The main command's table: warm start and each method's final step, one column each."""
  names = list(runs)
  cols = ["warm start"] + [f"{n} @{runs[n][-1]['step']}" for n in names]
  lines = [f"{'held-out metric':<24}" + "".join(f"{col:>14}" for col in cols)]
  first = runs[names[0]][0]
  # AUC-mean with its mixed questions, pooled AUC and the confidently-wrong share beside
  # it; then the rule's share on the arithmetic task, the trap metrics on the cued one.
  keys = ("accuracy", "auc_mean", "auc_questions", "pooled_auc", "confidently_wrong", "aurc")
  extra = traps.TRAP_KEYS if "trap_gap" in first else ("rule_share",)
  for k in (*keys, "entropy", *extra):
    vals = [first.get(k)] + [runs[n][-1].get(k) for n in names]
    cells = [f"{v:.0f}" if k == "auc_questions" and v is not None else _fmt(v) for v in vals]
    lines.append(f"{k:<24}" + "".join(f"{c:>14}" for c in cells))
  hard = cmp["labels"][0]
  vals = [cmp["warm start"]["buckets"][0][0]] + [cmp[n]["buckets"][0][0] for n in names]
  lines.append(f"{'auc, hard ' + hard:<24}" + "".join(f"{_fmt(v):>14}" for v in vals))
  if "paired" in cmp:
    p = cmp["paired"]
    sg = lambda v: "nan" if np.isnan(v) else f"{v:+.3f}"  # noqa: E731
    lines.append(
      f"\npaired ΔAUC ({a} - {b}) over the {p['pairs']} questions mixed under both: "
      f"{sg(p['delta'])}, 95% bootstrap interval [{sg(p['lo'])}, {sg(p['hi'])}]"
    )
  lines.append(
    "(hard: questions the warm start gets right at most 1/4 of the time; "
    "buckets are the warm start's, the same questions for every method)"
  )
  return "\n".join(lines)


def plot_curves(
  runs: dict[str, list[dict[str, float]]],
  path: str,
  keys: tuple[str, ...] = ("accuracy", "auc_mean", "auc_mostly_wrong", "entropy"),
) -> str:
  """Held-out metrics over RL steps, one line per method, one panel per metric."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.2))
  for name, evals in runs.items():
    steps = [e["step"] for e in evals]
    for ax, k in zip(axes, keys):
      ax.plot(steps, [np.nan if e.get(k) is None else e[k] for e in evals], "o-", label=name)
      ax.set_title(k)
      ax.set_xlabel("RL step")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def recorded_study() -> str:
  """What held across warm starts in the recorded demo study v3: every box's, whatever
  each shows (``STUDY_RESULTS``)."""
  with open(STUDY_RESULTS, encoding="utf-8") as f:
    return "\n\n".join(study.held_across_warm_starts(result) for result in json.load(f))
