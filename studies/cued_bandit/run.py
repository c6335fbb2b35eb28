"""The cued-bandit study: GRPO, Dr.GRPO and CAPO (tau 0.6, 1.0) on a shortcut task.

  python -m studies.cued_bandit.run --out DIR [--seeds 5] [--steps 200]

Trains every method from the same base policy on the same seeds (``bandit.train_seeds``),
evaluates each checkpoint on one fixed set of held-out questions (half traps, G samples
each, the same sampling key for every checkpoint), and writes ``DIR/cued_bandit.json``
(the task, the numbers per seed and their mean and sd over seeds, the wall time) and
``DIR/cued_bandit.png`` (the curves). docs/studies/cued_bandit/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np

from capo_jax.eval import traps
from studies.cued_bandit import bandit

HELDOUT = {"questions": 400, "samples": 64, "trap_share": 0.5, "seed": 10_000}
EVAL_EVERY = 10


def heldout_metrics(a_QG: Any, s_QG: Any, cue_Q: Any, trap_Q: Any) -> dict[str, float]:
  """``capo_jax.eval.traps.heldout_metrics`` of answers ``a_QG`` (0 = the true one)
  to questions whose cue is answer ``cue_Q``."""
  a_QG, cue_Q = np.asarray(a_QG), np.asarray(cue_Q)
  if a_QG.ndim != 2 or cue_Q.shape != a_QG.shape[:1]:
    raise ValueError(
      f"heldout_metrics: a_QG {a_QG.shape} and cue_Q {cue_Q.shape} do not fit [Q, G], [Q]"
    )
  return traps.heldout_metrics(s_QG, a_QG == 0, a_QG == cue_Q[:, None], trap_Q)


def evaluate(path_STF: Any, task: bandit.Task, steps: list[int]) -> list[list[dict]]:
  """Held-out metrics of each seed's checkpoint at ``steps``: [seed][step] dicts."""
  q = bandit.make_questions(
    jax.random.key(HELDOUT["seed"]), task, HELDOUT["questions"], HELDOUT["trap_share"]
  )
  draw = jax.jit(
    jax.vmap(
      lambda th: bandit.sample(jax.random.key(HELDOUT["seed"] + 1), th, q, HELDOUT["samples"])
    )
  )
  a_NQG, s_NQG = draw(np.asarray(path_STF)[:, steps].reshape(-1, path_STF.shape[-1]))
  rows = [
    heldout_metrics(a, s, q.cue_Q, q.trap_Q) for a, s in zip(np.asarray(a_NQG), np.asarray(s_NQG))
  ]
  return [rows[i : i + len(steps)] for i in range(0, len(rows), len(steps))]


def summarise(per_seed: list[list[dict]]) -> dict[str, list[float]]:
  """Mean and sample sd (ddof 1) over seeds of each metric, per evaluated step."""
  out: dict[str, list[float]] = {}
  for key in per_seed[0][0]:
    v_SE = np.array([[r[key] for r in rows] for rows in per_seed], np.float64)
    out[key] = np.nanmean(v_SE, axis=0).round(4).tolist()
    if v_SE.shape[0] > 1:
      out[key + "_sd"] = np.nanstd(v_SE, axis=0, ddof=1).round(4).tolist()
  return out


def study(task: bandit.Task, seeds: list[int]) -> dict[str, Any]:
  """Every method trained and evaluated; the JSON's content."""
  steps = list(range(0, task.steps + 1, EVAL_EVERY))
  start = time.perf_counter()
  methods = {}
  for name, estimator in bandit.METHODS.items():
    path_STF = np.asarray(bandit.train_seeds(seeds, task, estimator))
    per_seed = evaluate(path_STF, task, steps)
    methods[name] = {
      "theta_final": path_STF[:, -1].round(4).tolist(),
      "mean": summarise(per_seed),
      "per_seed": [{k: [round(r[k], 4) for r in rows] for k in rows[0]} for rows in per_seed],
    }
  return {
    "task": dataclasses.asdict(task),
    "heldout": HELDOUT,
    "seeds": seeds,
    "steps": steps,
    "methods": methods,
    "wall_s": round(time.perf_counter() - start, 1),
    "backend": jax.default_backend(),
  }


PANELS = (
  ("accuracy", "accuracy"),
  ("auc_mean", "AUC-mean (mixed questions)"),
  ("pooled_auc", "pooled AUC"),
  ("trap_accuracy", "trap accuracy"),
  ("trap_auc", "trap AUC (pooled)"),
  ("trap_gap", "trap gap: s copy - s correct"),
  ("confidently_wrong", "share all wrong, mean p >= 1/2"),
)


def plot(res: dict[str, Any], path: str) -> str:
  """One panel per metric against the step (mean over seeds, a band of one sd), and
  trap AUC and AUC-mean against accuracy (the matched-accuracy reading)."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(3, 3, figsize=(11, 9))
  flat = axes.ravel()
  steps = np.array(res["steps"])
  for i, (name, m) in enumerate(res["methods"].items()):
    mean = m["mean"]
    for ax, (key, title) in zip(flat, PANELS):
      y, sd = np.array(mean[key]), np.array(mean.get(key + "_sd", np.zeros(len(steps))))
      ax.plot(steps, y, color=f"C{i}", lw=1.2, label=name)
      ax.fill_between(steps, y - sd, y + sd, color=f"C{i}", alpha=0.2, lw=0)
      ax.set_title(title, fontsize=9)
      ax.set_xlabel("RL step", fontsize=8)
    for ax, key in zip(flat[len(PANELS) :], ("trap_auc", "auc_mean")):
      ax.plot(mean["accuracy"], mean[key], "o-", ms=2, color=f"C{i}", lw=1, label=name)
      ax.set_title(f"{key} against accuracy", fontsize=9)
      ax.set_xlabel("held-out accuracy", fontsize=8)
  flat[0].legend(fontsize=7)
  fig.suptitle(
    f"Cued bandit: {len(res['seeds'])} seeds, cue right on "
    f"{res['task']['cue_right']:.0%} of training questions, held-out half traps",
    fontsize=10,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def table(res: dict[str, Any]) -> str:
  """Markdown: each method at step 0 and at the last step (mean over seeds)."""
  keys = (
    "accuracy",
    "auc_mean",
    "mixed",
    "pooled_auc",
    "trap_accuracy",
    "trap_auc",
    "decoy_copied",
    "trap_gap",
    "confidently_wrong",
  )
  lines = ["| method | step | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
  first = next(iter(res["methods"].values()))["mean"]
  lines.append("| base | 0 | " + " | ".join(f"{first[k][0]:.3f}" for k in keys) + " |")
  for name, m in res["methods"].items():
    lines.append(
      f"| {name} | {res['steps'][-1]} | "
      + " | ".join(f"{m['mean'][k][-1]:.3f}" for k in keys)
      + " |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="folder for cued_bandit.json and .png")
  ap.add_argument("--seeds", type=int, default=5)
  ap.add_argument("--steps", type=int, default=bandit.Task.steps)
  args = ap.parse_args(argv)
  task = bandit.Task(steps=args.steps)
  res = study(task, list(range(args.seeds)))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "cued_bandit.json"), "w") as f:
    json.dump(res, f)  # one line: the per-seed curves are long
  plot(res, os.path.join(args.out, "cued_bandit.png"))
  print(table(res))
  print(
    f"{len(res['seeds'])} seeds x {len(res['methods'])} methods x {task.steps} steps: "
    f"{res['wall_s']} s ({res['backend']}); wrote {args.out}"
  )
  return res


if __name__ == "__main__":
  main()
