"""The cued study (studies/cued): its statistics by hand, its runner shrunk, resuming."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from scipy import stats

from studies.cued import design as design_lib
from studies.cued import report


def _ev(step: int, acc: float, **kw: float) -> dict[str, float]:
  return {"step": step, "accuracy": acc, **kw}


def test_matched_gap_interpolates_the_reference_frontier():
  ref = [_ev(0, 0.3, auc_mean=0.6), _ev(25, 0.5, auc_mean=0.7), _ev(50, 0.7, auc_mean=0.9)]
  arm = [
    _ev(0, 0.3, auc_mean=0.6),  # the shared warm start: not a comparison
    _ev(25, 0.4, auc_mean=0.7),  # GRPO at 0.4: 0.65 -> +0.05
    _ev(50, 0.6, auc_mean=0.7),  # GRPO at 0.6: 0.80 -> -0.10
    _ev(75, 0.8, auc_mean=0.99),  # beyond GRPO's accuracy: left out
  ]
  assert report.matched_gap(arm, ref, "auc_mean") == pytest.approx((0.05 - 0.10) / 2)
  assert np.isnan(report.matched_gap(arm[3:], ref, "auc_mean"))
  # A NaN metric (no correct trap answer) is left out, not interpolated through.
  ref_nan = [ref[0], _ev(25, 0.5, auc_mean=float("nan")), ref[2]]
  assert report.matched_gap(arm[:2], ref_nan, "auc_mean") == pytest.approx(0.7 - 0.675)


def _design(**over):
  d = json.loads(json.dumps(design_lib.DESIGN))
  d.update(over)
  return d


def _write(root: pathlib.Path, name: str, evals: list[dict[str, float]]) -> None:
  (root / name).mkdir(parents=True)
  (root / name / "evals.json").write_text(json.dumps(evals))


def test_premise_by_hand(tmp_path):
  start = _ev(0, 0.3, trap_accuracy=0.30, trap_gap=-0.10, auc_questions=50)
  finals = {  # (warm start, seed) -> final trap accuracy, trap gap
    (0, 0): (0.20, 0.00),
    (0, 1): (0.22, -0.04),  # mean drop 0.09, rise 0.08: holds
    (1, 0): (0.27, 0.05),
    (1, 1): (0.27, 0.05),  # drop 0.03 < 0.05: fails
    (2, 0): (0.10, float("nan")),  # no decoy copy at the end: fails
  }
  for (w, k), (acc, gap) in finals.items():
    _write(
      tmp_path,
      f"ws{w}/grpo_seed{k}",
      [start, _ev(150, 0.5, trap_accuracy=acc, trap_gap=gap, auc_questions=40)],
    )
  runs = report.load_runs(tmp_path)
  assert runs[(0, "grpo", 0)][0]["mixed"] == 50
  m = report.premise(runs, _design())
  rows = {r["warm_start"]: r for r in m["per_warm_start"]}
  assert rows[0]["trap_accuracy_drop"] == pytest.approx(0.09)
  assert rows[0]["trap_gap_rise"] == pytest.approx(0.08)
  assert [rows[w]["holds"] for w in (0, 1, 2)] == [True, False, False]
  assert (m["held"], m["holds"], m["decided"]) == (1, False, False)  # ws2 seed 1 missing
  assert report.premise(runs, _design(premise={**_design()["premise"], "need": 1}))["holds"]


def test_compare_gives_each_warm_start_and_a_t_interval(tmp_path):
  ref = [_ev(0, 0.3, trap_auc=0.5), _ev(25, 0.7, trap_auc=0.9)]
  gaps = {0: (0.02, 0.04), 1: (0.05, 0.07), 2: (-0.01, 0.01)}  # per seed
  for w, per_seed in gaps.items():
    for k, g in enumerate(per_seed):
      _write(tmp_path, f"ws{w}/grpo_seed{k}", ref)
      # at accuracy 0.5 GRPO's frontier reads 0.7
      _write(tmp_path, f"ws{w}/capo_tau0.6_seed{k}", [ref[0], _ev(25, 0.5, trap_auc=0.7 + g)])
  c = report.compare(
    report.load_runs(tmp_path), _design(warm_starts=[0, 1, 2, 3]), "capo_tau0.6", "trap_auc"
  )
  est = [np.mean(v) for v in gaps.values()]  # ws3 has no runs: not a warm start here
  assert [p["estimate"] for p in c["per_warm_start"]] == pytest.approx(est)
  half = stats.t.ppf(0.975, 2) * np.std(est, ddof=1) / np.sqrt(3)
  assert (c["t_mean"], c["t_lo"], c["t_hi"]) == pytest.approx(
    (np.mean(est), np.mean(est) - half, np.mean(est) + half)
  )
  assert report.verdict(c) == "not shown (the interval holds 0)"
  assert report.verdict({"t_lo": 0.01, "t_hi": 0.2}) == "the paper's way"
  assert report.verdict({"t_lo": 0.01, "t_hi": 0.2}, better=-1) == "against the paper"
  assert report.verdict({"t_lo": -0.3, "t_hi": -0.1}, better=-1) == "the paper's way"


def test_design_orders_the_premise_stage_first_and_covers_every_run():
  names = design_lib.run_names()
  d = design_lib.DESIGN
  assert (
    names[:6]
    == design_lib.premise_runs()
    == [f"ws{w}/grpo_seed{k}" for w in (0, 1, 2) for k in (0, 1)]
  )
  assert len(names) == len(set(names)) == len(d["warm_starts"]) * len(d["arms"]) * 2
  assert len(d["warm_starts"]) >= 5 and len(d["seeds"]) >= 2 and d["lr"] == 5e-4
  assert [design_lib.parse_name(n) for n in names[6:8]] == [(3, "grpo", 0), (3, "grpo", 1)]
  with pytest.raises(SystemExit, match="arm"):
    design_lib.parse_name("ws0/capo_seed0")


@pytest.mark.slow  # a shrunk study: 2 warm starts x 2 arms x 2 RL steps (minutes on 2 cores)
def test_shrunk_runner_runs_reports_and_resumes(tmp_path, monkeypatch):
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from studies.cued import run  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(design_lib, "DESIGN", dict(design_lib.DESIGN))  # shrink() edits it
  monkeypatch.setattr(design_lib, "_SHRINK", [False])
  root, out = tmp_path / "root", tmp_path / "out"
  args = ["--shrink", f"--root={root}", f"--out={out}"]
  text = run.main(args)
  names = design_lib.run_names()
  assert names == [f"ws{w}/{a}_seed0" for a in ("grpo", "capo_tau0.6") for w in (0, 1)]
  for name in names:
    evals = json.loads((root / name / "evals.json").read_text())
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert {"trap_gap", "trap_auc", "confidently_wrong", "auc_questions"} <= set(evals[-1])
    assert (root / name / "ran_on.json").exists()
  assert "## M: GRPO takes the shortcut" in text and "| capo_tau0.6 | 2 |" in text
  assert json.loads((out / "cued_study.json").read_text())["runs"] == 4

  # Rerun: every run is finished, so nothing trains again.
  def no_training(*a, **k):
    raise AssertionError("a finished run was run again")

  monkeypatch.setattr(demo_run, "run_rl", no_training)
  assert run.main(args).split("\n", 1)[1] == text.split("\n", 1)[1]
  # A lost run is run again, the others are not.
  (root / names[-1] / "evals.json").unlink()
  with pytest.raises(AssertionError, match="run again"):
    run.main(args)
