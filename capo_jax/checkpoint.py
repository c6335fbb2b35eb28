"""Atomic, resumable checkpoints with Orbax, and the final HF export.

A checkpoint holds the train state (params, optimizer state, step) as sharded
arrays plus a small JSON record (rng key data, data-iterator state, run
metadata). Orbax writes each step to a temporary directory and renames it
when complete, so a crash mid-save never leaves a half-written checkpoint
that a restart would pick up. Works with local paths and ``gs://`` paths.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
  """Periodic saves to ``<workdir>/checkpoints`` and restore of the latest."""

  def __init__(self, workdir: str, *, every_steps: int, keep: int = 2,
               async_save: bool = False) -> None:
    if every_steps < 0:
      raise ValueError(f"checkpoint.every_steps must be >= 0, got {every_steps}")
    self.every_steps = every_steps
    directory = os.path.join(workdir, "checkpoints") if "://" not in workdir \
        else workdir.rstrip("/") + "/checkpoints"
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
    """(step, state, meta) of the newest checkpoint, or None when there is none.

    ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings:
    arrays are read straight into those shardings (each host reads its shards).
    """
    step = self._manager.latest_step()
    if step is None:
      return None
    restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                      meta=ocp.args.JsonRestore()))
    log.info("restored checkpoint step %d from %s", step, self.directory)
    return step, restored["state"], dict(restored["meta"])

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

