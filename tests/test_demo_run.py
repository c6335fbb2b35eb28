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


def _report_rows(text: str) -> dict[str, tuple[str, str]]:
  """``metric -> (warm start, last step)`` cells of the printed before/after table."""
  rows = {}
  for line in text[text.index("held-out metric"):].splitlines()[1:]:
    parts = line.split()
    if len(parts) == 3:
      rows[parts[0]] = (parts[1], parts[2])
  return rows


def _cache_files(workdir: pathlib.Path) -> dict[str, int]:
  return {str(p.relative_to(workdir)): p.stat().st_mtime_ns
          for p in (workdir / "warm_start").rglob("*") if p.is_file()}


@pytest.mark.slow  # whole runs in subprocesses (1-4 min on 2 cores); .ci/run runs it
def test_demo_cli_trains_caches_and_reports(tmp_path: pathlib.Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
  workdir = tmp_path / "demo"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  proc = subprocess.run(
      [sys.executable, "-m", "capo_jax.main", "--config=configs/demo.py:shrink",
       f"--workdir={workdir}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
      check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = proc.stdout
  assert re.search(r"warm start: trained \(20 SFT steps", out), out

  # The warm start is cached: one HF directory with its info file.
  (cache,) = list((workdir / "warm_start").iterdir())
  assert (cache / "warm_start.json").is_file() and (cache / "config.json").is_file()
  assert list(cache.glob("*.safetensors"))
  assert json.loads((cache / "warm_start.json").read_text(encoding="utf-8"))["steps"] == 20

  # metrics.jsonl: training rows for every step, held-out evals before and after.
  rows = _jsonl(workdir / "capo_seed0" / "metrics.jsonl")
  assert sorted({r["step"] for r in rows if "loss" in r}) == list(range(1, TINY_STEPS + 1))
  evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
  assert sorted(evals) == [0, TINY_STEPS]
  for ev in evals.values():
    assert 0 <= ev["eval/accuracy"] <= 1
    # mean@G over 16 x 2 samples: a whole number of right samples.
    assert ev["eval/accuracy"] * TINY_SAMPLES == pytest.approx(
        round(ev["eval/accuracy"] * TINY_SAMPLES), abs=1e-9)

  # The before/after report: accuracy and AUC-mean rows, first and last evaluation.
  report = _report_rows(out)
  assert {"accuracy", "auc_mean"} <= set(report), out
  assert report["accuracy"] == (f"{evals[0]['eval/accuracy']:.3f}",
                                f"{evals[TINY_STEPS]['eval/accuracy']:.3f}")
  assert len(report["auc_mean"]) == 2
  assert re.search(rf"held-out metric\s+warm start\s+step {TINY_STEPS}", out)

  # Second call, in process: the cache is loaded (SFT would raise), nothing rewritten.
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from capo_jax.demo import warm_start  # pylint: disable=import-outside-toplevel
  from configs import demo  # pylint: disable=import-outside-toplevel

  def no_training(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the cached warm start was retrained")

  monkeypatch.setattr(warm_start, "train_sft", no_training)
  before = _cache_files(workdir)
  capsys.readouterr()
  evals_again = demo_run.run(demo.get_config("shrink"), str(workdir))
  out2 = capsys.readouterr().out
  assert "warm start: loaded from cache" in out2, out2
  assert _cache_files(workdir) == before
  assert [e["step"] for e in evals_again] == [0, TINY_STEPS]
  # The resumed run reads its evaluations back from metrics.jsonl (NaN included).
  assert _report_rows(out2) == report
