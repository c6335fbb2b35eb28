"""The persistent compilation cache: where it goes, and that another process (under
another workdir) finds the programs a first one compiled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from capo_jax.runtime import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Counts JAX's own cache-hit events (jax.monitoring) around one jitted call.
_CHILD = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from capo_jax.runtime import compile_cache
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
    compile_cache.enable(sys.argv[2], sys.argv[1], min_compile_s=0)
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(-1) * 3.0)
    f(jnp.ones((16, 16))).block_until_ready()
    print("hits", len(hits))
""")


def _run(workdir: str, setting: str, env: dict[str, str] | None = None) -> int:
  out = subprocess.run(
    [sys.executable, "-c", _CHILD, workdir, setting],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
  ).stdout
  return int(out.split("hits")[-1])


def test_cache_path():
  assert compile_cache.cache_path("", "/w") is None
  assert compile_cache.cache_path("/abs/c", "/w") == "/abs/c"
  assert compile_cache.cache_path("gs://b/c", "/w") == "gs://b/c"
  assert compile_cache.cache_path("jax_cache", "/w/run") == "/w/run/jax_cache"
  assert compile_cache.cache_path("jax_cache", "gs://b/run") == "gs://b/run/jax_cache"


def test_a_second_process_hits_the_cache_even_moved_to_another_workdir(tmp_path):
  first, second = tmp_path / "first", tmp_path / "second"
  assert _run(str(first), "jax_cache") == 0  # nothing cached yet: compiled, written
  assert os.listdir(first / "jax_cache")
  assert _run(str(first), "jax_cache") >= 1  # a rerun in the same workdir
  # The cache copied under another workdir still hits: the keys do not carry the path
  # (JAX's default XLA caches would put it into every program's compile options).
  os.makedirs(second)
  subprocess.run(["cp", "-r", str(first / "jax_cache"), str(second)], check=True)
  assert _run(str(second), "jax_cache") >= 1


def test_empty_setting_is_off(tmp_path):
  assert _run(str(tmp_path), "") == 0
  assert not os.path.exists(tmp_path / "jax_cache")


def test_a_gs_workdir_keeps_the_cache_in_cloud_storage():
  """The real job's workdir is on Cloud Storage: the cache goes there (JAX through
  etils / gcsfs) and a second process, another VM in effect, hits it."""
  from tests import gcs_emulator  # pylint: disable=import-outside-toplevel

  why = gcs_emulator.available()
  if why:
    pytest.skip(why)
  with gcs_emulator.GcsEmulator("capo-cache") as gcs:
    workdir = "gs://capo-cache/run"
    assert _run(workdir, "jax_cache", gcs.env()) == 0
    assert _run(workdir, "jax_cache", gcs.env()) >= 1
