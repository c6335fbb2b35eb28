"""The report of the demo study v3 (``studies/demo_v3/run.py``): tables, intervals, plots.

Reads what has finished under ``--root`` and writes ``study_v3.md``, ``study_v3.json``,
``study_v3_curves.png`` and ``study_v3_frontier.png``. Every number is computed
here from the runs' per-sample files (``heldout/step_*.npz``, ``scaling_final.npz``),
and the header records the machine, the date and the commit.

``record`` writes what the main command prints of the recorded study (every
comparison against GRPO, pooled over warm starts) from each box's
``study_v3.json`` into the package (``RECORDED``), so ``make demo`` reads
nothing from docs/.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from capo_jax.demo import study
from capo_jax.eval import calibration, scaling
from capo_jax.eval.paired import t_note
from studies.demo_v3.design import METHODS, PRIMARY
from studies.records import REPO, fmt, header, mean_sd, ran_on, write_report

# The recorded study as the main command prints it (``capo_jax/demo/report.py``): package
# data, one summary per box, written by ``record``.
RECORDED = REPO / "capo_jax" / "demo" / "study_v3_recorded.json"
# What ``study.held_across_warm_starts`` reads of a ``study_v3.json``.
SUMMARY_KEYS = ("date", "machine", "commit", "final", "paired")


def _load_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
  with np.load(path) as z:
    return {k: z[k] for k in z.files}


def _runs(root: pathlib.Path) -> dict[tuple[int, str], dict[str, Any]]:
  """(warm start, variant) -> {"evals", "dir"} for every finished run (seed 0)."""
  out = {}
  for path in sorted(root.glob("ws*/*_seed0/evals.json")):
    w = int(path.parent.parent.name[2:])
    out[(w, path.parent.name.rsplit("_seed", 1)[0])] = {
      "evals": json.loads(path.read_text()),
      "dir": path.parent,
    }
  return out


def _selected(root: pathlib.Path, w: int, design: dict[str, Any]) -> np.ndarray:
  return study.select_questions(
    _load_npz(root / f"ws{w}" / "selection.npz")["correct_QG"], *design["band"]
  )


def _at(run: dict[str, Any], step: int, keep_Q: np.ndarray) -> dict[str, Any]:
  """Metrics of one checkpoint on the selected questions."""
  z = _load_npz(run["dir"] / "heldout" / f"step_{step:06d}.npz")
  s_QG, c_QG = z["s_QG"][keep_Q], z["correct_QG"][keep_Q]
  auc_Q = calibration.auc_per_question(s_QG, c_QG)
  return {
    "auc_Q": auc_Q,
    "accuracy_sel": float(c_QG.mean()),
    "auc_mean_sel": float(np.nanmean(auc_Q)),
    "aurc_sel": calibration.aurc(s_QG, c_QG),
  }


def _scaling(path: pathlib.Path, design: dict[str, Any]) -> dict[str, Any] | None:
  if not path.exists():
    return None
  z = _load_npz(path)
  qs = []
  for q in range(z["s_QG"].shape[0]):
    group_G = scaling.group_answers([a or None for a in z["answers_QG"][q]], str.__eq__)
    qs.append(
      scaling.QuestionSamples(group_G, z["s_QG"][q], z["correct_QG"][q], z["completion_QG"][q])
    )
  cfg = scaling.ScalingConfig(
    ns=tuple(design["scaling_ks"]), n_subsets=design["scaling_subsets"], seed=0
  )
  return scaling.scaling_curves(qs, cfg)


def analyse(root: pathlib.Path, design: dict[str, Any]) -> dict[str, Any]:
  runs = _runs(root)
  warm_starts = sorted({w for w, _ in runs})
  res: dict[str, Any] = {"warm_starts": {}, "final": {}, "paired": {}, "scaling": {}}
  keep = {w: _selected(root, w, design) for w in warm_starts}
  for w in warm_starts:
    info = json.loads((root / f"ws{w}" / "warm_start_eval.json").read_text())
    ws_sc = _scaling(root / f"ws{w}" / "warm_start_scaling.npz", design)
    res["warm_starts"][w] = {
      "accuracy": info["accuracy"],
      "auc_mean": info["auc_mean"],
      "selected": int(keep[w].sum()),
      "scaling": ws_sc,
    }
  for (w, variant), run in runs.items():
    last = run["evals"][-1]
    sel = _at(run, last["step"], keep[w])
    res["final"].setdefault(variant, {})[w] = {
      "step": last["step"],
      "accuracy": last["accuracy"],
      "auc_mean": last["auc_mean"],
      "aurc": last["aurc"],
      "entropy": last["entropy"],
      **{k: v for k, v in sel.items() if k != "auc_Q"},
    }
    res["scaling"].setdefault(variant, {})[w] = _scaling(run["dir"] / "scaling_final.npz", design)
  base = PRIMARY[1]
  for variant in sorted({v for _, v in runs}):
    if variant == base or variant.endswith(tuple(s for s in design["lrs"] if s)):
      continue
    matched, final, notes = [], [], []
    for w in warm_starts:
      a, b = runs.get((w, variant)), runs.get((w, base))
      if a is None or b is None:
        continue
      m = study.matched_checkpoints(a["evals"], b["evals"], design["match_tol"])
      last_a, last_b = a["evals"][-1]["step"], b["evals"][-1]["step"]
      final.append((_at(a, last_a, keep[w])["auc_Q"], _at(b, last_b, keep[w])["auc_Q"]))
      if m is None:
        notes.append({"warm_start": w, "matched": None})
        continue
      matched.append((_at(a, m["step_a"], keep[w])["auc_Q"], _at(b, m["step_b"], keep[w])["auc_Q"]))
      notes.append({"warm_start": w, "matched": m})
    if final:
      res["paired"][variant] = {
        "matched": study.hierarchical_delta(matched) if matched else None,
        "final": study.hierarchical_delta(final),
        "checkpoints": notes,
      }
  res["frontier"] = _frontier(runs, keep, design)
  return res


def _frontier(
  runs: dict[tuple[int, str], dict[str, Any]], keep: dict[int, np.ndarray], design: dict[str, Any]
) -> dict[str, Any]:
  """Per learning rate: CAPO's checkpoints against GRPO's interpolated accuracy-AUC
  frontier (selected questions, same warm start; ``study.frontier_gaps``)."""

  def points(run: dict[str, Any], w: int) -> list[tuple[float, float]]:
    return [
      (e["accuracy"], _at(run, e["step"], keep[w])["auc_mean_sel"])
      for e in run["evals"]
      if e["step"]
    ]

  out: dict[str, Any] = {}
  capo, grpo = PRIMARY
  for lr_name, lr in design["lrs"].items():
    per_ws = {
      w: study.frontier_gaps(
        points(runs[(w, capo + lr_name)], w), points(runs[(w, grpo + lr_name)], w)
      )
      for w in sorted(keep)
      if (w, capo + lr_name) in runs and (w, grpo + lr_name) in runs
    }
    gaps = [g for v in per_ws.values() for g in v]
    if per_ws:
      out[f"{lr:.0e}".replace("e-0", "e-")] = {
        "per_warm_start": per_ws,
        "points": len(gaps),
        "above": sum(g > 0 for g in gaps),
        "mean_gap": float(np.mean(gaps)) if gaps else None,
      }
  return out


def _interval(d: dict[str, Any] | None) -> str:
  if not d:
    return "- (no matched checkpoints)"
  return (
    f"{fmt(d['delta'], True)} [{fmt(d['lo'], True)}, {fmt(d['hi'], True)}]"
    f"{t_note(d, 'warm starts')} ({d['pairs']} q, {d['warm_starts']} ws)"
  )


def tables(res: dict[str, Any], design: dict[str, Any]) -> str:
  k_max = max(design["scaling_ks"])
  head = [
    "method",
    "warm starts",
    "accuracy",
    "AUC-mean",
    "AURC",
    "accuracy (sel.)",
    "AUC-mean (sel.)",
    f"PC@{k_max} (sel.)",
    f"maj@{k_max} (sel.)",
    "entropy",
  ]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  ws = res["warm_starts"]
  lines.append(
    "| warm start | "
    + str(len(ws))
    + " | "
    + " | ".join(
      [
        mean_sd([v["accuracy"] for v in ws.values()]),
        mean_sd([v["auc_mean"] for v in ws.values()]),
        "-",
        "-",
        "-",
        mean_sd([v["scaling"]["pc"][-1] for v in ws.values() if v["scaling"]]),
        mean_sd([v["scaling"]["majority"][-1] for v in ws.values() if v["scaling"]]),
        "-",
      ]
    )
    + " |"
  )
  order = [m for m in METHODS if m in res["final"]] + sorted(
    v for v in res["final"] if v not in METHODS
  )
  for v in order:
    per = res["final"][v]
    sc = [s for s in res["scaling"].get(v, {}).values() if s]
    label = f"{v} (large-tau control)" if v == "dr_grpo" else v
    lines.append(
      f"| {label} | {len(per)} | "
      + " | ".join(
        [
          mean_sd([r[k] for r in per.values()])
          for k in ("accuracy", "auc_mean", "aurc", "accuracy_sel", "auc_mean_sel")
        ]
        + [
          mean_sd([s["pc"][-1] for s in sc]),
          mean_sd([s["majority"][-1] for s in sc]),
          mean_sd([r["entropy"] for r in per.values()]),
        ]
      )
      + " |"
    )
  out = "\n".join(lines)
  out += (
    "\n\nPaired per-question ΔAUC against grpo on the selected questions "
    "(hierarchical bootstrap 95%):\n\n| method | at matched accuracy (primary for capo) "
    "| at the final step | matched steps (method / grpo, per warm start) |\n"
    "|---|---|---|---|\n"
  )
  for v, p in res["paired"].items():
    steps = ", ".join(
      f"ws{c['warm_start']}: "
      + (f"{c['matched']['step_a']}/{c['matched']['step_b']}" if c["matched"] else "none")
      for c in p["checkpoints"]
    )
    out += f"| {v} | {_interval(p['matched'])} | {_interval(p['final'])} | {steps} |\n"
  if res.get("frontier"):
    out += (
      "\nFrontier, descriptive (no interval): each CAPO checkpoint inside its GRPO "
      "run's accuracy range (same warm start and learning rate) against GRPO's "
      "checkpoints linearly interpolated at its accuracy, AUC-mean on the selected "
      "questions:\n\n| lr | CAPO checkpoints in range | above GRPO's frontier "
      "| mean gap | per warm start (mean gap, checkpoints) |\n|---|---|---|---|---|\n"
    )
    for lr, f in res["frontier"].items():
      per = ", ".join(
        f"ws{w}: {fmt(np.mean(g) if g else None, True)} ({len(g)})"
        for w, g in f["per_warm_start"].items()
      )
      out += f"| {lr} | {f['points']} | {f['above']} | {fmt(f['mean_gap'], True)} | {per} |\n"
  out += (
    "\nConfidence-weighted voting on the selected questions at the last step, mean over "
    f"warm starts ({design['scaling_samples']} samples per question, each k averaged "
    f"over {design['scaling_subsets']} random subsets):\n\n| method | "
    + " | ".join(f"{m}@{k}" for m in ("majority", "pc", "rpc") for k in design["scaling_ks"])
    + " |\n|---|"
    + "---|" * (3 * len(design["scaling_ks"]))
    + "\n"
  )
  rows = {"warm start": [v["scaling"] for v in ws.values() if v["scaling"]]}
  rows.update({v: [s for s in res["scaling"].get(v, {}).values() if s] for v in order})
  for v, sc in rows.items():
    if sc:
      out += (
        f"| {v} | "
        + " | ".join(
          mean_sd([s[m][i] for s in sc])
          for m in ("majority", "pc", "rpc")
          for i in range(len(design["scaling_ks"]))
        )
        + " |\n"
      )
  return out


def _plots(root: pathlib.Path, res: dict[str, Any], out: str, design: dict[str, Any]) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  runs = _runs(root)
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  for v in [m for m in METHODS if m in res["final"]]:
    by_w = {w: r for (w, name), r in runs.items() if name == v}
    steps = [e["step"] for e in next(iter(by_w.values()))["evals"]]
    curves = {k: [] for k in ("accuracy", "auc_mean_sel", "entropy")}
    for w, r in by_w.items():
      if len(r["evals"]) != len(steps):
        continue
      keep = _selected(root, w, design)
      curves["accuracy"].append([e["accuracy"] for e in r["evals"]])
      curves["entropy"].append([e["entropy"] for e in r["evals"]])
      curves["auc_mean_sel"].append(
        [_at(r, e["step"], keep)["auc_mean_sel"] if e["step"] else np.nan for e in r["evals"]]
      )
    for ax, (k, c) in zip(axes, curves.items()):
      ax.plot(steps, np.nanmean(np.array(c, float), 0), "o-", ms=3, label=v)
      ax.set_title(k + " (mean over warm starts)")
      ax.set_xlabel("RL step")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "study_v3_curves.png"), dpi=110)
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for (w, name), r in sorted(runs.items()):
    method = name.split("_lr")[0]
    if method not in PRIMARY:
      continue
    keep = _selected(root, w, design)
    xs = [e["accuracy"] for e in r["evals"] if e["step"]]
    ys = [_at(r, e["step"], keep)["auc_mean_sel"] for e in r["evals"] if e["step"]]
    ax.plot(
      xs,
      ys,
      "o-" if method == "capo" else "s--",
      ms=3,
      color="C1" if method == "capo" else "C0",
      alpha=0.4 + 0.2 * ("_lr" in name),
      label=f"{name} ws{w}",
    )
  ax.set_xlabel("held-out accuracy")
  ax.set_ylabel("AUC-mean, selected questions")
  ax.legend(fontsize=5)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "study_v3_frontier.png"), dpi=110)
  plt.close(fig)


def report(root: str, out: str) -> str:
  root_p = pathlib.Path(root)
  # The design the runs were made with (run_all writes it), not this file's.
  design = json.loads((root_p / "design.json").read_text())
  res = analyse(root_p, design)
  dirs = sorted(p.parent for p in root_p.glob("ws*/*_seed*/evals.json"))
  text = (
    header("Demo study v3", dirs)
    + " Warm starts (SFT seeds): "
    + ", ".join(
      f"ws{w} accuracy {fmt(v['accuracy'])}, AUC-mean {fmt(v['auc_mean'])}, "
      f"{v['selected']} selected questions"
      for w, v in res["warm_starts"].items()
    )
    + ".\n\n"
    + tables(res, design)
  )
  write_report(out, "study_v3", text, {"design": design, "ran_on": ran_on(dirs), **res})
  _plots(root_p, res, out, design)  # into the folder write_report made
  return text


def recorded_summary(result: dict[str, Any]) -> dict[str, Any]:
  """The part of one box's ``study_v3.json`` that the main command prints."""
  missing = [k for k in SUMMARY_KEYS if k not in result]
  if missing:
    raise ValueError(f"recorded_summary: the study_v3.json lacks {missing}")
  return {k: result[k] for k in SUMMARY_KEYS}


def record(reports: list[str], path: pathlib.Path = RECORDED) -> pathlib.Path:
  """Writes ``path``: for each report (a box's ``study_v3.json``, in the order given) its
  path in the repository and ``recorded_summary``."""
  entries = []
  for r in reports:
    p = pathlib.Path(r).resolve()
    entries.append(
      {
        "report": p.relative_to(REPO).as_posix(),
        **recorded_summary(json.loads(p.read_text(encoding="utf-8"))),
      }
    )
  path.write_text(json.dumps(entries, indent=1) + "\n", encoding="utf-8")
  return path
