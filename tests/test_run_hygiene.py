"""What a long run needs besides the maths: its config on record, the paper's data split,
clean resumes after kills and damaged checkpoints, clear errors, W&B."""

from __future__ import annotations

import json
import logging
import os
import pathlib

import pytest

import host_utils
import rl_driver
from batches import padded_pass, run_pass
from capo_jax.data import datasets as data
from capo_jax.data import order
from capo_jax.run import setup
from capo_jax.run import spec as spec_lib
from capo_jax.runtime import metrics, run_record
from configs import common

QUESTIONS = [(f"What is {a} * {b}?", str(a * b)) for a in range(2, 5) for b in range(2, 5)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
  import hf_utils  # pylint: disable=import-outside-toplevel

  root = tmp_path_factory.mktemp("hygiene")
  tok = hf_utils.make_tokenizer_dir(root / "tok")
  train = root / "train.jsonl"
  train.write_text(
    "".join(
      json.dumps({"id": f"q{i}", "problem": q, "answer": a}) + "\n"
      for i, (q, a) in enumerate(QUESTIONS)
    )
  )
  empty = root / "empty.jsonl"
  empty.write_text("\n")
  return {"tok": str(tok), "train": str(train), "empty": str(empty)}


def _config(assets: dict[str, str], steps: int):
  c = rl_driver.tiny_config(assets["tok"], assets["train"], steps)
  c.checkpoint.keep = 3
  c.checkpoint.export_hf = False
  return c


def _steps(workdir: pathlib.Path) -> list[int]:
  return [r["step"] for r in host_utils.read_jsonl(str(workdir / "metrics.jsonl")) if "loss" in r]


@pytest.mark.slow  # whole runs in subprocesses (1-4 min on 2 cores); .ci/run runs it
def test_damaged_checkpoint_falls_back_and_each_step_is_logged_once(
  assets, tmp_path, caplog, monkeypatch
):
  monkeypatch.setenv("WANDB_MODE", "offline")
  pytest.importorskip("wandb", reason="wandb is an optional extra (pip install wandb)")
  workdir = tmp_path / "run"
  c = _config(assets, 3)
  c.log.wandb_project = "capo-test"
  rl_driver.train(c, str(workdir), grader=rl_driver.HashGrader())
  assert _steps(workdir) == [1, 2, 3]
  record = json.loads((workdir / "config.json").read_text())
  assert record["config"]["train"]["num_steps"] == 3 and "git_commit" in record
  # W&B (offline) mirrored the config and the metrics into its run file (protobuf
  # records, their strings stored as they are).
  run_files = list((workdir / "wandb").glob("offline-run-*/run-*.wandb"))
  assert len(run_files) == 1, list(workdir.iterdir())
  blob = run_files[0].read_bytes()
  assert b"num_steps" in blob and b"mini_batch_prompts" in blob  # the config
  assert blob.count(b"grad_norm") >= 3  # one history row per step

  # As if the machine died after step 3's metrics and while its checkpoint was written:
  # the newest checkpoint is truncated. The rerun names it, resumes from step 2, logs 3 once.
  for f in (workdir / "checkpoints" / "3").rglob("*"):
    if f.is_file() and "commit_success" not in f.name:
      os.truncate(f, f.stat().st_size // 2)
  c4 = _config(assets, 4)
  with caplog.at_level(logging.INFO):
    rl_driver.train(c4, str(workdir), grader=rl_driver.HashGrader())
  log_text = caplog.text
  assert "checkpoint step 3" in log_text and "unreadable" in log_text
  assert "resuming at step 2" in log_text
  assert _steps(workdir) == [1, 2, 3, 4]
  assert (workdir / "checkpoints" / "3" / "_CHECKPOINT_METADATA").is_file()  # saved again

  # A shape-changing field differs from the recorded run: a clear error before any work.
  c_bad = _config(assets, 5)
  c_bad.rollout.max_new_tokens = 12
  with pytest.raises(run_record.ConfigChanged, match="rollout.max_new_tokens: 8 -> 12"):
    rl_driver.train(c_bad, str(workdir), grader=rl_driver.HashGrader())


def test_config_record_warns_on_changed_fields_and_stops_on_shape_fields(tmp_path, caplog):
  c = common.shrink(common.get_base_config())
  raw = lambda c: spec_lib.RunSpec.from_config(c, num_devices=8).raw  # noqa: E731
  run_record.record(raw(c), str(tmp_path), resuming=False)
  c.optim.lr = 5e-5
  with caplog.at_level(logging.WARNING):
    rec = run_record.record(raw(c), str(tmp_path), resuming=True)
  assert "optim.lr: 0.0001 -> 5e-05" in caplog.text
  assert rec["previous"]["config"]["optim"]["lr"] == 1e-4
  assert json.loads((tmp_path / "config.json").read_text())["config"]["optim"]["lr"] == 5e-5
  for field, value in (
    ("model.preset", "qwen2p5_0p5b"),
    ("mesh.tensor", 2),
    ("train.micro_batch_size", 4),
  ):
    c2 = common.shrink(common.get_base_config())
    c2.optim.lr = 5e-5
    section, leaf = field.split(".")
    c2[section][leaf] = value
    with pytest.raises(run_record.ConfigChanged, match=field.replace(".", r"\.")):
      run_record.record(raw(c2), str(tmp_path), resuming=True)
  assert run_record.is_shape_field("model.preset_overrides.vocab_size")
  assert not run_record.is_shape_field("train.num_steps")


def test_metrics_writer_drops_rows_past_the_restored_step(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
  for step in (0, 1, 2, 3):
    w.write(step, {"loss": float(step)})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write('{"step": 4, "lo')  # torn by a kill mid-write
  w = metrics.MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False)
  w.write(3, {"loss": 30.0})
  w.close()
  rows = host_utils.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [(r["step"], r["loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
  metrics.MetricsWriter(str(tmp_path), resume_step=0, tensorboard=False).close()
  assert host_utils.read_jsonl(str(tmp_path / "metrics.jsonl")) == []  # a fresh start


def test_paper_split_of_the_deepscaler_sample(shared_data, tmp_path):
  ds = data.load_examples("deepscaler", data_dir=shared_data)
  n = len(ds.examples)
  split = order.split_train_val(ds.examples, 1000, 240, seed=0)
  assert len(split.val) == 240 and len(split.train) == 1000
  val, train = set(split.ids()["val_ids"]), set(split.ids()["train_ids"])
  assert not val & train and len(val) == 240 and len(train) == 1000
  again = order.split_train_val(list(ds.examples), 1000, 240, seed=0)
  assert again.ids() == split.ids()  # fixed seed: the same split every time
  other = order.split_train_val(ds.examples, 1000, 240, seed=1)
  assert other.ids()["val_ids"] != split.ids()["val_ids"]
  everything = order.split_train_val(ds.examples, 0, 240, seed=0)
  assert len(everything.train) == n - 240  # train_size 0: all the rest
  # Through the trainer's loader: the ids land in the workdir.
  c = common.get_base_config()
  c.data.data_dir, c.data.train_size, c.data.val_size = str(shared_data), 1000, 240
  got = setup.training_data(
    spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True).data, str(tmp_path)
  )
  rec = json.loads((tmp_path / setup.SPLIT_FILE).read_text())
  assert rec["val_ids"] == [e.id for e in got.val] == split.ids()["val_ids"]
  assert rec["train_ids"] == split.ids()["train_ids"]
  with pytest.raises(data.DataError, match="not enough"):
    order.split_train_val(ds.examples[:100], 0, 240, seed=0)


def test_an_empty_training_file_is_named_as_empty(assets, tmp_path):
  c = _config(assets, 1)
  c.data.train = assets["empty"]
  with pytest.raises(
    data.DataError,
    match=r"empty\.jsonl: no training questions \(the file is "
    "empty",
  ):
    rl_driver.train(c, str(tmp_path), grader=rl_driver.HashGrader())


def test_eval_config_fields_are_checked(assets):
  c = _config(assets, 1)
  c.eval.num_samples = 0
  with pytest.raises(spec_lib.ConfigError, match="eval.num_samples=0"):
    spec_lib.RunSpec.from_config(c, num_devices=1)


@pytest.mark.parametrize("name", ["capo_qwen2p5_math_1p5b", "grpo_qwen2p5_math_7b", "demo"])
def test_an_unknown_config_argument_is_an_error_naming_it(name):
  import importlib  # pylint: disable=import-outside-toplevel

  mod = importlib.import_module(f"configs.{name}")
  want = rf"unknown config argument 'tiny' in --config=configs/{name}\.py:tiny; known: shrink"
  with pytest.raises(ValueError, match=want):
    mod.get_config("tiny")  # the old demo switch: one name now, not two
  assert mod.get_config("shrink").train.num_steps < mod.get_config().train.num_steps


def test_an_unknown_config_argument_stops_the_cli_before_anything_runs(tmp_path):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  repo = pathlib.Path(__file__).resolve().parent.parent
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "capo_jax.main",
      "--config=configs/demo.py:bogus",
      f"--workdir={tmp_path / 'run'}",
    ],
    cwd=repo,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert proc.returncode != 0
  assert "unknown config argument 'bogus' in --config=configs/demo.py:bogus" in proc.stderr
  assert "known: shrink" in proc.stderr and not (tmp_path / "run").exists()


def test_log_prob_pass_in_row_calls_equals_one_call():
  """train.logprob_rows: the old / reference pass in calls of 4 rows == one call of 16
  == the padded forward, on 1 device and on a 2 x 2 x 2 mesh of 8 fake devices when
  they exist."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from capo_jax.rl.logprobs import token_logprobs  # pylint: disable=import-outside-toplevel
  from capo_jax.runtime import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from models import qwen2  # pylint: disable=import-outside-toplevel

  c = common.shrink(common.get_base_config())
  cfg = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True).model_config()
  params = qwen2.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  B, P, C = 16, 6, 5
  prompt = rng.integers(1, cfg.vocab_size, (B, P)).astype(np.int32)
  pmask = np.ones((B, P), np.int32)
  pmask[::3, :2] = 0  # left padding
  comp = rng.integers(1, cfg.vocab_size, (B, C)).astype(np.int32)
  cmask = (np.arange(C)[None] < rng.integers(1, C + 1, (B, 1))).astype(np.int32)
  meshes = [mesh_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])]
  if jax.device_count() >= 8:
    meshes.append(
      mesh_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=jax.devices()[:8])
    )
  keys = ("logp_BC", "entropy_BC", "topk_ids_BCJ", "topk_logp_BCJ")
  # The padded [B, P + C] forward: an independent reference for the rows' layout.
  ref = token_logprobs(params, cfg, prompt, pmask, comp, cmask, top_k=3)
  for mesh in meshes:
    p = jax.device_put(params, mesh_lib.param_shardings(cfg, mesh, mesh_lib.TRAIN_RULES))
    want, got = (
      run_pass(
        padded_pass(cfg, mesh, mesh_lib.TRAIN_RULES, L, top_k=3),
        p,
        (prompt, pmask, comp, cmask),
        keys,
      )
      for L in (B, 4)
    )
    assert set(got) == set(want) == set(keys) and got["logp_BC"].shape == (B, C)
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(got["logp_BC"], np.asarray(ref["logp_BC"]), atol=1e-5)
    np.testing.assert_array_equal(got["topk_ids_BCJ"], np.asarray(ref["topk_ids_BCJ"]))


@pytest.mark.parametrize(
  "algo,agg,want",
  [
    ("simko", "auto", "token-mean"),
    ("capo", "auto", "seq-mean-token-mean"),
    ("grpo", "auto", "seq-mean-token-mean"),
    ("simko", "seq-mean-token-mean", "seq-mean-token-mean"),
  ],
)
def test_simko_is_one_field_away_with_its_papers_aggregation(algo, agg, want):
  c = common.shrink(common.get_base_config())
  c.algo.name, c.loss.agg = algo, agg
  assert (
    spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True).train_config().loss.agg
    == want
  )
