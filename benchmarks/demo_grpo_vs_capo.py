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

import argparse
import json
import os
import pathlib

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent

_CAPO = {"algo.name": "capo", "algo.mask": "on"}
_GRPO = {"algo.name": "grpo", "algo.mask": "off"}
VARIANTS = {
    "capo": _CAPO,
    "grpo": _GRPO,
    # Controls: which part of CAPO does the work, its logistic weights or GRPO's 1/std.
    "dr_grpo": {"algo.name": "dr_grpo", "algo.mask": "off"},
    "capo_tau10": {**_CAPO, "algo.tau": 10.0},  # large tau: Dr.GRPO up to a constant
    "capo_adapt0.5": {**_CAPO, "algo.adaptive_tau": 0.5},
    "capo_adapt1": {**_CAPO, "algo.adaptive_tau": 1.0},
    "capo_adapt2": {**_CAPO, "algo.adaptive_tau": 2.0},
    # Learning-rate sweep (x the default 1e-4).
    "grpo_lr0.5": {**_GRPO, "optim.lr": 5e-5},
    "grpo_lr2": {**_GRPO, "optim.lr": 2e-4},
    "capo_lr0.5": {**_CAPO, "optim.lr": 5e-5},
    "capo_lr2": {**_CAPO, "optim.lr": 2e-4},
    # The mask: ablations, and a verifier that flips 10% of the training rewards.
    "capo_nomask": {"algo.name": "capo", "algo.mask": "off"},
    "grpo_mask": {"algo.name": "grpo", "algo.mask": "on"},
    "grpo_noise": {**_GRPO, "demo.reward_flip": 0.1},
    "capo_noise": {**_CAPO, "demo.reward_flip": 0.1},
    "capo_nomask_noise": {"algo.name": "capo", "algo.mask": "off", "demo.reward_flip": 0.1},
}
STUDY_STEPS, STUDY_EVAL_EVERY = 150, 50
METRICS = ("accuracy", "auc_mean", "pooled_auc", "auc_mostly_wrong", "entropy")


def make_config(variant: str, seed: int, overrides: list[str]):
  from configs import demo  # pylint: disable=import-outside-toplevel
  c = demo.get_config()
  c.seed = seed
  for key, value in VARIANTS[variant].items():
    section, leaf = key.split(".")
    c[section][leaf] = value
  c.train.num_steps = STUDY_STEPS
  c.eval.every_steps = STUDY_EVAL_EVERY
  for kv in overrides:  # again: --set may change the study's steps too
    key, value = kv.split("=", 1)
    section, leaf = key.split(".")
    c[section][leaf] = type(c[section][leaf])(value)
  return c


def run_all(args: argparse.Namespace) -> None:
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  names = args.runs.split(",") if args.runs else [
      f"{v}_seed{s}" for s in args.seeds for v in args.variants]
  ws = demo_run.get_warm_start(make_config("capo", 0, args.set), args.workdir)
  print(f"warm start: {ws.info.get('path')} ({'trained' if ws.info.get('trained') else 'cached'})")
  # The warm start's held-out eval is the same for every run: compute it once.
  initial_path = os.path.join(args.workdir, "warm_start_eval.json")
  if os.path.exists(initial_path):
    initial = json.loads(pathlib.Path(initial_path).read_text())
  else:
    c0 = make_config("capo", 0, args.set)
    from capo_jax.demo import task as task_lib  # pylint: disable=import-outside-toplevel
    heldout = task_lib.make_splits(demo_run.task_config(c0))[1][:c0.demo.eval_questions]
    initial = demo_run.heldout_metrics(
        ws, ws.params, heldout, c0.demo.eval_samples, c0.demo.eval_seed,
        save_to=os.path.join(args.workdir, "warm_start_heldout.npz"))
    pathlib.Path(initial_path).write_text(json.dumps(initial))
  for name in names:
    variant, seed = name.rsplit("_seed", 1)
    print(f"=== {name}", flush=True)
    demo_run.run_rl(make_config(variant, int(seed), args.set), args.workdir, ws, run_name=name,
                    initial_eval=initial)


def load_runs(workdir: str) -> dict[str, dict[int, list[dict[str, float]]]]:
  runs: dict[str, dict[int, list[dict[str, float]]]] = {}
  for variant in VARIANTS:
    for path in sorted(pathlib.Path(workdir).glob(f"{variant}_seed*/evals.json")):
      seed = int(path.parent.name.rsplit("_seed", 1)[1])
      runs.setdefault(variant, {})[seed] = json.loads(path.read_text())
  return runs


def _final(evals: list[dict[str, float]], key: str, last: int) -> float:
  """Mean of a metric over the last ``last`` evaluations (eval noise is ~+-0.04)."""
  vals = [e[key] for e in evals[-last:] if e.get(key) is not None]
  return float(np.nanmean(vals)) if vals else float("nan")


def report(workdir: str, out: str, last: int) -> str:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  runs = load_runs(workdir)
  if not runs:
    raise SystemExit(f"no finished runs (evals.json) under {workdir}")
  os.makedirs(out, exist_ok=True)
  summary: dict[str, dict[str, float]] = {}
  start = next(iter(next(iter(runs.values())).values()))[0]
  lines = ["| variant | seeds | " + " | ".join(METRICS) + " |",
           "|---|---|" + "---|" * len(METRICS),
           "| warm start | - | " + " | ".join(f"{start.get(m, float('nan')):.3f}"
                                              for m in METRICS) + " |"]
  for variant, by_seed in runs.items():
    row = {}
    for m in METRICS:
      vals = np.array([_final(ev, m, last) for ev in by_seed.values()])
      row[m], row[m + "_sd"] = float(np.nanmean(vals)), float(np.nanstd(vals))
    summary[variant] = {**row, "seeds": sorted(by_seed)}
    lines.append(f"| {variant} | {len(by_seed)} | " + " | ".join(
        f"{row[m]:.3f} ± {row[m + '_sd']:.3f}" for m in METRICS) + " |")
  table = "\n".join(lines)
  fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4))
  for variant, by_seed in runs.items():
    steps = [e["step"] for e in next(iter(by_seed.values()))]
    for ax, m in zip(axes, METRICS):
      curves = np.array([[e.get(m, np.nan) if e.get(m) is not None else np.nan for e in ev]
                         for ev in by_seed.values() if len(ev) == len(steps)], float)
      mean = np.nanmean(curves, 0)
      line, = ax.plot(steps, mean, label=variant)
      ax.fill_between(steps, np.nanmin(curves, 0), np.nanmax(curves, 0),
                      color=line.get_color(), alpha=0.15)
      ax.set_title(m)
      ax.set_xlabel("RL step")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "demo_curves.png"), dpi=110)
  with open(os.path.join(out, "demo_results.md"), "w", encoding="utf-8") as f:
    f.write(f"Final = mean of the last {last} held-out evaluations, then mean ± sd over "
            "seeds.\n\n" + table + "\n")
  with open(os.path.join(out, "demo_results.json"), "w", encoding="utf-8") as f:
    json.dump({"summary": summary, "runs": runs}, f, indent=1)
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
  p.add_argument("--last", type=int, default=2, help="evals averaged for the final numbers")
  p.add_argument("--report_only", action="store_true")
  args = p.parse_args()
  if not args.report_only:
    run_all(args)
  print(report(args.workdir, args.out, args.last))


if __name__ == "__main__":
  main()
