"""Each chip's share of an update's gradient kept on the chip until the update ends.

With the weights gathered once an update (``config.mesh.gather_once``) every chip
holds the whole compute-dtype copy for its rows, yet each micro-batch's gradient of
that copy is still summed over the chips that split the rows (data x fsdp) before it
is added up: an all-reduce of a whole model's gradient per micro-batch, by the TPU
compiler most of what a train step sends between chips. ``jit`` cannot hold a sum
pending across a loop, and the TPU compiler did not move that all-reduce out of the
micro-batch loop when the accumulator lay whole on every chip (tried).

So the shards get their own copy of the weights instead: the copy is broadcast to
[n, ...] along a leading axis laid over the row axes (n = data x fsdp; each chip holds
one slice, its own whole copy, so nothing moves), the model runs ``vmap``-ed over that
axis on each shard's rows (``spmd_axis_name``: inside, "batch" maps to nothing, the
vmapped axis to the row axes), and the gradient of a shard's copy is that shard's rows'
share, computed and accumulated (float32) where it lies. The update sums the n shares
once, into the masters' split: one reduction an update, not an all-reduce a
micro-batch (on v4-32 the TPU compiler makes it an all-reduce and a slice, not a
reduce-scatter, in every form tried: docs/results/tpu.md). The cost: a float32
gradient of the whole model (over tensor) a chip, and in the compiled program about
as much again (tools/memory_terms.py).
"""

from __future__ import annotations

import contextvars
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from capo_jax.runtime import mesh as mesh_lib
from models import sharding
from models.config import Qwen2Config
from models.sharding import Layout

Params = Any
ROW_NAMES = ("batch", "attn_batch")
_INSIDE = contextvars.ContextVar("inside_row_shards", default=False)


def inside() -> bool:
  """Whether the forward being traced runs shard by shard (``per_shard``): a
  ``shard_map`` in it must skip JAX's varying-axes check, which rejects the row axes
  the shard ``vmap`` adds to its inputs (jax 0.10: "Primitive sub requires varying
  manual axes to match")."""
  return _INSIDE.get()


def row_axes(layout: Layout) -> tuple[str, ...]:
  """The mesh axes the rows are split over (the shards of ``split_weights``)."""
  entry = layout.spec(("batch",))[0]
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def shards(layout: Layout | None) -> int:
  return 1 if layout is None else layout.shards("batch")


def inner_layout(layout: Layout) -> Layout:
  """``layout`` with the rows whole: inside the shard ``vmap`` the row axes carry the
  vmapped axis, so no activation may name them again."""
  rules = tuple((k, None if k in ROW_NAMES else v) for k, v in layout.rules)
  return Layout(layout.mesh, rules)


def split_shardings(model_cfg: Qwen2Config, layout: Layout) -> Any:
  """Where ``split_weights`` (and the accumulated shares) lie: the leading axis over
  the row axes, the rest as the gathered weights (``mesh.GATHERED_RULES``)."""
  axes = row_axes(layout)
  whole = mesh_lib.param_shardings(model_cfg, layout.mesh, mesh_lib.GATHERED_RULES)
  return jax.tree.map(lambda s: NamedSharding(layout.mesh, PartitionSpec(axes, *s.spec)), whole)


def split_weights(weights: Params, model_cfg: Qwen2Config, layout: Layout) -> Params:
  """[n, ...]: each row shard's own copy of ``weights`` (gathered: whole over the row
  axes), the leading axis over those axes; a broadcast, nothing moves."""
  n = shards(layout)
  put = lambda w, s: jax.lax.with_sharding_constraint(  # noqa: E731
    jnp.broadcast_to(w[None], (n,) + w.shape), s
  )
  return jax.tree.map(put, weights, split_shardings(model_cfg, layout))


def zero_shares(model_cfg: Qwen2Config, weights_N: Params, layout: Layout) -> Params:
  """The float32 accumulator of the shards' shares, laid out as ``split_weights``."""
  zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights_N)
  return jax.lax.with_sharding_constraint(zeros, split_shardings(model_cfg, layout))


def split_rows(tree: Any, layout: Layout) -> Any:
  """Every [Y, ...] leaf as [n, Y / n, ...], the leading axis over the row axes."""
  n, axes = shards(layout), row_axes(layout)

  def one(x: jax.Array) -> jax.Array:
    x = x.reshape((n, x.shape[0] // n) + x.shape[1:])
    spec = PartitionSpec(axes, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))

  return jax.tree.map(one, tree)


def merge_rows(tree: Any) -> Any:
  """``split_rows``' inverse: [n, Y / n, ...] -> [Y, ...]."""
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


def per_shard(fn: Any, layout: Layout) -> Any:
  """``fn(weights, rows)`` over split weights and rows: ``vmap``-ed over the shards, each
  shard's rows under its own copy, the activations' rows whole inside."""
  inner = inner_layout(layout)

  def one(w: Params, rows: Any) -> Any:
    token = _INSIDE.set(True)
    try:
      with sharding.activations(inner):
        return fn(w, rows)
    finally:
      _INSIDE.reset(token)

  return jax.vmap(one, spmd_axis_name=row_axes(layout))


def reduce_to(grads_N: Params, stored: Any, params: Params) -> Params:
  """The shards' float32 shares summed once, in the masters' split and dtype."""
  summed = jax.tree.map(lambda g: jnp.sum(g, axis=0), grads_N)
  summed = jax.lax.with_sharding_constraint(summed, stored)
  return jax.tree.map(lambda g, p: g.astype(p.dtype), summed, params)
