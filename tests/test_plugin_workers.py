"""Plug-in workers (capo_jax/data/_grader_pool.py, reward_fns.py, docs/rewards.md): replaced
after `reward.worker_max_calls` calls or above `reward.worker_max_rss_mb`, and killed with
their process group, so a plug-in's subprocess does not outlive a timeout or a crash.
Memory is measured here from /proc, independently of the pool's own reading (Linux)."""

from __future__ import annotations

import os
import textwrap
import time

import numpy as np
import pytest

from capo_jax.data import reward_fns
from capo_jax.data.rows import Example

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")

LEAK_MB = 100

PLUGINS = textwrap.dedent(f'''
    import os, subprocess, time

    _LEAK = []

    def pid(completions, examples):
      return [os.getpid()] * len(completions)

    def leak(completions, examples):
      """Keeps {LEAK_MB} MiB more per call (written, so resident); returns the chunks held."""
      _LEAK.append(b"x" * ({LEAK_MB} << 20))
      return [len(_LEAK)] * len(completions)

    def _spawn(pid_file):
      child = subprocess.Popen(["sleep", "600"])
      with open(pid_file, "w") as f:
        f.write(str(child.pid))

    def spawn_and_hang(completions, examples):
      _spawn(completions[0])
      time.sleep(600)

    def spawn_and_crash(completions, examples):
      _spawn(completions[0])
      os._exit(3)
    ''')


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> str:
  path = tmp_path_factory.mktemp("workers") / "workers.py"
  path.write_text(PLUGINS)
  return str(path)


@pytest.fixture(autouse=True)
def _one_worker(monkeypatch):
  """One worker per pool, so which worker runs a call is known; pools closed after."""
  monkeypatch.setenv("CAPO_GRADER_WORKERS", "1")
  before = set(reward_fns._pools)  # pylint: disable=protected-access
  yield
  for key in set(reward_fns._pools) - before:  # pylint: disable=protected-access
    reward_fns._pools.pop(key).close()  # pylint: disable=protected-access


def _call(fns: reward_fns.RewardFns, text: str = "a") -> tuple[float, dict]:
  """One question of one completion: the reward and the health counts."""
  e = Example(id="q", problem="p", answer="1")
  got, health = fns([text], [e], np.zeros(1), np.ones(1))
  return float(got[0]), health


def _vm_rss_mb(pid: int) -> float:
  with open(f"/proc/{pid}/status", encoding="ascii") as f:
    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
  return kb / 1024


def _alive(pid: int) -> bool:
  """Running or sleeping; a zombie (state Z, waiting to be reaped) is dead."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _gone_within(pid: int, seconds: float) -> bool:
  deadline = time.monotonic() + seconds
  while _alive(pid):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.05)
  return True


def test_worker_replaced_every_max_calls(plugins: str) -> None:
  fns = reward_fns.RewardFns(
    fns=(f"{plugins}:pid",), weights=(1.0,), timeout_s=30.0, worker_max_calls=2, worker_max_rss_mb=0
  )
  pids = [_call(fns)[0] for _ in range(5)]
  # Calls 1-2 in one worker, 3-4 in the next, 5 in a third.
  assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4] != pids[0], pids
  pool = reward_fns.pool(30.0, 2, 0)
  assert (pool.num_recycled, pool.num_restarts) == (2, 0)


def test_leaking_plugin_kept_under_the_memory_ceiling(plugins: str) -> None:
  name = f"{plugins}:leak"
  # Without a ceiling the worker grows by LEAK_MB per call (the measurement sees the leak).
  free = reward_fns.RewardFns(
    fns=(name,), weights=(1.0,), timeout_s=30.0, worker_max_calls=0, worker_max_rss_mb=0
  )
  assert _call(free)[0] == 1
  (worker,) = reward_fns.pool(30.0, 0, 0).worker_pids()
  rss1 = _vm_rss_mb(worker)
  assert [_call(free)[0] for _ in range(2)] == [2, 3]
  assert _vm_rss_mb(worker) - rss1 > 1.9 * LEAK_MB
  reward_fns._pools.pop((30.0, 0, 0.0)).close()  # pylint: disable=protected-access
  # A ceiling half a leak above a worker holding one leak: a second leak passes it.
  ceiling = rss1 + LEAK_MB / 2
  capped = reward_fns.RewardFns(
    fns=(name,), weights=(1.0,), timeout_s=30.0, worker_max_calls=0, worker_max_rss_mb=ceiling
  )
  held = []
  for _ in range(5):
    held.append(_call(capped)[0])
    for pid in reward_fns.pool(30.0, 0, ceiling).worker_pids():
      assert _vm_rss_mb(pid) <= ceiling, (held, ceiling)
  assert held == [1, 2, 1, 2, 1]  # each worker served two calls, then was replaced
  assert reward_fns.pool(30.0, 0, ceiling).num_recycled == 2


def test_timeout_kills_the_plugins_subprocess(plugins: str, tmp_path) -> None:
  pid_file = tmp_path / "child.pid"
  fns = reward_fns.RewardFns(fns=(f"{plugins}:spawn_and_hang",), weights=(1.0,), timeout_s=2.0)
  reward, health = _call(fns, str(pid_file))
  assert (reward, health) == (0.0, {"fn_timeout": 1})
  child = int(pid_file.read_text())
  try:
    assert _gone_within(child, 10.0), f"the plug-in's `sleep 600` (pid {child}) outlived it"
  finally:
    if _alive(child):
      os.kill(child, 9)


def test_crash_kills_the_plugins_subprocess(plugins: str, tmp_path) -> None:
  pid_file = tmp_path / "child.pid"
  fns = reward_fns.RewardFns(fns=(f"{plugins}:spawn_and_crash",), weights=(1.0,), timeout_s=30.0)
  with pytest.raises(reward_fns.RewardFnError, match=r"raised worker died \(exit code 3\)"):
    _call(fns, str(pid_file))
  child = int(pid_file.read_text())
  try:
    assert _gone_within(child, 10.0), f"the plug-in's `sleep 600` (pid {child}) outlived it"
  finally:
    if _alive(child):
      os.kill(child, 9)
