"""A process pool with a per-item deadline, used to grade answers off the main thread.

Why not `multiprocessing.Pool` or `concurrent.futures`: neither can kill one worker that is
stuck in a sympy call and replace it, so one pathological expression would stall a whole
training step. Why not math-verify's own timeout: it uses `signal.alarm`, which only works on
the main thread; elsewhere every call fails and every reward silently becomes 0.

Workers are fresh interpreters started with `subprocess` (fork + exec, like the 'spawn' start
method, so nothing is forked from a process that has JAX threads running). Unlike 'spawn', they
do not re-import the launching script's `__main__` (which, for the trainer, imports JAX). Each
worker runs `module:function` on the items it is sent and reports after every item, so the
parent knows which item is running and since when; an item past its deadline gets its worker
killed (SIGKILL) and replaced, and the rest of that worker's chunk goes back in the queue.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

logger = logging.getLogger(__name__)

# Outcome kinds of one item, as returned by `DeadlinePool.map`.
OK = "ok"
TIMEOUT = "timeout"
ERROR = "error"

# The directory that holds the capo_jax package (this file is capo_jax/data/_grader_pool.py).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class _Worker:
  proc: subprocess.Popen
  to_worker: Connection
  from_worker: Connection
  started: float
  ready: bool = False
  inflight: collections.deque = dataclasses.field(default_factory=collections.deque)
  last_progress: float = 0.0


class DeadlinePool:
  """Runs `target(*item)` for many items in worker processes, each item within `timeout_s`.

  `target` and `warmup` are "module:function" names importable in a fresh interpreter; `warmup`
  (optional) runs once before a worker reports ready, so slow imports do not count against the
  first item's deadline. Thread-safe: concurrent `map` calls run one after the other.
  """

  def __init__(self, target: str, num_workers: int, timeout_s: float, *,
               warmup: str | None = None, startup_timeout_s: float = 120.0) -> None:
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    self.target = target
    self.warmup = warmup
    self.num_workers = num_workers
    self.timeout_s = float(timeout_s)
    self.startup_timeout_s = float(startup_timeout_s)
    self.num_restarts = 0
    self._workers: list[_Worker] = []
    self._failed_starts = 0
    self._lock = threading.RLock()
    # Kills the workers when the pool is garbage-collected without close().
    weakref.finalize(self, DeadlinePool._kill_all, self._workers)

  # -- worker lifecycle ---------------------------------------------------------------------

  def _start_worker(self) -> _Worker:
    parent_r, child_w = os.pipe()
    child_r, parent_w = os.pipe()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-c", "from capo_jax.data._grader_pool import _worker_main; _worker_main()",
           self.target, self.warmup or "", str(child_r), str(child_w)]
    try:
      # Own process group (Python >= 3.11): a Ctrl-C at the terminal reaches the parent only,
      # which then kills the workers, instead of every worker printing a KeyboardInterrupt.
      group = {"process_group": 0} if sys.version_info >= (3, 11) else {}
      proc = subprocess.Popen(cmd, pass_fds=(child_r, child_w), env=env,
                              stdin=subprocess.DEVNULL, **group)
    finally:
      os.close(child_r)
      os.close(child_w)
    return _Worker(proc=proc, to_worker=Connection(parent_w, readable=False),
                   from_worker=Connection(parent_r, writable=False), started=time.monotonic())

  @staticmethod
  def _kill(w: _Worker) -> None:
    try:
      w.proc.kill()
      w.proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
      pass
    for conn in (w.to_worker, w.from_worker):
      try:
        conn.close()
      except OSError:
        pass

  def _replace(self, w: _Worker) -> None:
    self._kill(w)
    self._workers[self._workers.index(w)] = self._start_worker()
    self.num_restarts += 1

  def _start_failed(self, w: _Worker, why: str) -> None:
    self._failed_starts += 1
    if self._failed_starts >= max(3, 2 * self.num_workers):
      self.close()
      raise RuntimeError(f"grader workers for {self.target} keep failing to start ({why}); "
                         "see the worker's stderr above")
    logger.warning("grader worker failed to start (%s); starting another", why)
    self._replace(w)

  @staticmethod
  def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
      DeadlinePool._kill(w)
    workers.clear()

  def worker_pids(self) -> list[int]:
    """Process ids of the current workers (for monitoring)."""
    return [w.proc.pid for w in self._workers]

  def close(self) -> None:
    """Stops all workers (they hold no state worth a graceful exit); a later `map` starts
    new ones. Waits for a `map` running in another thread to finish."""
    with self._lock:
      self._kill_all(self._workers)

  def __enter__(self) -> DeadlinePool:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  # -- the scheduling loop ------------------------------------------------------------------

  def map(self, items: Sequence[tuple]) -> list[tuple[str, Any]]:
    """Returns one (kind, value) per item, in order: (OK, result), (TIMEOUT, None) when the
    item ran past `timeout_s`, or (ERROR, message) when it raised or killed its worker."""
    n = len(items)
    results: list[tuple[str, Any] | None] = [None] * n
    if n == 0:
      return []
    with self._lock:
      try:
        self._run(items, results)
      except BaseException:
        # An interrupted batch leaves workers busy with stale items: start over next time.
        self.close()
        raise
    return results  # type: ignore[return-value]

  def _run(self, items: Sequence[tuple], results: list) -> None:
    while len(self._workers) < self.num_workers:
      self._workers.append(self._start_worker())
    queue = collections.deque(range(len(items)))
    chunk = max(1, min(64, math.ceil(len(items) / (4 * self.num_workers))))
    self._remaining = len(items)
    while self._remaining:
      for w in self._workers:
        if w.ready and not w.inflight and queue:
          take = [queue.popleft() for _ in range(min(chunk, len(queue)))]
          w.inflight.extend(take)
          w.last_progress = time.monotonic()
          try:
            w.to_worker.send([(i, items[i]) for i in take])
          except OSError:
            pass  # it died; the EOF on its pipe is handled below
      now = time.monotonic()
      deadlines = [w.last_progress + self.timeout_s if w.ready else
                   w.started + self.startup_timeout_s
                   for w in self._workers if w.inflight or not w.ready]
      wait_s = max(0.0, min(deadlines) - now) if deadlines else 1.0
      for conn in wait([w.from_worker for w in self._workers], timeout=wait_s):
        w = next((w for w in self._workers if w.from_worker is conn), None)
        if w is not None:
          self._drain(w, results, queue)
      now = time.monotonic()
      for w in list(self._workers):
        if w.inflight and now > w.last_progress + self.timeout_s:
          self._drain(w, results, queue)  # results it sent just before the deadline count
          if w in self._workers and w.inflight and time.monotonic() > (
              w.last_progress + self.timeout_s):
            self._finish(results, w.inflight.popleft(), (TIMEOUT, None))
            queue.extendleft(reversed(w.inflight))
            w.inflight.clear()
            self._replace(w)
        elif not w.ready and now > w.started + self.startup_timeout_s:
          self._start_failed(w, f"not ready after {self.startup_timeout_s:.0f} s")

  def _finish(self, results: list, idx: int, outcome: tuple[str, Any]) -> None:
    if results[idx] is None:
      self._remaining -= 1
    results[idx] = outcome

  def _drain(self, w: _Worker, results: list, queue: collections.deque) -> None:
    """Reads every message `w` has sent; handles its death (EOF) by requeueing its items."""
    try:
      while w.from_worker.poll(0):
        msg = w.from_worker.recv()
        if msg[0] == "ready":
          w.ready = True
          self._failed_starts = 0
          continue
        kind, idx, value = msg
        if not w.inflight or w.inflight[0] != idx:
          raise RuntimeError(f"grader worker answered item {idx} out of order")
        w.inflight.popleft()
        w.last_progress = time.monotonic()
        self._finish(results, idx, (kind, value))
    except (EOFError, OSError):
      try:  # the pipe closes as the process exits: reap it for its exit code
        code = w.proc.wait(timeout=2)
      except subprocess.TimeoutExpired:
        code = None
      if not w.ready:
        self._start_failed(w, f"exited with code {code}")
        return
      if w.inflight:
        self._finish(results, w.inflight.popleft(), (ERROR, f"worker died (exit code {code})"))
        queue.extendleft(reversed(w.inflight))
        w.inflight.clear()
      logger.warning("grader worker died (exit code %s); starting another", code)
      self._replace(w)


def _resolve(name: str) -> Any:
  module, _, attr = name.partition(":")
  return getattr(importlib.import_module(module), attr)


def _exit_when_orphaned() -> None:
  parent = os.getppid()
  while True:
    time.sleep(1.0)
    if os.getppid() != parent:
      os._exit(0)


def _worker_main() -> None:
  """Entry point of a worker process: argv = target, warmup, read fd, write fd."""
  target_name, warmup_name, rfd, wfd = sys.argv[1:5]
  inbox = Connection(int(rfd), writable=False)
  outbox = Connection(int(wfd), readable=False)
  threading.Thread(target=_exit_when_orphaned, daemon=True).start()
  target = _resolve(target_name)
  if warmup_name:
    _resolve(warmup_name)()
  outbox.send(("ready",))
  while True:
    try:
      batch = inbox.recv()
    except (EOFError, OSError):
      return
    if batch is None:
      return
    for idx, item in batch:
      try:
        msg = (OK, idx, target(*item))
      except Exception as e:  # noqa: BLE001 -- reported to the parent, which counts it
        msg = (ERROR, idx, f"{type(e).__name__}: {e}"[:500])
      outbox.send(msg)
