"""``<workdir>/config.json``: the run's resolved config, package version and git commit.

Written at start (command-line overrides included). A resumed run compares its
config with the recorded one and names every changed field: a field that
changes array shapes or the data stream (model, batch and sequence sizes,
mesh, data split) would make the checkpoint unusable or the run a different
experiment, so that is an error; any other change (learning rate, number of
steps, logging) is a warning, and the new config is recorded.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
from collections.abc import Mapping
from typing import Any

from capo_jax.runtime import fs

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
# Dotted prefixes of the fields that a resumed run may not change.
SHAPE_FIELDS = (
  "model.hf_path",
  "model.preset",
  "model.preset_overrides.",
  "model.param_dtype",
  "model.lora_rank",
  "model.lora_alpha",
  "model.lora_targets",
  "tokenizer_path",
  "seed",
  "rollout.num_prompts",
  "rollout.num_samples",
  "rollout.max_prompt_len",
  "rollout.max_new_tokens",
  "rollout.prompts_per_call",
  "train.mini_batch_prompts",
  "train.micro_batch_size",
  "train.logprob_chunk",
  "mesh.",
  "data.train",
  "data.train_size",
  "data.val_size",
  "data.split_seed",
  "data.data_dir",
  "data.skip_bad_rows",
  "algo.name",
  "loss.simko_k",
)


class ConfigChanged(ValueError):
  """A resumed run changed a field that its checkpoint depends on."""


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out: dict[str, Any] = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
  return out


def _git_commit() -> str | None:
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(
      ["git", "-C", here, "rev-parse", "HEAD"],
      capture_output=True,
      text=True,
      timeout=10,
      check=False,
    )
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None if out.returncode == 0 else None


def _version() -> str:
  from importlib import metadata  # pylint: disable=import-outside-toplevel

  try:
    return metadata.version("capo-jax")
  except metadata.PackageNotFoundError:
    return "unknown"


def changed_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
  """``{dotted field: (old, new)}`` of the fields that differ (missing = None)."""
  a, b = _flatten(old), _flatten(new)
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def is_shape_field(field: str) -> bool:
  return any(field == p or (p.endswith(".") and field.startswith(p)) for p in SHAPE_FIELDS)


def record(
  config: Mapping[str, Any], workdir: str, *, resuming: bool, write: bool = True
) -> dict[str, Any]:
  """Checks the resolved ``config`` (JSON values) against the recorded one (when
  resuming) and records it.

  Raises ConfigChanged naming the fields when a resumed run changes a shape
  field; logs a warning naming the others. ``write`` is False on every
  process but the first. Returns the record written.
  """
  path = fs.join(workdir, CONFIG_FILE)
  new = json.loads(json.dumps(dict(config)))
  previous = None
  if fs.exists(path):
    try:
      previous = json.loads(fs.read_text(path))
    except json.JSONDecodeError as e:
      log.warning("%s: unreadable (%s); recording the config anew", path, e)
  if resuming and previous is not None:
    diff = changed_fields(previous.get("config", {}), new)
    fatal = {k: v for k, v in diff.items() if is_shape_field(k)}
    if fatal:
      raise ConfigChanged(
        f"{path}: this run resumes a checkpoint made with another config; these fields "
        "change shapes or the data stream and must match the recorded run: "
        + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in fatal.items())
        + ". Use another --workdir for a new run."
      )
    if diff:
      log.warning(
        "resuming with a changed config: %s",
        "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()),
      )
  rec = {
    "config": new,
    "capo_jax_version": _version(),
    "git_commit": _git_commit(),
    "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  if previous is not None and previous.get("config") != new:
    rec["previous"] = {k: previous.get(k) for k in ("config", "git_commit", "written_at")}
  if write:
    write_record(rec, workdir)
  return rec


def write_record(rec: Mapping[str, Any], workdir: str) -> None:
  """Writes a ``record(..., write=False)`` result; the trainer does so once the
  checkpoint restored, so that a failed resume leaves the previous record."""
  fs.write_text(fs.join(workdir, CONFIG_FILE), json.dumps(rec, indent=1, sort_keys=True) + "\n")
