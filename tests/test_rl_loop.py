"""The RL run end to end: configs, bad configs, resume, faults, preemption, multi-host."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import hf_utils
import rl_driver
from capo_jax.run import loop, setup
from capo_jax.run import spec as spec_lib
from configs import common
from models import qwen2

REPO = pathlib.Path(__file__).resolve().parent.parent
DRIVER = str(REPO / "tests" / "rl_driver.py")
CONFIG_FILES = sorted(
  p.stem for p in (REPO / "configs").glob("*.py") if p.stem not in ("__init__", "common")
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
  return rl_driver.write_assets(tmp_path_factory.mktemp("rl"))


def _env(**extra: str) -> dict[str, str]:
  env = dict(
    os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}", CAPO_GRADER_WORKERS="1", JAX_PLATFORMS="cpu"
  )
  env.pop("XLA_FLAGS", None)
  env.update(extra)
  return env


def _run_driver(
  workdir: str,
  assets: dict[str, str],
  steps: int,
  *overrides: str,
  env: dict[str, str] | None = None,
  check: bool = True,
) -> subprocess.CompletedProcess:
  cmd = [sys.executable, DRIVER, workdir, assets["tok"], assets["data"], str(steps), *overrides]
  proc = subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=600)
  if check and proc.returncode:
    raise AssertionError(f"driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
  return proc


def _digest(workdir: str, process: int = 0) -> str:
  return pathlib.Path(workdir, f"params.{process}.sha256").read_text()


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_config_file_loads_and_validates(name, monkeypatch, tmp_path):
  mod = importlib.import_module(f"configs.{name}")
  if mod.get_config().model.hf_path:  # a hub id: validated against an offline stub snapshot
    hf_utils.offline_hub(monkeypatch, tmp_path / "hub")
    hf_utils.stub_snapshot_of_preset(
      tmp_path / "hub", mod.get_config().model.hf_path, mod.get_config().model.preset
    )
  if name in ("demo", "cued"):  # the warm start supplies the policy; "shrink": smoke variant
    full, tiny = mod.get_config(), mod.get_config("shrink")
    for c in (full, tiny):
      c.rollout.max_new_tokens = c.rollout.max_new_tokens or 40  # 0: the demo sets it
    spec_lib.RunSpec.from_config(full, num_devices=1, policy_given=True)
    spec_lib.RunSpec.from_config(tiny, num_devices=1, policy_given=True)
    assert tiny.train.num_steps < full.train.num_steps
    return
  full, tiny = mod.get_config(), mod.get_config("shrink")
  assert full.algo.name in spec_lib.ALGORITHMS
  spec_lib.RunSpec.from_config(full, num_devices=8)
  spec_lib.RunSpec.from_config(tiny, num_devices=1)
  assert (
    spec_lib.RunSpec.from_config(tiny, num_devices=1, policy_given=True).model_config().num_layers
    <= 4
  )  # shrink really shrinks


@pytest.mark.parametrize(
  "field,value,needle",
  [
    ("rollout.num_samples", 1, "rollout.num_samples=1"),
    ("train.mini_batch_prompts", 3, "train.mini_batch_prompts=3"),
    ("train.micro_batch_size", 5, "train.micro_batch_size=5"),
    ("algo.name", "ppo_magic", "algo.name='ppo_magic'"),
    ("mesh.data", 16, "mesh"),
    ("model.hf_path", "/no/such/checkpoint", "/no/such/checkpoint"),
    ("model.preset", "qwen9_huge", "qwen9_huge"),
    ("algo.mask", "sometimes", "algo.mask='sometimes'"),
  ],
)
def test_bad_config_fails_at_start_naming_the_field(field, value, needle):
  c = common.shrink(common.get_base_config())
  section, leaf = field.split(".")
  c[section][leaf] = value
  with pytest.raises(spec_lib.ConfigError, match=needle.replace("(", r"\(")):
    spec_lib.RunSpec.from_config(c, num_devices=1)


@pytest.mark.slow  # whole runs in subprocesses (1-4 min on 2 cores); .ci/run runs it
def test_resume_after_process_exit_is_bit_exact(assets, tmp_path):
  """4 uninterrupted steps == 2 steps, exit, 2 more: bit-identical params (CPU)."""
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  _run_driver(straight, assets, 4)
  _run_driver(resumed, assets, 2)
  first_half = _digest(resumed)
  _run_driver(resumed, assets, 4)
  assert _digest(resumed) != first_half  # the second run really trained
  assert _digest(resumed) == _digest(straight)
  rows = [json.loads(l) for l in open(os.path.join(resumed, "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for key in (
    "accuracy",
    "auc_mean",
    "frac_all_correct",
    "frac_all_wrong",
    "masked_frac",
    "response_len",
    "truncation_rate",
    "clip_frac",
    "entropy",
    "kl",
    "grad_norm",
    "lr",
    "time_step",
    "time/rollout_s",
    "time/update_wait_s",
    "time/checkpoint_s",
    "sample_tokens_per_s",
    "train_tokens_per_s",
    "reward/timeout",
    "s_spread",
  ):
    assert key in rows[-1], key
  assert any(r["grad_norm"] > 0 for r in rows)
  assert os.path.isfile(os.path.join(resumed, "export_hf", "config.json"))


@pytest.mark.slow  # whole runs in subprocesses (1-4 min on 2 cores); .ci/run runs it
def test_nonfinite_steps_are_skipped_then_stop_the_run(assets, tmp_path):
  c = common.shrink(common.get_base_config())
  c.tokenizer_path, c.data.train = assets["tok"], assets["data"]
  c.rollout.max_prompt_len, c.rollout.max_new_tokens = 256, 8
  c.train.num_steps, c.train.max_consecutive_skips = 6, 2
  cfg = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True).model_config()
  params = jax.tree.map(np.array, qwen2.init_params(cfg, jax.random.key(1)))
  params["final_norm"][0] = np.nan  # every loss is NaN
  with pytest.raises(loop.TrainingDiverged, match="2 consecutive steps"):
    rl_driver.train(
      c, str(tmp_path), policy=setup.Policy(cfg, params), grader=rl_driver.HashGrader()
    )
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["skipped_updates"] for r in rows] == [2, 2]  # 2 mini-batch updates per step


@pytest.mark.slow  # ~50 s (.ci/run runs it)
def test_sigterm_saves_a_checkpoint_and_the_rerun_resumes(assets, tmp_path):
  workdir = str(tmp_path / "preempted")
  cmd = [
    sys.executable,
    DRIVER,
    workdir,
    assets["tok"],
    assets["data"],
    "100",
    "checkpoint.every_steps=1000",
  ]
  proc = subprocess.Popen(
    cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  metrics_file = pathlib.Path(workdir, "metrics.jsonl")
  deadline = time.time() + 300
  while time.time() < deadline and not (metrics_file.exists() and metrics_file.read_text()):
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0 and "preempted" in err, err[-2000:]
  steps = [int(p.name) for p in pathlib.Path(workdir, "checkpoints").iterdir() if p.name.isdigit()]
  assert steps and max(steps) >= 1  # saved although every_steps=1000
  done = max(steps)
  _run_driver(workdir, assets, done + 1, "checkpoint.every_steps=1000")
  rows = [json.loads(l) for l in open(metrics_file)]
  assert rows[-1]["step"] == done + 1 and len(rows) == done + 1


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch_two(
  workdir: str, assets: dict[str, str], steps: int, *overrides: str
) -> list[subprocess.Popen]:
  port = _free_port()
  procs = []
  for pid in range(2):
    env = _env(
      JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid)
    )
    cmd = [sys.executable, DRIVER, workdir, assets["tok"], assets["data"], str(steps), *overrides]
    procs.append(
      subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    )
  return procs


def _wait_all(procs: list[subprocess.Popen]) -> list[str]:
  errs = []
  for p in procs:
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-4000:]
    errs.append(err)
  return errs


@pytest.mark.slow  # ~2 min: three 2-process runs (.ci/run runs it)
def test_sigterm_to_one_of_two_processes_saves_the_same_step_on_both(assets, tmp_path):
  """jax.distributed over 2 CPU processes on localhost, with JAX's preemption sync: only
  process 1 is told, both save step N and exit 0; the rerun to N + 1 steps equals an
  uninterrupted 2-process run of N + 1 steps bit for bit, and process 0 == process 1.
  Only process 0 writes logs: every step appears once."""
  workdir = str(tmp_path / "preempted")
  keep_going = ("checkpoint.every_steps=1000",)
  procs = _launch_two(workdir, assets, 100, *keep_going)
  metrics_file = pathlib.Path(workdir, "metrics.jsonl")
  deadline = time.time() + 300
  while time.time() < deadline and not (metrics_file.exists() and metrics_file.read_text()):
    time.sleep(0.5)
  procs[1].send_signal(signal.SIGTERM)
  errs = _wait_all(procs)
  assert all("preempted" in e for e in errs), errs[0][-2000:]
  steps = sorted(
    int(p.name) for p in pathlib.Path(workdir, "checkpoints").iterdir() if p.name.isdigit()
  )
  assert len(steps) == 1 and 1 <= steps[0] < 100, steps  # one step, saved by both
  done = steps[0]
  _wait_all(_launch_two(workdir, assets, done + 1, *keep_going))
  straight = str(tmp_path / "straight")
  _wait_all(_launch_two(straight, assets, done + 1, *keep_going))
  assert _digest(workdir, 0) == _digest(workdir, 1) == _digest(straight, 0)
  rows = [json.loads(l) for l in open(metrics_file)]
  assert [r["step"] for r in rows] == list(range(1, done + 2))


@pytest.mark.parametrize(
  "algo",
  [
    "simko",
    pytest.param("gspo", marks=pytest.mark.slow),
    pytest.param("cde", marks=pytest.mark.slow),
    pytest.param("codapo", marks=pytest.mark.slow),
    pytest.param("dr_grpo", marks=pytest.mark.slow),
  ],
)
def test_every_algorithm_trains_end_to_end(algo, assets, tmp_path):
  """One RL step per algorithm: finite loss, a real update (its own loss path for SimKO/GSPO)."""
  c = common.shrink(common.get_base_config())
  c.tokenizer_path, c.data.train = assets["tok"], assets["data"]
  c.rollout.max_prompt_len, c.rollout.max_new_tokens = 256, 8
  c.algo.name, c.train.num_steps, c.checkpoint.export_hf = algo, 1, False
  c.optim.lr = 1e-3
  rl_driver.train(c, str(tmp_path), grader=rl_driver.HashGrader())
  row = json.loads(open(tmp_path / "metrics.jsonl").readline())
  assert np.isfinite(row["loss"]) and row["grad_norm"] > 0 and row["skipped_updates"] == 0
  if algo == "simko":
    assert "forked_frac" in row


@pytest.mark.slow  # two whole runs; tests/test_packing.py checks the log-probs and gradients
def test_shared_prompts_train_as_the_unshared_layout(assets, tmp_path, monkeypatch):
  """One CAPO step with the G completions of a prompt sharing its forward in the passes
  and updates (model.shared_prompts) against the same step without: the same samples,
  so the same loss and gradient norm up to float rounding."""
  from capo_jax.rl import packing  # pylint: disable=import-outside-toplevel

  grouped, plan = [], packing.plan

  def spy(*args, **kwargs):
    grouped.append(kwargs.get("group_B") is not None)
    return plan(*args, **kwargs)

  monkeypatch.setattr(packing, "plan", spy)
  rows = []
  for shared in (False, True):
    c = common.shrink(common.get_base_config())
    c.tokenizer_path, c.data.train = assets["tok"], assets["data"]
    c.rollout.max_prompt_len, c.rollout.max_new_tokens = 256, 8
    c.train.num_steps, c.checkpoint.export_hf = 1, False
    c.model.attention = "reference"  # both layouts on the full score matrix
    c.model.shared_prompts, c.model.shared_prompt_cols = shared, 512
    rl_driver.train(c, str(tmp_path / str(shared)), grader=rl_driver.HashGrader())
    rows.append(json.loads(open(tmp_path / str(shared) / "metrics.jsonl").readline()))
  # The shared run planned its passes and updates with the groups, the other without.
  first = grouped.index(True)
  assert first > 0 and not any(grouped[:first]) and all(grouped[first:])
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(rows[1][key], rows[0][key], rtol=1e-4, err_msg=key)
