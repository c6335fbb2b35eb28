"""One run per workdir: the lease, on a local disk and on a Cloud Storage API (the emulator)."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

import gcs_emulator
import host_utils
import rl_driver
from capo_jax.runtime import fs
from capo_jax.runtime import lease as lease_lib

BUCKET = "capo-lease"


@pytest.fixture(scope="module")
def gcs():
  if gcs_emulator.available() is not None:
    pytest.skip(str(gcs_emulator.available()))
  with gcs_emulator.GcsEmulator(BUCKET) as emulator:
    yield emulator


@pytest.fixture(params=["local", "gcs"])
def workdir(request, tmp_path, monkeypatch) -> str:
  if request.param == "local":
    return str(tmp_path / "run")
  request.getfixturevalue("gcs").apply(monkeypatch)
  return f"gs://{BUCKET}/{tmp_path.name}/run"


def _write_holder(workdir: str, **fields) -> None:
  rec = {
    "host": socket.gethostname(),
    "pid": 1,
    "run_id": "old",
    "since": "then",
    "heartbeat": time.time(),
    **fields,
  }
  fs.write_text(fs.join(workdir, lease_lib.LEASE_FILE), json.dumps(rec))


def test_a_second_run_is_refused_naming_the_first_until_it_releases(workdir):
  fs.makedirs(workdir)
  first = lease_lib.Lease(workdir).acquire()
  holder = json.loads(fs.read_text(fs.join(workdir, lease_lib.LEASE_FILE)))
  assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
  with pytest.raises(
    lease_lib.LeaseHeld,
    match=re.escape(
      f"another run holds this workdir: host "
      f"{socket.gethostname()}, pid {os.getpid()}, since "
      f"{holder['since']}"
    ),
  ):
    lease_lib.Lease(workdir).acquire()
  first.release()
  assert not fs.exists(fs.join(workdir, lease_lib.LEASE_FILE))
  with lease_lib.Lease(workdir):  # free again
    pass


def test_the_heartbeat_keeps_the_lease_fresh(workdir):
  fs.makedirs(workdir)
  path = fs.join(workdir, lease_lib.LEASE_FILE)
  with lease_lib.Lease(workdir, heartbeat_s=0.05, stale_after_s=0.5):
    t0 = json.loads(fs.read_text(path))["heartbeat"]
    time.sleep(1.0)  # twice stale_after_s: only the heartbeat keeps it alive
    assert json.loads(fs.read_text(path))["heartbeat"] > t0 + 0.5
    with pytest.raises(lease_lib.LeaseHeld):
      lease_lib.Lease(workdir, stale_after_s=0.5).acquire()


def test_a_stale_lease_is_taken_over_with_a_warning(workdir, caplog):
  fs.makedirs(workdir)
  ended = subprocess.run(
    [sys.executable, "-c", "import os; print(os.getpid())"],
    capture_output=True,
    text=True,
    check=True,
  )
  dead_pid = int(ended.stdout)
  _write_holder(workdir, pid=dead_pid)  # this host, its process gone: stale at once
  with caplog.at_level(logging.WARNING), lease_lib.Lease(workdir) as lease:
    assert json.loads(fs.read_text(lease.path))["run_id"] == lease.run_id
  assert f"process {dead_pid} on this host has ended" in caplog.text
  _write_holder(workdir, host="elsewhere", pid=7, heartbeat=time.time() - 120)
  with caplog.at_level(logging.WARNING), lease_lib.Lease(workdir, stale_after_s=60):
    pass
  assert "no heartbeat for 120 s" in caplog.text
  _write_holder(workdir, host="elsewhere", pid=7, heartbeat=time.time() - 5)
  with pytest.raises(lease_lib.LeaseHeld, match="host elsewhere, pid 7, since then"):
    lease_lib.Lease(workdir, stale_after_s=60).acquire()


def test_of_many_runs_racing_for_a_stale_lease_exactly_one_wins(workdir):
  fs.makedirs(workdir)
  _write_holder(workdir, host="elsewhere", heartbeat=0.0)
  n = 6
  barrier = threading.Barrier(n)
  won, refused = [], []

  def race() -> None:
    me = lease_lib.Lease(workdir, heartbeat_s=3600)
    barrier.wait()
    try:
      won.append(me.acquire())
    except lease_lib.LeaseHeld as e:
      refused.append(str(e))

  threads = [threading.Thread(target=race) for _ in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(won) == 1 and len(refused) == n - 1, (won, refused)
  assert json.loads(fs.read_text(won[0].path))["run_id"] == won[0].run_id
  assert all(won[0].run_id in r for r in refused)
  won[0].release()


REPO = pathlib.Path(__file__).resolve().parent.parent
DRIVER = str(REPO / "tests" / "rl_driver.py")
TIMING = ("time_", "time/", "_per_s")  # wall-clock fields differ between any two runs


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
  return rl_driver.write_assets(tmp_path_factory.mktemp("lease_run"))


def test_a_run_on_a_held_bucket_workdir_stops_before_writing(gcs, assets, tmp_path, monkeypatch):
  gcs.apply(monkeypatch)
  workdir = f"gs://{BUCKET}/{tmp_path.name}/held"
  c = rl_driver.tiny_config(assets["tok"], assets["data"], 1)
  with lease_lib.Lease(workdir) as first:
    with pytest.raises(
      lease_lib.LeaseHeld,
      match=f"host {socket.gethostname()}, pid {os.getpid()}, .*run {first.run_id}",
    ):
      rl_driver.train(c, workdir, grader=rl_driver.HashGrader())
    assert [p.name for p in fs.path(workdir).iterdir()] == [lease_lib.LEASE_FILE]


def _env() -> dict[str, str]:
  env = dict(
    os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}", CAPO_GRADER_WORKERS="1", JAX_PLATFORMS="cpu"
  )
  env.pop("XLA_FLAGS", None)
  return env


def _driver(workdir: pathlib.Path, assets: dict[str, str], *overrides: str) -> list[str]:
  return [sys.executable, DRIVER, str(workdir), assets["tok"], assets["data"], "3", *overrides]


def _outputs(workdir: pathlib.Path) -> dict[str, object]:
  rows = [
    {k: v for k, v in r.items() if not any(t in k for t in TIMING)}
    for r in host_utils.read_jsonl(str(workdir / "metrics.jsonl"))
  ]
  return {
    "metrics": rows,
    "params": (workdir / "params.0.sha256").read_text(),
    "checkpoints": sorted(p.name for p in (workdir / "checkpoints").iterdir()),
    "export": (workdir / "export_hf" / "model.safetensors").read_bytes(),
    "lr": json.loads((workdir / "config.json").read_text())["config"]["optim"]["lr"],
  }


@pytest.mark.slow  # three tiny runs in subprocesses (~1-2 min on 2 cores)
def test_a_second_run_on_a_busy_workdir_stops_and_the_first_equals_a_solo_run(assets, tmp_path):
  busy, solo = tmp_path / "busy", tmp_path / "solo"
  first = subprocess.Popen(
    _driver(busy, assets), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  deadline = time.time() + 300
  while not (busy / lease_lib.LEASE_FILE).exists():
    assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
    time.sleep(0.2)
  second = subprocess.run(
    _driver(busy, assets, "optim.lr=0.01"), env=_env(), capture_output=True, text=True, timeout=600
  )
  _, err = first.communicate(timeout=600)
  assert first.returncode == 0, err[-3000:]
  assert second.returncode != 0
  assert (
    f"another run holds this workdir: host {socket.gethostname()}, pid {first.pid}" in second.stderr
  ), second.stderr[-3000:]
  subprocess.run(_driver(solo, assets), env=_env(), capture_output=True, check=True, timeout=600)
  got, want = _outputs(busy), _outputs(solo)
  assert [r["step"] for r in got["metrics"] if "loss" in r] == [1, 2, 3]
  assert got == want
  assert not (busy / lease_lib.LEASE_FILE).exists()  # released at the end
