"""A local Cloud Storage API for tests: ``gcp-storage-emulator`` on 127.0.0.1.

    with GcsEmulator(bucket="capo-test") as gcs:
      env = gcs.env()          # for subprocesses: gcsfs and TensorStore talk to it
      gcs.apply(monkeypatch)   # for this process

Started and stopped by the test; in memory, no network beyond loopback.
``gcs_emulator_server.py`` adds one header the emulator leaves out (see there).
gcsfs follows ``STORAGE_EMULATOR_HOST``, TensorStore (Orbax's arrays)
``TENSORSTORE_GCS_HTTP_URL``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def available() -> str | None:
  """None when the emulator and gcsfs are installed, else why not."""
  # find_spec, not import: gcsfs picks its file system class when first imported,
  # and capo_jax.runtime.fs must set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT before that.
  if importlib.util.find_spec("gcsfs") is None:
    return "gcsfs is not installed"
  if importlib.util.find_spec("gcp_storage_emulator") is None:
    return "gcp-storage-emulator is not installed (pip install -r requirements-test.txt)"
  return None


class GcsEmulator:
  """Context manager running the emulator with one bucket."""

  def __init__(self, bucket: str = "capo-test") -> None:
    self.bucket = bucket
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._proc: subprocess.Popen | None = None
    self._log: Any = None

  def __enter__(self) -> GcsEmulator:
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_emulator_server.py")
    cmd = [
      sys.executable,
      server,
      "start",
      "--host",
      "127.0.0.1",
      "--port",
      str(self.port),
      "--default-bucket",
      self.bucket,
      "--in-memory",
      "-q",
    ]
    # Its log goes to a file, never a pipe: the server is single-threaded and prints a
    # traceback for every dropped connection; a full pipe would stall it mid-request.
    self._log = tempfile.TemporaryFile()
    self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while time.time() < deadline:
      if self._proc.poll() is not None:
        self._log.seek(0)
        raise RuntimeError(f"gcp-storage-emulator exited: {self._log.read()[-2000:]!r}")
      try:
        socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        return self
      except OSError:
        time.sleep(0.2)
    self.__exit__()
    raise RuntimeError("gcp-storage-emulator did not start within 30 s")

  def env(self) -> dict[str, str]:
    return {
      "STORAGE_EMULATOR_HOST": self.url,
      "TENSORSTORE_GCS_HTTP_URL": self.url,
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
      "NO_GCE_CHECK": "true",
    }

  def apply(self, monkeypatch: Any) -> None:
    for k, v in self.env().items():
      monkeypatch.setenv(k, v)

  def __exit__(self, *exc: object) -> None:
    if self._proc is not None and self._proc.poll() is None:
      self._proc.terminate()
      try:
        self._proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._proc.kill()
    if self._log is not None:
      self._log.close()
