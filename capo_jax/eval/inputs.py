"""Checks of the evaluator's inputs that name the file (and field or line) at fault.

``InputError`` is what the command line prints without a traceback; ``check_benchmark_name``
keeps names read from data from becoming paths.
"""

from __future__ import annotations

import json
import os

from capo_jax.runtime import fs


class InputError(ValueError):
  """A bad input file or flag, named; the command line prints it without a traceback."""


_HF_INT_FIELDS = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
)


def check_policy_config(policy: str) -> None:
  """Checks the config.json files of a local ``--policy`` directory before the load, so a
  bad one is named with its field (the loader would fail deep inside with a KeyError).

  A trainer workdir's own config.json (the run record, with a "config" key) is only
  checked to be a JSON object; a HF config.json (the dir's or its export's) needs the
  model fields. Hub ids and gs:// paths are left to the loader.
  """
  if fs.is_remote(policy) or not os.path.isdir(policy):
    return
  # Imported here: report.py imports this module and needs neither JAX nor the models.
  from capo_jax.runtime.policy_io import EXPORT_DIR  # pylint: disable=import-outside-toplevel
  from models.config import Qwen2Config  # pylint: disable=import-outside-toplevel

  for path in (
    os.path.join(policy, "config.json"),
    os.path.join(policy, EXPORT_DIR, "config.json"),
  ):
    if not os.path.isfile(path):
      continue
    try:
      with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise InputError(f"--policy: {path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
      raise InputError(f"--policy: {path} must hold a JSON object, got {type(cfg).__name__}")
    if "config" in cfg:  # the trainer's run record
      continue
    for field in _HF_INT_FIELDS:
      if field not in cfg:
        raise InputError(f"--policy: {path} has no field {field!r} (a HF model config)")
      val = cfg[field]
      if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
        raise InputError(
          f"--policy: {path}: field {field!r} must be a positive integer, got {val!r}"
        )
    try:
      Qwen2Config.from_hf(path)
    except (KeyError, TypeError, ValueError, NotImplementedError) as e:
      msg = str(e.args[0]) if e.args else type(e).__name__
      raise InputError(f"--policy: {msg if path in msg else f'{path}: {msg}'}") from None


def check_benchmark_name(name: str, where: str) -> str:
  """``name``, or a ValueError naming ``where``: a benchmark name from data becomes part of
  file names (``<name>_scaling.png``), where a path separator could write outside the
  output directory ("../x", "/tmp/x")."""
  if name in ("", ".", "..") or any(c in "/\\" or ord(c) < 32 for c in name):
    raise ValueError(
      f"{where}: benchmark name {name!r} cannot be part of a file name "
      "(empty, '.', '..', or a '/', '\\' or control character)"
    )
  return name
