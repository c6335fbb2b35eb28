r"""The demo study v3: every method of the paper from several warm starts.

The design and results: docs/studies/demo_v3/README.md.

  python -m studies.demo_v3.run --root=/tmp/capo_v3                 # every run, then report
  python -m studies.demo_v3.run --root=/tmp/capo_v3 --runs=ws0/grpo_seed0,ws0/capo_seed0
  python -m studies.demo_v3.run --root=/tmp/capo_v3 --report_only
  python -m studies.demo_v3.run \
      --record=docs/studies/demo_v3/run1/study_v3.json,docs/studies/demo_v3/run2/study_v3.json

The design is fixed in ``DESIGN`` (``studies/demo_v3/design.py``) and written, before any run, in
docs/studies/demo_v3/README.md ("Pre-registered design"): the plain task with 3 to 6 operands,
warm starts supervised until ~35% sampled accuracy (SFT seeds 0, 1, 2; cached),
each RL method from each warm start, held-out evaluations every 25 steps, and
the primary metric, the paired per-question ΔAUC of CAPO minus GRPO on the
questions the warm start gets right in (0, 60%] of its samples, at checkpoints
matched within 0.5 points of held-out accuracy, with a hierarchical bootstrap
interval over warm starts and questions (``capo_jax/demo/study.py``).

Runs are ordinary RL workdirs under ``<root>/ws<k>/`` and resume where they
stopped; ``--runs`` splits them over processes. ``--report_only`` writes
``<out>/study_v3.md``, ``study_v3.json`` and ``study_v3_frontier.png`` from
what has finished (with the machine and the date; ``studies/demo_v3/report.py``).
``--record`` writes what ``make demo`` prints of the recorded study, from each box's
``study_v3.json`` in that order, into the package
(``capo_jax/demo/study_v3_recorded.json``), and runs nothing.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported (capo_jax/hugepages.py), as the launcher
  from capo_jax import hugepages

  hugepages.reexec_with_hugepages()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import os
import pathlib
from typing import Any

import numpy as np

from studies import records
from studies.demo_v3 import report
from studies.demo_v3.design import DESIGN, parse_name, run_names, shrink, spec_for


def selected_examples(spec, workdir: str, ws) -> tuple[list[Any], np.ndarray]:
  """The held-out questions in the band, chosen on the selection seed's samples (cached)."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from capo_jax.demo import study  # pylint: disable=import-outside-toplevel
  from capo_jax.demo import task as task_lib  # pylint: disable=import-outside-toplevel

  demo = demo_run.Demo.of(spec)
  heldout = task_lib.make_splits(demo.task)[1][: demo.eval_questions]
  path = os.path.join(workdir, "selection.npz")
  if not os.path.exists(path):
    demo_run.heldout_metrics(
      ws, ws.params, heldout, DESIGN["selection_samples"], DESIGN["selection_seed"], save_to=path
    )
  with np.load(path) as z:
    keep_Q = study.select_questions(z["correct_QG"], *DESIGN["band"])
  if not keep_Q.any():
    raise SystemExit(
      f"{path}: no held-out question has the warm start's accuracy in "
      f"{DESIGN['band']} (the band of DESIGN): nothing to compare on"
    )
  return [ex for ex, k in zip(heldout, keep_Q) if k], keep_Q


def scaling_eval(ws, params, examples: list[Any], path: str) -> None:
  """``scaling_samples`` answers per selected question at T = 1, for the voting table."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel

  if not os.path.exists(path):
    demo_run.heldout_metrics(
      ws, params, examples, DESIGN["scaling_samples"], DESIGN["scaling_seed"], save_to=path
    )


def prepare(root: str, warm_start: int):
  """The warm start (trained once, cached), its held-out eval, selection and scaling eval."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel

  workdir = os.path.join(root, f"ws{warm_start}")
  spec = spec_for(warm_start)
  ws = demo_run.get_warm_start(spec, workdir)
  print(
    f"warm start {warm_start}: {ws.info.get('steps')} SFT steps "
    f"({'trained' if ws.info.get('trained') else 'cached'}) -> {ws.info.get('path')}",
    flush=True,
  )
  initial = demo_run.warm_start_eval(spec, workdir, ws)
  examples, _ = selected_examples(spec, workdir, ws)
  scaling_eval(ws, ws.params, examples, os.path.join(workdir, "warm_start_scaling.npz"))
  return workdir, ws, initial, examples


def run_all(root: str, names: list[str]) -> None:
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from capo_jax.runtime import compile_cache  # pylint: disable=import-outside-toplevel

  compile_cache.enable("jax_cache", root)  # one cache for every warm start's runs
  records.check_design(os.path.join(root, "design.json"), DESIGN)
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

    demo_run.run_rl(
      spec_for(w, method, lr, seed),
      workdir,
      ws,
      run_name=name.split("/", 1)[1],
      initial_eval=initial,
      on_eval=on_eval,
    )
    records.record_machine(pathlib.Path(run_dir))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--root", default="/tmp/capo_study_v3")
  p.add_argument("--out", default=str(records.REPO / "docs" / "studies" / "demo_v3"))
  p.add_argument("--runs", default="", help="comma list of ws<k>/<method>[_lr2]_seed<k>")
  p.add_argument("--report_only", action="store_true")
  p.add_argument("--shrink", action="store_true", help="a seconds-long smoke run of the code")
  p.add_argument(
    "--record",
    default="",
    help="comma list of study_v3.json reports (one per "
    "box) to write into what make demo prints; nothing is run",
  )
  args = p.parse_args()
  if args.record:
    print(f"wrote {report.record(args.record.split(','))}")
    return
  if args.shrink:
    shrink()
  if not args.report_only:
    run_all(args.root, args.runs.split(",") if args.runs else run_names())
  print(report.report(args.root, args.out))


if __name__ == "__main__":
  main()
