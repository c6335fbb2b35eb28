"""The devices of a TPU slice without the hardware, for ahead-of-time compilation.

With ``jax[tpu]`` installed (libtpu), ``jax.experimental.topologies`` describes
the devices of a TPU slice; ``set_tpu_env`` sets what libtpu reads at load so that
it needs no TPU VM, and ``topology_mesh`` lays the run's mesh over those devices.
``capo_jax.run.aot`` compiles a step's programs over that mesh.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
from jax.sharding import Mesh

from capo_jax.run.spec import RunSpec

# Chips per slice -> the topology string libtpu takes ("<gen>:<chip grid>").
# v4 and v5p are 3-D tori counted in TensorCores (2 per chip); v5e and v6e are
# 2-D grids counted in chips.
_GRID_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
_GRID_2D = {
  1: "1x1",
  4: "2x2",
  8: "2x4",
  16: "4x4",
  32: "4x8",
  64: "8x8",
  128: "8x16",
  256: "16x16",
}
# gcloud's accelerator-type prefix of each generation (TPU_ACCELERATOR_TYPE).
_GCLOUD = {"v4": "v4", "v5p": "v5p", "v5e": "v5litepod", "v6e": "v6e"}


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str  # as the user wrote it, e.g. "v5e-16"
  gen: str  # v4, v5p, v5e, v6e
  chips: int

  @property
  def topology(self) -> str:
    grid = (_GRID_3D if self.gen in ("v4", "v5p") else _GRID_2D).get(self.chips)
    if grid is None:
      raise ValueError(f"accelerator {self.name!r}: no known topology for {self.chips} chips")
    return f"{self.gen}:{grid}"

  @property
  def gcloud_type(self) -> str:
    cores = self.chips * 2 if self.gen in ("v4", "v5p") else self.chips
    return f"{_GCLOUD[self.gen]}-{cores}"


def parse_accelerator(name: str) -> Accelerator:
  """``v4-32`` -> 16 chips (v4-N / v5p-N count TensorCores), ``v5e-16`` -> 16 chips."""
  m = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
  if not m:
    raise ValueError(f"accelerator {name!r}: expected v4-N, v5p-N, v5e-N (v5litepod-N) or v6e-N")
  gen, n = ("v5e" if m[1] == "v5litepod" else m[1]), int(m[2])
  chips = n // 2 if gen in ("v4", "v5p") else n
  acc = Accelerator(name, gen, chips)
  acc.topology  # raises for a size with no known grid
  return acc


def set_tpu_env(acc: Accelerator) -> None:
  """What libtpu reads at load; without them it queries the GCE metadata server
  (absent off Cloud) and logs errors. JAX itself stays on the CPU backend: the
  TPU devices come from the topology description, not from a TPU client."""
  # jax read $JAX_PLATFORMS when it was imported. Config sets its options as attributes at
  # run time, so its type has none of them.
  if not jax.config.jax_platforms:  # type: ignore[attr-defined]
    jax.config.update("jax_platforms", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", acc.gcloud_type)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_WORKER_ID", "0")
  # libtpu takes /tmp/libtpu_lockfile to own the chips; compiling owns none, so
  # several compiling processes (a test next to a benchmark) may share the host.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_devices(acc: Accelerator) -> list[Any]:
  """The slice's TPU devices (for compiling only), all of them, every host's."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  # v4 / v5p chips have 2 TensorCores; "megacore" fuses them into one device per
  # chip, as jax.devices() shows on those VMs (jax's TPU mesh builder requires it).
  kw = {"chip_config_name": "megacore"} if acc.gen in ("v4", "v5p") else {}
  return list(topologies.get_topology_desc(acc.topology, "tpu", **kw).devices)


def topology_mesh(spec: RunSpec, acc: Accelerator) -> Mesh:
  """The run's mesh (``spec.mesh``) over the slice's devices (``spec`` validated for them)."""
  devices = topology_devices(acc)
  spec.validate(num_devices=len(devices), policy_given=True)
  return spec.make_mesh(devices)
