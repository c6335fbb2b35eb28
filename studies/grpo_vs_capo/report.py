r"""GRPO vs CAPO (and the paper's two ablations) on the demo task, several seeds.

  python -m benchmarks.demo_grpo_vs_capo --workdir=/tmp/capo_bench          # all runs + report
  python -m benchmarks.demo_grpo_vs_capo --workdir=/tmp/capo_bench --runs=capo_seed0,grpo_seed0
  python -m benchmarks.demo_grpo_vs_capo --workdir=/tmp/capo_bench --report_only

Every run starts from the same cached warm start (configs/demo.py) and
evaluates held-out accuracy, AUC-mean, pooled AUC, AUC on mostly-wrong
questions and policy entropy every ``eval.every_steps``. Variants:

  capo         CAPO with the noise mask (the method)
  grpo         GRPO (no mask)
  capo_nomask  ablation: CAPO without the noise mask
  grpo_mask    ablation: GRPO with CAPO's noise mask

Runs are resumable (each is an ordinary RL workdir) and can be split over
processes with ``--runs``; ``--report_only`` aggregates what exists into
``<out>/demo_results.md``, ``demo_results.json`` and ``demo_curves.png``.
The claim under test (ISSUE 8): GRPO's AUC-mean falls or rises less while
CAPO's rises, with CAPO's accuracy within 2 points of GRPO's or better.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported (capo_jax/hugepages.py), as the launcher
  from capo_jax import hugepages
  hugepages.reexec_with_hugepages()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import json
import os
import pathlib
from typing import Any

import numpy as np

from capo_jax.demo import compare
from capo_jax.eval import calibration
from capo_jax.runtime import compile_cache

REPO = pathlib.Path(__file__).resolve().parent.parent

VARIANTS = compare.VARIANTS
STUDY_STEPS, STUDY_EVAL_EVERY = 150, 50
METRICS = ("accuracy", "auc_mean", "pooled_auc", "auc_mostly_wrong", "entropy")


def make_spec(variant: str, seed: int, overrides: list[str]):
  """The run spec of one study run: the demo config, the variant, the study's steps."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from configs import demo  # pylint: disable=import-outside-toplevel
  c = demo.get_config()
  c.seed = seed
  for key, value in VARIANTS[variant].items():
    section, leaf = key.split(".")
    c[section][leaf] = value
  c.train.num_steps = STUDY_STEPS
  c.eval.every_steps = STUDY_EVAL_EVERY
  for kv in overrides:  # last: --set may change the study's steps too
    key, value = kv.split("=", 1)
    *path, leaf = key.split(".")
    node = c
    for part in path:
      node = node[part]
    node[leaf] = type(node[leaf])(value)
  return demo_run.spec_of(c)


def run_all(args: argparse.Namespace) -> None:
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  names = args.runs.split(",") if args.runs else [
      f"{v}_seed{s}" for s in args.seeds for v in args.variants]
  # <workdir>/jax_cache (configs/demo.py): a run finds the programs an earlier run of
  # the same shapes compiled (every seed of a variant; the variants of one loss).
  compile_cache.enable(make_spec("capo", 0, args.set).compilation_cache_dir, args.workdir)
  ws = demo_run.get_warm_start(make_spec("capo", 0, args.set), args.workdir)
  print(f"warm start: {ws.info.get('path')} ({'trained' if ws.info.get('trained') else 'cached'})")
  # The warm start's held-out eval is the same for every run: computed once, cached.
  initial = demo_run.warm_start_eval(make_spec("capo", 0, args.set), args.workdir, ws)
  for name in names:
    variant, seed = name.rsplit("_seed", 1)
    print(f"=== {name}", flush=True)
    demo_run.run_rl(make_spec(variant, int(seed), args.set), args.workdir, ws, run_name=name,
                    initial_eval=initial)


def load_runs(workdir: str) -> dict[str, dict[int, list[dict[str, float]]]]:
  runs: dict[str, dict[int, list[dict[str, float]]]] = {}
  for variant in VARIANTS:
    for path in sorted(pathlib.Path(workdir).glob(f"{variant}_seed*/evals.json")):
      seed = int(path.parent.name.rsplit("_seed", 1)[1])
      runs.setdefault(variant, {})[seed] = json.loads(path.read_text())
  return runs


def _arrays(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
  with np.load(path) as z:
    return z["s_QG"], z["correct_QG"]


def _final_arrays(workdir: str, variant: str, seed: int, evals: list[dict[str, float]]
                  ) -> tuple[np.ndarray, np.ndarray]:
  step = evals[-1]["step"]
  return _arrays(pathlib.Path(workdir) / f"{variant}_seed{seed}" / "heldout" /
                 f"step_{step:06d}.npz")


def _mask_fractions(workdir: str, variant: str, seed: int) -> tuple[float, float]:
  """Mean masked fraction among correct and among wrong training samples."""
  rows = [json.loads(line) for line in
          (pathlib.Path(workdir) / f"{variant}_seed{seed}" / "metrics.jsonl").open()]
  get = lambda k: float(np.mean([r[k] for r in rows if k in r])) if any(  # noqa: E731
      k in r for r in rows) else float("nan")
  return get("masked_frac_correct"), get("masked_frac_wrong")


def _train_seconds(workdir: str, variant: str, seed: int, steps: list[int]) -> list[float]:
  """The run's cumulative RL step time (evaluations excluded) at each of ``steps``."""
  rows = [json.loads(line) for line in
          (pathlib.Path(workdir) / f"{variant}_seed{seed}" / "metrics.jsonl").open()]
  # The evaluations are rows of their own (eval/* only, at the same step): skip them.
  rows = [r for r in rows if "time_step" in r]
  t = dict(zip([r["step"] for r in rows], np.cumsum([r["time_step"] for r in rows])))
  return [0.0 if k == 0 else float(t.get(k, np.nan)) for k in steps]


def equal_wall_time(workdir: str, runs: dict[str, dict[int, list[dict[str, float]]]]
                    ) -> list[dict[str, Any]]:
  """Each ``<v>_dyn`` run (dynamic sampling) against ``<v>`` of the same seed, both
  read at the shorter run's total RL time (linear between evaluations)."""
  out = []
  for variant in [v for v in runs if v.endswith("_dyn") and v[:-4] in runs]:
    base = variant[:-4]
    for seed in sorted(set(runs[variant]) & set(runs[base])):
      curves = {v: (runs[v][seed], _train_seconds(workdir, v, seed,
                                                  [e["step"] for e in runs[v][seed]]))
                for v in (variant, base)}
      t = min(ts[-1] for _, ts in curves.values())
      row = {"variant": variant, "seed": seed, "seconds": t}
      for v, (evals, ts) in curves.items():
        for k in ("accuracy", "auc_mean"):
          row[f"{'dyn' if v == variant else 'base'}_{k}"] = compare.value_at(
              ts, [e[k] for e in evals], t)
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
          auc_hard=summ["buckets"][0][0], buckets=[b[0] for b in summ["buckets"]],
          auc_Q=calibration.auc_per_question(s, c),
          peak_auc=max(e["auc_mean"] for e in evals),
          mask=_mask_fractions(workdir, variant, seed), evals=evals)
  out: dict[str, Any] = {"labels": labels, "warm_start": warm_row,
                         "warm_buckets": [b[0] for b in warm["buckets"]], "variants": {}}
  base = per.get(baseline, {})
  for variant, by_seed in per.items():
    row: dict[str, Any] = {"seeds": sorted(by_seed)}
    for k in COLUMNS + ("peak_auc",):
      vals = np.array([r[k] for r in by_seed.values()], float)
      row[k], row[k + "_sd"] = float(np.nanmean(vals)), float(np.nanstd(vals))
    row["buckets"] = np.nanmean([r["buckets"] for r in by_seed.values()], 0).tolist()
    row["masked_correct"], row["masked_wrong"] = np.nanmean(
        [r["mask"] for r in by_seed.values()], 0).tolist()
    shared = sorted(set(by_seed) & set(base))
    if variant != baseline and shared:
      row["paired"] = compare.paired_delta_auc(
          np.stack([by_seed[k]["auc_Q"] for k in shared]),
          np.stack([base[k]["auc_Q"] for k in shared]))
      # AUC-mean of both where each first reaches the lower of their final accuracies.
      gaps = []
      for k in shared:
        target = min(by_seed[k]["evals"][-1]["accuracy"], base[k]["evals"][-1]["accuracy"])
        gaps.append(compare.value_at_accuracy(by_seed[k]["evals"], target, "auc_mean")
                    - compare.value_at_accuracy(base[k]["evals"], target, "auc_mean"))
      row["matched_delta_auc"] = float(np.nanmean(gaps))
    out["variants"][variant] = row
  return out


def _table(res: dict[str, Any], baseline: str) -> str:
  head = ["variant", "seeds", *COLUMNS, "peak AUC", f"ΔAUC vs {baseline} [95%]",
          "ΔAUC at matched acc.", "masked (correct / wrong)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  w = res["warm_start"]
  lines.append("| warm start | - | " + " | ".join(_f(w[k]) for k in COLUMNS)
               + " | - | - | - | - |")
  for variant, r in res["variants"].items():
    p = r.get("paired")
    paired = (f"{p['delta']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]" if p else "-")
    matched = f"{r['matched_delta_auc']:+.3f}" if "matched_delta_auc" in r else "-"
    lines.append(f"| {variant} | {len(r['seeds'])} | " + " | ".join(
        f"{_f(r[k])} ± {_f(r[k + '_sd'])}" for k in COLUMNS) + f" | {_f(r['peak_auc'])} | "
        f"{paired} | {matched} | {_f(r['masked_correct'])} / {_f(r['masked_wrong'])} |")
  buckets = ["| AUC-mean by warm-start accuracy | " + " | ".join(res["labels"]) + " |",
             "|---|" + "---|" * len(res["labels"]),
             "| warm start | " + " | ".join(_f(v) for v in res["warm_buckets"]) + " |"]
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
  shown = [v for v in plot.split(",") if v in runs] if plot else \
      [v for v, by_seed in runs.items() if len(by_seed) == most]
  for variant in shown:
    by_seed = runs[variant]
    steps = [e["step"] for e in next(iter(by_seed.values()))]
    for ax, m in zip(axes, keys):
      curves = np.array([[np.nan if e.get(m) is None else e[m] for e in ev]
                         for ev in by_seed.values() if len(ev) == len(steps)], float)
      line, = ax.plot(steps, np.nanmean(curves, 0), "o-", label=variant)
      ax.fill_between(steps, np.nanmin(curves, 0), np.nanmax(curves, 0),
                      color=line.get_color(), alpha=0.15)
      ax.set_title(m)
      ax.set_xlabel("RL step")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "demo_curves.png"), dpi=110)
  plt.close(fig)
  wall = equal_wall_time(workdir, runs)
  if wall:
    table += ("\n\nDynamic sampling at equal RL wall time (evaluations excluded), each "
              "against the same variant without it, same seed:\n\n"
              "| variant | seed | seconds | accuracy (dyn / without) | AUC-mean (dyn / without) |"
              "\n|---|---|---|---|---|\n" + "\n".join(
                  f"| {w['variant']} | {w['seed']} | {w['seconds']:.0f} | "
                  f"{_f(w['dyn_accuracy'])} / {_f(w['base_accuracy'])} | "
                  f"{_f(w['dyn_auc_mean'])} / {_f(w['base_auc_mean'])} |" for w in wall))
  with open(os.path.join(out, "demo_results.md"), "w", encoding="utf-8") as f:
    f.write("Final step, mean ± sd over seeds; ΔAUC paired per question (same questions, same "
            "evaluation seed) over questions mixed under both, bootstrap 95% interval over "
            "questions and seeds; auc_hard = AUC-mean on questions the warm start gets right "
            "at most 1/4 of the time.\n\n" + table + "\n")
  slim = {v: {k: x for k, x in r.items()} for v, r in res["variants"].items()}
  with open(os.path.join(out, "demo_results.json"), "w", encoding="utf-8") as f:
    json.dump({"summary": {**res, "variants": slim}, "equal_wall_time": wall, "runs": runs}, f,
              indent=1)
  return table


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default="/tmp/capo_demo_bench")
  p.add_argument("--out", default=str(REPO / "docs" / "demo"))
  p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
  p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
  p.add_argument("--runs", default="", help="comma list of <variant>_seed<k> to run")
  p.add_argument("--set", action="append", default=[],
                 help="config override section.field=value (e.g. train.num_steps=100)")
  p.add_argument("--baseline", default="grpo", help="the variant ΔAUC is paired against")
  p.add_argument("--report_only", action="store_true")
  p.add_argument("--plot", default="", help="comma list of variants in the figure "
                 "(default: those with the most seeds)")
  args = p.parse_args()
  if not args.report_only:
    run_all(args)
  print(report(args.workdir, args.out, args.baseline, args.plot))


if __name__ == "__main__":
  main()
