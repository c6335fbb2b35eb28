"""What carries a run: device mesh, local / gs:// paths, checkpoints, metrics, preemption."""

from capo_jax.runtime.checkpoint import Checkpointer
from capo_jax.runtime.mesh import make_mesh

__all__ = ["Checkpointer", "make_mesh"]
