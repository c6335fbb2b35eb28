"""Run a test file's ``__main__`` in a child process with N fake CPU devices.

JAX fixes its device count when it starts, so a test that needs a mesh runs its body
in a fresh interpreter (``XLA_FLAGS=--xla_force_host_platform_device_count=N``) and
checks what the child prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(
  test_file: str, devices: int = 8, fast_compile: bool = False, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
  """``python test_file`` on ``devices`` CPU devices, the repo and tests/ importable.
  ``fast_compile``: LLVM at -O0, which halves a tiny model's compile time (XLA's own
  passes still run)."""
  flags = f"--xla_force_host_platform_device_count={devices}"
  if fast_compile:
    flags += " --xla_backend_optimization_level=0"
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
    XLA_FLAGS=flags,
  )
  return subprocess.run(
    [sys.executable, os.path.abspath(test_file)],
    env=env,
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def child_results(test_file: str, **kwargs: Any) -> Any:
  """``run_child(test_file, **kwargs)`` and the JSON its child printed after ``RESULTS ``
  (the test fails with the child's output when it printed none)."""
  res = run_child(test_file, **kwargs)
  lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULTS ")]
  assert res.returncode == 0 and lines, res.stdout[-2000:] + res.stderr[-3000:]
  return json.loads(lines[0][len("RESULTS ") :])
