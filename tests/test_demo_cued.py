"""``make demo`` on the cued testbed: the study's checks on the demo's own run (M, P1, P2)
beside the recorded study, recomputed by hand and from the run's saved samples; the
recorded study against the studies' index; the curves."""

from __future__ import annotations

import json
import pathlib
import re
import tomllib
from typing import Any

import numpy as np
import pytest

from capo_jax.demo import cued_checks, report, tasks
from tests.docs_guard import refuse_docs

REPO = pathlib.Path(__file__).resolve().parent.parent


def _ev(step: int, acc: float, **kw: float) -> dict[str, float]:
  return {"step": step, "accuracy": acc, **kw}


def test_make_demo_runs_the_cued_testbed():
  """The Makefile's demo recipe runs configs/cued.py."""
  recipe = (REPO / "Makefile").read_text(encoding="utf-8").split("\ndemo:")[1].split("\n\n")[0]
  assert "-m capo_jax.main --config=configs/cued.py --workdir=$(WORKDIR)" in recipe


def test_demo_runs_are_the_studys_first_warm_start_runs():
  """configs/cued.py's GRPO and CAPO are the study's ws0 seed-0 runs of GRPO and its
  primary arm, setting for setting: the demo's checks read like one of the study's."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from configs import cued  # pylint: disable=import-outside-toplevel
  from studies.cued import design  # pylint: disable=import-outside-toplevel

  base = demo_run.spec_of(cued.get_config())
  for method, arm in (("grpo", design.REFERENCE), ("capo", design.PRIMARY)):
    ours, study = demo_run.method_spec(base, method), design.spec_for(0, arm, 0)
    assert ours == study and dict(ours.raw) == dict(study.raw), method


def test_single_run_checks_by_hand():
  margins = {"trap_accuracy_drop": 0.05, "trap_gap_rise": 0.03, "need": 2}
  grpo = [
    _ev(0, 0.30, trap_accuracy=0.25, trap_gap=-0.10, auc_mean=0.60, trap_auc=0.80),
    _ev(75, 0.40, trap_accuracy=0.22, trap_gap=0.00, auc_mean=0.64, trap_auc=0.70),
    _ev(150, 0.50, trap_accuracy=0.21, trap_gap=0.10, auc_mean=0.66, trap_auc=0.60),
  ]
  capo = [
    grpo[0],
    _ev(75, 0.35, trap_accuracy=0.24, trap_gap=-0.05, auc_mean=0.70, trap_auc=0.76),
    _ev(150, 0.45, trap_accuracy=0.23, trap_gap=float("nan"), auc_mean=0.61, trap_auc=0.70),
  ]
  recorded = report.recorded_cued()
  recorded = {**recorded, "design": {**recorded["design"], "premise": margins}}
  own = report.cued_estimates({"grpo": grpo, "capo": capo}, recorded)
  # M: drop 0.25 - 0.21 = 0.04 < 0.05 misses; rise 0.20 >= 0.03.
  assert own["premise"]["trap_accuracy_drop"] == pytest.approx(0.04)
  assert own["premise"]["trap_gap_rise"] == pytest.approx(0.20)
  assert not own["premise"]["holds"]
  assert report.premise_marks(grpo, recorded) == pytest.approx(
    {"trap_accuracy": 0.25 - 0.05, "trap_gap": -0.10 + 0.03}
  )
  # GRPO at accuracy 0.35: AUC-mean 0.62, trap AUC 0.75; at 0.45: 0.65, 0.65.
  assert own["p1"] == pytest.approx(((0.70 - 0.62) + (0.61 - 0.65)) / 2)
  assert own["p2"] == pytest.approx(((0.76 - 0.75) + (0.70 - 0.65)) / 2)
  assert own["trap_gap"] == pytest.approx(-0.05 - (-0.05))  # the NaN checkpoint left out
  text = report.cued_checks_text(own, recorded)
  assert "trap accuracy 0.250 -> 0.210 (drop +0.040, missed)" in text
  assert "(rise +0.200, met): M missed on this warm start" in text
  assert f"this run:  {own['p1']:+.3f} (one warm start, one seed" in text
  assert "A single run is not evidence" in text
  # No CAPO checkpoint within GRPO's accuracy range: said, not a number.
  far = [grpo[0], _ev(150, 0.9, trap_accuracy=0.2, trap_gap=0.1, auc_mean=0.7, trap_auc=0.7)]
  none = report.cued_estimates({"grpo": grpo, "capo": far}, recorded)
  assert np.isnan(none["p1"])
  assert "this run:  not measured" in report.cued_checks_text(none, recorded)


def test_recorded_cued_study_is_the_latest_indexed_report(tmp_path):
  """The package's record is what ``python -m studies.cued.report --record`` writes from
  the latest cued entry of docs/results/studies.json and its report, byte for byte; its
  figures are the report's and its margins the design's."""
  # pylint: disable=import-outside-toplevel
  from studies.cued import design
  from studies.cued import report as study_report

  index = json.loads((REPO / "docs/results/studies.json").read_text(encoding="utf-8"))
  entry = [e for e in index if e["study"] == "cued"][-1]
  full = json.loads((REPO / entry["report"]).read_text(encoding="utf-8"))
  rec = report.recorded_cued()
  assert (rec["report"], rec["run"], rec["date"], rec["notes"]) == (
    entry["report"],
    entry["run"],
    entry["date"],
    entry["notes"],
  )
  assert (rec["machine"], rec["commit"], rec["runs"]) == (
    full["machine"],
    full["commit"],
    full["runs"],
  )
  assert rec["premise"] == full["premise"]
  assert rec["compare"] == full["compare"][design.PRIMARY]
  want = json.loads(json.dumps(design.DESIGN))
  for k in ("premise", "compare", "warm_starts", "seeds", "reference", "primary"):
    assert rec["design"][k] == want[k], k
  out = study_report.record(path=tmp_path / "recorded.json")
  assert out.read_bytes() == pathlib.Path(report.STUDY_CUED).read_bytes()
  cfg = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
  assert (
    pathlib.Path(report.STUDY_CUED).name
    in cfg["tool"]["setuptools"]["package-data"]["capo_jax.demo"]
  )


def test_cued_report_reads_nothing_from_docs(monkeypatch):
  refuse_docs(monkeypatch)
  recorded = report.recorded_cued()
  runs = {m: [_ev(0, 0.3, trap_accuracy=0.2, trap_gap=0.0)] * 2 for m in ("grpo", "capo")}
  text = report.cued_checks_text(report.cued_estimates(runs, recorded), recorded)
  assert f"over {recorded['compare']['p1']['clusters']} warm starts" in text


# The independent references: brute-force AUCs, the trap metrics and the frontier by loops.


def _brute_auc(s: Any, c: Any) -> float:
  pos = [x for x, ok in zip(s, c) if ok]
  neg = [x for x, ok in zip(s, c) if not ok]
  if not pos or not neg:
    return float("nan")
  return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def _metrics(path: pathlib.Path, trap_Q: np.ndarray, cue_Q: np.ndarray) -> dict[str, float]:
  with np.load(path) as z:
    s_QG, c_QG, a_QG = z["s_QG"], z["correct_QG"], z["answers_QG"]
  aucs = [_brute_auc(s, c) for s, c in zip(s_QG, c_QG)]
  mixed = [a for a in aucs if not np.isnan(a)]
  copies, rights = [], []
  for q in np.flatnonzero(trap_Q):
    for g in range(s_QG.shape[1]):
      if a_QG[q, g] == cue_Q[q]:
        copies.append(s_QG[q, g])
      if c_QG[q, g]:
        rights.append(s_QG[q, g])
  mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
  return {
    "accuracy": float(c_QG.mean()),
    "auc_mean": mean(mixed),
    "trap_accuracy": float(c_QG[trap_Q].mean()),
    "trap_auc": _brute_auc(s_QG[trap_Q].ravel(), c_QG[trap_Q].ravel()),
    "trap_gap": mean(copies) - mean(rights),
  }


def _frontier_gap(arm: list[dict[str, float]], ref: list[dict[str, float]], key: str) -> float:
  """The arm's checkpoints after step 0 against GRPO's, linear in accuracy between its two
  neighbours; at a tied accuracy the last tied point (np.interp's choice)."""
  pts = sorted(((e["accuracy"], e[key]) for e in ref if not np.isnan(e[key])), key=lambda p: p[0])
  gaps = []
  for e in arm[1:]:
    x, y = e["accuracy"], e[key]
    if np.isnan(y) or not pts or not pts[0][0] <= x <= pts[-1][0]:
      continue
    at = [v for a, v in pts if a == x]
    if at:
      gaps.append(y - at[-1])
      continue
    (x0, y0), (x1, y1) = next((p, q) for p, q in zip(pts, pts[1:]) if p[0] < x < q[0])
    gaps.append(y - (y0 + (x - x0) / (x1 - x0) * (y1 - y0)))
  return sum(gaps) / len(gaps) if gaps else float("nan")


def test_single_run_matches_the_loop_reference_on_random_curves():
  """``single_run``'s gaps against ``_frontier_gap`` on random curves: accuracies with
  ties (multiples of 1/16), NaN metrics, arms outside GRPO's range."""
  rng = np.random.default_rng(0)
  margins = {"trap_accuracy_drop": 0.05, "trap_gap_rise": 0.03}
  keys = {"p1": "auc_mean", "p2": "trap_auc"}
  for _ in range(300):
    n = int(rng.integers(2, 8))

    def curve(start: dict[str, float] | None = None) -> list[dict[str, float]]:
      out = [start] if start else []
      for step in range(len(out), n):
        m = {k: float(rng.random()) for k in ("auc_mean", "trap_auc", "trap_accuracy")}
        m["trap_gap"] = float(rng.normal())
        if rng.random() < 0.2:
          m[str(rng.choice(list(m)))] = float("nan")
        out.append(_ev(25 * step, float(rng.integers(0, 17)) / 16, **m))
      return out

    grpo = curve()
    capo = curve(grpo[0])
    got = cued_checks.single_run(grpo, capo, margins, keys)
    for name, key in keys.items():
      assert _close(got[name], _frontier_gap(capo, grpo, key), 1e-12), (name, grpo, capo)
    drop = grpo[0]["trap_accuracy"] - grpo[-1]["trap_accuracy"]
    assert _close(got["premise"]["trap_accuracy_drop"], drop, 1e-12)


def _printed(text: str, label: str) -> float:
  """The signed number after ``label`` on its "this run:" line ("-" reads as NaN)."""
  block = text[text.index(label) :]
  m = re.search(r"this run:\s+([+-]?\d\.\d{3}|not measured)", block)
  assert m, block[:300]
  return float("nan") if m.group(1) == "not measured" else float(m.group(1))


def _close(got: float, want: float, tol: float) -> bool:
  return (np.isnan(got) and np.isnan(want)) or abs(got - want) <= tol


@pytest.mark.slow  # a warm start and two shrunk runs (minutes on 2 cores)
def test_shrunk_demo_prints_checks_equal_to_its_saved_samples(tmp_path, capsys, monkeypatch):
  """The cued demo end to end, shrunk to a task small enough that a 1-layer warm start
  answers some questions right (finite AUCs and trap gaps): every trap metric, M, P1
  and P2 it prints and returns, recomputed from the per-sample files it saved; nothing
  read from docs/."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from capo_jax.eval import traps  # pylint: disable=import-outside-toplevel
  from configs import cued as run_file  # pylint: disable=import-outside-toplevel

  c = run_file.get_config("shrink")
  # Operands 0-2: answers from -4 to 8, so 80 SFT steps already answer ~10% right.
  c.demo.task.update(max_operand=2, num_sft=150, num_rl=64, num_heldout=32)
  c.demo.sft.max_steps, c.demo.eval_samples = 80, 8
  spec = demo_run.spec_of(c)
  refuse_docs(monkeypatch)  # the run and its report read nothing from docs/
  runs = demo_run.run(spec, str(tmp_path))
  monkeypatch.undo()
  out = capsys.readouterr().out
  for key in ("auc_questions", "pooled_auc", "confidently_wrong", *traps.TRAP_KEYS):
    assert re.search(rf"^{key}\s", out, re.M), key
  assert "Across warm starts" not in out  # the arithmetic task's recorded study

  heldout = tasks.splits(demo_run.Demo.of(spec).task)[1][: spec.extra["demo"]["eval_questions"]]
  trap_Q = np.array([ex.meta["trap"] for ex in heldout])
  cue_Q = np.array([ex.meta["cue"] for ex in heldout])
  gold_Q = np.array([ex.answer for ex in heldout])
  mine: dict[str, list[dict[str, float]]] = {}
  for method, evals in runs.items():
    mine[method] = []
    for e in evals:
      path = (
        tmp_path / "warm_start_heldout.npz"
        if e["step"] == 0
        else tmp_path / method / "heldout" / f"step_{e['step']:06d}.npz"
      )
      with np.load(path) as z:  # the saved answers are the checker's
        np.testing.assert_array_equal(z["correct_QG"], z["answers_QG"] == gold_Q[:, None])
      m = _metrics(path, trap_Q, cue_Q)
      for k, v in m.items():
        np.testing.assert_allclose(e[k], v, rtol=1e-9, err_msg=f"{method} step {e['step']} {k}")
      mine[method].append({"step": e["step"], **m})
  g, k = mine["grpo"], mine["capo"]
  want = {
    "drop": g[0]["trap_accuracy"] - g[-1]["trap_accuracy"],
    "rise": g[-1]["trap_gap"] - g[0]["trap_gap"],
    "p1": _frontier_gap(k, g, "auc_mean"),
    "p2": _frontier_gap(k, g, "trap_auc"),
    "trap_gap": _frontier_gap(k, g, "trap_gap"),
  }
  assert np.isfinite([want["drop"], want["p1"], want["p2"]]).all(), want  # the test bites
  own = report.cued_estimates(runs, report.recorded_cued())
  got = {
    "drop": own["premise"]["trap_accuracy_drop"],
    "rise": own["premise"]["trap_gap_rise"],
    **{n: own[n] for n in ("p1", "p2", "trap_gap")},
  }
  for name, v in want.items():
    assert _close(got[name], v, 1e-9), (name, got[name], v)
  # ... and as printed: three decimals of the same numbers.
  m = re.search(r"this run:  trap accuracy .*\(drop ([+-]\d\.\d{3}).*\(rise ([+-]\d\.\d{3}|-)", out)
  assert m, out
  assert _close(float(m.group(1)), want["drop"], 5e-4 + 1e-12)
  assert _close(float("nan") if m.group(2) == "-" else float(m.group(2)), want["rise"], 5e-4)
  for label, name in (("P1:", "p1"), ("P2:", "p2"), ("Secondary", "trap_gap")):
    assert _close(_printed(out, label), want[name], 5e-4 + 1e-12), name
  assert "A single run is not evidence" in out

  png = tmp_path / "demo_curves.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  img = plt.imread(png)
  assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 2 * img.shape[0]  # 4 panels
