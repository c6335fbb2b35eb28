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

Each worker leads its own process group, and a kill is sent to the group: a subprocess the
target started (a hung compiler, a sandbox) dies with its worker instead of living on as an
orphan. A subprocess that starts its own session leaves the group and is not reached.

Optional recycling (`max_calls`, `max_rss_mb`; 0: off): after each item the parent counts the
worker's items and reads its resident memory from /proc/<pid>/statm (Linux; elsewhere the
memory limit does nothing); a worker at either limit is replaced, the rest of its chunk
requeued. This bounds what a target that leaks (a growing cache, a module-level list) can
take. Workers answer about equally many items, so they reach `max_calls` together: one at
`max_calls` keeps working past it while another worker is still starting, so grading never
stalls on a fresh interpreter's imports while a ready worker could go on. `max_calls=1` (a
fresh worker per item, for isolation) and the memory limit replace at once.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
import math
import os
import signal
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
  items_done: int = 0  # items it answered, for `max_calls`


class DeadlinePool:
  """Runs `target(*item)` for many items in worker processes, each item within `timeout_s`.

  `target` and `warmup` are "module:function" names importable in a fresh interpreter; `warmup`
  (optional) runs once before a worker reports ready, so slow imports do not count against the
  first item's deadline. A worker is replaced after `max_calls` items or once its resident
  memory exceeds `max_rss_mb` MiB (0: no limit). Thread-safe: concurrent `map` calls run one
  after the other.
  """

  def __init__(
    self,
    target: str,
    num_workers: int,
    timeout_s: float,
    *,
    warmup: str | None = None,
    startup_timeout_s: float = 120.0,
    max_calls: int = 0,
    max_rss_mb: float = 0.0,
  ) -> None:
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if max_calls < 0 or not max_rss_mb >= 0:
      raise ValueError(f"max_calls={max_calls} and max_rss_mb={max_rss_mb} must be >= 0 (0: off)")
    self.target = target
    self.warmup = warmup
    self.num_workers = num_workers
    self.timeout_s = float(timeout_s)
    self.startup_timeout_s = float(startup_timeout_s)
    self.max_calls = int(max_calls)
    self.max_rss_mb = float(max_rss_mb)
    self.num_restarts = 0  # workers replaced after a timeout or a crash
    self.num_recycled = 0  # workers replaced at max_calls or max_rss_mb
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
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    main = "from capo_jax.data._grader_pool import _worker_main; _worker_main()"
    cmd = [sys.executable, "-c", main, self.target, self.warmup or "", str(child_r), str(child_w)]
    try:
      # Own process group: `_kill` signals the group, so the target's subprocesses die too; and
      # a Ctrl-C at the terminal reaches the parent only, which then kills the workers,
      # instead of every worker printing a KeyboardInterrupt.
      group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
      proc = subprocess.Popen(
        cmd, pass_fds=(child_r, child_w), env=env, stdin=subprocess.DEVNULL, **group
      )
    finally:
      os.close(child_r)
      os.close(child_w)
    return _Worker(
      proc=proc,
      to_worker=Connection(parent_w, readable=False),
      from_worker=Connection(parent_r, writable=False),
      started=time.monotonic(),
    )

  @staticmethod
  def _kill(w: _Worker) -> None:
    """SIGKILLs the worker's process group, then reaps the worker. Only while the worker is
    unreaped (alive or a zombie) is its pid certain to still name its group."""
    if w.proc.returncode is None:
      try:
        os.killpg(w.proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    try:
      w.proc.kill()  # no-op once reaped; covers a worker that left its group
      w.proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
      pass
    for conn in (w.to_worker, w.from_worker):
      try:
        conn.close()
      except OSError:
        pass

  def _replace(self, w: _Worker, recycled: bool = False) -> None:
    self._kill(w)
    self._workers[self._workers.index(w)] = self._start_worker()
    if recycled:
      self.num_recycled += 1
    else:
      self.num_restarts += 1

  def _worn_out(self, w: _Worker) -> str | None:
    """Why `w` is due for recycling now (`max_rss_mb` resident, or `max_calls` items
    unless another worker is still starting: module docstring), else None."""
    rss = rss_mb(w.proc.pid) if self.max_rss_mb else None
    if rss is not None and rss > self.max_rss_mb:
      return f"{rss:.0f} MiB resident"
    if self.max_calls and w.items_done >= self.max_calls:
      starting = self.max_calls > 1 and any(not o.ready for o in self._workers if o is not w)
      return None if starting else f"{w.items_done} items"
    return None

  def _start_failed(self, w: _Worker, why: str) -> None:
    self._failed_starts += 1
    if self._failed_starts >= max(3, 2 * self.num_workers):
      self.close()
      raise RuntimeError(
        f"grader workers for {self.target} keep failing to start ({why}); "
        "see the worker's stderr above"
      )
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

  def wait_ready(self, timeout_s: float) -> bool:
    """Starts the missing workers and waits until every worker reported ready; False if
    some had not within ``timeout_s``. Grading does not need it (``map`` starts them);
    it lets a caller pay the start-up before timing work."""
    with self._lock:
      while len(self._workers) < self.num_workers:
        self._workers.append(self._start_worker())
      end = time.monotonic() + timeout_s
      while not all(w.ready for w in self._workers):
        left = end - time.monotonic()
        if left <= 0:
          return False
        for conn in wait([w.from_worker for w in self._workers if not w.ready], timeout=left):
          w = next((w for w in self._workers if w.from_worker is conn), None)
          if w is not None:
            self._drain(w, [], collections.deque())
      return True

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
      deadlines = [
        w.last_progress + self.timeout_s if w.ready else w.started + self.startup_timeout_s
        for w in self._workers
        if w.inflight or not w.ready
      ]
      wait_s = max(0.0, min(deadlines) - now) if deadlines else 1.0
      for conn in wait([w.from_worker for w in self._workers], timeout=wait_s):
        sender = next((w for w in self._workers if w.from_worker is conn), None)
        if sender is not None:
          self._drain(sender, results, queue)
      now = time.monotonic()
      for w in list(self._workers):
        if w.inflight and now > w.last_progress + self.timeout_s:
          self._drain(w, results, queue)  # results it sent just before the deadline count
          if (
            w in self._workers
            and w.inflight
            and time.monotonic() > (w.last_progress + self.timeout_s)
          ):
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
    """Reads every message `w` has sent; handles its death (EOF) by requeueing its items,
    and replaces it when it answered items and reached `max_calls` or `max_rss_mb`."""
    answered = w.items_done
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
        w.items_done += 1
        self._finish(results, idx, (kind, value))
    except (EOFError, OSError):
      # The pipe closes as the process exits. Its code is read without reaping it, so that
      # `_replace` can still kill the group (and any subprocess left in it) by its pid.
      code = _exit_code_unreaped(w.proc, timeout_s=2.0)
      if not w.ready:
        self._start_failed(w, f"exited with code {code}")
        return
      if w.inflight:
        self._finish(results, w.inflight.popleft(), (ERROR, f"worker died (exit code {code})"))
        queue.extendleft(reversed(w.inflight))
        w.inflight.clear()
      logger.warning("grader worker died (exit code %s); starting another", code)
      self._replace(w)
      return
    why = self._worn_out(w) if w.items_done > answered else None
    if why:
      # Once per worker, so quiet unless a worker is near the limit from its first item.
      log = logger.warning if w.items_done == 1 and self.max_calls != 1 else logger.info
      log(
        "grader worker for %s recycled (%s; limits: %s items, %s MiB)",
        self.target,
        why,
        self.max_calls or "no",
        self.max_rss_mb or "no",
      )
      queue.extendleft(reversed(w.inflight))
      w.inflight.clear()
      self._replace(w, recycled=True)


def rss_mb(pid: int) -> float | None:
  """Resident memory of process `pid` in MiB, from /proc/<pid>/statm; None without /proc."""
  try:
    with open(f"/proc/{pid}/statm", encoding="ascii") as f:
      pages = int(f.read().split()[1])
  except (OSError, ValueError, IndexError):
    return None
  return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _exit_code_unreaped(proc: subprocess.Popen, timeout_s: float) -> int | None:
  """`proc`'s exit code (negative: the signal) once it exits within `timeout_s`, else None;
  leaves it a zombie for `Popen.wait` to reap."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped
      return proc.returncode
    if info is not None:
      return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    if time.monotonic() > deadline:
      return None
    time.sleep(0.01)


def _resolve(name: str) -> Any:
  module, _, attr = name.partition(":")
  return getattr(importlib.import_module(module), attr)


def _exit_when_orphaned() -> None:
  parent = os.getppid()
  while True:
    time.sleep(1.0)
    if os.getppid() != parent:
      if os.getpgrp() == os.getpid():  # takes the target's subprocesses along
        os.killpg(os.getpid(), signal.SIGKILL)
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
