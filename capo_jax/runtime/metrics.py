"""Run logging: JSONL and TensorBoard metrics, sample dumps, W&B, console summaries.

Only process 0 writes; other processes get a writer whose methods do nothing,
so call sites need no ``if process_index == 0`` of their own. The workdir may
be local or ``gs://`` (``capo_jax.runtime.fs``).

Resuming: a run killed between a step's metrics and its checkpoint logs that
step again after the restart. ``MetricsWriter(..., resume_step=N)`` therefore
drops the JSONL rows past step N and starts TensorBoard's event file with a
purge at N + 1, so every step appears once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from capo_jax.runtime import fs

log = logging.getLogger(__name__)

METRICS_FILE, SAMPLES_FILE, TB_DIR = "metrics.jsonl", "samples.jsonl", "tb"


def _scalar(v: Any) -> float | None:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """Mirror of the metrics to Weights & Biases (``config.log.wandb_*``)."""

  project: str
  entity: str = ""
  name: str = ""
  config: Mapping[str, Any] | None = None


class _JsonlFile:
  """A JSONL file on the path layer that can be appended to and truncated.

  Cloud Storage objects cannot be appended to: a remote file is kept in memory
  and re-uploaded whole on each flush (what ``tf.io.gfile`` does too; the
  metrics of a 600-step run are a few MB).
  """

  def __init__(self, path: str, keep_through_step: int | None) -> None:
    self.path = path
    self.remote = fs.is_remote(path)
    text = fs.read_text(path) if fs.exists(path) else ""
    if keep_through_step is not None and text:
      kept, dropped = [], 0
      for line in text.splitlines(keepends=True):
        try:
          step = json.loads(line).get("step", -1) if line.strip() else None
        except json.JSONDecodeError:  # a torn last line from a kill mid-write
          step = math.inf
        if step is None:
          continue
        if step <= keep_through_step:
          kept.append(line if line.endswith("\n") else line + "\n")
        else:
          dropped += 1
      if dropped:
        log.info("%s: dropped %d rows past the restored step %d", path, dropped, keep_through_step)
        text = "".join(kept)
        fs.write_text(path, text)
    self._buffer = [text] if self.remote else []
    self._file = None if self.remote else open(path, "a", encoding="utf-8")

  def append(self, lines: list[str]) -> None:
    if self._file is None:  # remote: the whole file is rewritten from the buffer
      self._buffer.extend(lines)
      fs.write_text(self.path, "".join(self._buffer))
    else:
      self._file.write("".join(lines))
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


class MetricsWriter:
  """Appends one JSON line per step to ``metrics.jsonl`` and mirrors it to TensorBoard.

  Args:
    workdir: the run directory, local or ``gs://``.
    enabled: False on every process but the first.
    resume_step: the restored checkpoint's step; rows past it are dropped
      (0: a fresh start, every earlier row goes). None keeps everything.
    tensorboard: also write TensorBoard events to ``<workdir>/tb``.
    wandb: mirror metrics and config to Weights & Biases (needs ``wandb``).
  """

  def __init__(
    self,
    workdir: str,
    *,
    enabled: bool = True,
    resume_step: int | None = None,
    tensorboard: bool = True,
    wandb: WandbConfig | None = None,
  ) -> None:
    self.enabled = enabled
    self.workdir = os.fspath(workdir)
    self._tb: Any = None  # a tensorboardX SummaryWriter while TensorBoard logging is on
    self._tb_local: str | None = None  # the events' local directory for a remote workdir
    self._wandb = None
    if not enabled:
      return
    fs.makedirs(self.workdir)
    keep = None if resume_step is None else (resume_step if resume_step > 0 else -1)
    self._jsonl = _JsonlFile(fs.join(self.workdir, METRICS_FILE), keep)
    self._samples = _JsonlFile(fs.join(self.workdir, SAMPLES_FILE), keep)
    if tensorboard:
      self._open_tensorboard(None if keep is None else keep + 1)
    if wandb is not None:
      self._wandb = _start_wandb(wandb, self.workdir)

  def _open_tensorboard(self, purge_step: int | None) -> None:
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    except ImportError:
      log.warning("tensorboardX is not installed: TensorBoard logging is off")
      return
    tb_dir = fs.join(self.workdir, TB_DIR)
    if fs.is_remote(tb_dir):  # events go to a local file, uploaded on each flush
      self._tb_local = tempfile.mkdtemp(prefix="capo-tb-")
    # purge_step: TensorBoard discards earlier events at steps >= purge_step.
    self._tb = SummaryWriter(self._tb_local or tb_dir, purge_step=purge_step)

  def _flush_tensorboard(self) -> None:
    self._tb.flush()
    if self._tb_local is not None:
      for name in os.listdir(self._tb_local):
        fs.upload_file(os.path.join(self._tb_local, name), fs.join(self.workdir, TB_DIR, name))

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    """Writes the scalar entries of ``metrics``; returns them as floats."""
    scalars = {k: f for k, v in metrics.items() if (f := _scalar(v)) is not None}
    if not self.enabled:
      return scalars
    row = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
    self._jsonl.append([json.dumps(row) + "\n"])
    if self._tb is not None:
      for k, v in scalars.items():
        if math.isfinite(v):  # NaN (e.g. AUC with no mixed group) stays in the JSONL only
          self._tb.add_scalar(k, v, step)
      self._flush_tensorboard()
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in scalars.items() if math.isfinite(v)}, step=step)
    return scalars

  def write_samples(self, step: int, records: list[dict[str, Any]]) -> None:
    """A few completions with their reward and s, for a human to read."""
    if not self.enabled or not records:
      return
    self._samples.append(
      [json.dumps({"step": step, **r}, ensure_ascii=False) + "\n" for r in records]
    )

  def close(self) -> None:
    if not self.enabled:
      return
    self._jsonl.close()
    self._samples.close()
    if self._tb is not None:
      self._flush_tensorboard()
      self._tb.close()
      if self._tb_local is not None:
        shutil.rmtree(self._tb_local, ignore_errors=True)
    if self._wandb is not None:
      self._wandb.finish()


def _start_wandb(cfg: WandbConfig, workdir: str) -> Any:
  try:
    import wandb  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(
      "config.log.wandb_project is set but the package 'wandb' is not "
      "installed: pip install wandb (or pip install 'capo-jax[wandb]')"
    ) from e
  # One W&B run per workdir: a resumed run continues the same W&B run.
  run_id = hashlib.sha1(workdir.rstrip("/").encode()).hexdigest()[:16]
  return wandb.init(
    project=cfg.project,
    entity=cfg.entity or None,
    name=cfg.name or os.path.basename(workdir.rstrip("/")),
    id=run_id,
    resume="allow",
    config=dict(cfg.config or {}),
    dir=tempfile.mkdtemp(prefix="capo-wandb-") if fs.is_remote(workdir) else workdir,
  )


def summary_line(
  m: Mapping[str, float],
  keys: tuple[str, ...] = (
    "accuracy",
    "auc_mean",
    "entropy",
    "masked_frac",
    "response_len",
    "grad_norm",
  ),
) -> str:
  """A short ``key=value`` string for the progress bar."""
  parts = []
  for k in keys:
    if k in m:
      parts.append(f"{k}={m[k]:.3g}")
  return " ".join(parts)
