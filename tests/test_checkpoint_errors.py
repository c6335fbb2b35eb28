"""Checkpoints are deleted only for proven damage, and every failure is early and named.

A transient read error is retried and then stops the run, moving nothing; named
damage moves a step to ``quarantine/``; a changed optimizer tree is ConfigChanged
naming the field, with config.json left as it was; a full disk on save is one line
naming the path; an unwritable workdir stops the run before any work.
"""

from __future__ import annotations

import errno
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import gcs_emulator
import rl_driver
from capo_jax.runtime import checkpoint as ckpt_lib
from capo_jax.runtime import fs, run_record

QUARANTINE = "quarantine"  # checkpoint.QUARANTINE (a literal: the probe runs on old code too)


def _state(scale: float) -> dict:
  return {"w": jnp.arange(64.0) * scale, "opt": {"mu": jnp.ones((4, 8)) * scale}}


def _abstract(state: dict) -> dict:
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state)


@pytest.fixture
def saved(tmp_path, monkeypatch) -> pathlib.Path:
  """A workdir with checkpoints of steps 1, 2, 3 (each step's arrays scaled by it)."""
  monkeypatch.setattr(ckpt_lib, "RETRY_DELAYS_S", (0.0, 0.0), raising=False)
  ck = ckpt_lib.Checkpointer(str(tmp_path), every_steps=1, keep=5)
  for step in (1, 2, 3):
    ck.save(step, _state(float(step)), {"step": step})
  ck.close()
  return tmp_path


def _steps(workdir: pathlib.Path) -> list[str]:
  return sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_transient_read_error_is_retried_and_then_stops_the_run_deleting_nothing(
  saved, monkeypatch, caplog
):
  real = ocp.CheckpointManager.restore
  calls = []

  def flaky(self, step, *args, **kwargs):  # EIO twice (a storage hiccup), then the data
    calls.append(step)
    if len(calls) <= 2:
      raise OSError(errno.EIO, "Input/output error")
    return real(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", flaky)
  ck = ckpt_lib.Checkpointer(str(saved), every_steps=1, keep=5)
  with caplog.at_level(logging.WARNING):
    step, state, meta = ck.restore_latest(_abstract(_state(0.0)))
  assert (step, meta) == (3, {"step": 3}) and calls == [3, 3, 3]
  np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(64.0) * 3)
  assert caplog.text.count("reading checkpoint step 3 failed") == 2

  def down(self, step, *args, **kwargs):  # the storage stays down
    raise OSError(errno.EIO, "Input/output error")

  monkeypatch.setattr(ocp.CheckpointManager, "restore", down)
  ck = ckpt_lib.Checkpointer(str(saved), every_steps=1, keep=5)
  with pytest.raises(
    ckpt_lib.CheckpointUnavailable,
    match=r"step 3 .* could not be read after 3 tries .*Input/output error.*"
    "nothing was moved or deleted",
  ):
    ck.restore_latest(_abstract(_state(0.0)))
  assert _steps(saved) == ["1", "2", "3"]
  assert not (saved / "checkpoints" / QUARANTINE).exists()


@pytest.mark.parametrize("damage", ["truncated_array", "bad_json", "missing_file"])
def test_named_damage_moves_the_step_to_quarantine_and_resumes_before_it(saved, damage, caplog):
  step3 = saved / "checkpoints" / "3"
  if damage == "truncated_array":
    for f in (step3 / "state").rglob("*"):
      if f.is_file() and f.parent.name == "d":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  elif damage == "bad_json":
    (step3 / "state" / "_METADATA").write_text('{"tree_metadata": ')
  else:
    (step3 / "state" / "manifest.ocdbt").unlink()
  files = sorted(str(p.relative_to(step3)) for p in step3.rglob("*"))
  ck = ckpt_lib.Checkpointer(str(saved), every_steps=1, keep=5)
  with caplog.at_level(logging.ERROR):
    step, state, _ = ck.restore_latest(_abstract(_state(0.0)))
  assert step == 2
  np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(64.0) * 2)
  moved = saved / "checkpoints" / QUARANTINE / "3"
  assert sorted(str(p.relative_to(moved)) for p in moved.rglob("*")) == files  # kept whole
  assert _steps(saved) == ["1", "2"] and "checkpoint step 3" in caplog.text
  ck.save(3, _state(30.0), {"step": 3})  # the step is saved again
  assert _steps(saved) == ["1", "2", "3"]


def test_a_full_disk_on_save_is_one_line_naming_the_path(saved, monkeypatch, caplog):
  ck = ckpt_lib.Checkpointer(str(saved), every_steps=1, keep=5)

  def full(*args, **kwargs):  # as Orbax's writer thread reports it: wrapped once more
    try:
      raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as e:
      raise RuntimeError("asyncio task failed") from e

  monkeypatch.setattr(ck._manager, "save", full)  # pylint: disable=protected-access
  want = f"checkpoint save to {saved / 'checkpoints' / '4'} failed: ENOSPC: No space left on device"
  with caplog.at_level(logging.ERROR), pytest.raises(ckpt_lib.CheckpointError) as e:
    ck.save(4, _state(4.0), {})
  assert str(e.value) == want
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [want]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
  return rl_driver.write_assets(tmp_path_factory.mktemp("ckpt_errors"))


def _config(assets: dict[str, str], steps: int):
  c = rl_driver.tiny_config(assets["tok"], assets["data"], steps)
  c.checkpoint.export_hf = False
  return c


@pytest.mark.slow  # ~30 s: two real runs (.ci/run runs it)
def test_a_changed_optimizer_tree_is_config_changed_naming_the_field(assets, tmp_path):
  workdir = tmp_path / "run"
  rl_driver.train(_config(assets, 1), str(workdir), grader=rl_driver.HashGrader())
  before = (workdir / "config.json").read_text()
  c = _config(assets, 2)
  c.optim.grad_clip = 0.0  # no clipping: one optimizer state fewer
  with pytest.raises(
    run_record.ConfigChanged,
    match=r"checkpoint step 1 .* holds other arrays .*"
    r"optim\.grad_clip: 1\.0 -> 0\.0",
  ):
    rl_driver.train(c, str(workdir), grader=rl_driver.HashGrader())
  assert (workdir / "config.json").read_text() == before  # the next run compares with 1.0
  assert _steps(workdir) == ["1"]
  assert not (workdir / "checkpoints" / QUARANTINE).exists()
  assert not (workdir / "lease.json").exists()  # released on the error


def test_an_unwritable_workdir_stops_the_run_before_any_work(assets, tmp_path, monkeypatch):
  if gcs_emulator.available() is not None:
    pytest.skip(str(gcs_emulator.available()))
  with gcs_emulator.GcsEmulator("capo-errors") as gcs:
    gcs.apply(monkeypatch)
    workdir = "gs://no-such-bucket/run"
    with pytest.raises(fs.NotWritable, match=f"the workdir {workdir} is not writable"):
      rl_driver.train(_config(assets, 1), workdir, grader=rl_driver.HashGrader())
