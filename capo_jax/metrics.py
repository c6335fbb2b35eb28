"""Run logging: JSONL and TensorBoard metrics, sample dumps, console summaries.

Only process 0 writes; other processes get a writer whose methods do nothing,
so call sites need no ``if process_index == 0`` of their own.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def _scalar(v: Any) -> float | None:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f


class MetricsWriter:
  """Appends one JSON line per step to ``metrics.jsonl`` and mirrors it to TensorBoard."""

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True) -> None:
    self.enabled = enabled
    self.workdir = workdir
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))
      except ImportError:
        log.warning("tensorboardX is not installed: TensorBoard logging is off")

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    """Writes the scalar entries of ``metrics``; returns them as floats."""
    scalars = {k: f for k, v in metrics.items() if (f := _scalar(v)) is not None}
    if not self.enabled:
      return scalars
    row = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        if math.isfinite(v):  # NaN (e.g. AUC with no mixed group) stays in the JSONL only
          self._tb.add_scalar(k, v, step)
      self._tb.flush()
    return scalars

  def write_samples(self, step: int, records: list[dict[str, Any]]) -> None:
    """A few completions with their reward and s, for a human to read."""
    if not self.enabled or not records:
      return
    path = os.path.join(self.workdir, "samples.jsonl")
    with open(path, "a", encoding="utf-8") as f:
      for r in records:
        f.write(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n")

  def close(self) -> None:
    if not self.enabled:
      return
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def summary_line(m: Mapping[str, float], keys: tuple[str, ...] = (
    "accuracy", "auc_mean", "entropy", "masked_frac", "response_len", "grad_norm")) -> str:
  """A short ``key=value`` string for the progress bar."""
  parts = []
  for k in keys:
    if k in m:
      parts.append(f"{k}={m[k]:.3g}")
  return " ".join(parts)
