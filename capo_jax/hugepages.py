"""Transparent huge pages for the host heap: one re-exec with glibc's ``hugetlb`` tunable.

XLA:CPU allocates each execution's temporaries as one block (1.1 GB for the
27.7M-parameter train step of ``benchmarks/train_step.py``) and frees it at the
end, so glibc maps fresh 4 KiB pages every step: hundreds of thousands of page
faults and a fifth of the step in kernel time. Where the kernel's transparent huge
pages are in ``madvise`` mode (the common default), glibc >= 2.35 asks for 2 MiB
pages when ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: a few hundred times fewer
faults, and a faster step (the measured figures: docs/training.md, "CPU runs: huge
pages", and the train-step row of docs/benchmarks.md). The results are
bit-identical: only where memory comes from changes.

glibc reads the tunable once, at process start, so ``reexec_with_hugepages`` starts
the same command again with it set (``os.execv``: same pid, same arguments) when
that helps, and does nothing otherwise: not Linux/glibc, glibc older than 2.35,
THP ``always`` (nothing to gain) or ``never`` (nothing to get), the tunable already
set, or ``CAPO_HUGEPAGES=0``. Standard library only: it runs before JAX is imported.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "CAPO_HUGEPAGES"  # "0": never re-exec
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_DETECT: Any = object()  # should_reexec's default: this machine's value


def thp_mode(path: str = _THP_MODE) -> str | None:
  """The kernel's THP mode (``always`` / ``madvise`` / ``never``), None if unknown."""
  try:
    with open(path, encoding="ascii") as f:
      text = f.read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1 : end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
  lib, version = platform.libc_ver()
  if lib != "glibc" or not version:
    return None
  try:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)
  except ValueError:
    return None


def should_reexec(
  environ: Any = os.environ, *, mode: str | None = _DETECT, glibc: tuple[int, int] | None = _DETECT
) -> bool:
  """Whether a re-exec with ``TUNABLE`` would give this process huge pages it lacks.

  ``mode`` (``thp_mode``) and ``glibc`` (``glibc_version``; None: not glibc) default
  to this machine's; tests pass their own.
  """
  if environ.get(OPT_OUT, "1") == "0" or "glibc.malloc.hugetlb" in environ.get(
    "GLIBC_TUNABLES", ""
  ):
    return False
  if not sys.platform.startswith("linux"):
    return False
  mode = thp_mode() if mode is _DETECT else mode
  glibc = glibc_version() if glibc is _DETECT else glibc
  return mode == "madvise" and glibc is not None and glibc >= (2, 35)


def tunables_with_hugepages(current: str) -> str:
  """``GLIBC_TUNABLES`` with ``TUNABLE`` added (colon-separated, existing ones kept)."""
  return f"{current}:{TUNABLE}" if current else TUNABLE


def reexec_with_hugepages() -> None:
  """Re-executes this command with huge pages when ``should_reexec``; else returns."""
  if not should_reexec():
    return
  os.environ["GLIBC_TUNABLES"] = tunables_with_hugepages(os.environ.get("GLIBC_TUNABLES", ""))
  sys.stdout.flush()
  sys.stderr.flush()
  # sys.orig_argv is the command as typed (``python -m capo_jax.main ...``).
  os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
