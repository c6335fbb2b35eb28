"""One path layer for local paths and Cloud Storage (``gs://``) alike.

Everything the trainer, the evaluator and the HF exporter read or write goes
through here. Paths are ``etils.epath.Path``: the same layer Orbax uses, which
reaches ``gs://`` through ``gcsfs`` (a requirement). Plain ``open`` and
``os.makedirs`` must not see a ``gs://`` string: ``os.makedirs("gs://b/r")``
silently creates the local folder ``./gs:/b/r``, and the run's files would die
with the VM.

Libraries that only read local files (``safetensors.safe_open``, HF
tokenizers, matplotlib's ``savefig``) get a local copy of a remote directory
(``local_copy``; ``model_dir`` also takes Hugging Face hub ids) or write into a
local staging directory that is uploaded when complete (``staged_dir``).

Cloud Storage emulators: ``gcsfs`` follows ``STORAGE_EMULATOR_HOST`` and
TensorStore (Orbax's array store) ``TENSORSTORE_GCS_HTTP_URL``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

# Recent gcsfs asks every bucket over gRPC whether it is zonal / hierarchical
# and waits up to 60 s for the answer where gRPC is unreachable (emulators,
# locked-down VPCs). The run's buckets are standard ones: skip the probe unless
# the user asks for it.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from etils import epath  # noqa: E402  (after the environment default above)

log = logging.getLogger(__name__)

PathLike = str | os.PathLike
Path = epath.Path


def is_remote(path: PathLike) -> bool:
  """True for URLs such as ``gs://bucket/dir`` (anything with a scheme)."""
  return "://" in os.fspath(path)


def path(p: PathLike) -> epath.Path:
  """``p`` as an ``epath.Path`` (``gs://`` kept intact, unlike ``pathlib``)."""
  return epath.Path(p)


def join(base: PathLike, *parts: str) -> str:
  """``base/part/...`` as a string; never turns ``gs://`` into ``gs:/``."""
  return os.fspath(epath.Path(base).joinpath(*parts))


def makedirs(p: PathLike) -> None:
  epath.Path(p).mkdir(parents=True, exist_ok=True)


def exists(p: PathLike) -> bool:
  return epath.Path(p).exists()


def is_file(p: PathLike) -> bool:
  return epath.Path(p).is_file()


def is_dir(p: PathLike) -> bool:
  return epath.Path(p).is_dir()


def read_text(p: PathLike) -> str:
  return epath.Path(p).read_text(encoding="utf-8")


def write_text(p: PathLike, text: str) -> None:
  """Writes ``text`` so that a reader sees the old file or the new one, never half.

  Local: a temporary sibling renamed over the target. Cloud Storage: one
  object upload, which is atomic by itself.
  """
  target = epath.Path(p)
  target.parent.mkdir(parents=True, exist_ok=True)
  if is_remote(p):
    target.write_text(text, encoding="utf-8")
    return
  fd, tmp = tempfile.mkstemp(dir=os.fspath(target.parent), prefix=f".{target.name}.")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, os.fspath(target))
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


class NotWritable(OSError):
  """A run's output folder cannot be written (read-only, missing bucket, no permission)."""


def check_writable(directory: PathLike, what: str) -> None:
  """Writes and deletes a probe file in ``directory``; NotWritable naming it when that fails.

  A read-only checkpoint folder would otherwise be found only when the first
  save fails, a whole checkpoint interval later.
  """
  probe = epath.Path(directory) / f".capo-write-probe-{uuid.uuid4().hex[:12]}"
  try:
    epath.Path(directory).mkdir(parents=True, exist_ok=True)
    probe.write_text("probe", encoding="utf-8")
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except  (gcsfs, PermissionError, ENOSPC ...)
    raise NotWritable(
      f"{what} {os.fspath(directory)} is not writable: {type(e).__name__}: {e}"
    ) from None


def move_tree(src: PathLike, dst: PathLike) -> None:
  """Moves the folder ``src`` to ``dst`` (absent): a rename locally, copies then deletes
  on Cloud Storage (which has no folder rename)."""
  if not is_remote(src):
    os.makedirs(os.path.dirname(os.fspath(dst)), exist_ok=True)
    os.replace(os.fspath(src), os.fspath(dst))
    return
  root = epath.Path(src)
  for rel, f in _files(root):
    target = epath.Path(dst).joinpath(*rel.split("/"))
    with f.open("rb") as r, target.open("wb") as w:
      shutil.copyfileobj(r, w, length=16 << 20)
  root.rmtree()


def upload_file(local: PathLike, remote: PathLike) -> None:
  """Copies one local file to ``remote`` (local or ``gs://``), replacing it."""
  dest = epath.Path(remote)
  dest.parent.mkdir(parents=True, exist_ok=True)
  with open(local, "rb") as src, dest.open("wb") as out:
    shutil.copyfileobj(src, out, length=16 << 20)


def upload_tree(local_dir: PathLike, remote_dir: PathLike, last: tuple[str, ...] = ()) -> None:
  """Copies a local directory tree to ``remote_dir``; files named in ``last`` go last.

  Readers that test for a marker file (a HF directory's ``config.json``) then
  never see a directory whose marker is there but whose weights are not.
  """
  local: str = os.fspath(local_dir)
  files = sorted(
    os.path.relpath(os.path.join(d, f), local) for d, _, names in os.walk(local) for f in names
  )
  files.sort(key=lambda rel: rel in last)
  for rel in files:
    upload_file(os.path.join(local, rel), join(remote_dir, *rel.split(os.sep)))


def _cache_root() -> str:
  return os.environ.get("CAPO_CACHE_DIR") or os.path.join(
    os.path.expanduser("~"), ".cache", "capo_jax"
  )


def _files(root: epath.Path, prefix: str = "") -> Iterator[tuple[str, epath.Path]]:
  """(relative path, path) of every file under ``root``, one listing per folder.

  (epath refuses recursive globs on Cloud Storage, and its ``walk`` drops the
  ``gs://`` scheme; ``iterdir`` keeps it.)
  """
  for child in sorted(root.iterdir()):
    rel = f"{prefix}{child.name}"
    if child.is_dir():
      yield from _files(child, rel + "/")
    else:
      yield rel, child


def _fingerprint(src: epath.Path) -> list[tuple[str, int, int]]:
  """(relative path, size, mtime) of a remote file or of every file under a folder."""
  files = _files(src) if src.is_dir() else [(src.name, src)]
  out = []
  for rel, f in files:
    st = f.stat()
    out.append((rel, int(st.length), int(st.mtime or 0)))
  return out


def local_copy(p: PathLike) -> str:
  """A local path with the contents of ``p``: ``p`` itself when local.

  A remote file or directory is downloaded into ``$CAPO_CACHE_DIR`` (default
  ``~/.cache/capo_jax``) under a name derived from its URL. The copy is
  reused while every remote file keeps its size and modification time (a
  listing, no download), and fetched again when one changed: a run's
  ``export_hf`` is rewritten when the run is resumed. The fingerprint is
  written last, so an interrupted download starts over.
  """
  s = os.fspath(p)
  if not is_remote(s):
    return s
  src = epath.Path(s)
  if not src.exists():
    raise FileNotFoundError(f"{s}: no such file or directory")
  key = hashlib.sha1(s.rstrip("/").encode()).hexdigest()[:16]
  dest = os.path.join(_cache_root(), "remote", f"{key}-{src.name}")
  marker = dest + ".complete"
  fingerprint = json.dumps(_fingerprint(src))
  if os.path.exists(marker) and open(marker, encoding="utf-8").read() == fingerprint:
    return dest
  shutil.rmtree(dest, ignore_errors=True)
  log.info("copying %s to the local cache %s", s, dest)
  if src.is_dir():
    for rel, f in _files(src):
      os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
      with f.open("rb") as r, open(os.path.join(dest, rel), "wb") as w:
        shutil.copyfileobj(r, w, length=16 << 20)
  else:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with src.open("rb") as r, open(dest, "wb") as w:
      shutil.copyfileobj(r, w, length=16 << 20)
  write_text(marker, fingerprint)
  return dest


def model_dir(p: PathLike) -> str:
  """A local directory with the model (weights, config, tokenizer) named by ``p``.

  ``gs://`` directories are copied to the local cache (``local_copy``), local
  paths are used as they are, and anything else is taken for a Hugging Face
  hub id ("Qwen/Qwen2.5-Math-1.5B") and fetched into the hub cache
  (``models.hub.resolve``; ``HF_HOME``, ``HF_HUB_OFFLINE``). Raises
  ``FileNotFoundError`` naming both the local path and the hub id when ``p``
  is neither.
  """
  from models import hub  # pylint: disable=import-outside-toplevel

  return local_copy(hub.resolve(p))


@contextlib.contextmanager
def staged_dir(target: PathLike, last: tuple[str, ...] = ()) -> Iterator[str]:
  """A local directory whose contents become ``target`` when the block succeeds.

  Local targets: the directory is built beside ``target`` and renamed into
  place (an earlier ``target`` is replaced), so a crash leaves the old one.
  Remote targets: built in a temporary directory, then uploaded with the
  files in ``last`` (e.g. ``config.json``) written last.
  """
  s = os.fspath(target).rstrip("/")
  if is_remote(s):
    with tempfile.TemporaryDirectory(prefix="capo-stage-") as tmp:
      yield tmp
      upload_tree(tmp, s, last)
    return
  parent = os.path.dirname(os.path.abspath(s))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(s)}.tmp-")
  try:
    yield tmp
    old = None
    if os.path.exists(s):
      old = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(s)}.old-")
      os.rmdir(old)
      os.replace(s, old)
    os.replace(tmp, s)
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def output_dir(target: PathLike) -> Iterator[str]:
  """A local directory to write files into that end up in ``target``.

  Local targets are used as they are (files already there stay); remote ones
  get a temporary directory that is uploaded when the block succeeds.
  """
  s = os.fspath(target)
  if not is_remote(s):
    os.makedirs(s, exist_ok=True)
    yield s
    return
  with tempfile.TemporaryDirectory(prefix="capo-out-") as tmp:
    yield tmp
    upload_tree(tmp, s)
