"""Host <-> device transfers of a run's arrays.

A host array is global: every process holds all of it (the rollout's arrays,
once ``gather_rows`` has shared each process's rows); ``put_global`` places it
on the mesh, each device taking its slice. ``models.sharding.to_host`` reads a
device array back, whole, on every process.

On one process these are plain ``device_put`` / ``np.asarray``; on several
they use ``multihost_utils`` / ``make_array_from_*``, so the callers are the
same code on a laptop and on a pod slice.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def gather_rows(x: np.ndarray) -> np.ndarray:
  """Concatenates each process's host rows (in process order), on every process."""
  if jax.process_count() == 1:
    return x
  return np.asarray(multihost_utils.process_allgather(x, tiled=False)).reshape((-1,) + x.shape[1:])


def put_global(tree: Any, sharding: jax.sharding.Sharding) -> Any:
  """Global host arrays (every process holds them in full) -> global device arrays."""
  return jax.tree.map(
    lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx]), tree
  )
