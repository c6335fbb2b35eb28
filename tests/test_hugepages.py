"""capo_jax.hugepages: when the launcher re-executes itself with glibc's THP tunable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from capo_jax import hugepages

GLIBC = (2, 36)


@pytest.mark.parametrize(
  "environ, mode, glibc, want",
  [
    ({}, "madvise", GLIBC, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", GLIBC, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise", GLIBC, False),  # done already
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", GLIBC, False),  # the user's own
    ({"CAPO_HUGEPAGES": "0"}, "madvise", GLIBC, False),
    ({}, "always", GLIBC, False),  # the kernel gives them anyway
    ({}, "never", GLIBC, False),
    ({}, "madvise", (2, 34), False),  # the tunable is new in 2.35
    ({}, "madvise", None, False),  # musl, or no libc found
  ],
)
def test_should_reexec(environ, mode, glibc, want):
  if not sys.platform.startswith("linux") and want:
    pytest.skip("re-exec is Linux only")
  assert hugepages.should_reexec(environ, mode=mode, glibc=glibc) is want


def test_tunables_keep_the_users_own():
  assert hugepages.tunables_with_hugepages("") == "glibc.malloc.hugetlb=1"
  assert (
    hugepages.tunables_with_hugepages("glibc.malloc.arena_max=2")
    == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
  )


def test_thp_mode_parses_the_kernel_file(tmp_path):
  path = tmp_path / "enabled"
  path.write_text("always [madvise] never\n")
  assert hugepages.thp_mode(str(path)) == "madvise"
  path.write_text("[always] madvise never\n")
  assert hugepages.thp_mode(str(path)) == "always"
  assert hugepages.thp_mode(str(tmp_path / "missing")) is None


_CHILD = """
import os, sys
from capo_jax import hugepages
print("start", os.getpid(), flush=True)
hugepages.reexec_with_hugepages()
import jax, jax.numpy as jnp, numpy as np
x = jnp.asarray(np.random.default_rng(0).normal(size=(256, 256)), jnp.float32)
y = jax.jit(lambda a: jax.nn.log_softmax(a @ a.T, -1).sum(0))(x)
print("env", os.environ.get("GLIBC_TUNABLES", ""), os.getpid())
print("result", np.asarray(y).tobytes().hex()[:64], np.asarray(y).sum())
"""


def _child(extra_env: dict[str, str]) -> list[str]:
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "CAPO_HUGEPAGES")}
  env.update(extra_env)
  out = subprocess.run(
    [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120, check=True
  ).stdout
  return out.splitlines()


def test_reexec_once_same_pid_same_results():
  if not hugepages.should_reexec({}):
    pytest.skip(
      f"this machine gains nothing from the tunable (THP mode "
      f"{hugepages.thp_mode()!r}, glibc {hugepages.glibc_version()})"
    )
  lines = _child({})
  starts = [line for line in lines if line.startswith("start")]
  env = next(line for line in lines if line.startswith("env")).split()
  assert len(starts) == 2, lines  # the command, then once more under the tunable
  assert env[1] == hugepages.TUNABLE
  assert starts[0].split()[1] == starts[1].split()[1] == env[2]  # execv keeps the pid
  plain = _child({"CAPO_HUGEPAGES": "0"})
  assert sum(line.startswith("start") for line in plain) == 1
  assert "hugetlb" not in next(line for line in plain if line.startswith("env"))
  result = lambda ls: next(line for line in ls if line.startswith("result"))  # noqa: E731
  assert result(lines) == result(plain)  # where the pages come from changes no number
