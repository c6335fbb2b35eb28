"""Logical axis names -> mesh PartitionSpecs.

A rule list maps each logical axis (``"embed"``, ``"mlp"``, ...) to a mesh
axis, a tuple of mesh axes, or ``None`` (replicated). The first rule naming a
logical axis wins. When a mesh and the array shape are given, a mesh axis
that does not divide the dimension (or is already used by an earlier
dimension) is dropped and logged, so a small model on a big mesh replicates
instead of crashing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

log = logging.getLogger(__name__)


def logical_to_spec(axes: tuple[str | None, ...], rules: Rules,
                    shape: tuple[int, ...] | None = None, mesh: Mesh | None = None,
                    name: str = "") -> PartitionSpec:
  """The PartitionSpec of one array whose dimensions carry ``axes`` names."""
  table: dict[str, Any] = {}
  for logical, physical in rules:
    table.setdefault(logical, physical)
  used: set[str] = set()
  spec: list[Any] = []
  for dim, logical in enumerate(axes):
    physical = table.get(logical) if logical is not None else None
    if physical is None:
      spec.append(None)
      continue
    mesh_axes = (physical,) if isinstance(physical, str) else tuple(physical)
    kept = []
    for ax in mesh_axes:
      if mesh is not None and ax not in mesh.shape:
        raise ValueError(f"sharding rule {logical!r} -> {ax!r}: mesh has no axis {ax!r} "
                         f"(axes {tuple(mesh.shape)})")
      size = mesh.shape[ax] if mesh is not None else 1
      if ax in used:
        log.info("%s dim %d (%s): mesh axis %r already used; replicating it", name, dim,
                 logical, ax)
        continue
      if shape is not None and mesh is not None:
        total = size
        for k in kept:
          total *= mesh.shape[k]
        if shape[dim] % total:
          log.info("%s dim %d (%s) of size %d is not divisible by mesh axis %r (%d); "
                   "replicating over it", name, dim, logical, shape[dim], ax, size)
          continue
      kept.append(ax)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def tree_specs(axes_tree: Any, rules: Rules, shapes_tree: Any = None,
               mesh: Mesh | None = None) -> Any:
  """PartitionSpecs for a pytree of axis-name tuples (e.g. ``param_axes(cfg)``)."""
  is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
  paths_axes = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=is_axes)
  leaves_axes, treedef = paths_axes
  if shapes_tree is None:
    shapes = [None] * len(leaves_axes)
  else:
    shapes = [tuple(s.shape) for s in jax.tree_util.tree_leaves(shapes_tree)]
    if len(shapes) != len(leaves_axes):
      raise ValueError(f"axes tree has {len(leaves_axes)} leaves, shapes tree {len(shapes)}")
  specs = []
  for (path, axes), shape in zip(leaves_axes, shapes):
    if shape is not None and len(shape) != len(axes):
      raise ValueError(f"{jax.tree_util.keystr(path)}: {len(axes)} axis names {axes} for "
                       f"shape {shape}")
    specs.append(logical_to_spec(axes, rules, shape, mesh, name=jax.tree_util.keystr(path)))
  return jax.tree_util.tree_unflatten(treedef, specs)
