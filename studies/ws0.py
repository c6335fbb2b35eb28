"""What the studies from warm start 0 of the demo study v3 share (the mask and tau studies).

Each such study is a ``Ws0Study`` (``studies/mask/run.py``, ``studies/tau/run.py``):
its variants (``capo_jax/demo/compare.py`` ``VARIANTS``), its pre-registered design
(``<root>/<name>_design.json``; the warm start's own, v3's, in
``<root>/design.json``), the configuration of one run and its report. The runs are
ordinary RL workdirs under ``<root>/ws0/<name>/``,
named ``ws0/<name>/<variant>_seed<k>``; they resume where they stopped, and
``--runs`` splits them over processes. Given the v3 study's root, a study reuses
its cached warm start 0, held-out evaluation and question selection.

The report helpers read what a finished run leaves: ``evals.json``, the per-sample
held-out files (``heldout/step_*.npz``) and the training rows of ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import types
import warnings
from typing import Any, Callable

import numpy as np

from studies import records
from studies.demo_v3 import design as v3_design
from studies.demo_v3 import run as v3_run


@dataclasses.dataclass(frozen=True)
class Ws0Study:
  """One study from v3's warm start 0.

  name: the runs' folder under ``<root>/ws0/`` and the design file's stem.
  variants: the variant names, in report order.
  make_design: the pre-registered design (read after ``shrink``, so it follows it).
  spec_for: ``(variant, seed) -> RunSpec``.
  run_names: every run, in the order they are run.
  report: ``(root, out) -> text``, from what has finished.
  shrink: switches the study to its seconds-long smoke size (v3's ``design.shrink`` included).
  """

  name: str
  variants: Callable[[], list[str]]
  make_design: Callable[[], dict[str, Any]]
  spec_for: Callable[[str, int], Any]
  run_names: Callable[[], list[str]]
  report: Callable[[str, str], str]
  shrink: Callable[[], None]

  @classmethod
  def of(cls, name: str, design: types.ModuleType, report: types.ModuleType) -> Ws0Study:
    """The study laid out as ``studies/<name>/``: ``design`` holds ``variant_names``,
    ``make_design``, ``spec_for``, ``run_names`` and ``shrink``; ``report`` holds ``report``."""
    return cls(
      name=name,
      variants=design.variant_names,
      make_design=design.make_design,
      spec_for=design.spec_for,
      run_names=design.run_names,
      report=report.report,
      shrink=design.shrink,
    )

  def parse_name(self, name: str) -> tuple[str, int]:
    """``ws0/<name>/<variant>_seed<k>`` -> (variant, k)."""
    head, _, rest = name.rpartition("/")
    variant, _, seed = rest.rpartition("_seed")
    if head != f"ws0/{self.name}" or variant not in self.variants() or not seed.isdigit():
      raise SystemExit(
        f"--runs: {name!r} is not ws0/{self.name}/<variant>_seed<k> with "
        f"variant in {self.variants()}"
      )
    return variant, int(seed)

  def run_all(self, root: str, names: list[str]) -> None:
    """Runs ``names`` in order, skipping the finished ones, from v3's warm start 0."""
    from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
    from capo_jax.runtime import compile_cache  # pylint: disable=import-outside-toplevel

    compile_cache.enable("jax_cache", root)  # shared with the v3 study's runs
    records.check_design(os.path.join(root, "design.json"), v3_design.DESIGN)
    records.check_design(os.path.join(root, f"{self.name}_design.json"), self.make_design())
    parsed = [self.parse_name(n) for n in names]  # every name checked before any run
    workdir = os.path.join(root, "ws0")
    spec = self.spec_for(*parsed[0])
    ws = demo_run.get_warm_start(spec, workdir)
    print(
      f"warm start 0: {ws.info.get('steps')} SFT steps "
      f"({'trained' if ws.info.get('trained') else 'cached'}) -> {ws.info.get('path')}",
      flush=True,
    )
    initial = demo_run.warm_start_eval(spec, workdir, ws)
    v3_run.selected_examples(spec, workdir, ws)  # the selection the report scores on
    for i, (name, (variant, seed)) in enumerate(zip(names, parsed)):
      run_name = name.split("/", 1)[1]
      if os.path.exists(os.path.join(workdir, run_name, "evals.json")):
        print(f"=== [{i + 1}/{len(names)}] {name}: finished", flush=True)
        continue
      print(f"=== [{i + 1}/{len(names)}] {name}", flush=True)
      demo_run.run_rl(
        self.spec_for(variant, seed), workdir, ws, run_name=run_name, initial_eval=initial
      )
      records.record_machine(pathlib.Path(workdir) / run_name)

  def main(self, description: str) -> None:
    """The study's command line: every run (or ``--runs``), then the report."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--root", default="/tmp/capo_study_v3")
    p.add_argument("--out", default=str(records.REPO / "docs" / "studies" / self.name))
    p.add_argument("--runs", default="", help=f"comma list of ws0/{self.name}/<variant>_seed<k>")
    p.add_argument("--report_only", action="store_true")
    p.add_argument("--shrink", action="store_true", help="a seconds-long smoke run of the code")
    args = p.parse_args()
    if args.shrink:
      self.shrink()
    if not args.report_only:
      self.run_all(args.root, args.runs.split(",") if args.runs else self.run_names())
    print(self.report(args.root, args.out))


def finished_runs(root: pathlib.Path, name: str) -> dict[tuple[str, int], pathlib.Path]:
  """(variant, seed) -> run directory, for every finished run of study ``name``."""
  out = {}
  for path in sorted((root / "ws0" / name).glob("*_seed*/evals.json")):
    variant, seed = path.parent.name.rsplit("_seed", 1)
    out[(variant, int(seed))] = path.parent
  return out


def as_float(v: Any) -> float:
  return float(v) if v is not None else float("nan")  # MetricsWriter writes NaN as "nan"


def load_runs(root: pathlib.Path, name: str) -> dict[tuple[str, int], dict[str, Any]]:
  """(variant, seed) -> {"evals", "dir", "train"} for every finished run of study ``name``."""
  return {
    key: {
      "evals": json.loads((d / "evals.json").read_text()),
      "dir": d,
      "train": train_rows(d / "metrics.jsonl"),
    }
    for key, d in finished_runs(root, name).items()
  }


def mean_curve(
  runs: list[dict[str, Any]], src: str, key: str
) -> tuple[list[int], np.ndarray] | None:
  """One logged value (``src`` "evals" or "train") against the RL step, the mean over
  ``runs`` up to the shortest of them; None where no run logged it (e.g. the masked
  fraction of an unmasked run)."""
  n = min((len(r[src]) for r in runs), default=0)
  if n == 0:
    return None
  y_RS = np.array([[as_float(row.get(key)) for row in r[src][:n]] for r in runs], np.float64)
  if not np.isfinite(y_RS).any():
    return None
  with np.errstate(invalid="ignore"), warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # a step no run logged stays NaN
    return [row["step"] for row in runs[0][src][:n]], np.nanmean(y_RS, 0)


def selection(root: pathlib.Path, band: tuple[float, float]) -> np.ndarray:
  """Warm start 0's selected held-out questions (v3's band), as a mask over questions."""
  from capo_jax.demo import study  # pylint: disable=import-outside-toplevel

  with np.load(root / "ws0" / "selection.npz") as z:
    return study.select_questions(z["correct_QG"], *band)


def train_rows(path: pathlib.Path) -> list[dict[str, Any]]:
  """One row per RL step of a ``metrics.jsonl`` (the last written, after a resume), in
  step order."""
  by_step = {}
  for line in path.read_text(encoding="utf-8").splitlines():
    row = json.loads(line)
    if "entropy" in row:  # a training step (held-out rows carry eval/ keys only)
      by_step[row["step"]] = row
  return [by_step[s] for s in sorted(by_step)]


def heldout_at(run_dir: pathlib.Path, step: int, keep_Q: np.ndarray) -> dict[str, Any]:
  """A run's held-out evaluation at ``step``: per-question AUC on all questions and on
  the selected ones, and accuracy / AUC-mean on the selected ones."""
  from capo_jax.eval import calibration  # pylint: disable=import-outside-toplevel

  with np.load(run_dir / "heldout" / f"step_{step:06d}.npz") as z:
    s_QG, c_QG = z["s_QG"], z["correct_QG"]
  auc_Q = calibration.auc_per_question(s_QG, c_QG)
  sel_Q = auc_Q[keep_Q]
  return {
    "auc_Q": auc_Q,
    "auc_sel_Q": sel_Q,
    "accuracy_sel": float(c_QG[keep_Q].mean()),
    "auc_mean_sel": float(np.nanmean(sel_Q)) if np.isfinite(sel_Q).any() else float("nan"),
  }
