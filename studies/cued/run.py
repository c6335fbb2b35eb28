r"""The cued study (docs/studies/cued/README.md): does CAPO keep GRPO from trusting a trap cue?

  python -m studies.cued.run --root=/tmp/capo_cued                 # premise, then the rest
  python -m studies.cued.run --root=/tmp/capo_cued --stage=premise # the premise stage only
  python -m studies.cued.run --root=/tmp/capo_cued --runs=ws3/capo_tau0.6_seed1
  python -m studies.cued.run --root=/tmp/capo_cued --report_only

The design is fixed in ``DESIGN`` (``studies/cued/design.py``) and written, before any
run, in docs/studies/cued/README.md: the cued testbed (``configs/cued.py``), 5 warm starts
(SFT seeds, cached) x 11 arms x 2 RL seeds at one budget. The premise stage runs first
(GRPO from warm starts 0-2, both seeds); when its check M fails, the runner stops there,
as pre-registered. One run per (warm start, arm, seed), an ordinary RL workdir
``<root>/ws<w>/<arm>_seed<k>`` with its ``evals.json``; a finished run is skipped and an
unfinished one resumes from its checkpoint, so the command can be rerun at will and
``--runs`` splits the runs over processes. The report (``studies/cued/report.py``)
writes ``<out>/cued_study.md`` and ``cued_study.json`` from what has finished.
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

from studies import records
from studies.cued import design as design_lib
from studies.cued import report


def prepare(root: str, warm_start: int) -> tuple[str, Any, dict[str, float]]:
  """The warm start (trained once, cached) and its held-out evaluation."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel

  workdir = os.path.join(root, f"ws{warm_start}")
  spec = design_lib.spec_for(warm_start)
  ws = demo_run.get_warm_start(spec, workdir)
  print(
    f"warm start {warm_start}: {ws.info.get('steps')} SFT steps "
    f"({'trained' if ws.info.get('trained') else 'cached'}) -> {ws.info.get('path')}",
    flush=True,
  )
  return workdir, ws, demo_run.warm_start_eval(spec, workdir, ws)


def run_all(root: str, names: list[str]) -> None:
  """Runs ``names`` in order, skipping the finished ones."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from capo_jax.runtime import compile_cache  # pylint: disable=import-outside-toplevel

  compile_cache.enable("jax_cache", root)  # one cache for every warm start's runs
  records.check_design(os.path.join(root, "design.json"), design_lib.DESIGN)
  parsed = [design_lib.parse_name(n) for n in names]  # every name checked before any run
  prepared: dict[int, Any] = {}
  for i, (name, (w, arm, seed)) in enumerate(zip(names, parsed)):
    run_dir = os.path.join(root, name)
    if os.path.exists(os.path.join(run_dir, "evals.json")):
      print(f"=== [{i + 1}/{len(names)}] {name}: finished", flush=True)
      continue
    print(f"=== [{i + 1}/{len(names)}] {name}", flush=True)
    if w not in prepared:
      prepared[w] = prepare(root, w)
    workdir, ws, initial = prepared[w]
    demo_run.run_rl(
      design_lib.spec_for(w, arm, seed),
      workdir,
      ws,
      run_name=name.split("/", 1)[1],
      initial_eval=initial,
    )
    records.record_machine(pathlib.Path(run_dir))


def premise_holds(root: str) -> bool:
  """M on the finished premise runs (``report.premise``); prints the verdict."""
  design = json.loads(json.dumps(design_lib.DESIGN))  # as check_design recorded it
  m = report.premise(report.load_runs(pathlib.Path(root)), design)
  print(
    f"premise M {'holds' if m['holds'] else 'does not hold'}: {m['held']} of "
    f"{len(m['per_warm_start'])} premise warm starts ({design['premise']['need']} needed)",
    flush=True,
  )
  return m["holds"]


def main(argv: list[str] | None = None) -> str:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--root", default="/tmp/capo_cued")
  p.add_argument("--out", default=str(records.REPO / "docs" / "studies" / "cued"))
  p.add_argument("--runs", default="", help="comma list of ws<w>/<arm>_seed<k>")
  p.add_argument("--stage", choices=("premise", "all"), default="all")
  p.add_argument("--report_only", action="store_true")
  p.add_argument("--shrink", action="store_true", help="a seconds-long smoke run of the code")
  args = p.parse_args(argv)
  if args.shrink:
    design_lib.shrink()
  if not args.report_only:
    if args.runs:
      run_all(args.root, args.runs.split(","))
    else:
      run_all(args.root, design_lib.premise_runs())
      if args.stage == "all" and premise_holds(args.root):
        run_all(args.root, design_lib.run_names())
  text = report.report(args.root, args.out)
  print(text)
  return text


if __name__ == "__main__":
  main()
