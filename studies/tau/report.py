"""The report of the tau study (``studies/tau/run.py``): paired ΔAUC per tau, the verdict, curves.

Reads what has finished under ``<root>/ws0/tau/`` and writes ``tau_study.md``,
``tau_study.json`` and ``tau_study_curves.png``.

The pre-registered reading (``verdict``): the result is CAPO minus GRPO, the
paired per-question ΔAUC on the selected questions at the final step. It is
"robust to tau" when the three point estimates have one sign and no interval
lies wholly on the other side of zero; "not robust" otherwise.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from capo_jax.eval.paired import t_note
from studies import ws0
from studies.records import fmt, header, mean_sd, ran_on, write_report
from studies.tau.design import GRID, PAPER_TAU, REFERENCE, variant_names


def verdict(deltas: list[dict[str, Any]]) -> str:
  """ "robust to tau" / "not robust" (module docstring); "-" without all three.

  Under a null of no effect at any tau it says "robust" about half the time
  (``study.null_false_alarm``; docs/studies/tau/README.md): read it beside ``study.tau_verdict``'s
  "intervals" rule."""
  from capo_jax.demo import study  # pylint: disable=import-outside-toplevel

  if len(deltas) < len(GRID):
    return "-"
  return study.tau_verdict(deltas, "signs")


def analyse(root: pathlib.Path, design: dict[str, Any]) -> dict[str, Any]:
  from capo_jax.demo import compare  # pylint: disable=import-outside-toplevel

  keep_Q = ws0.selection(root, design["v3"]["band"])
  runs, final = {}, {}
  for (variant, seed), run_dir in ws0.finished_runs(root, "tau").items():
    evals = json.loads((run_dir / "evals.json").read_text())
    h = ws0.heldout_at(run_dir, evals[-1]["step"], keep_Q)
    spread = [r.get("s_spread") for r in ws0.train_rows(run_dir / "metrics.jsonl")]
    spread = np.array([np.nan if v is None else v for v in spread], np.float64)
    runs[(variant, seed)] = h
    final.setdefault(variant, {})[seed] = {
      "accuracy": evals[-1]["accuracy"],
      "auc_mean": evals[-1]["auc_mean"],
      "accuracy_sel": h["accuracy_sel"],
      "auc_mean_sel": h["auc_mean_sel"],
      "s_spread_median": float(np.nanmedian(spread)) if np.isfinite(spread).any() else None,
    }
  paired = {}
  for t in design["grid"]:
    v = f"capo_rtau{t:g}"
    seeds = sorted(s for (u, s) in runs if u == v and (REFERENCE, s) in runs)
    if not seeds:
      continue
    paired[v] = {
      "seeds": seeds,
      "tau_scale": design["variants"][v]["algo.adaptive_tau"],
      "d_accuracy": [final[v][s]["accuracy"] - final[REFERENCE][s]["accuracy"] for s in seeds],
      **{
        where: compare.paired_delta_auc(
          np.stack([runs[(v, s)][key] for s in seeds]),
          np.stack([runs[(REFERENCE, s)][key] for s in seeds]),
          n_boot=design["n_boot"],
        )
        for where, key in (("selected", "auc_sel_Q"), ("all", "auc_Q"))
      },
    }
  # Per-question AUC on the selected questions, so that a later session can pool these
  # seeds with its own (another box gives another warm start: docs/studies/demo_v3/README.md).
  per_question = {
    f"{v}_seed{s}": [None if np.isnan(a) else round(float(a), 4) for a in h["auc_sel_Q"]]
    for (v, s), h in runs.items()
  }
  return {
    "final": final,
    "paired": paired,
    "selected": int(keep_Q.sum()),
    "verdict": verdict([p["selected"] for p in paired.values()]),
    "auc_selected_per_question": per_question,
  }


def tables(res: dict[str, Any]) -> str:
  out = [
    "| variant | tau | seeds | accuracy | AUC-mean | accuracy (sel.) | AUC-mean (sel.) | "
    "median s_spread |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for v in variant_names():
    per = list(res["final"].get(v, {}).values())
    if per:
      tau = "-" if v == REFERENCE else f"{float(v[len('capo_rtau') :]) / PAPER_TAU:.3g} x spread"
      out.append(
        f"| {v} | {tau} | {len(per)} | "
        + " | ".join(
          mean_sd([r[k] for r in per])
          for k in ("accuracy", "auc_mean", "accuracy_sel", "auc_mean_sel", "s_spread_median")
        )
        + " |"
      )
  out += [
    "",
    f"Paired per-question ΔAUC, CAPO minus {REFERENCE}, final step, bootstrap 95% over "
    "seeds and questions; Δ accuracy per seed:",
    "",
    "| tau (paper's scale) | ΔAUC, selected | ΔAUC, all held-out | Δ accuracy |",
    "|---|---|---|---|",
  ]
  for v, p in res["paired"].items():
    iv = lambda d: (
      f"{fmt(d['delta'], True)} [{fmt(d['lo'], True)}, {fmt(d['hi'], True)}]"  # noqa: E731
      f"{t_note(d)} ({d['pairs']} cells)"
    )
    out.append(
      f"| {v[len('capo_rtau') :]} | {iv(p['selected'])} | {iv(p['all'])} | "
      + ", ".join(fmt(d, True) for d in p["d_accuracy"])
      + " |"
    )
  out += ["", f"Verdict (pre-registered rule): **{res['verdict']}**."]
  return "\n".join(out) + "\n"


def plot(root: pathlib.Path, path: str) -> str:
  """Held-out accuracy and AUC-mean, and the training score spread and entropy, against
  the RL step: one line per variant, the mean over its seeds."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  runs = ws0.load_runs(root, "tau")
  panels = (
    ("evals", "accuracy"),
    ("evals", "auc_mean"),
    ("train", "s_spread"),
    ("train", "entropy"),
  )
  fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.0))
  for i, v in enumerate(variant_names()):
    seeds = [r for (u, _), r in runs.items() if u == v]
    for ax, (src, key) in zip(axes, panels):
      ax.set_title(f"{key} ({'held-out' if src == 'evals' else 'training'})", fontsize=8)
      ax.set_xlabel("RL step", fontsize=8)
      curve = ws0.mean_curve(seeds, src, key)
      if curve is not None:
        ax.plot(
          *curve,
          "o-" if src == "evals" else "-",
          ms=3,
          color=f"C{i}",
          lw=1,
          label=f"{v} ({len(seeds)} seed{'s' * (len(seeds) != 1)})",
        )
  axes[0].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def report(root: str, out: str) -> str:
  root_p = pathlib.Path(root)
  design = json.loads((root_p / "tau_design.json").read_text())  # what the runs used
  res = analyse(root_p, design)
  dirs = list(ws0.finished_runs(root_p, "tau").values())
  text = (
    header("Tau study", dirs) + " Warm start 0 of the v3 study, "
    f"{res['selected']} selected questions.\n\n" + tables(res)
  )
  write_report(out, "tau_study", text, {"design": design, "ran_on": ran_on(dirs), **res})
  plot(root_p, os.path.join(out, "tau_study_curves.png"))  # into the folder write_report made
  return text
