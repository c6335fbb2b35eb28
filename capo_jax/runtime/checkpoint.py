"""Atomic, resumable checkpoints with Orbax, and the final HF export.

A checkpoint holds the train state (params, optimizer state, step) as sharded
arrays plus a small JSON record (rng key data, data-iterator state, run
metadata). Orbax writes each step to a temporary directory and renames it
when complete, so a crash mid-save never leaves a half-written checkpoint
that a restart would pick up. Works with local paths and ``gs://`` paths.

A checkpoint can still be damaged after the fact (a truncated file, a
half-synced copy). ``restore_latest`` then names the step and the file, falls
back to the newest readable checkpoint and deletes the damaged ones, so the
run saves those steps again instead of skipping them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from capo_jax.runtime import fs

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
  """No checkpoint of a run directory can be read."""


def _check_json_files(step_dir: str) -> None:
  """Parses every JSON file Orbax wrote in a step directory; names the first bad one.

  Orbax reports a truncated JSON file as a bare ``JSONDecodeError``, without
  the file; this check runs first so the error says which file it is.
  """
  root = fs.path(step_dir)
  arrays = root / "state" / "array_metadatas"
  files = [root / "_CHECKPOINT_METADATA", root / "meta" / "metadata",
           root / "state" / "_METADATA", root / "state" / "_sharding"]
  files += sorted(arrays.iterdir()) if arrays.exists() else []
  for f in files:
    if not f.exists():
      continue
    try:
      json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{f}: invalid JSON ({e})") from None


class Checkpointer:
  """Periodic saves to ``<workdir>/checkpoints`` and restore of the latest."""

  def __init__(self, workdir: str, *, every_steps: int, keep: int = 2,
               async_save: bool = False) -> None:
    if every_steps < 0:
      raise ValueError(f"checkpoint.every_steps must be >= 0, got {every_steps}")
    self.every_steps = every_steps
    directory = fs.join(workdir, "checkpoints")
    self._manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save),
        item_names=("state", "meta"),
    )

  @property
  def directory(self) -> str:
    return str(self._manager.directory)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def should_save(self, step: int) -> bool:
    return self.every_steps > 0 and step % self.every_steps == 0

  def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
    """Saves ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``."""
    if not force and not self.should_save(step):
      return False
    if step in self._manager.all_steps():
      return False
    saved = self._manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                      meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()
    if saved:
      log.info("saved checkpoint step %d to %s", step, self.directory)
    return bool(saved)

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, state, meta) of the newest readable checkpoint, or None when there is none.

    ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings:
    arrays are read straight into those shardings (each host reads its shards).
    An unreadable checkpoint is reported by step and file and skipped for the
    one before it; CheckpointError when none is readable.
    """
    failures = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        _check_json_files(fs.join(self.directory, str(step)))
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                          meta=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        # Orbax, TensorStore and json raise many types for a damaged file.
        why = str(e) if len(str(e)) < 400 else str(e)[:400] + " ..."  # TensorStore's are long
        failures.append(f"step {step}: {why}")
        log.error("checkpoint step %d in %s is unreadable (%s); trying the one before it",
                  step, self.directory, why)
        continue
      for bad in failures:
        log.warning("deleting the unreadable checkpoint %s so that its step is saved "
                    "again", bad.split(":")[0])
      for bad_step in sorted(self._manager.all_steps(), reverse=True):
        if bad_step > step:
          self._manager.delete(bad_step)
      if failures:
        log.warning("resumed from checkpoint step %d, the newest readable one", step)
      log.info("restored checkpoint step %d from %s", step, self.directory)
      return step, restored["state"], dict(restored["meta"])
    if failures:
      raise CheckpointError(f"{self.directory}: no readable checkpoint:\n  "
                            + "\n  ".join(failures))
    return None

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def key_to_json(key: jax.Array) -> list[int]:
  """A typed PRNG key as plain ints (for the JSON record)."""
  return np.asarray(jax.random.key_data(key)).astype(np.uint32).ravel().tolist()


def key_from_json(data: list[int], like: jax.Array) -> jax.Array:
  shape = jax.random.key_data(like).shape
  return jax.random.wrap_key_data(np.asarray(data, np.uint32).reshape(shape),
                                  impl=jax.random.key_impl(like))

