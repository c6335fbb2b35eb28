"""The report of the mask study (``studies/mask/run.py``): tables, paired ΔAUC, curves.

Reads what has finished under ``<root>/ws0/mask/`` and writes ``mask_study.md``,
``mask_study.json`` and ``mask_study_curves.png``. Held-out numbers come from the
runs' per-sample files (``heldout/step_*.npz``), training ones (policy entropy,
masked fractions) from their ``metrics.jsonl``; the decision rule of
docs/studies/mask/README.md is ``verdict``.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from capo_jax.demo import compare
from capo_jax.eval.paired import t_note
from studies import ws0
from studies.mask.design import METHODS, NOISES
from studies.records import fmt, header, mean_sd, ran_on, write_report

TAIL = 10  # training metrics are read as the mean over the first / last TAIL RL steps
TRAIN_KEYS = ("entropy", "masked_frac_wrong", "masked_frac_correct")


def _train_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
  out = {}
  for k in TRAIN_KEYS:
    v = np.array([ws0.as_float(r.get(k)) for r in rows], np.float64)
    out[f"{k}_first"] = float(np.nanmean(v[:TAIL])) if np.isfinite(v[:TAIL]).any() else np.nan
    out[f"{k}_last"] = float(np.nanmean(v[-TAIL:])) if np.isfinite(v[-TAIL:]).any() else np.nan
    out[f"{k}_mean"] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
  return out


def verdict(paired: dict[str, Any], n_seeds: int) -> dict[str, str]:
  """The pre-registered reading of one (noise, mask vs no mask) comparison.

  Calibration: "helps" when the ΔAUC interval on the selected questions lies above 0,
  "hurts" below, else "inconclusive". The paper's claim (without the mask, entropy
  grows and accuracy stalls): "reproduced" when in every seed the unmasked run ends
  with the higher training entropy and the lower held-out accuracy, "contradicted"
  when every seed shows neither, else "mixed"; "-" without paired seeds. The rule is
  over the design's ``n_seeds``: with fewer paired seeds finished, both readings say
  so ("... (1 of 3 seeds)"), so a partial study is never read as the verdict.
  """
  d = paired["selected"]
  calib = (
    "inconclusive"
    if not np.isfinite(d["lo"]) or d["lo"] <= 0 <= d["hi"]
    else "helps"
    if d["lo"] > 0
    else "hurts"
  )
  seeds = paired["per_seed"]
  claim = [s["d_entropy"] < 0 and s["d_accuracy"] > 0 for s in seeds]  # mask minus no mask
  against = [s["d_entropy"] >= 0 and s["d_accuracy"] <= 0 for s in seeds]
  paper = (
    "-"
    if not seeds
    else "reproduced"
    if all(claim)
    else "contradicted"
    if all(against)
    else "mixed"
  )
  if seeds and len(seeds) < n_seeds:
    partial = f" ({len(seeds)} of {n_seeds} seeds)"
    calib, paper = calib + partial, paper + partial
  return {"calibration": calib, "paper_claim": paper}


def analyse(root: pathlib.Path, design: dict[str, Any]) -> dict[str, Any]:
  runs = ws0.load_runs(root, "mask")
  ws_dir = root / "ws0"
  keep_Q = ws0.selection(root, design["v3"]["band"])
  warm = json.loads((ws_dir / "warm_start_eval.json").read_text())
  res: dict[str, Any] = {
    "warm_start": {
      "accuracy": warm["accuracy"],
      "auc_mean": warm["auc_mean"],
      "selected": int(keep_Q.sum()),
    },
    "thresholds": [
      json.loads(p.read_text()) for p in sorted(ws_dir.glob("mask_thresholds_q*.json"))
    ],
    "final": {},
    "paired": {},
  }
  auc: dict[tuple[str, int], dict[str, Any]] = {}
  for (variant, seed), run in runs.items():
    last = run["evals"][-1]
    auc[(variant, seed)] = h = ws0.heldout_at(run["dir"], last["step"], keep_Q)
    res["final"].setdefault(variant, {})[seed] = {
      "step": last["step"],
      "accuracy": last["accuracy"],
      "auc_mean": last["auc_mean"],
      "auc_questions": last["auc_questions"],
      "entropy_heldout": last["entropy"],
      "accuracy_sel": h["accuracy_sel"],
      "auc_mean_sel": h["auc_mean_sel"],
      **_train_summary(run["train"]),
    }
  for noise in NOISES:
    for a, b in (design["primary"], design["secondary"]):
      va, vb = f"{a}_{noise}", f"{b}_{noise}"
      seeds = sorted(s for v, s in auc if v == va and (vb, s) in auc)
      if not seeds:
        continue
      fa, fb = res["final"][va], res["final"][vb]
      p = {
        "seeds": seeds,
        **{
          where: compare.paired_delta_auc(
            np.stack([auc[(va, s)][key] for s in seeds]),
            np.stack([auc[(vb, s)][key] for s in seeds]),
            n_boot=design["n_boot"],
          )
          for where, key in (("selected", "auc_sel_Q"), ("all", "auc_Q"))
        },
        "per_seed": [
          {
            "seed": s,
            "d_accuracy": fa[s]["accuracy"] - fb[s]["accuracy"],
            "d_entropy": fa[s]["entropy_last"] - fb[s]["entropy_last"],
          }
          for s in seeds
        ],
      }
      p["verdict"] = verdict(p, len(design["seeds"]))
      res["paired"][f"{va} - {vb}"] = p
  return res


def _interval(d: dict[str, Any]) -> str:
  return (
    f"{fmt(d['delta'], True)} [{fmt(d['lo'], True)}, {fmt(d['hi'], True)}]"
    f"{t_note(d)} ({d['pairs']} cells)"
  )


def tables(res: dict[str, Any]) -> str:
  out = []
  for t in res["thresholds"]:
    q = t["key"]["quantiles"]
    out.append(
      f"Mask thresholds on the warm start's {t['samples']} samples of "
      f"{t['key']['questions']} training questions (accuracy {fmt(t['accuracy'])}): "
      f"at quantiles ({q[0]:g}, {q[1]:g}) low {t['low']:.4f}, high {t['high']:.4f}, "
      f"masking {fmt(t['masked']['wrong'])} of the wrong and "
      f"{fmt(t['masked']['right'])} of the correct samples; the paper's thresholds "
      f"mask {fmt(t['paper_masked']['wrong'])} and {fmt(t['paper_masked']['right'])}."
    )
  # AUC-mean is a mean over the questions with right and wrong samples: a collapsed run
  # has few, so its AUC-mean says little; the count is printed beside it.
  head = [
    "variant",
    "seeds",
    "accuracy",
    "AUC-mean",
    "over questions",
    "accuracy (sel.)",
    "AUC-mean (sel.)",
    "held-out entropy",
    f"train entropy (first / last {TAIL})",
    "masked of wrong",
    "masked of right",
  ]
  for noise in NOISES:
    out.append(
      f"\n**{'10% random flips' if noise == 'noise' else 'structured false negatives'}"
      f"** (final step, mean ± sd over seeds; masked: mean over the run's steps)\n"
    )
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in METHODS:
      per = list(res["final"].get(f"{m}_{noise}", {}).values())
      if not per:
        continue
      ms = lambda k: mean_sd([r[k] for r in per])  # noqa: E731
      out.append(
        f"| {m}_{noise} | {len(per)} | "
        + " | ".join(
          [
            ms("accuracy"),
            ms("auc_mean"),
            " / ".join(f"{r['auc_questions']:.0f}" for r in per),
            ms("accuracy_sel"),
            ms("auc_mean_sel"),
            ms("entropy_heldout"),
            f"{ms('entropy_first')} / {ms('entropy_last')}",
            ms("masked_frac_wrong_mean"),
            ms("masked_frac_correct_mean"),
          ]
        )
        + " |"
      )
  out.append(
    "\nPaired per-question ΔAUC (mask minus no mask) at the final step, bootstrap "
    "95% over seeds and questions; Δ accuracy and Δ train entropy (last "
    f"{TAIL} steps) per seed:\n"
  )
  out += [
    "| pair | ΔAUC, selected | ΔAUC, all held-out | Δ accuracy | Δ train entropy "
    "| calibration | paper's claim |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, p in res["paired"].items():
    per = p["per_seed"]
    out.append(
      f"| {name} | {_interval(p['selected'])} | {_interval(p['all'])} | "
      + ", ".join(fmt(s["d_accuracy"], True) for s in per)
      + " | "
      + ", ".join(fmt(s["d_entropy"], True) for s in per)
      + f" | {p['verdict']['calibration']} | {p['verdict']['paper_claim']} |"
    )
  return "\n".join(out) + "\n"


def plot(root: pathlib.Path, path: str) -> str:
  """Per noise (rows): held-out accuracy and AUC-mean, training entropy and masked
  fractions against the RL step, one line per variant (mean over seeds)."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  runs = ws0.load_runs(root, "mask")
  panels = (
    ("evals", "accuracy"),
    ("evals", "auc_mean"),
    ("train", "entropy"),
    ("train", "masked_frac_wrong"),
    ("train", "masked_frac_correct"),
  )
  fig, axes = plt.subplots(
    len(NOISES), len(panels), figsize=(3.3 * len(panels), 5.6), squeeze=False
  )
  for row, noise in enumerate(NOISES):
    for i, m in enumerate(METHODS):
      seeds = [r for (v, _), r in runs.items() if v == f"{m}_{noise}"]
      for ax, (src, key) in zip(axes[row], panels):
        ax.set_title(f"{key} ({noise})", fontsize=8)
        curve = ws0.mean_curve(seeds, src, key)
        if curve is not None:
          ax.plot(*curve, "-", color=f"C{i}", lw=1, label=m)
    axes[row][0].legend(fontsize=6)
  for ax in axes[-1]:
    ax.set_xlabel("RL step")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def report(root: str, out: str) -> str:
  root_p = pathlib.Path(root)
  design = json.loads((root_p / "mask_design.json").read_text())  # what the runs used
  res = analyse(root_p, design)
  w = res["warm_start"]
  dirs = list(ws0.finished_runs(root_p, "mask").values())
  text = (
    header("Mask study", dirs) + " Warm start 0 of the v3 study: held-out "
    f"accuracy {fmt(w['accuracy'])}, AUC-mean {fmt(w['auc_mean'])}, "
    f"{w['selected']} selected questions.\n\n" + tables(res)
  )
  write_report(out, "mask_study", text, {"design": design, "ran_on": ran_on(dirs), **res})
  plot(root_p, os.path.join(out, "mask_study_curves.png"))
  return text
