"""The embedded demo end to end: ``python -m capo_jax.main --config=configs/demo.py:shrink``.

The first call goes through the real command line (a subprocess) and trains
and caches the warm start; the second runs ``capo_jax.demo.run.run`` in
process on the same workdir with SFT replaced by a function that fails, so it
passes only if the cached warm start is loaded, not retrained.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# configs/demo.py:shrink: 2 RL steps, held-out evaluation before and after only,
# 16 held-out questions x 2 samples.
TINY_STEPS = 2
TINY_SAMPLES = 16 * 2


def _jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _report_rows(text: str) -> dict[str, list[str]]:
  """``metric -> [warm start, grpo, capo]`` cells of the printed side-by-side table."""
  rows = {}
  block = text[text.index("held-out metric") :].split("\n\n")[0]
  for line in block.splitlines()[1:]:
    parts = line.rsplit(maxsplit=3)
    rows[parts[0].strip()] = parts[1:]
  return rows


def _brute_auc(s_G: Any, c_G: Any) -> float:
  pos = [s for s, c in zip(s_G, c_G) if c]
  neg = [s for s, c in zip(s_G, c_G) if not c]
  if not pos or not neg:
    return float("nan")
  return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def _cache_files(workdir: pathlib.Path) -> dict[str, int]:
  return {
    str(p.relative_to(workdir)): p.stat().st_mtime_ns
    for p in (workdir / "warm_start").rglob("*")
    if p.is_file()
  }


@pytest.mark.slow  # whole runs in subprocesses (1-4 min on 2 cores); .ci/run runs it
def test_demo_cli_trains_caches_and_reports(
  tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
  workdir = tmp_path / "demo"
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(
      [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ),
  )
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "capo_jax.main",
      "--config=configs/demo.py:shrink",
      f"--workdir={workdir}",
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = proc.stdout
  assert re.search(r"warm start: trained \(20 SFT steps", out), out

  # The warm start is cached: one HF directory with its info file.
  (cache,) = list((workdir / "warm_start").iterdir())
  assert (cache / "warm_start.json").is_file() and (cache / "config.json").is_file()
  assert list(cache.glob("*.safetensors"))
  assert json.loads((cache / "warm_start.json").read_text(encoding="utf-8"))["steps"] == 20

  # Each method's metrics.jsonl: training rows for every step, held-out evals before
  # and after; per-sample held-out scores for the paired comparison.
  import numpy as np  # pylint: disable=import-outside-toplevel

  report = _report_rows(out)
  evals = {}
  for col, method in enumerate(("grpo", "capo"), start=1):
    rows = _jsonl(workdir / method / "metrics.jsonl")
    assert sorted({r["step"] for r in rows if "loss" in r}) == list(range(1, TINY_STEPS + 1))
    evals[method] = {r["step"]: r for r in rows if "eval/accuracy" in r}
    assert sorted(evals[method]) == [0, TINY_STEPS]
    for ev in evals[method].values():
      # mean@G over 16 x 2 samples: a whole number of right samples.
      assert ev["eval/accuracy"] * TINY_SAMPLES == pytest.approx(
        round(ev["eval/accuracy"] * TINY_SAMPLES), abs=1e-9
      )
    assert report["accuracy"][col] == f"{evals[method][TINY_STEPS]['eval/accuracy']:.3f}"
    assert report["accuracy"][0] == f"{evals[method][0]['eval/accuracy']:.3f}"
  assert re.search(
    rf"held-out metric\s+warm start\s+grpo @{TINY_STEPS}\s+capo @{TINY_STEPS}", out
  ), out
  assert (workdir / "demo_curves.png").stat().st_size > 1000

  # The paired ΔAUC line, recomputed from the saved samples with a brute-force AUC.
  aucs = {}
  for method in ("grpo", "capo"):
    with np.load(workdir / method / "heldout" / f"step_{TINY_STEPS:06d}.npz") as z:
      aucs[method] = np.array([_brute_auc(s, c) for s, c in zip(z["s_QG"], z["correct_QG"])])
  both = np.isfinite(aucs["grpo"]) & np.isfinite(aucs["capo"])
  m = re.search(
    r"paired ΔAUC \(capo - grpo\) over the (\d+) questions mixed under both: "
    r"([+-]?[\d.]+|nan),",
    out,
  )
  assert m, out
  assert int(m.group(1)) == int(both.sum())
  if both.any():
    assert float(m.group(2)) == pytest.approx(
      float((aucs["capo"] - aucs["grpo"])[both].mean()), abs=5e-4
    )

  # Second call, in process: the cache is loaded (SFT would raise), nothing rewritten.
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from capo_jax.demo import warm_start  # pylint: disable=import-outside-toplevel
  from configs import demo  # pylint: disable=import-outside-toplevel

  def no_training(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the cached warm start was retrained")

  monkeypatch.setattr(warm_start, "train_sft", no_training)
  before = _cache_files(workdir)
  capsys.readouterr()
  runs_again = demo_run.run(demo_run.spec_of(demo.get_config("shrink")), str(workdir))
  out2 = capsys.readouterr().out
  assert "warm start: loaded from cache" in out2, out2
  assert _cache_files(workdir) == before
  assert [e["step"] for e in runs_again["capo"]] == [0, TINY_STEPS]
  # The resumed runs read their evaluations back from metrics.jsonl (NaN included).
  assert _report_rows(out2) == report


@pytest.mark.slow  # two real shrink runs and a warm start (~1 min on 2 cores)
def test_resumed_run_keeps_every_evaluation(tmp_path: pathlib.Path) -> None:
  """A run stopped after its step-1 checkpoint and resumed writes the evaluations of
  steps 0, 1 and 2 to evals.json, not only those made after the resume."""
  import shutil  # pylint: disable=import-outside-toplevel

  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from configs import demo  # pylint: disable=import-outside-toplevel

  c = demo.get_config("shrink")
  c.eval.every_steps, c.checkpoint.every_steps = 1, 1
  spec = demo_run.method_spec(demo_run.spec_of(c), "grpo")
  ws = demo_run.get_warm_start(spec, str(tmp_path))
  first = demo_run.run_rl(spec, str(tmp_path), ws, run_name="r")
  assert [e["step"] for e in first] == [0, 1, TINY_STEPS]
  run_dir = tmp_path / "r"
  (run_dir / "evals.json").unlink()
  shutil.rmtree(run_dir / "checkpoints" / str(TINY_STEPS))  # as if stopped after step 1
  again = demo_run.run_rl(spec, str(tmp_path), ws, run_name="r")
  written = json.loads((run_dir / "evals.json").read_text())
  assert [e["step"] for e in written] == [e["step"] for e in again] == [0, 1, TINY_STEPS]
  for w, f in zip(written[:2], first[:2]):  # the evaluations before the resume, as made
    assert w == pytest.approx(f, nan_ok=True)
  assert written[2]["accuracy"] == pytest.approx(first[2]["accuracy"])  # step 2 redone
