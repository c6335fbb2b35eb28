"""The report of the GRPO vs CAPO study (``studies/grpo_vs_capo/run.py``): tables, curves.

Reads every finished run (``<variant>_seed<k>/evals.json``) under the workdir and
writes ``<out>/demo_results.md``, ``demo_results.json`` and ``demo_curves.png``: final
metrics over seeds, the paired per-question ΔAUC against the baseline, AUC-mean at
matched accuracy, the masked fractions, and dynamic sampling at equal wall time.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from capo_jax.demo import compare
from capo_jax.eval import calibration


def load_runs(workdir: str) -> dict[str, dict[int, list[dict[str, float]]]]:
  runs: dict[str, dict[int, list[dict[str, float]]]] = {}
  for variant in compare.VARIANTS:
    for path in sorted(pathlib.Path(workdir).glob(f"{variant}_seed*/evals.json")):
      seed = int(path.parent.name.rsplit("_seed", 1)[1])
      runs.setdefault(variant, {})[seed] = json.loads(path.read_text())
  return runs


def _arrays(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
  with np.load(path) as z:
    return z["s_QG"], z["correct_QG"]


def _final_arrays(
  workdir: str, variant: str, seed: int, evals: list[dict[str, float]]
) -> tuple[np.ndarray, np.ndarray]:
  step = evals[-1]["step"]
  return _arrays(
    pathlib.Path(workdir) / f"{variant}_seed{seed}" / "heldout" / f"step_{step:06d}.npz"
  )


def _mask_fractions(workdir: str, variant: str, seed: int) -> tuple[float, float]:
  """Mean masked fraction among correct and among wrong training samples."""
  rows = [
    json.loads(line)
    for line in (pathlib.Path(workdir) / f"{variant}_seed{seed}" / "metrics.jsonl").open()
  ]
  get = lambda k: (
    float(np.mean([r[k] for r in rows if k in r]))
    if any(  # noqa: E731
      k in r for r in rows
    )
    else float("nan")
  )
  return get("masked_frac_correct"), get("masked_frac_wrong")


def _train_seconds(workdir: str, variant: str, seed: int, steps: list[int]) -> list[float]:
  """The run's cumulative RL step time (evaluations excluded) at each of ``steps``."""
  rows = [
    json.loads(line)
    for line in (pathlib.Path(workdir) / f"{variant}_seed{seed}" / "metrics.jsonl").open()
  ]
  # The evaluations are rows of their own (eval/* only, at the same step): skip them.
  rows = [r for r in rows if "time_step" in r]
  t = dict(zip([r["step"] for r in rows], np.cumsum([r["time_step"] for r in rows])))
  return [0.0 if k == 0 else float(t.get(k, np.nan)) for k in steps]


def equal_wall_time(
  workdir: str, runs: dict[str, dict[int, list[dict[str, float]]]]
) -> list[dict[str, Any]]:
  """Each ``<v>_dyn`` run (dynamic sampling) against ``<v>`` of the same seed, both
  read at the shorter run's total RL time (linear between evaluations)."""
  out = []
  for variant in [v for v in runs if v.endswith("_dyn") and v[:-4] in runs]:
    base = variant[:-4]
    for seed in sorted(set(runs[variant]) & set(runs[base])):
      curves = {
        v: (runs[v][seed], _train_seconds(workdir, v, seed, [e["step"] for e in runs[v][seed]]))
        for v in (variant, base)
      }
      t = min(ts[-1] for _, ts in curves.values())
      row = {"variant": variant, "seed": seed, "seconds": t}
      for v, (evals, ts) in curves.items():
        for k in ("accuracy", "auc_mean"):
          row[f"{'dyn' if v == variant else 'base'}_{k}"] = compare.value_at(
            ts, [e[k] for e in evals], t
          )
      out.append(row)
  return out


COLUMNS = ("accuracy", "auc_mean", "pooled_auc", "aurc", "auc_hard", "entropy", "rule_share")


def analyse(workdir: str, baseline: str = "grpo") -> dict[str, Any]:
  """Per variant: final metrics (mean, sd over seeds), the paired ΔAUC against
  ``baseline`` on the seeds both have, AUC-mean at matched accuracy, mask fractions."""
  runs = load_runs(workdir)
  if not runs:
    raise SystemExit(f"no finished runs (evals.json) under {workdir}")
  s0, c0 = _arrays(pathlib.Path(workdir) / "warm_start_heldout.npz")
  bucket_Q, labels = compare.difficulty_buckets(c0)
  warm = compare.summary(s0, c0, bucket_Q, len(labels))
  start = next(iter(next(iter(runs.values())).values()))[0]
  warm_row = {**{k: start.get(k, float("nan")) for k in COLUMNS}, "auc_hard": warm["buckets"][0][0]}
  per: dict[str, dict[int, dict[str, Any]]] = {}
  for variant, by_seed in runs.items():
    for seed, evals in by_seed.items():
      s, c = _final_arrays(workdir, variant, seed, evals)
      summ = compare.summary(s, c, bucket_Q, len(labels))
      per.setdefault(variant, {})[seed] = dict(
        **{k: evals[-1].get(k, float("nan")) for k in COLUMNS if k != "auc_hard"},
        auc_hard=summ["buckets"][0][0],
        buckets=[b[0] for b in summ["buckets"]],
        auc_Q=calibration.auc_per_question(s, c),
        peak_auc=max(e["auc_mean"] for e in evals),
        mask=_mask_fractions(workdir, variant, seed),
        evals=evals,
      )
  out: dict[str, Any] = {
    "labels": labels,
    "warm_start": warm_row,
    "warm_buckets": [b[0] for b in warm["buckets"]],
    "variants": {},
  }
  base = per.get(baseline, {})
  for variant, by_seed in per.items():
    row: dict[str, Any] = {"seeds": sorted(by_seed)}
    for k in COLUMNS + ("peak_auc",):
      vals = np.array([r[k] for r in by_seed.values()], float)
      sd = float(np.nanstd(vals, ddof=1)) if np.isfinite(vals).sum() > 1 else float("nan")
      row[k], row[k + "_sd"] = float(np.nanmean(vals)), sd  # sample sd over seeds
    row["buckets"] = np.nanmean([r["buckets"] for r in by_seed.values()], 0).tolist()
    row["masked_correct"], row["masked_wrong"] = np.nanmean(
      [r["mask"] for r in by_seed.values()], 0
    ).tolist()
    shared = sorted(set(by_seed) & set(base))
    if variant != baseline and shared:
      row["paired"] = compare.paired_delta_auc(
        np.stack([by_seed[k]["auc_Q"] for k in shared]),
        np.stack([base[k]["auc_Q"] for k in shared]),
      )
      # AUC-mean of both where each first reaches the lower of their final accuracies.
      gaps = []
      for k in shared:
        target = min(by_seed[k]["evals"][-1]["accuracy"], base[k]["evals"][-1]["accuracy"])
        gaps.append(
          compare.value_at_accuracy(by_seed[k]["evals"], target, "auc_mean")
          - compare.value_at_accuracy(base[k]["evals"], target, "auc_mean")
        )
      row["matched_delta_auc"] = float(np.nanmean(gaps))
    out["variants"][variant] = row
  return out


def _table(res: dict[str, Any], baseline: str) -> str:
  head = [
    "variant",
    "seeds",
    *COLUMNS,
    "peak AUC",
    f"ΔAUC vs {baseline} [95%]",
    "ΔAUC at matched acc.",
    "masked (correct / wrong)",
  ]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  w = res["warm_start"]
  lines.append("| warm start | - | " + " | ".join(_f(w[k]) for k in COLUMNS) + " | - | - | - | - |")
  for variant, r in res["variants"].items():
    p = r.get("paired")
    paired = f"{p['delta']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]" if p else "-"
    matched = f"{r['matched_delta_auc']:+.3f}" if "matched_delta_auc" in r else "-"
    lines.append(
      f"| {variant} | {len(r['seeds'])} | "
      + " | ".join(f"{_f(r[k])} ± {_f(r[k + '_sd'])}" for k in COLUMNS)
      + f" | {_f(r['peak_auc'])} | "
      f"{paired} | {matched} | {_f(r['masked_correct'])} / {_f(r['masked_wrong'])} |"
    )
  buckets = [
    "| AUC-mean by warm-start accuracy | " + " | ".join(res["labels"]) + " |",
    "|---|" + "---|" * len(res["labels"]),
    "| warm start | " + " | ".join(_f(v) for v in res["warm_buckets"]) + " |",
  ]
  for variant, r in res["variants"].items():
    buckets.append(f"| {variant} | " + " | ".join(_f(v) for v in r["buckets"]) + " |")
  return "\n".join(lines) + "\n\n" + "\n".join(buckets)


def _f(v: Any) -> str:
  return "nan" if v is None or not np.isfinite(v) else f"{v:.3f}"


def report(workdir: str, out: str, baseline: str = "grpo", plot: str = "") -> str:
  """Writes the tables and ``demo_curves.png`` to ``out``; returns the tables.

  ``plot``: comma list of the variants the figure shows (mean over seeds, min-max
  band); empty: those run with the most seeds (with a dozen single-seed variants in
  one panel the lines cannot be told apart).
  """
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  res = analyse(workdir, baseline)
  runs = load_runs(workdir)
  os.makedirs(out, exist_ok=True)
  table = _table(res, baseline)
  keys = ("accuracy", "auc_mean", "auc_mostly_wrong", "entropy")
  fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4))
  most = max(len(by_seed) for by_seed in runs.values())
  shown = (
    [v for v in plot.split(",") if v in runs]
    if plot
    else [v for v, by_seed in runs.items() if len(by_seed) == most]
  )
  for variant in shown:
    by_seed = runs[variant]
    steps = [e["step"] for e in next(iter(by_seed.values()))]
    for ax, m in zip(axes, keys):
      curves = np.array(
        [
          [np.nan if e.get(m) is None else e[m] for e in ev]
          for ev in by_seed.values()
          if len(ev) == len(steps)
        ],
        float,
      )
      (line,) = ax.plot(steps, np.nanmean(curves, 0), "o-", label=variant)
      ax.fill_between(
        steps, np.nanmin(curves, 0), np.nanmax(curves, 0), color=line.get_color(), alpha=0.15
      )
      ax.set_title(m)
      ax.set_xlabel("RL step")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "demo_curves.png"), dpi=110)
  plt.close(fig)
  wall = equal_wall_time(workdir, runs)
  if wall:
    table += (
      "\n\nDynamic sampling at equal RL wall time (evaluations excluded), each "
      "against the same variant without it, same seed:\n\n"
      "| variant | seed | seconds | accuracy (dyn / without) | AUC-mean (dyn / without) |"
      "\n|---|---|---|---|---|\n"
      + "\n".join(
        f"| {w['variant']} | {w['seed']} | {w['seconds']:.0f} | "
        f"{_f(w['dyn_accuracy'])} / {_f(w['base_accuracy'])} | "
        f"{_f(w['dyn_auc_mean'])} / {_f(w['base_auc_mean'])} |"
        for w in wall
      )
    )
  with open(os.path.join(out, "demo_results.md"), "w", encoding="utf-8") as f:
    f.write(
      "Final step, mean ± sd over seeds; ΔAUC paired per question (same questions, same "
      "evaluation seed) over questions mixed under both, bootstrap 95% interval over "
      "questions and seeds; auc_hard = AUC-mean on questions the warm start gets right "
      "at most 1/4 of the time.\n\n" + table + "\n"
    )
  slim = {v: {k: x for k, x in r.items()} for v, r in res["variants"].items()}
  with open(os.path.join(out, "demo_results.json"), "w", encoding="utf-8") as f:
    json.dump(
      {"summary": {**res, "variants": slim}, "equal_wall_time": wall, "runs": runs}, f, indent=1
    )
  return table
