"""Model directories by local path or Hugging Face hub id ("Qwen/Qwen2.5-Math-1.5B").

``resolve`` is the one place a model path becomes a directory: an existing
local path is used as it is, a URL (``gs://...``) is left to the caller's path
layer (``capo_jax.runtime.fs.model_dir`` copies it to the local cache), and
anything else that reads as ``owner/name`` is fetched with
``huggingface_hub.snapshot_download``: only the safetensors weights, the
config and the tokenizer files, into the hub cache (``HF_HOME`` /
``HF_HUB_CACHE``), once. With ``HF_HUB_OFFLINE=1`` only that cache is looked
at, and nothing is requested from the network.

    cfg, params = hf_weights.load_pretrained("Qwen/Qwen2.5-Math-1.5B")
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

log = logging.getLogger(__name__)

# What a snapshot brings: weights, configs, tokenizer (no *.bin / *.pt / *.gguf / images).
ALLOW_PATTERNS = (
  "*.safetensors",
  "*.safetensors.index.json",
  "config.json",
  "generation_config.json",
  "tokenizer.json",
  "tokenizer_config.json",
  "vocab.json",
  "merges.txt",
  "special_tokens_map.json",
  "added_tokens.json",
  "chat_template.jinja",
  "chat_template.json",
)
# A hub model id: "owner/name" (letters, digits, '-', '_', '.'), as huggingface_hub checks it.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
_TRUE = ("1", "ON", "YES", "TRUE")


def is_hub_id(path: str | os.PathLike) -> bool:
  """True when ``path`` has the shape of a hub id ("owner/name"), whether or not it exists."""
  s = os.fspath(path)
  return bool(_HUB_ID.fullmatch(s)) and ".." not in s


def offline() -> bool:
  """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, read at call time.

  huggingface_hub reads it once, at import; reading it here as well means a
  process that sets it later is still kept off the network.
  """
  from huggingface_hub import constants  # pylint: disable=import-outside-toplevel

  env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
  return env.upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def _download(repo_id: str, **kw: Any) -> str:
  """``huggingface_hub.snapshot_download``; tests replace this with a local stand-in."""
  from huggingface_hub import snapshot_download  # pylint: disable=import-outside-toplevel

  return snapshot_download(repo_id, **kw)


def resolve(path: str | os.PathLike) -> str:
  """A path to read the model at ``path`` from: local, a URL, or a hub snapshot.

  Raises ``FileNotFoundError`` naming both possibilities (the local path
  tried, and the hub id with the hub's error) when ``path`` is neither.
  """
  s = os.fspath(path)
  if "://" in s or os.path.exists(s):
    return s
  local = f"{os.path.abspath(s)} does not exist"
  if not is_hub_id(s):
    raise FileNotFoundError(
      f"{s!r}: {local}, and it is not a Hugging Face hub id (owner/name) either"
    )
  mode = "the local hub cache (HF_HUB_OFFLINE is set)" if offline() else "the Hugging Face hub"
  log.info("%s is not a local path: fetching it from %s", s, mode)
  try:
    snapshot = _download(s, allow_patterns=list(ALLOW_PATTERNS), local_files_only=offline())
  except Exception as e:  # pylint: disable=broad-except  (hub errors have no common base)
    raise FileNotFoundError(
      f"{s!r} is neither a local directory ({local}) nor a model fetched from {mode} "
      f"(hub id {s!r}: {type(e).__name__}: {e})"
    ) from e
  return os.fspath(snapshot)


def resolve_file(path: str | os.PathLike, filename: str) -> str:
  """``filename`` of the model at ``path``; a hub id fetches that one file, not the snapshot
  (the architecture of a run to compile ahead of time needs config.json, not the weights)."""
  s = os.fspath(path)
  if "://" in s:
    return f"{s.rstrip('/')}/{filename}"
  if os.path.exists(s) or not is_hub_id(s):
    return os.path.join(resolve(s), filename)  # resolve raises for what is neither
  mode = "the local hub cache (HF_HUB_OFFLINE is set)" if offline() else "the Hugging Face hub"
  try:
    snapshot = _download(s, allow_patterns=[filename], local_files_only=offline())
  except Exception as e:  # pylint: disable=broad-except  (hub errors have no common base)
    raise FileNotFoundError(
      f"{s!r}: {filename} not found locally ({os.path.abspath(s)} does "
      f"not exist) nor fetched from {mode} ({type(e).__name__}: {e})"
    ) from e
  return os.path.join(os.fspath(snapshot), filename)
