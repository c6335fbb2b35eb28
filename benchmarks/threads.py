"""The same CPU thread count for both sides of a CPU benchmark: JAX (XLA:CPU) and PyTorch.

``pin(n)`` restricts the whole process to n CPUs (``os.sched_setaffinity``,
as ``taskset`` does) before JAX starts its backend, and sets PyTorch's
intra-op threads to n. XLA:CPU sizes its intra-op pool from the process's
CPU affinity when the backend starts: with jax 0.10.2 a jitted matmul ran on
one thread pinned to one CPU and on four (two of them the Eigen pool's) with
two CPUs, while ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`` left it on
four; an affinity set after the backend started left four threads sharing one
CPU. ``busy_threads`` is that measurement: it counts the threads that take a
real share of the process's CPU time while a function runs, which does not
depend on how loaded the machine is (CPU time per wall second does).
"""

from __future__ import annotations

import os
import time
from typing import Callable

BUSY_SHARE = 0.1  # a thread with less of the process's CPU time than this is not working


def pin(threads: int) -> list[int]:
  """Restricts this process to ``threads`` CPUs and PyTorch to as many threads; returns the CPUs.

  Must run before JAX's backend starts (the first ``jax.devices()`` or array), which
  fixes the size of XLA:CPU's thread pool.
  """
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  if xla_bridge.backends_are_initialized():
    raise RuntimeError(
      "benchmarks.threads.pin: JAX's backend already started, so XLA:CPU's thread pool "
      "keeps its size; call pin() before the first jax.devices() or array"
    )
  cpus = sorted(os.sched_getaffinity(0))
  if not 1 <= threads <= len(cpus):
    raise ValueError(f"benchmarks.threads.pin: threads={threads}, this process may use {cpus}")
  os.sched_setaffinity(0, cpus[:threads])
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:  # a JAX-only benchmark
    return cpus[:threads]
  torch.set_num_threads(threads)
  return cpus[:threads]


def _thread_cpu_ticks() -> dict[str, int]:
  """User + system clock ticks of each thread of this process, by thread id."""
  ticks = {}
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # the thread ended
      continue
    ticks[tid] = int(fields[11]) + int(fields[12])  # utime, stime (proc(5) fields 14, 15)
  return ticks


def busy_threads(fn: Callable[[], object], seconds: float = 1.0) -> int:
  """How many threads take at least ``BUSY_SHARE`` of the CPU time while ``fn`` runs in a loop."""
  before = _thread_cpu_ticks()
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    fn()
  after = _thread_cpu_ticks()
  used = [after[t] - before.get(t, 0) for t in after]
  total = sum(used)
  return sum(1 for u in used if total and u >= BUSY_SHARE * total)


def check(threads: int) -> dict[str, int]:
  """Busy threads of a float32 matmul in JAX and in PyTorch (after ``pin(threads)``)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  a = np.random.default_rng(0).normal(size=(1024, 1024)).astype(np.float32)
  dot = jax.jit(jnp.dot)
  a_jax, a_pt = jnp.asarray(a), torch.from_numpy(a)
  dot(a_jax, a_jax).block_until_ready()
  result = {
    "threads": threads,
    "cpus": len(os.sched_getaffinity(0)),
    "torch_threads": torch.get_num_threads(),
    "jax_busy_threads": busy_threads(lambda: dot(a_jax, a_jax).block_until_ready()),
    "torch_busy_threads": busy_threads(lambda: a_pt @ a_pt),
  }
  print(
    f"threads: {result['cpus']} CPUs (affinity), torch {result['torch_threads']} intra-op "
    f"threads; busy threads of a 1024^2 matmul: jax {result['jax_busy_threads']}, torch "
    f"{result['torch_busy_threads']}",
    flush=True,
  )
  return result
