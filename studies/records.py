"""What every study shares: its design on disk, the machine each run finished on, the
report's header and files, and the number formats of its tables.

A study's runs may be split over machines and its report made on another one, so
each run records where it finished (``record_machine``) and each report says where
every run came from (``ran_on``), with its own machine, commit and date.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
from typing import Any

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent


def check_design(path: str, design: dict[str, Any]) -> None:
  """Writes ``design`` to ``path``, or exits if the file there holds another one."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      if json.load(f) != json.loads(json.dumps(design)):
        raise SystemExit(
          f"{path}: the runs under {os.path.dirname(path)} were made with "
          "another DESIGN; use a new --root"
        )
  else:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(design, f, indent=1)


def machine() -> str:
  """This machine's CPU model and core count."""
  cpu = platform.processor() or platform.machine()
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return f"{cpu}, {os.cpu_count()} cores"


def git_commit() -> str:
  """The checkout's short commit (empty outside a git checkout)."""
  return subprocess.run(
    ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
    capture_output=True,
    text=True,
    check=False,
  ).stdout.strip()


def record_machine(run_dir: pathlib.Path) -> None:
  """``<run_dir>/ran_on.json``: the machine, JAX version and date a run finished on. A
  study's runs may be split over machines; XLA's float rounding differs between them."""
  import jax  # pylint: disable=import-outside-toplevel

  (run_dir / "ran_on.json").write_text(
    json.dumps(
      {"machine": machine(), "jax": jax.__version__, "date": datetime.date.today().isoformat()}
    ),
    encoding="utf-8",
  )


def ran_on(run_dirs: list[pathlib.Path]) -> dict[str, int]:
  """How many of ``run_dirs`` finished on each machine (``record_machine``)."""
  out: dict[str, int] = {}
  for d in run_dirs:
    path = d / "ran_on.json"
    if path.exists():
      r = json.loads(path.read_text(encoding="utf-8"))
      where = f"{r['machine']}, jax {r['jax']}, {r['date']}"
    else:
      where = "not recorded"
    out[where] = out.get(where, 0) + 1
  return out


def write_report(out: str, stem: str, text: str, payload: dict[str, Any]) -> None:
  """``<out>/<stem>.md`` (``text``) and ``<out>/<stem>.json`` (``payload`` with the
  machine, the commit and the date)."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"{stem}.md"), "w", encoding="utf-8") as f:
    f.write(text)
  with open(os.path.join(out, f"{stem}.json"), "w", encoding="utf-8") as f:
    json.dump(
      {
        **payload,
        "machine": machine(),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
      },
      f,
      indent=1,
      default=str,
    )


def header(study: str, run_dirs: list[pathlib.Path]) -> str:
  """The report's first words: the study, the date, the machine and the commit of the
  report, and the machines the runs were made on."""
  runs = "; ".join(f"{n} on {where}" for where, n in ran_on(run_dirs).items())
  return (
    f"{study}, report of {datetime.date.today().isoformat()} on {machine()}, commit "
    f"{git_commit()}; runs: {runs or 'none finished'}."
  )


def fmt(v: Any, sign: bool = False) -> str:
  """A table cell: three decimals (signed with ``sign``), "-" for a missing value."""
  if v is None or not np.isfinite(v):
    return "-"
  return f"{v:+.3f}" if sign else f"{v:.3f}"


def mean_sd(vals: list[float]) -> str:
  """A table cell: the mean ± sd of the finite values (the mean alone for one)."""
  vals = [v for v in vals if v is not None and np.isfinite(v)]
  if not vals:
    return "-"
  return f"{np.mean(vals):.3f}" + (f" ± {np.std(vals, ddof=1):.3f}" if len(vals) > 1 else "")
