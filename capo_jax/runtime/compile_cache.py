"""JAX's persistent compilation cache, from ``config.compilation_cache_dir``.

The trainer builds its jitted train step and log-prob pass as closures over the
run's config, so every run compiles them again: a rerun of the same command, a
resumed run, and each of the study's runs in one process
(``studies/grpo_vs_capo/run.py``). JAX's disk cache is keyed by the compiled
program, not by the Python function, so each finds the executables of the first
(what it saves, measured: ``docs/training.md``).

``compilation_cache_dir``: empty turns the cache off (the default for real runs);
an absolute path or ``gs://`` URL is used as is (JAX reaches Cloud Storage through
etils; tested against the Cloud Storage emulator from one host at a time, not on a
pod); a relative one lies under the run's workdir.
The cache is trusted code: never point it at a directory others may write.
"""

from __future__ import annotations

import logging
import os

import jax

from capo_jax.runtime import fs

log = logging.getLogger(__name__)

# Programs that compile faster than this are not worth a file. JAX's default is 1 s;
# the demo's compiles that show in its step times take 4-8 s, so half a second keeps
# every one of them and skips the many small helper programs.
MIN_COMPILE_S = 0.5


def cache_path(setting: str, workdir: str) -> str | None:
  """Where ``config.compilation_cache_dir = setting`` puts the cache for ``workdir``."""
  if not setting:
    return None
  if fs.is_remote(setting) or os.path.isabs(setting):
    return setting
  return fs.join(workdir, setting)


def enable(setting: str, workdir: str, *, min_compile_s: float = MIN_COMPILE_S) -> str | None:
  """Turns the cache on as ``compilation_cache_dir = setting`` asks; returns its path or None.

  Call before the run compiles anything: JAX reads the setting at its first
  compilation, and a later change only takes effect after ``reset``.
  """
  path = cache_path(setting, workdir)
  if path is None:
    return None
  if not fs.is_remote(path):
    fs.makedirs(path)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  # JAX's default also points XLA's GPU autotune cache into the directory, which puts the
  # path into every program's compile options and so into its key: the same programs
  # under another workdir would never hit.
  jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
  log.info("JAX compilation cache: %s", path)
  return path
