"""Whether a model or tokenizer directory holds the files a run reads, before anything reads them.

transformers' answer to a directory without tokenizer files is "You need to have
sentencepiece or tiktoken installed to convert a slow tokenizer to a fast one";
a missing ``config.json`` is a bare ``FileNotFoundError``. These checks name the
directory, the files it lacks and the files it has instead. Paths may be local
or ``gs://`` (``capo_jax.runtime.fs``).
"""

from __future__ import annotations

import json
import os

from capo_jax.runtime import fs

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS = "model.safetensors"  # models.hf_weights.SINGLE_FILE / INDEX_FILE
INDEX_WEIGHTS = "model.safetensors.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # special tokens and the chat template
# Each of these is a full vocabulary: the fast tokenizer's file, the byte-level BPE
# pair a fast tokenizer is converted from (Qwen's slow tokenizer), or a sentencepiece model.
VOCAB_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


def _listing(path: str) -> str:
  try:
    names = sorted(p.name for p in fs.path(path).iterdir())
  except (OSError, ValueError):
    return "it cannot be listed"
  if not names:
    return "it is empty"
  more = f", ... ({len(names)} files)" if len(names) > 12 else ""
  return "it holds " + ", ".join(names[:12]) + more


def missing_model_files(path: str) -> list[str]:
  """What a HF checkpoint directory lacks: config.json, the safetensors weights (one file,
  or an index and every shard it names)."""
  missing = [] if fs.is_file(fs.join(path, CONFIG_FILE)) else [CONFIG_FILE]
  index = fs.join(path, INDEX_WEIGHTS)
  if fs.is_file(index):
    try:
      shards = sorted(set(json.loads(fs.read_text(index))["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
      return missing + [f"{INDEX_WEIGHTS} with a weight_map (it is unreadable)"]
    missing += [s for s in shards if not fs.is_file(fs.join(path, s))]
  elif not fs.is_file(fs.join(path, SINGLE_WEIGHTS)):
    missing.append(f"{SINGLE_WEIGHTS} (or {INDEX_WEIGHTS} and its shards)")
  return missing


def missing_tokenizer_files(path: str) -> list[str]:
  """What a HF tokenizer directory lacks: tokenizer_config.json and a vocabulary."""
  missing = [] if fs.is_file(fs.join(path, TOKENIZER_CONFIG)) else [TOKENIZER_CONFIG]
  if not any(all(fs.is_file(fs.join(path, f)) for f in group) for group in VOCAB_SETS):
    missing.append(" or ".join(" + ".join(g) for g in VOCAB_SETS))
  return missing


def _check(path: str, what: str, missing: list[str]) -> None:
  if not fs.is_dir(path):
    raise FileNotFoundError(f"{what} {path} does not exist")
  if missing:
    raise FileNotFoundError(f"{what} {path} lacks {'; '.join(missing)} ({_listing(path)})")


def check_model_dir(path: str | os.PathLike, *, tokenizer: bool = False) -> None:
  """Raises FileNotFoundError naming ``path`` and what it lacks to be loaded as a HF
  model (and, with ``tokenizer``, its tokenizer)."""
  path = os.fspath(path)
  missing = missing_model_files(path) if fs.is_dir(path) else []
  if tokenizer and fs.is_dir(path):
    missing += [f"tokenizer file {m}" for m in missing_tokenizer_files(path)]
  _check(path, "model directory", missing)


def check_tokenizer_dir(path: str | os.PathLike) -> None:
  """Raises FileNotFoundError naming ``path`` and the tokenizer files it lacks."""
  path = os.fspath(path)
  _check(path, "tokenizer directory", missing_tokenizer_files(path) if fs.is_dir(path) else [])
