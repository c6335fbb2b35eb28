r"""GRPO vs CAPO (and the paper's two ablations) on the demo task, several seeds.

  python -m studies.grpo_vs_capo.run --workdir=/tmp/capo_bench          # all runs + report
  python -m studies.grpo_vs_capo.run --workdir=/tmp/capo_bench --runs=capo_seed0,grpo_seed0
  python -m studies.grpo_vs_capo.run --workdir=/tmp/capo_bench --report_only

Every run starts from the same cached warm start (configs/demo.py) and
evaluates held-out accuracy, AUC-mean, pooled AUC, AUC on mostly-wrong
questions and policy entropy every ``eval.every_steps``. Variants:

  capo         CAPO with the noise mask (the method)
  grpo         GRPO (no mask)
  capo_nomask  ablation: CAPO without the noise mask
  grpo_mask    ablation: GRPO with CAPO's noise mask

Runs are resumable (each is an ordinary RL workdir) and can be split over
processes with ``--runs``; ``--report_only`` aggregates what exists into
``<out>/demo_results.md``, ``demo_results.json`` and ``demo_curves.png``
(``studies/grpo_vs_capo/report.py``).
The claim under test (ISSUE 8): GRPO's AUC-mean falls or rises less while
CAPO's rises, with CAPO's accuracy within 2 points of GRPO's or better.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported (capo_jax/hugepages.py), as the launcher
  from capo_jax import hugepages

  hugepages.reexec_with_hugepages()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse

from capo_jax.demo import compare
from capo_jax.runtime import compile_cache
from studies import records
from studies.grpo_vs_capo import report

STUDY_STEPS, STUDY_EVAL_EVERY = 150, 50


def make_spec(variant: str, seed: int, overrides: list[str]):
  """The run spec of one study run: the demo config, the variant, the study's steps."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from configs import demo  # pylint: disable=import-outside-toplevel

  c = demo.get_config()
  c.seed = seed
  for key, value in compare.VARIANTS[variant].items():
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

  names = (
    args.runs.split(",")
    if args.runs
    else [f"{v}_seed{s}" for s in args.seeds for v in args.variants]
  )
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
    demo_run.run_rl(
      make_spec(variant, int(seed), args.set), args.workdir, ws, run_name=name, initial_eval=initial
    )


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default="/tmp/capo_demo_bench")
  p.add_argument("--out", default=str(records.REPO / "docs" / "studies" / "grpo_vs_capo"))
  p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
  p.add_argument("--variants", type=lambda s: s.split(","), default=list(compare.VARIANTS))
  p.add_argument("--runs", default="", help="comma list of <variant>_seed<k> to run")
  p.add_argument(
    "--set",
    action="append",
    default=[],
    help="config override section.field=value (e.g. train.num_steps=100)",
  )
  p.add_argument("--baseline", default="grpo", help="the variant ΔAUC is paired against")
  p.add_argument("--report_only", action="store_true")
  p.add_argument(
    "--plot",
    default="",
    help="comma list of variants in the figure (default: those with the most seeds)",
  )
  args = p.parse_args()
  if not args.report_only:
    run_all(args)
  print(report.report(args.workdir, args.out, args.baseline, args.plot))


if __name__ == "__main__":
  main()
