"""One run per workdir: ``<workdir>/lease.json``, taken atomically, kept alive by a heartbeat.

Two commands started on one workdir would otherwise both run to the end: each
step logged twice, checkpoints and exports of one run under the config of the
other. The lease records who runs (host, pid, run id, start time) and a
heartbeat that a thread refreshes every ``heartbeat_s``. A second run refuses
to start while the holder is alive, naming it; a lease whose holder is gone
(same host and its pid is dead, or no heartbeat for ``stale_after_s``) is taken
over with a warning.

Every change is conditional on the version read just before, so two runs can
never both take the lease: on Cloud Storage an upload with ``ifGenerationMatch``
(0: the object must not exist), locally the same check under an ``flock``.

In a multi-process run process 0 takes the lease and tells the others through
the jax.distributed coordinator (``share_outcome``); only process 0 heartbeats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from urllib.parse import quote

from capo_jax.runtime import fs

log = logging.getLogger(__name__)

LEASE_FILE = "lease.json"
HEARTBEAT_S = 5.0
STALE_AFTER_S = 60.0  # 12 missed heartbeats: a busy host stalls threads for seconds, not this


class LeaseHeld(RuntimeError):
  """Another live run holds the workdir's lease."""


@dataclasses.dataclass(frozen=True)
class Holder:
  """What ``lease.json`` says about the run that holds it."""

  host: str
  pid: int
  run_id: str
  since: str
  heartbeat: float  # time.time() of the holder's last heartbeat

  def describe(self) -> str:
    age = max(0.0, time.time() - self.heartbeat)
    return (
      f"host {self.host}, pid {self.pid}, since {self.since} (run {self.run_id}, "
      f"last heartbeat {age:.0f} s ago)"
    )


class _LocalStore:
  """The lease file on a local disk; each read-check-write under an flock of a side file.

  The generation of the file is a hash of its text.
  """

  def __init__(self, path: str) -> None:
    self.path = path

  @contextlib.contextmanager
  def _locked(self) -> Iterator[None]:
    fd = os.open(self.path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
      yield
    finally:
      os.close(fd)  # closing drops the flock

  def _read(self) -> tuple[str, str] | None:
    try:
      with open(self.path, encoding="utf-8") as f:
        text = f.read()
    except FileNotFoundError:
      return None
    return text, hashlib.sha1(text.encode()).hexdigest()

  def read(self) -> tuple[str, str] | None:
    with self._locked():
      return self._read()

  def write(self, text: str, if_generation: str) -> str:
    with self._locked():
      now = self._read()
      if (now[1] if now else "0") != if_generation:
        raise FileExistsError(f"{self.path}: changed by another run")
      fs.write_text(self.path, text)
      return hashlib.sha1(text.encode()).hexdigest()

  def delete(self, if_generation: str) -> None:
    with self._locked():
      now = self._read()
      if now is not None and now[1] == if_generation:
        os.unlink(self.path)


class _GcsStore:
  """The lease object on Cloud Storage; writes and deletes carry ``ifGenerationMatch``."""

  def __init__(self, path: str) -> None:
    import gcsfs  # pylint: disable=import-outside-toplevel  (after fs set its env default)

    self.path = path
    self._gcs = gcsfs.GCSFileSystem()
    self._bucket, self._key = path[len("gs://") :].split("/", 1)

  def read(self) -> tuple[str, str] | None:
    try:
      headers, body = self._gcs.call("GET", "b/{}/o/{}", self._bucket, self._key, alt="media")
    except FileNotFoundError:
      return None
    return body.decode("utf-8"), str(headers["x-goog-generation"])

  def write(self, text: str, if_generation: str) -> str:
    url = f"{self._gcs._location}/upload/storage/v1/b/{quote(self._bucket)}/o"  # pylint: disable=protected-access
    # A 412 (the generation moved) surfaces from gcsfs as FileExistsError.
    out = self._gcs.call(
      "POST",
      url,
      uploadType="media",
      name=self._key,
      ifGenerationMatch=if_generation,
      data=text.encode("utf-8"),
      headers={"Content-Type": "application/octet-stream"},
      json_out=True,
    )
    return str(out["generation"])

  def delete(self, if_generation: str) -> None:
    with contextlib.suppress(FileNotFoundError, FileExistsError):  # gone, or not ours now
      self._gcs.call(
        "DELETE", "b/{}/o/{}", self._bucket, self._key, ifGenerationMatch=if_generation
      )


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process: alive
    return True
  return True


class Lease:
  """``with Lease(workdir): ...`` holds ``<workdir>/lease.json`` for the block.

  Raises LeaseHeld, naming the holder, while another live run holds it.
  """

  def __init__(
    self, workdir: str, *, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S
  ) -> None:
    self.path = fs.join(workdir, LEASE_FILE)
    self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
    self.run_id = uuid.uuid4().hex[:12]
    self.lost = False  # set when another run took the lease over (we looked stale)
    self._store = _GcsStore(self.path) if fs.is_remote(self.path) else _LocalStore(self.path)
    self._since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    self._generation: str | None = None
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _text(self) -> str:
    return (
      json.dumps(
        {
          "host": socket.gethostname(),
          "pid": os.getpid(),
          "run_id": self.run_id,
          "since": self._since,
          "heartbeat": time.time(),
        }
      )
      + "\n"
    )

  def _stale(self, h: Holder) -> str | None:
    """Why the holder ``h`` is gone, or None while it may be alive."""
    if h.host == socket.gethostname() and not _pid_alive(h.pid):
      return f"its process {h.pid} on this host has ended"
    age = time.time() - h.heartbeat
    if age > self.stale_after_s:
      return f"no heartbeat for {age:.0f} s (> {self.stale_after_s:.0f} s)"
    return None

  def acquire(self) -> Lease:
    for _ in range(5):  # another run changed the file between our read and our write
      current = self._store.read()
      generation = "0"
      if current is not None:
        text, generation = current
        try:
          holder = Holder(**json.loads(text))
        except (ValueError, TypeError) as e:
          log.warning("%s: unreadable lease (%s); taking it over", self.path, e)
        else:
          why = self._stale(holder)
          if why is None:
            raise LeaseHeld(
              f"{self.path}: another run holds this workdir: {holder.describe()}. Wait for "
              "it to end or use another --workdir; a lease whose holder died is taken "
              f"over {self.stale_after_s:.0f} s after its last heartbeat."
            )
          log.warning("%s: taking over the lease of %s: %s", self.path, holder.describe(), why)
      try:
        self._generation = self._store.write(self._text(), generation)
      except FileExistsError:
        continue
      break
    else:
      raise LeaseHeld(
        f"{self.path}: other runs keep changing the lease; is another run starting on this workdir?"
      )
    log.info("took the lease %s (run %s)", self.path, self.run_id)
    self._thread = threading.Thread(target=self._beat, name="capo-lease-heartbeat", daemon=True)
    self._thread.start()
    return self

  def _beat(self) -> None:
    while not self._stop.wait(self.heartbeat_s):
      try:
        self._generation = self._store.write(self._text(), self._generation or "0")
      except FileExistsError:
        self.lost = True
        log.error(
          "%s: another run took this workdir's lease over (this run's heartbeat "
          "looked stale); stop one of the two runs",
          self.path,
        )
        return
      except Exception as e:  # pylint: disable=broad-except  (a storage hiccup: try again)
        log.warning("%s: lease heartbeat failed (%s: %s); retrying", self.path, type(e).__name__, e)

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._generation is not None and not self.lost:
      try:
        self._store.delete(self._generation)
      except Exception as e:  # pylint: disable=broad-except  (the next run takes it over)
        log.warning(
          "%s: could not release the lease (%s); the next run takes it over once it is stale",
          self.path,
          e,
        )
    self._generation = None

  def __enter__(self) -> Lease:
    return self.acquire()

  def __exit__(self, *exc: object) -> None:
    self.release()


_calls = 0  # train() calls in this process: a fresh coordinator key for each


def share_outcome(error: str | None, timeout_s: float = 600.0) -> None:
  """Tells processes > 0 whether process 0 took the lease (``error``: why not, given on
  process 0, which raises its own error) through the jax.distributed coordinator's
  key-value store; they then raise LeaseHeld with that reason. Nothing on one process."""
  import jax  # pylint: disable=import-outside-toplevel

  global _calls
  _calls += 1
  if jax.process_count() == 1:
    return
  from jax._src import distributed  # pylint: disable=import-outside-toplevel

  client = distributed.global_state.client
  if client is None:  # more than one process, yet jax.distributed.initialize was not called
    raise RuntimeError("lease: jax.distributed has no coordinator client on a multi-process run")
  key = f"capo_jax/lease/{_calls}"
  if jax.process_index() == 0:
    client.key_value_set(key, error or "")
    return
  error = client.blocking_key_value_get(key, int(timeout_s * 1000))
  if error:
    raise LeaseHeld(f"process 0 could not take the workdir's lease: {error}")
