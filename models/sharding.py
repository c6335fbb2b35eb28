"""Shardings from logical axis names, through Flax's logical partitioning.

Params carry logical axis names (``nn.with_logical_partitioning`` in
``models.qwen2``); activations and batches name theirs where they are placed
(``"batch"`` for rows). A rule list maps each logical name to a mesh axis, a
tuple of mesh axes, or ``None`` (replicated); Flax's
``nn.logical_to_mesh_axes`` resolves it (earlier rules take precedence, a mesh
axis serves one dimension at most).

One step is ours: against a concrete mesh and shape, a mesh axis that does not
divide its dimension is dropped and logged, so a small model on a big mesh
replicates instead of failing in ``device_put``.

``Layout`` bundles a mesh with its rule list: the one value that says how a
program is laid out.

Activations: the model names the logical axes of its activations where it makes
them (``constrain(x, ("batch", "length", "act_embed"))``, as MaxText's layers do)
and a program says, while it traces, which layout those names resolve under
(``with activations(layout): ...``). Outside such a block ``constrain`` is the
identity, so the model runs unchanged on one device and in tests. The constraint
is what keeps the rows where the batch put them: without it, XLA is free to keep
the fsdp-sharded weights in place and gather the rows instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

log = logging.getLogger(__name__)


def _fit(
  spec: PartitionSpec,
  axes: Sequence[str | None],
  shape: Sequence[int] | None,
  mesh: Mesh | AbstractMesh,
  name: str,
) -> PartitionSpec:
  """``spec`` without the mesh axes that do not divide their dimension.

  Within a tuple entry, axes are kept left to right while their product
  divides the dimension.
  """
  out: list[Any] = []
  for dim, (entry, logical) in enumerate(zip(spec, axes)):
    mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept: list[str] = []
    for ax in mesh_axes:
      if ax not in mesh.shape:
        raise ValueError(
          f"sharding rule {logical!r} -> {ax!r}: mesh has no axis {ax!r} (axes {tuple(mesh.shape)})"
        )
      size = math.prod(mesh.shape[a] for a in kept + [ax])
      if shape is not None and shape[dim] % size:
        log.info(
          "%s dim %d (%s) of size %d is not divisible by mesh axis %r (%d); replicating over it",
          name,
          dim,
          logical,
          shape[dim],
          ax,
          mesh.shape[ax],
        )
        continue
      kept.append(ax)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def logical_to_spec(
  axes: Sequence[str | None],
  rules: Rules,
  shape: Sequence[int] | None = None,
  mesh: Mesh | AbstractMesh | None = None,
  name: str = "",
) -> PartitionSpec:
  """The mesh PartitionSpec of one array whose dimensions carry logical ``axes``."""
  spec = nn.logical_to_mesh_axes(tuple(axes), list(rules))
  assert spec is not None  # flax returns None only when the axes themselves are None
  if mesh is None:
    return spec
  return _fit(spec, tuple(axes), shape, mesh, name)


def tree_specs(
  logical_tree: Any, rules: Rules, shapes_tree: Any = None, mesh: Mesh | AbstractMesh | None = None
) -> Any:
  """Mesh PartitionSpecs of a tree of logical PartitionSpecs (``nn.get_partition_spec``)."""
  is_spec = lambda x: isinstance(x, PartitionSpec)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(logical_tree, is_leaf=is_spec)
  shapes = (
    [None] * len(leaves)
    if shapes_tree is None
    else [tuple(s.shape) for s in jax.tree_util.tree_leaves(shapes_tree)]
  )
  if len(shapes) != len(leaves):
    raise ValueError(f"logical tree has {len(leaves)} leaves, shapes tree {len(shapes)}")
  specs = []
  for (path, axes), shape in zip(leaves, shapes):
    if shape is not None and len(shape) != len(axes):
      raise ValueError(
        f"{jax.tree_util.keystr(path)}: {len(axes)} axis names {tuple(axes)} for shape {shape}"
      )
    specs.append(logical_to_spec(tuple(axes), rules, shape, mesh, name=jax.tree_util.keystr(path)))
  return jax.tree_util.tree_unflatten(treedef, specs)


def to_host(x: jax.Array | np.ndarray) -> np.ndarray:
  """The whole (global) value of an array as NumPy, on every process.

  An array sharded over several processes is all-gathered first.
  """
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def hashable_rules(rules: Rules) -> tuple[tuple[str, Any], ...]:
  """A rule list as nested tuples (lists, e.g. from a config, become tuples)."""
  return tuple((name, tuple(ax) if isinstance(ax, list) else ax) for name, ax in rules)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A device mesh and the rules that map logical axis names onto it.

  Frozen and hashable, so it can be a static argument of ``jax.jit``.
  ``Layout.of(mesh, rules)`` normalises a rule list (lists become tuples).
  """

  mesh: Mesh
  rules: tuple[tuple[str, Any], ...]

  @classmethod
  def of(cls, mesh: Mesh, rules: Rules) -> Layout:
    return cls(mesh, hashable_rules(rules))

  def spec(
    self, axes: Sequence[str | None], shape: Sequence[int] | None = None, name: str = ""
  ) -> PartitionSpec:
    return logical_to_spec(axes, self.rules, shape, self.mesh, name)

  def sharding(
    self, axes: Sequence[str | None], shape: Sequence[int] | None = None, name: str = ""
  ) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(axes, shape, name))

  def shards(self, name: str) -> int:
    """Devices the logical axis ``name`` is split over (1 when no rule maps it)."""
    axes = self.spec((name,))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(self.mesh.shape[a] for a in axes)

  def constrain(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``x`` constrained to its logical ``axes`` (inside jit)."""
    return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape))

  def put(self, x: Any, axes: Sequence[str | None]) -> jax.Array:
    """``x`` placed on the mesh along its logical ``axes`` (outside jit)."""
    return jax.device_put(x, self.sharding(axes, x.shape))


# Logical axes of the models' activations (the rule lists of capo_jax.runtime.mesh map them).
ACT_BT = ("batch", "length")
ACT_BTD = ("batch", "length", "act_embed")
ACT_BTNH = ("batch", "length", "act_heads", None)
ACT_BTKH = ("batch", "length", "act_kv_heads", None)
ACT_BTF = ("batch", "length", "act_mlp")
ACT_BTV = ("batch", "length", "act_vocab")

_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar(
  "activation_layout", default=None
)


@contextlib.contextmanager
def activations(layout: Layout | None) -> Iterator[None]:
  """Within the block, ``constrain`` resolves activation axis names under ``layout``
  (None: constraints off). Enter it inside the traced function, so it holds when
  ``jax.jit`` traces it."""
  token = _ACTIVE.set(layout)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """``x`` constrained to its logical ``axes`` under the active layout (identity when none)."""
  layout = _ACTIVE.get()
  if layout is None:
    return x
  if len(axes) != x.ndim:
    raise ValueError(f"constrain: {len(axes)} axis names {tuple(axes)} for shape {x.shape}")
  return layout.constrain(x, axes)


def active_layout() -> Layout | None:
  """The layout of the ``activations`` block being traced, or None."""
  return _ACTIVE.get()


def platform() -> str:
  """The platform the traced program is for: the active layout's devices' (a TPU
  topology compiled ahead of time from a CPU host), else JAX's default backend."""
  layout = _ACTIVE.get()
  if layout is None:
    return jax.default_backend()
  return layout.mesh.devices.flat[0].platform
