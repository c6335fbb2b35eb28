"""A process whose peer died says so, naming it, before JAX aborts it (issue 44, item 6).

Two real processes under ``jax.distributed`` on localhost (``maybe_initialize``, as the
trainer starts); one dies with ``os._exit`` (no clean shutdown, as under ``kill -9``), and
the survivor's log must name it before JAX's coordination service aborts the survivor.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = r"""
import logging, os, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from capo_jax.runtime import distributed
assert distributed.maybe_initialize()
print("ready", flush=True)
if int(os.environ["JAX_PROCESS_ID"]) == int(os.environ["DIES"]):
  time.sleep(2)
  os._exit(1)
time.sleep(120)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(dies: int, heartbeat_timeout_s: int) -> list[subprocess.Popen]:
  port, procs = _free_port(), []
  for pid in range(2):
    env = dict(
      os.environ,
      PYTHONPATH=str(REPO),
      JAX_PLATFORMS="cpu",
      DIES=str(dies),
      JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
      JAX_NUM_PROCESSES="2",
      JAX_PROCESS_ID=str(pid),
      CAPO_PEER_STALE_S="4",
      CAPO_HEARTBEAT_TIMEOUT_S=str(heartbeat_timeout_s),
    )
    env.pop("XLA_FLAGS", None)
    procs.append(
      subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
      )
    )
  return procs


def _run(dies: int) -> tuple[subprocess.Popen, list[subprocess.Popen], str, float]:
  procs = _launch(dies, heartbeat_timeout_s=20)
  survivor = procs[1 - dies]
  start = time.monotonic()
  try:
    _, err = survivor.communicate(timeout=90)  # JAX aborts it in the end
  finally:
    for p in procs:
      p.kill()
      p.wait()
  return survivor, procs, err, time.monotonic() - start


@pytest.mark.slow  # ~25 s: two processes and JAX's 20 s heartbeat timeout (.ci/run runs it)
def test_process_0_names_a_dead_peer_before_jax_aborts_it():
  survivor, procs, err, took = _run(dies=1)
  lines = [line for line in err.splitlines() if "process 1 (" in line]
  assert len(lines) == 1, err[-3000:]
  assert "has probably died" in lines[0] and "heartbeat_timeout_seconds=20" in lines[0]
  assert f"pid {procs[1].pid}" in lines[0] and socket.gethostname() in lines[0]
  # ... before the abort: JAX's own fatal lines follow ours, and the survivor did die.
  after = err[err.index(lines[0]) + len(lines[0]) :]
  assert survivor.returncode != 0 and "Terminating process" in after, err[-2000:]
  assert took < 60


@pytest.mark.slow  # two processes (.ci/run runs it)
def test_when_the_coordinator_dies_the_others_abort_at_once_saying_so():
  """Process 0 hosts the coordination service: the others lose it at once and JAX aborts
  them with its own line naming the leader, before any heartbeat could be missed."""
  survivor, _, err, took = _run(dies=0)
  assert survivor.returncode != 0
  assert "the leader task was preempted/died" in err, err[-2000:]
  assert took < 15  # 2 s to the death, then the abort (no heartbeat timeout)
