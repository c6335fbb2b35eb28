r"""The demo study v3: every method of the paper from several warm starts (docs/demo.md).

  python -m benchmarks.demo_study_v3 --root=/tmp/capo_v3                 # every run, then report
  python -m benchmarks.demo_study_v3 --root=/tmp/capo_v3 --runs=ws0/grpo_seed0,ws0/capo_seed0
  python -m benchmarks.demo_study_v3 --root=/tmp/capo_v3 --report_only

The design is fixed in ``DESIGN`` below and written, before any run, in
docs/demo.md ("Study v3, pre-registered"): the plain task with 3 to 6 operands,
warm starts supervised until ~35% sampled accuracy (SFT seeds 0, 1, 2; cached),
each RL method from each warm start, held-out evaluations every 25 steps, and
the primary metric, the paired per-question ΔAUC of CAPO minus GRPO on the
questions the warm start gets right in (0, 60%] of its samples, at checkpoints
matched within 0.5 points of held-out accuracy, with a hierarchical bootstrap
interval over warm starts and questions (``capo_jax/demo/study.py``).

Runs are ordinary RL workdirs under ``<root>/ws<k>/`` and resume where they
stopped; ``--runs`` splits them over processes. ``--report_only`` writes
``<out>/study_v3.md``, ``study_v3.json`` and ``study_v3_frontier.png`` from
what has finished (with the machine and the date).
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

REPO = pathlib.Path(__file__).resolve().parent.parent

# The pre-registered design (docs/demo.md, "Study v3"). Changing it is a new study.
DESIGN: dict[str, Any] = dict(
    warm_starts=(0, 1, 2),  # SFT seeds
    task=dict(min_operands=3, max_operands=6, max_operand=9, operators="+-*",
              num_train=20000, num_heldout=1000, seed=0, wrong_rule="", wrong_fraction=0.0),
    sft=dict(max_steps=4000, eval_every=25, target_low=0.30, target_high=0.40),
    steps=150, eval_every=25,
    band=(0.0, 0.6), selection_seed=4321, selection_samples=16,
    match_tol=0.005,
    scaling_samples=64, scaling_seed=777, scaling_ks=(4, 8, 16), scaling_subsets=64,
    # learning rates of the accuracy-AUC frontier: the demo's and twice it
    lrs={"": 1e-4, "_lr2": 2e-4},
)
# --shrink: the same code at a seconds-long size (the smoke test; no result).
SHRINK_DESIGN: dict[str, Any] = dict(
    warm_starts=(0,), task=dict(DESIGN["task"], num_train=600, num_heldout=32),
    sft=dict(max_steps=20, eval_every=10, eval_questions=32, eval_samples=2,
             early_stop=False, batch_size=16),
    steps=2, eval_every=1, band=(-1.0, 1.0), selection_samples=2, scaling_samples=4,
    scaling_ks=(2, 4), scaling_subsets=4)
_SHRINK = [False]
METHODS = ("grpo", "capo", "gspo", "codapo", "cde", "simko", "dr_grpo")
FRONTIER_METHODS = ("grpo", "capo")
PRIMARY = ("capo", "grpo")


def shrink() -> None:
  """Switches this module to the smoke-run size (``--shrink``)."""
  _SHRINK[0] = True
  DESIGN.update(SHRINK_DESIGN)


def base_config(warm_start: int):
  """configs/demo.py with the study's task, SFT target and evaluation cadence."""
  from configs import demo  # pylint: disable=import-outside-toplevel
  c = demo.get_config("shrink" if _SHRINK[0] else None)
  c.demo.task.update(DESIGN["task"])
  c.demo.sft.update({**DESIGN["sft"], "seed": warm_start})
  c.train.num_steps = DESIGN["steps"]
  c.eval.every_steps = DESIGN["eval_every"]
  return c


def run_names() -> list[str]:
  """Every run, most important first: the primary pair on each warm start, then the
  other methods, then the frontier's second learning rate."""
  ws = DESIGN["warm_starts"]
  names = [f"ws{w}/{m}_seed0" for w in ws for m in PRIMARY]  # a pair per warm start, early
  names += [f"ws{w}/{m}_seed0" for m in METHODS if m not in PRIMARY for w in ws]
  names += [f"ws{w}/{m}{lr}_seed0" for lr in DESIGN["lrs"] if lr for m in FRONTIER_METHODS
            for w in ws]
  return names


def parse_name(name: str) -> tuple[int, str, str, int]:
  """``ws1/capo_lr2_seed0`` -> (1, "capo", "_lr2", 0)."""
  ws, rest = name.split("/", 1)
  variant, seed = rest.rsplit("_seed", 1)
  lr = next((s for s in DESIGN["lrs"] if s and variant.endswith(s)), "")
  method = variant[:len(variant) - len(lr)] if lr else variant
  if not ws.startswith("ws") or method not in METHODS:
    raise SystemExit(f"--runs: {name!r} is not ws<k>/<method>[_lr2]_seed<k> with method in "
                     f"{METHODS}")
  return int(ws[2:]), method, lr, int(seed)


def spec_for(warm_start: int, method: str = "capo", lr: str = "", seed: int = 0):
  from capo_jax.demo import compare  # pylint: disable=import-outside-toplevel
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  c = base_config(warm_start)
  c.seed = seed
  for key, value in compare.VARIANTS[method].items():
    section, leaf = key.split(".")
    c[section][leaf] = value
  c.optim.lr = DESIGN["lrs"][lr]
  return demo_run.spec_of(c)


def selected_examples(spec, workdir: str, ws) -> tuple[list[Any], np.ndarray]:
  """The held-out questions in the band, chosen on the selection seed's samples (cached)."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from capo_jax.demo import study  # pylint: disable=import-outside-toplevel
  from capo_jax.demo import task as task_lib  # pylint: disable=import-outside-toplevel
  demo = demo_run.Demo.of(spec)
  heldout = task_lib.make_splits(demo.task)[1][:demo.eval_questions]
  path = os.path.join(workdir, "selection.npz")
  if not os.path.exists(path):
    demo_run.heldout_metrics(ws, ws.params, heldout, DESIGN["selection_samples"],
                             DESIGN["selection_seed"], save_to=path)
  with np.load(path) as z:
    keep_Q = study.select_questions(z["correct_QG"], *DESIGN["band"])
  if not keep_Q.any():
    raise SystemExit(f"{path}: no held-out question has the warm start's accuracy in "
                     f"{DESIGN['band']} (the band of DESIGN): nothing to compare on")
  return [ex for ex, k in zip(heldout, keep_Q) if k], keep_Q


def scaling_eval(ws, params, examples: list[Any], path: str) -> None:
  """``scaling_samples`` answers per selected question at T = 1, for the voting table."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  if not os.path.exists(path):
    demo_run.heldout_metrics(ws, params, examples, DESIGN["scaling_samples"],
                             DESIGN["scaling_seed"], save_to=path)


def prepare(root: str, warm_start: int):
  """The warm start (trained once, cached), its held-out eval, selection and scaling eval."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  workdir = os.path.join(root, f"ws{warm_start}")
  spec = spec_for(warm_start)
  ws = demo_run.get_warm_start(spec, workdir)
  print(f"warm start {warm_start}: {ws.info.get('steps')} SFT steps "
        f"({'trained' if ws.info.get('trained') else 'cached'}) -> {ws.info.get('path')}",
        flush=True)
  initial = demo_run.warm_start_eval(spec, workdir, ws)
  examples, _ = selected_examples(spec, workdir, ws)
  scaling_eval(ws, ws.params, examples, os.path.join(workdir, "warm_start_scaling.npz"))
  return workdir, ws, initial, examples


def check_design(path: str, design: dict[str, Any]) -> None:
  """Writes ``design`` to ``path``, or exits if the file there holds another one."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      if json.load(f) != json.loads(json.dumps(design)):
        raise SystemExit(f"{path}: the runs under {os.path.dirname(path)} were made with "
                         "another DESIGN; use a new --root")
  else:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(design, f, indent=1)


def run_all(root: str, names: list[str]) -> None:
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from capo_jax.runtime import compile_cache  # pylint: disable=import-outside-toplevel
  compile_cache.enable("jax_cache", root)  # one cache for every warm start's runs
  check_design(os.path.join(root, "design.json"), DESIGN)
  prepared: dict[int, Any] = {}
  for i, name in enumerate(names):
    w, method, lr, seed = parse_name(name)
    if w not in prepared:
      prepared[w] = prepare(root, w)
    workdir, ws, initial, examples = prepared[w]
    run_dir = os.path.join(workdir, name.split("/", 1)[1])
    if os.path.exists(os.path.join(run_dir, "evals.json")):
      print(f"=== [{i + 1}/{len(names)}] {name}: finished", flush=True)
      continue
    print(f"=== [{i + 1}/{len(names)}] {name}", flush=True)

    def on_eval(step: int, params: Any, run_dir: str, examples=examples, ws=ws) -> None:
      if step == DESIGN["steps"]:
        scaling_eval(ws, params, examples, os.path.join(run_dir, "scaling_final.npz"))

    demo_run.run_rl(spec_for(w, method, lr, seed), workdir, ws,
                    run_name=name.split("/", 1)[1], initial_eval=initial, on_eval=on_eval)
    from benchmarks import demo_study_v3_report  # pylint: disable=import-outside-toplevel
    demo_study_v3_report.record_machine(pathlib.Path(run_dir))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--root", default="/tmp/capo_study_v3")
  p.add_argument("--out", default=str(REPO / "docs" / "demo" / "v3"))
  p.add_argument("--runs", default="", help="comma list of ws<k>/<method>[_lr2]_seed<k>")
  p.add_argument("--report_only", action="store_true")
  p.add_argument("--shrink", action="store_true", help="a seconds-long smoke run of the code")
  args = p.parse_args()
  if args.shrink:
    shrink()
  if not args.report_only:
    run_all(args.root, args.runs.split(",") if args.runs else run_names())
  from benchmarks import demo_study_v3_report  # pylint: disable=import-outside-toplevel
  print(demo_study_v3_report.report(args.root, args.out))


if __name__ == "__main__":
  main()
