"""Shared helpers of tests and benchmarks: a batch of local rows onto the mesh, a metrics file back.

Test modules import it as ``import host_utils`` (pytest puts tests/ on
sys.path); benchmarks and subprocesses run from the repo root use
``from tests import host_utils``.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from capo_jax.runtime import fs
from capo_jax.runtime import mesh as mesh_lib


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
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sh, np.asarray(x)), batch)


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """The rows of a JSON-lines file (local or ``gs://``), blank lines skipped."""
  return [json.loads(line) for line in fs.read_text(path).splitlines() if line.strip()]
