"""The demo's printed results: the tables, the curves, the recorded studies.

``capo_jax.demo.run`` runs the warm start and the RL runs; this module turns their
held-out evaluations into what the main command prints: ``side_by_side`` (warm start
and each method's final step, with ``compare_runs``' difficulty buckets and paired
ΔAUC), ``plot_curves``, and beside the run what its recorded study found: on the cued
testbed ``cued_checks`` (the premise M, P1 and P2 of this run next to the cued study's
estimates with their intervals), on the arithmetic task ``recorded_study`` (what held
across warm starts in the demo study v3).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from capo_jax.demo import compare, cued_checks, study
from capo_jax.eval import calibration, traps

# The demo study v3's recorded results, one summary per box (the first box's study and
# its replicate on a second box, each from its own warm starts), package data that
# ``python -m studies.demo_v3.run --record`` writes from the study's reports: the main
# command prints what held across warm starts beside its own run.
STUDY_RESULTS = os.path.join(os.path.dirname(__file__), "study_v3_recorded.json")
# The cued study's recorded results (the latest cued entry of docs/results/studies.json and
# its report), package data that ``python -m studies.cued.report --record`` writes.
STUDY_CUED = os.path.join(os.path.dirname(__file__), "study_cued_recorded.json")
# The curves of the cued testbed: the shortcut (trap accuracy and confidence gap), then
# calibration and accuracy.
CUED_CURVES = ("trap_accuracy", "trap_gap", "auc_mean", "accuracy")
DEMO_CURVES = ("accuracy", "auc_mean", "auc_mostly_wrong", "entropy")  # the arithmetic task's
METRIC_NAMES = {"auc_mean": "AUC-mean", "trap_auc": "pooled trap AUC", "trap_gap": "trap gap"}
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
  keys: tuple[str, ...] = DEMO_CURVES,
  marks: dict[str, float] | None = None,
) -> str:
  """Held-out metrics over RL steps, one line per method, one panel per metric;
  ``marks``: a dashed level on a metric's panel (the premise's margins)."""
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
  for ax, k in zip(axes, keys):
    if k in (marks or {}):
      ax.axhline((marks or {})[k], color="gray", linestyle="--", linewidth=1, label="M's margin")
      ax.legend()
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


def recorded_cued() -> dict[str, Any]:
  """The cued study as recorded in the package (``STUDY_CUED``)."""
  with open(STUDY_CUED, encoding="utf-8") as f:
    return json.load(f)


def cued_estimates(
  runs: dict[str, list[dict[str, float]]], recorded: dict[str, Any]
) -> dict[str, Any]:
  """The study's checks on this run's "grpo" and "capo" (``cued_checks.single_run``) at
  the recorded design's margins and metrics: ``premise``, ``p1``, ``p2`` and each
  secondary metric."""
  cmp = recorded["design"]["compare"]
  keys = {"p1": cmp["p1"], "p2": cmp["p2"], **{k: k for k in cmp["secondary"]}}
  return cued_checks.single_run(runs["grpo"], runs["capo"], recorded["design"]["premise"], keys)


def premise_marks(evals: list[dict[str, float]], recorded: dict[str, Any]) -> dict[str, float]:
  """Where GRPO's final trap accuracy and trap gap must reach for M (the recorded
  margins from the warm start's values): the curves' dashed levels."""
  m, start = recorded["design"]["premise"], evals[0]
  return {
    "trap_accuracy": cued_checks.value(start, "trap_accuracy") - m["trap_accuracy_drop"],
    "trap_gap": cued_checks.value(start, "trap_gap") + m["trap_gap_rise"],
  }


def _seeds_per_warm_start(c: dict[str, Any]) -> str:
  counts = sorted({len(p["seeds"]) for p in c["per_warm_start"]})
  return " or ".join(map(str, counts)) or "0"


def cued_checks_text(own: dict[str, Any], recorded: dict[str, Any]) -> str:
  """``cued_estimates`` of this run, each beside the recorded study's figure."""
  m, cmp = recorded["premise"], recorded["compare"]
  margins = recorded["design"]["premise"]
  sg, f = cued_checks.signed, _fmt
  r = own["premise"]
  met = lambda ok: "met" if ok else "missed"  # noqa: E731
  (a0, a1), (g0, g1) = r["trap_accuracy"], r["trap_gap"]
  drop_ok = r["trap_accuracy_drop"] >= margins["trap_accuracy_drop"]
  rise_ok = r["trap_gap_rise"] >= margins["trap_gap_rise"]
  per = "; ".join(
    f"ws{p['warm_start']} ({p['seeds']} GRPO seeds) drop {sg(p.get('trap_accuracy_drop'))}, rise "
    f"{sg(p.get('trap_gap_rise'))}: {'held' if p['holds'] else 'missed'}"
    for p in m["per_warm_start"]
  )
  lines = [
    f"The cued study's checks (docs/studies/cued/README.md), this run beside the recorded "
    f"study ({recorded['run']} of {recorded['date']}, {recorded['runs']} runs"
    + (f"; {recorded['notes'].rstrip('.')}" if recorded.get("notes") else "")
    + ").",
    f"\nM, GRPO takes the shortcut: from the warm start to the final step, trap accuracy "
    f"falls by >= {margins['trap_accuracy_drop']:g} and the trap gap rises by >= "
    f"{margins['trap_gap_rise']:g} nats (pre-registered margins)",
    f"  this run:  trap accuracy {f(a0)} -> {f(a1)} (drop {sg(r['trap_accuracy_drop'])}, "
    f"{met(drop_ok)}), trap gap {sg(g0)} -> {sg(g1)} (rise {sg(r['trap_gap_rise'])}, "
    f"{met(rise_ok)}): M {'held' if r['holds'] else 'missed'} on this warm start",
    f"  the study: {'held' if m['holds'] else 'not held'} on {m['held']} of "
    f"{len(m['per_warm_start'])} premise warm starts ({margins['need']} needed): {per}",
  ]
  titles = {"p1": "P1", "p2": "P2"}
  for name, c in cmp.items():
    better = 1 if name in titles else -1  # the secondary trap gap: lower is better
    title = titles.get(name, "Secondary (lower is better)")
    own_v = own[name]
    lines += [
      f"\n{title}: CAPO - GRPO on {METRIC_NAMES.get(c['key'], c['key'])} at matched accuracy",
      "  this run:  "
      + (
        f"{sg(own_v)} (one warm start, one seed: a point estimate, no interval)"
        if np.isfinite(own_v)
        else "not measured (no CAPO checkpoint with a value within GRPO's accuracy range)"
      ),
      f"  the study: {cued_checks.interval_text(c)}, {_seeds_per_warm_start(c)} seed(s) "
      f"per warm start; {cued_checks.verdict(c, better)}",
    ]
  lines.append(
    "\nA single run is not evidence: one warm start and one RL seed give a point estimate "
    "whose spread across warm starts the study's interval measures; read the study's line."
  )
  return "\n".join(lines)
