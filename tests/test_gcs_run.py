"""A real run with a ``gs://`` workdir, against a local Cloud Storage API (an emulator).

The trainer reads its HF model, tokenizer and training data from the bucket,
writes metrics, TensorBoard events, checkpoints, the config and the HF export
there, resumes from it, and the evaluator evaluates the run from the bucket
into the bucket. No local directory named ``gs:`` may appear on the way.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import gcs_emulator
import hf_utils
import host_utils

REPO = pathlib.Path(__file__).resolve().parent.parent
BUCKET = "capo-test"
QUESTIONS = [(f"What is {a} + {b}?", str(a + b)) for a in range(3) for b in range(4)]

pytestmark = pytest.mark.skipif(
  gcs_emulator.available() is not None, reason=str(gcs_emulator.available())
)


@pytest.fixture(scope="module")
def gcs():
  with gcs_emulator.GcsEmulator(BUCKET) as emulator:
    yield emulator


def _env(gcs, tmp_path) -> dict[str, str]:
  env = dict(
    os.environ,
    PYTHONPATH=str(REPO),
    CAPO_GRADER_WORKERS="1",
    JAX_PLATFORMS="cpu",
    CAPO_CACHE_DIR=str(tmp_path / "cache"),
    **gcs.env(),
  )
  env.pop("XLA_FLAGS", None)
  return env


def _run(args: list[str], env: dict[str, str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
  proc = subprocess.run(
    [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=900
  )
  assert proc.returncode == 0, proc.stderr[-5000:]
  return proc


def _no_gs_dirs(*roots: pathlib.Path) -> list[str]:
  """Local files or folders whose name starts with 'gs:' (os.makedirs('gs://b') makes one)."""
  return [str(p) for root in roots for p in root.rglob("gs:*")]


@pytest.mark.slow  # whole runs in subprocesses (1-4 min on 2 cores); .ci/run runs it
def test_a_run_on_cloud_storage_resumes_and_evaluates(gcs, tmp_path, monkeypatch):
  gcs.apply(monkeypatch)
  from capo_jax.runtime import fs  # pylint: disable=import-outside-toplevel

  assets = tmp_path / "assets"
  hf_utils.make_hf_model(assets / "model", vocab_size=512)
  hf_utils.make_tokenizer_dir(assets / "model")
  (assets / "data").mkdir()
  rows = [
    json.dumps({"id": f"q{i}", "problem": q, "answer": a}) for i, (q, a) in enumerate(QUESTIONS)
  ]
  (assets / "data" / "train.jsonl").write_text("\n".join(rows) + "\n")
  (assets / "data" / "bench.jsonl").write_text("\n".join(rows[:3]) + "\n")
  base = f"gs://{BUCKET}"
  fs.upload_tree(str(assets), f"{base}/assets")

  run = f"{base}/run"
  env, cwd = _env(gcs, tmp_path), tmp_path / "cwd"
  cwd.mkdir()
  # configs/ is named by absolute path: the run starts in a scratch cwd, to catch stray
  # local folders there.
  cmd = [
    "-m",
    "capo_jax.main",
    f"--config={REPO}/configs/capo_qwen2p5_math_1p5b.py:shrink",
    f"--workdir={run}",
    f"--config.model.hf_path={base}/assets/model",
    f"--config.data.train={base}/assets/data/train.jsonl",
    f"--config.data.eval=('{base}/assets/data/bench.jsonl',)",
    "--config.rollout.max_prompt_len=256",
    "--config.rollout.max_new_tokens=8",
    "--config.eval.every_steps=2",
    "--config.log.samples_every_steps=1",
    "--config.checkpoint.export_hf_every=1",
  ]
  _run([*cmd, "--config.train.num_steps=2"], env, cwd)

  for name in (
    "metrics.jsonl",
    "samples.jsonl",
    "config.json",
    "data_split.json",
    "checkpoints/2/_CHECKPOINT_METADATA",
    "export_hf/config.json",
    "export_hf/model.safetensors",
    "export_hf/tokenizer.json",
    "exports/step_000001/config.json",
    "eval/step_000002/results.json",
    "export_hf/README.md",
    "exports/step_000001/prompt.json",
  ):
    assert fs.exists(f"{run}/{name}"), name
  assert any(p.name.startswith("events.out.tfevents") for p in fs.path(f"{run}/tb").iterdir())
  record = json.loads(fs.read_text(f"{run}/config.json"))
  assert record["config"]["eval"]["every_steps"] == 2  # the command-line override
  assert record["config"]["data"]["train"] == f"{base}/assets/data/train.jsonl"
  split = json.loads(fs.read_text(f"{run}/data_split.json"))
  assert len(split["val_ids"]) == 2 and len(split["train_ids"]) == len(QUESTIONS) - 2
  assert not set(split["val_ids"]) & set(split["train_ids"])
  rows1 = host_utils.read_jsonl(f"{run}/metrics.jsonl")
  evals = [r for r in rows1 if "eval/val/auc_mean" in r or "eval/val/mean@4" in r]
  assert [r["step"] for r in evals] == [0, 2]
  assert "eval/bench/pass@4" in evals[-1] and "eval/bench/mean@4" in evals[-1]

  # Resume from the bucket with one more step: no step is logged twice.
  proc = _run([*cmd, "--config.train.num_steps=3"], env, cwd)
  assert "resuming at step 2" in proc.stderr
  rows2 = host_utils.read_jsonl(f"{run}/metrics.jsonl")
  train_steps = [r["step"] for r in rows2 if "loss" in r]
  assert train_steps == [1, 2, 3]
  assert rows2[: len(rows1)] == rows1
  assert fs.exists(f"{run}/checkpoints/3/_CHECKPOINT_METADATA")

  out = f"{base}/eval"
  _run(
    [
      "-m",
      "capo_jax.eval",
      f"--policy={run}",
      f"--out={out}",
      f"--benchmarks={base}/assets/data/bench.jsonl",
      "--num_samples=2",
      "--max_new_tokens=8",
      "--no_progress",
      "--dtype=float32",
    ],
    env,
    cwd,
  )
  results = json.loads(fs.read_text(f"{out}/results.json"))
  assert results["benchmarks"]["bench"]["n_questions"] == 3
  assert fs.exists(f"{out}/samples.jsonl") and fs.exists(f"{out}/bench_scaling.png")
  assert not _no_gs_dirs(tmp_path, REPO), _no_gs_dirs(tmp_path, REPO)


def test_local_copy_of_a_bucket_folder_follows_remote_changes(gcs, tmp_path, monkeypatch):
  """HF directories on gs:// are read through a local cache, refreshed when they change."""
  gcs.apply(monkeypatch)
  monkeypatch.setenv("CAPO_CACHE_DIR", str(tmp_path / "cache"))
  from capo_jax.runtime import fs  # pylint: disable=import-outside-toplevel

  src = tmp_path / "src"
  (src / "sub").mkdir(parents=True)
  (src / "config.json").write_text('{"a": 1}')
  (src / "sub" / "w.bin").write_bytes(b"\0" * 100)
  remote = f"gs://{BUCKET}/copy-test/model"
  fs.upload_tree(str(src), remote)
  local = pathlib.Path(fs.local_copy(remote))
  assert (local / "config.json").read_text() == '{"a": 1}'
  assert (local / "sub" / "w.bin").read_bytes() == b"\0" * 100
  (local / "config.json").write_text("local edit")  # unchanged remote: the cache is reused
  assert fs.local_copy(remote) == str(local)
  assert (local / "config.json").read_text() == "local edit"
  fs.write_text(f"{remote}/config.json", '{"a": 22}')  # a new export: fetched again
  assert pathlib.Path(fs.local_copy(remote), "config.json").read_text() == '{"a": 22}'
  with pytest.raises(FileNotFoundError, match="no-such"):
    fs.local_copy(f"gs://{BUCKET}/no-such")
