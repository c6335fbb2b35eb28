"""Host <-> device transfers: the one place where a run's arrays cross over.

A host array is either
  * global: every process holds all of it (the rollout's arrays, once
    ``gather_rows`` has shared each process's rows); ``put_global`` places it
    on the mesh, each device taking its slice;
  * local rows: each process holds only its own contiguous rows of the batch;
    ``shard_batch`` stitches them into global device arrays.
``to_host`` reads a device array back, whole, on every process.

On one process all of these are plain ``device_put`` / ``np.asarray``; on
several they use ``multihost_utils`` / ``make_array_from_*``, so the callers
are the same code on a laptop and on a pod slice.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from capo_jax.runtime import mesh as mesh_lib
from models.sharding import to_host  # noqa: F401  (re-exported: the one to_host)


def gather_rows(x: np.ndarray) -> np.ndarray:
  """Concatenates each process's host rows (in process order), on every process."""
  if jax.process_count() == 1:
    return x
  return np.asarray(multihost_utils.process_allgather(x, tiled=False)).reshape(
      (-1,) + x.shape[1:])


def put_global(tree: Any, sharding: jax.sharding.Sharding) -> Any:
  """Global host arrays (every process holds them in full) -> global device arrays."""
  return jax.tree.map(
      lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx]), tree)


def shard_batch(batch: Any, mesh: Mesh, rules: Any) -> Any:
  """Places a batch of local rows (pytree, common leading row axis) on the mesh.

  On one process the arrays are the global batch. On several, each process
  passes its own contiguous rows and they are stitched into global arrays
  sharded over the batch axes of ``rules`` (e.g. ``mesh.TRAIN_RULES``).
  """
  leaves = jax.tree.leaves(batch)
  if not leaves:
    return batch
  local_rows = {np.shape(x)[0] for x in leaves}
  if len(local_rows) != 1:
    raise ValueError(f"shard_batch: leaves have different leading sizes {sorted(local_rows)}")
  rows = local_rows.pop() * jax.process_count()
  sh = mesh_lib.batch_sharding(mesh, rules, rows)
  if jax.process_count() == 1:
    return jax.device_put(batch, sh)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sh, np.asarray(x)),
                      batch)
