"""Names a dead peer in a multi-process run before JAX aborts this process.

When one process of a ``jax.distributed`` run dies, the others learn it from JAX's
coordination service only after its heartbeat timeout (``heartbeat_timeout_seconds``),
and then abort with a C++ error as their last line. Each process here also writes its
own heartbeat into the service's key-value store every ``interval_s``, and a thread
watches the peers' heartbeats: a peer whose value has not changed for ``stale_s``
(measured on this process's monotonic clock, so hosts' clocks need not agree) gets one
error line naming it (process index, host, pid), well before the abort. If the store
itself stops answering, the coordinator (process 0) is the one gone, and that is said.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

log = logging.getLogger(__name__)
PREFIX = "capo_jax/alive/"


class PeerWatch:
  """A daemon thread: beats for this process, reports peers that stopped beating."""

  def __init__(
    self,
    client: Any,
    process_index: int,
    num_processes: int,
    *,
    interval_s: float = 5.0,
    stale_s: float = 20.0,
    heartbeat_timeout_s: float = 100.0,
  ) -> None:
    if not 0 < interval_s < stale_s:
      raise ValueError(f"PeerWatch: need 0 < interval_s ({interval_s}) < stale_s ({stale_s})")
    self.client, self.index, self.count = client, process_index, num_processes
    self.interval_s, self.stale_s = interval_s, stale_s
    self.heartbeat_timeout_s = heartbeat_timeout_s
    self._me = f"{socket.gethostname()}, pid {os.getpid()}"
    self._beats = 0
    self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last value, when it changed)
    self._reported: set[int] = set()
    self._lost_store = False
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="capo-peer-watch", daemon=True)

  def start(self) -> PeerWatch:
    self._started = time.monotonic()
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=self.interval_s + 1)

  def _loop(self) -> None:
    while not self._stop.is_set():
      self.poll()
      self._stop.wait(self.interval_s)

  def poll(self) -> None:
    """One beat and one look at the peers (the thread's body; callable in tests)."""
    now = time.monotonic()
    try:
      self._beats += 1
      self.client.key_value_set(
        f"{PREFIX}{self.index}", f"{self._me}, beat {self._beats}", allow_overwrite=True
      )
      entries = self.client.key_value_dir_get(PREFIX)
    except Exception as e:  # pylint: disable=broad-except  (any failure: the store is gone)
      if not self._lost_store and self.index != 0:
        self._lost_store = True
        log.error(
          "lost JAX's coordination service (process 0, the coordinator, has probably "
          "died: %s); JAX aborts this process within heartbeat_timeout_seconds=%.0f s",
          e,
          self.heartbeat_timeout_s,
        )
      return
    values = {int(k.rsplit("/", 1)[-1]): v for k, v in entries if k.rsplit("/", 1)[-1].isdigit()}
    for peer in range(self.count):
      if peer == self.index or peer in self._reported:
        continue
      value = values.get(peer)
      last = self._seen.get(peer)
      if value is not None and (last is None or last[0] != value):
        self._seen[peer] = (value, now)
        continue
      since = last[1] if last else self._started
      if now - since >= self.stale_s:
        self._reported.add(peer)
        who = last[0].rsplit(", beat", 1)[0] if last else "never heard from"
        log.error(
          "process %d (%s) has sent no heartbeat for %.0f s: it has probably died; "
          "JAX aborts this process within heartbeat_timeout_seconds=%.0f s",
          peer,
          who,
          now - since,
          self.heartbeat_timeout_s,
        )
