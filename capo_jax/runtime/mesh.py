"""Device mesh from config axes, and the logical-to-mesh sharding rules.

The mesh has up to three named axes (``MESH_AXES``):
  data    pure data parallelism: params replicated, batch rows split;
  fsdp    batch rows split *and* params sharded (ZeRO-3 style all-gather per
          use), so memory per device falls with its size;
  tensor  Megatron-style model parallelism over heads / MLP columns / vocab.

Sharding is data: params carry logical axis names (Flax's
``nn.with_logical_partitioning``, listed by ``models.qwen2.param_axes``),
activations and batches use ``"batch"``, and a rule list maps logical names
to mesh axes (``models.sharding``, on Flax's ``nn.logical_to_mesh_axes``).
Activations carry names of their own (``models.sharding.ACT_*``), resolved under the
program's layout (``models.sharding.activations``). ``TRAIN_RULES`` shard params
over fsdp and tensor. The sampler has a mesh of its own over the same devices
(``sampling_mesh``: data x a tensor group of tensor x tensor_q chips), on which
``SAMPLING_RULES`` split each weight over the tensor group (no all-gather per
decode step: each chip reads its part of the weights a step) and the rows over data.
A mesh axis that does not divide a dimension is dropped with a log line
(``models.sharding``), so a tiny model on a big mesh replicates.

Typical use::

  mesh = make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  p_specs = models.qwen2.param_specs(cfg, TRAIN_RULES, mesh)
  batch = capo_jax.runtime.host.put_global(
      host_batch, batch_sharding(mesh, TRAIN_RULES, batch_size))

Multi-host: ``make_mesh`` uses the global ``jax.devices()``, and
``host.put_global`` places a batch every process holds in full on it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models import sharding
from models.sharding import Rules

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

# Logical names: params use those of models.qwen2.param_axes; "batch" is the
# row axis of every batch / activation array.
TRAIN_RULES: Rules = (
  ("batch", ("data", "fsdp")),
  ("attn_batch", ("data", "fsdp")),
  ("vocab", "tensor"),
  ("embed", "fsdp"),
  ("q_heads", "tensor"),
  ("kv_heads", "tensor"),
  ("mlp", "tensor"),
  ("head_dim", None),
  ("layers", None),
  ("norm", None),
  # Activations (models.sharding.ACT_*): rows over data x fsdp ("batch" above), the
  # model dim whole, heads / MLP columns / vocab over tensor.
  ("length", None),
  ("act_embed", None),
  ("act_heads", "tensor"),
  ("act_kv_heads", "tensor"),
  ("act_mlp", "tensor"),
  ("act_vocab", "tensor"),
  ("choice_rows", ("data", "fsdp", "tensor")),
)

# Where each weight goes in sampling: on a sampling mesh of its own over the same
# devices (``sampling_mesh``): rows over data, nothing over fsdp (no all-gather of
# the weights per decode step), MLP columns / vocab over the tensor group
# tensor x tensor_q. The attention's weights (query, kv and output heads) go over
# tensor, at most the kv heads; past them the group splits the attention's rows
# instead ("attn_batch": each chip attends for 1 / tensor_q of its group's rows, over
# its own slots of the KV cache), so no kv head and no cache row is held twice.
TENSOR_GROUP = ("tensor", "tensor_q")
SAMPLING_RULES: Rules = (
  ("batch", ("data", "fsdp")),
  ("attn_batch", ("data", "fsdp", "tensor_q")),
  ("vocab", TENSOR_GROUP),
  ("embed", None),
  ("q_heads", "tensor"),
  ("kv_heads", "tensor"),
  ("mlp", TENSOR_GROUP),
  ("head_dim", None),
  ("layers", None),
  ("norm", None),
  ("length", None),
  ("act_embed", None),
  ("act_heads", "tensor"),
  ("act_kv_heads", "tensor"),
  ("act_mlp", TENSOR_GROUP),
  ("act_vocab", TENSOR_GROUP),
  # The rows a top-k / top-p token is chosen for: over every device, so each chip draws
  # from whole vocabulary rows (the vocab-split logits are exchanged, all-to-all,
  # first); greedy and plain temperature draw inside the vocab shards (choice.py).
  ("choice_rows", ("data", "fsdp") + TENSOR_GROUP),
)

# The train rules with each weight whole where only its storage is split ("embed" over
# fsdp): how the weights lie when gathered once per log-prob pass or update
# (``config.mesh.gather_once``) rather than layer by layer inside each call.
GATHERED_RULES: Rules = (("embed", None),) + tuple(r for r in TRAIN_RULES if r[0] != "embed")

# The log-prob passes as pure data parallelism (``config.mesh.logprob_data_parallel``):
# the rows over every chip of the train mesh, tensor included, each chip running whole
# rows on the whole compute-dtype copy gathered once a pass, so a call sends nothing.
ALL_ROWS = ("batch", "attn_batch", "choice_rows")
PASS_RULES: Rules = tuple(
  (name, ("data", "fsdp", "tensor") if name in ALL_ROWS else None) for name, _ in TRAIN_RULES
)

RULES = {
  "train": TRAIN_RULES,
  "sampling": SAMPLING_RULES,
  "gathered": GATHERED_RULES,
  "pass": PASS_RULES,
}


def _axis_items(axes: Mapping[str, int] | Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
  items = list(axes.items()) if isinstance(axes, Mapping) else [(n, s) for n, s in axes]
  if not items:
    raise ValueError("mesh axes: at least one axis is needed, got none")
  names = [name for name, _ in items]
  if len(set(names)) != len(names):
    raise ValueError(f"mesh axes: duplicate axis names in {names}")
  for name, size in items:
    if not isinstance(name, str):
      raise ValueError(f"mesh axes: axis name {name!r} is not a string")
    if not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
      raise ValueError(
        f"mesh axes: {name}={size!r}; sizes are positive ints or -1 (the rest of the devices)"
      )
  if sum(size == -1 for _, size in items) > 1:
    raise ValueError(f"mesh axes: only one axis may be -1, got {dict(items)}")
  return [(name, int(size)) for name, size in items]


def make_mesh(
  axes: Mapping[str, int] | Sequence[tuple[str, int]], devices: Sequence[Any] | None = None
) -> Mesh:
  """A mesh with the named axes, e.g. ``{"data": -1, "fsdp": 2, "tensor": 1}``.

  Args:
    axes: axis name -> size, in mesh order; one size may be -1, meaning the
      devices left once the others are placed. Standard axes (``MESH_AXES``)
      left out are added with size 1, so every rule list resolves.
    devices: devices to use (default: all of ``jax.devices()``, every host's).
      A mesh smaller than this list takes its first devices and logs it.

  Raises:
    ValueError: naming the axis and value when the sizes do not fit the devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  items = _axis_items(axes)
  known = math.prod(size for _, size in items if size != -1)
  if any(size == -1 for _, size in items):
    name = next(n for n, s in items if s == -1)
    if len(devices) % known:
      raise ValueError(
        f"mesh axes {dict(items)}: the other axes multiply to {known}, which "
        f"does not divide the {len(devices)} devices, so {name}=-1 has no size"
      )
    items = [(n, len(devices) // known if s == -1 else s) for n, s in items]
  total = math.prod(size for _, size in items)
  if total > len(devices):
    detail = ", ".join(f"{n}={s}" for n, s in items)
    raise ValueError(
      f"mesh axes {detail} need {total} devices but only {len(devices)} are "
      f"available ({devices[0].platform}); lower one of them or use -1"
    )
  if total < len(devices):
    log.warning("mesh %s uses %d of %d devices", dict(items), total, len(devices))
    devices = devices[:total]
  items += [(name, 1) for name in MESH_AXES if name not in dict(items)]
  names = tuple(n for n, _ in items)
  shape = tuple(s for _, s in items)
  # Auto axes: shardings are stated at jit boundaries and propagated by XLA.
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def tensor_split(model_cfg: Any, tensor: int) -> tuple[int, int]:
  """(tensor, tensor_q) sizes of a sampling tensor group of ``tensor`` chips.

  The attention's heads split over gcd(tensor, K) chips (whole kv heads, each with
  its query heads); the rest of the group, tensor_q, splits the attention's rows
  (``SAMPLING_RULES``' "attn_batch") while every chip of the group splits the MLP
  columns and the vocabulary.

  Raises:
    ValueError: when ``tensor`` is not a positive number of chips.
  """
  if tensor < 1:
    raise ValueError(f"sampling tensor group of {tensor} chips: it must be at least 1")
  t_kv = math.gcd(tensor, model_cfg.num_kv_heads)
  return t_kv, tensor // t_kv


def auto_sampling_tensor(devices: Sequence[Any]) -> int:
  """The sampling tensor group's size: one host's chips (the most that divide both the
  host and all devices). Past the kv heads the group splits the attention's rows
  (``tensor_split``), so the KV cache per chip stays what pure data parallelism gives
  while the weights per chip keep falling."""
  host = sum(d.process_index == devices[0].process_index for d in devices)
  return max(t for t in range(1, host + 1) if host % t == 0 and len(devices) % t == 0)


def sampling_mesh(mesh: Mesh, model_cfg: Any, tensor: int = 0) -> Mesh:
  """The sampler's mesh: ``mesh``'s devices as data x (tensor x tensor_q) groups.

  Rows split over data; a group of ``tensor`` chips (0: ``auto_sampling_tensor``)
  shares each weight, each chip holding 1 / tensor of it (``SAMPLING_RULES``). The
  devices keep ``mesh``'s order, so one jitted program may take arrays of both
  (the train params in, the sampling params out). A group is one host's chips
  when that order allows it (consecutive or strided), else consecutive devices.

  Raises:
    ValueError: naming ``tensor`` when it does not divide the devices or the heads.
  """
  devices = np.asarray(mesh.devices).reshape(-1)
  n = devices.size
  tensor = tensor or auto_sampling_tensor(list(devices))
  if n % tensor:
    raise ValueError(f"sampling tensor group of {tensor} chips: does not divide {n} devices")
  t_kv, t_q = tensor_split(model_cfg, tensor)
  auto = (AxisType.Auto,) * 4
  if strided_groups([d.process_index for d in devices], tensor):
    grid = devices.reshape(t_kv, t_q, n // tensor, 1)
    return Mesh(grid, ("tensor", "tensor_q", "data", "fsdp"), axis_types=auto)
  grid = devices.reshape(n // tensor, 1, t_kv, t_q)
  return Mesh(grid, ("data", "fsdp", "tensor", "tensor_q"), axis_types=auto)


def strided_groups(process_ids: Sequence[int], tensor: int) -> bool:
  """Whether groups of ``tensor`` devices, in this order, lie on one host only when
  taken every n / tensor devices (a train mesh that interleaves the hosts) rather
  than consecutively."""
  p = np.asarray(process_ids)
  one_host = lambda g_GT: bool((g_GT == g_GT[:, :1]).all())
  return not one_host(p.reshape(-1, tensor)) and one_host(p.reshape(tensor, -1).T)


def spec(
  axes: tuple[str | None, ...],
  rules: Rules,
  mesh: Mesh,
  shape: tuple[int, ...] | None = None,
  name: str = "",
) -> PartitionSpec:
  """PartitionSpec of one activation / batch array with logical ``axes``."""
  return sharding.logical_to_spec(axes, rules, shape, mesh, name=name)


def batch_spec(mesh: Mesh, rules: Rules, batch_size: int, name: str = "batch") -> PartitionSpec:
  """Spec of an array whose leading axis is ``batch_size`` rows (other axes whole).

  A batch that the batch mesh axes do not divide is replicated over the
  offending axis, with a log line, rather than failing.
  """
  return spec(("batch",), rules, mesh, (batch_size,), name=name)


def batch_sharding(mesh: Mesh, rules: Rules, batch_size: int, name: str = "batch") -> NamedSharding:
  """NamedSharding of the leading batch axis; usable as a prefix for a whole batch tree."""
  return NamedSharding(mesh, batch_spec(mesh, rules, batch_size, name))


def param_shardings(model_cfg: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings of the Qwen2 params under ``rules``."""
  from models import qwen2  # local import keeps this module light for configs

  return qwen2.param_shardings(model_cfg, sharding.Layout.of(mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
