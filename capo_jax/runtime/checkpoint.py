"""Atomic, resumable checkpoints with Orbax, and the final HF export.

A checkpoint holds the train state (params, optimizer state, step) as sharded
arrays plus a small JSON record (rng key data, data-iterator state, run
metadata). Orbax writes each step to a temporary directory and renames it
when complete, so a crash mid-save never leaves a half-written checkpoint
that a restart would pick up. Works with local paths and ``gs://`` paths.

A checkpoint can still be damaged after the fact (a truncated file, a
half-synced copy). ``restore_latest`` tells damage from a storage hiccup:

* damage the code can name (invalid JSON, a missing file, a truncated array
  file: TensorStore's NOT_FOUND / OUT_OF_RANGE / DATA_LOSS) moves the step aside
  into ``<checkpoints>/quarantine/<step>`` (kept for a human, never deleted)
  and the run resumes from the step before, saving the later steps again;
* anything else (an OSError such as EIO, a Cloud Storage 5xx or 429, a
  timeout) is retried with backoff (``RETRY_DELAYS_S``); if it persists the run
  stops with CheckpointUnavailable and nothing is moved or deleted;
* a checkpoint whose array tree differs from the run's (a config change such
  as ``optim.grad_clip`` 1.0 -> 0.0 adds or drops optimizer state) is
  TreeMismatch, before anything is read.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from capo_jax.runtime import fs

log = logging.getLogger(__name__)

QUARANTINE = "quarantine"
RETRY_DELAYS_S = (2.0, 10.0, 30.0)  # then CheckpointUnavailable
# TensorStore's status codes for a file that is missing or shorter / other than written.
_DAMAGE_CODES = ("NOT_FOUND:", "OUT_OF_RANGE:", "DATA_LOSS:")
# Files every complete step has (Orbax writes them; _CHECKPOINT_METADATA is newer).
_REQUIRED = (("meta", "metadata"), ("state", "_METADATA"), ("state", "manifest.ocdbt"))


class CheckpointError(RuntimeError):
  """No checkpoint of a run directory can be read, or one cannot be written."""


class CheckpointDamaged(CheckpointError):
  """A step's files are missing or invalid: named damage, not a storage hiccup."""


class CheckpointUnavailable(CheckpointError):
  """Reading a step kept failing without proven damage; nothing was moved or deleted."""


class TreeMismatch(CheckpointError):
  """The saved train state has other arrays than the run's (its config changed)."""

  def __init__(self, message: str, step: int) -> None:
    super().__init__(message)
    self.step = step


def _check_files(step_dir: str) -> None:
  """Names the first missing required file or invalid JSON file of a step directory.

  Orbax reports a truncated JSON file as a bare ``JSONDecodeError``, without
  the file; this check runs first so the error says which file it is.
  """
  root = fs.path(step_dir)
  for parts in _REQUIRED:
    if not root.joinpath(*parts).exists():
      raise CheckpointDamaged(f"{root.joinpath(*parts)}: missing")
  arrays = root / "state" / "array_metadatas"
  files = [
    root / "_CHECKPOINT_METADATA",
    root / "meta" / "metadata",
    root / "state" / "_METADATA",
    root / "state" / "_sharding",
  ]
  files += sorted(arrays.iterdir()) if arrays.exists() else []
  for f in files:
    if not f.exists():
      continue
    try:
      json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointDamaged(f"{f}: invalid JSON ({e})") from None


def _is_damage(e: BaseException) -> bool:
  """True for corruption the code can name; False for what may pass (I/O, network)."""
  if isinstance(
    e, (CheckpointDamaged, FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError)
  ):
    return True
  return isinstance(e, ValueError) and str(e).startswith(_DAMAGE_CODES)


def _short(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}"
  return text if len(text) < 400 else text[:400] + " ..."  # TensorStore's are long


def _cause(e: BaseException) -> str:
  """The root OSError of ``e`` as 'ENOSPC: No space left on device', else ``e`` itself."""
  seen: BaseException | None = e
  while seen is not None:
    if isinstance(seen, OSError) and seen.errno is not None and seen.errno in errno.errorcode:
      return f"{errno.errorcode[seen.errno]}: {seen.strerror or seen}"
    seen = seen.__cause__ or seen.__context__
  return _short(e)


def _leaves(tree: Any) -> dict[str, tuple[int, ...]]:
  """{'opt_state/1/0/mu/embed': shape} of a pytree's arrays, for comparing trees."""

  def name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)

  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {name(p): tuple(getattr(x, "shape", ())) for p, x in flat}


class Checkpointer:
  """Periodic saves to ``<workdir>/checkpoints`` and restore of the latest."""

  def __init__(
    self, workdir: str, *, every_steps: int, keep: int = 2, async_save: bool = False
  ) -> None:
    if every_steps < 0:
      raise ValueError(f"checkpoint.every_steps must be >= 0, got {every_steps}")
    self.every_steps = every_steps
    directory = fs.join(workdir, "checkpoints")
    self._manager = ocp.CheckpointManager(
      directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save
      ),
      # Handlers, not just names: item_metadata can then read a step's tree.
      item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
    )

  @property
  def directory(self) -> str:
    return str(self._manager.directory)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def should_save(self, step: int) -> bool:
    return self.every_steps > 0 and step % self.every_steps == 0

  def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
    """Saves ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``.

    A failed save (a full disk, lost permissions) logs one line naming the path and
    the cause and raises CheckpointError.
    """
    if not force and not self.should_save(step):
      return False
    if step in self._manager.all_steps():
      return False
    try:
      saved = self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
      )
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except  (Orbax wraps it in asyncio's)
      message = f"checkpoint save to {fs.join(self.directory, str(step))} failed: {_cause(e)}"
      log.error(message)
      raise CheckpointError(message) from e
    if saved:
      log.info("saved checkpoint step %d to %s", step, self.directory)
    return bool(saved)

  def _check_tree(self, step: int, abstract_state: Any) -> None:
    saved = self._manager.item_metadata(step)["state"]
    if saved is None:  # no tree metadata (an old Orbax layout): the restore checks it
      return
    have, want = _leaves(saved), _leaves(abstract_state)
    if have == want:
      return
    only_saved = sorted(set(have) - set(want))
    only_run = sorted(set(want) - set(have))
    reshaped = sorted(k for k in set(have) & set(want) if have[k] != want[k])
    parts = [
      f"{what}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
      for what, keys in (
        ("only in the checkpoint", only_saved),
        ("only in this run", only_run),
        ("other shapes", reshaped),
      )
      if keys
    ]
    raise TreeMismatch(
      f"checkpoint step {step} in {self.directory} holds other arrays "
      f"than this run's train state ({'; '.join(parts)})",
      step,
    )

  def _read(self, step: int, abstract_state: Any) -> Any:
    """One step's (state, meta), retried while the error may pass."""
    for attempt, delay in enumerate((*RETRY_DELAYS_S, None)):
      try:
        _check_files(fs.join(self.directory, str(step)))
        self._check_tree(step, abstract_state)
        return self._manager.restore(
          step,
          args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
          ),
        )
      except TreeMismatch:
        raise
      except Exception as e:  # pylint: disable=broad-except  (sorted below)
        if _is_damage(e):
          raise CheckpointDamaged(_short(e)) from e
        if delay is None:
          raise CheckpointUnavailable(
            f"checkpoint step {step} in {self.directory} could not be read after "
            f"{attempt + 1} tries ({_short(e)}); nothing was moved or deleted. Rerun "
            "when the storage answers again."
          ) from e
        log.warning(
          "reading checkpoint step %d failed (%s); retrying in %.0f s", step, _short(e), delay
        )
        time.sleep(delay)
    raise AssertionError("unreachable")

  def _quarantine(self, step: int) -> str:
    """Moves a damaged step to ``quarantine/<step>`` (``<step>.1`` ... when taken)."""
    base = fs.join(self.directory, QUARANTINE, str(step))
    target, n = base, 0
    while fs.exists(target):
      n += 1
      target = f"{base}.{n}"
    if jax.process_index() == 0:
      fs.move_tree(fs.join(self.directory, str(step)), target)
    return target

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, state, meta) of the newest readable checkpoint, or None when there is none.

    ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings:
    arrays are read straight into those shardings (each host reads its shards).
    A damaged step is named, moved to the quarantine folder and skipped for the
    one before it; CheckpointError when none is readable, CheckpointUnavailable
    when a step cannot be read for another reason, TreeMismatch (see there).
    """
    failures = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        restored = self._read(step, abstract_state)
      except CheckpointDamaged as e:
        failures.append(f"step {step}: {e}")
        where = self._quarantine(step)
        log.error(
          "checkpoint step %d in %s is unreadable (%s); moved it to %s and trying the "
          "one before it",
          step,
          self.directory,
          e,
          where,
        )
        continue
      if failures:
        self._sync_after_quarantine()
        log.warning("resumed from checkpoint step %d, the newest readable one", step)
      log.info("restored checkpoint step %d from %s", step, self.directory)
      return step, restored["state"], dict(restored["meta"])
    if failures:
      self._sync_after_quarantine()
      raise CheckpointError(
        f"{self.directory}: no readable checkpoint (the damaged ones "
        f"are in {QUARANTINE}/):\n  " + "\n  ".join(failures)
      )
    return None

  def _sync_after_quarantine(self) -> None:
    """Every process sees process 0's moves before it lists steps again."""
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

      multihost_utils.sync_global_devices("capo_jax checkpoint quarantine")
    self._manager.reload()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def key_to_json(key: jax.Array) -> list[int]:
  """A typed PRNG key as plain ints (for the JSON record)."""
  return np.asarray(jax.random.key_data(key)).astype(np.uint32).ravel().tolist()


def key_from_json(data: list[int], like: jax.Array) -> jax.Array:
  shape = jax.random.key_data(like).shape
  return jax.random.wrap_key_data(
    jnp.asarray(np.asarray(data, np.uint32).reshape(shape)), impl=jax.random.key_impl(like)
  )
