"""Preemption: every process saves the same step, then the run exits cleanly.

A TPU VM gets SIGTERM before it is taken away, but on a pod slice not every
worker necessarily gets it at the same moment. A process that saved alone
would leave a checkpoint the others never wrote. So with several processes
the decision goes through JAX's preemption sync manager
(``multihost_utils.reached_preemption_sync_point``): the coordination
service hears the notice on any worker, agrees on the next step every process
reaches, and then returns True on all of them at that same step. On one
process a plain SIGTERM handler sets a flag that the loop checks after each
step.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import jax
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


class Preempted(SystemExit):
  """Raised after the preemption checkpoint is saved; the process exits with 0."""

  def __init__(self, step: int, directory: str) -> None:
    super().__init__(0)
    self.message = (
      f"preempted: the checkpoint of step {step} is saved in {directory}; "
      "rerun the same command to resume"
    )


def _sync_manager_running() -> bool:
  from jax._src import distributed  # pylint: disable=import-outside-toplevel

  return distributed.global_state.preemption_sync_manager is not None


class PreemptionWatch:
  """``with PreemptionWatch() as w: ... if w.reached(step): save and stop``.

  ``reached(step)`` must be called by every process at every step, with the
  same step numbers (JAX's protocol requires it).
  """

  def __init__(self) -> None:
    self._requested = False
    self._previous: Any = None
    self._synced = False

  def __enter__(self) -> PreemptionWatch:
    # With several processes JAX's own notifier listens for SIGTERM; a Python
    # handler installed on top would replace it, so none is installed then.
    self._synced = jax.process_count() > 1 and _sync_manager_running()
    if jax.process_count() > 1 and not self._synced:
      log.warning(
        "jax.distributed runs without its preemption service "
        "(jax_enable_preemption_service is off): a SIGTERM will not be synced "
        "across processes, and only a regular checkpoint survives it"
      )
    if not self._synced:
      try:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
      except ValueError:  # not the main thread: no handler, no preemption saves
        self._previous = None
    return self

  def _handle(self, signum: int, frame: Any) -> None:
    del signum, frame
    log.warning("SIGTERM received: saving a checkpoint after this step, then exiting")
    self._requested = True

  def reached(self, step: int) -> bool:
    """True at the step where every process must save and stop."""
    if self._synced:
      hit = multihost_utils.reached_preemption_sync_point(step)
      if hit:
        log.warning("preemption notice: every process saves step %d, then exits", step)
      return hit
    return self._requested

  def __exit__(self, *exc: object) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
