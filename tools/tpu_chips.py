"""The TPU chips and slices the memory plan and the step estimate are for.

Per chip: HBM, peak dense bfloat16 FLOP/s and HBM bandwidth (Google's Cloud TPU pages
for v4, v5e, v5p, v6e / Trillium); the inter-chip links (ICI) and their topology; the
host link; and the on-chip memory bandwidth the estimate assumes (``ONCHIP_OVER_HBM``).
``rates`` turns a chip into the rates ``capo_jax.run.hlo_cost`` times operations by.

ICI: bytes per second one way on one link, from "How to Scale Your Model" (the JAX
team's scaling book, jax-ml.github.io/scaling-book/tpus: 4.5e10 on v4 and v5e, 9e10 on
v5p and v6e), which agrees with the Cloud TPU v5p page's 1,200 GB/s bidirectional per
chip (6 links x 2 ways x ~100 GB/s). v4 and v5p chips have 6 links (a 3D mesh, closed
into a torus on slices of whole 4x4x4 cubes), v5e and v6e 4 (a 2D mesh, a torus on the
full 16x16 pod). A collective is timed as a ring along one axis of that mesh, sending
both ways at once: 2 links per chip (``ICI_LINKS_USED``); the compiler may spread a
collective over more axes, so this is the slow end.

Host: PCIe, 16 GB/s per chip (PCIe 3.0 x16, ~15.75 GB/s; the scaling book's ~1.5e10 B/s
per chip), an assumption for every generation.
"""

from __future__ import annotations

import dataclasses
import re

from capo_jax.run import hlo_cost


@dataclasses.dataclass(frozen=True)
class Chip:
  hbm_gib: float
  hbm_gb_s: float  # HBM bandwidth, GB/s
  bf16_tflops: float  # peak dense bfloat16 TFLOP/s
  topology: str  # how the chips of a slice are linked (ICI)
  ici_links: int  # ICI links per chip
  ici_link_gb_s: float  # GB/s one way on one link
  host_gb_s: float = 16.0  # host <-> chip over PCIe (module docstring)


# HBM, FLOP/s and HBM bandwidth: Google's TPU pages; ICI: the module docstring.
CHIPS = {
  "v4": Chip(32, 1228, 275, "3D mesh (torus on whole 4x4x4 cubes)", 6, 45),
  "v5e": Chip(16, 819, 197, "2D mesh (torus on the 16x16 pod)", 4, 45),
  "v5p": Chip(95, 2765, 459, "3D mesh (torus on whole 4x4x4 cubes)", 6, 90),
  "v6e": Chip(32, 1640, 918, "2D mesh (torus on the 16x16 pod)", 4, 90),
}
# On-chip memory (v4's 128 MiB CMEM, VMEM) bandwidth over HBM bandwidth. Not published;
# the honest end of the estimate times on-chip traffic at 2x HBM, one after the HBM
# traffic, and the optimistic end not at all (VMEM is faster still, so 2x is slow).
ONCHIP_OVER_HBM = 2.0
ICI_LINKS_USED = 2  # a ring along one mesh axis, both ways (module docstring)


def rates(chip: Chip) -> hlo_cost.Rates:
  """The chip's rates, in units per second, for ``hlo_cost``'s per-operation roofline."""
  return hlo_cost.Rates(
    flops=chip.bf16_tflops * 1e12,
    hbm=chip.hbm_gb_s * 1e9,
    onchip=ONCHIP_OVER_HBM * chip.hbm_gb_s * 1e9,
    host=chip.host_gb_s * 1e9,
    ici=ICI_LINKS_USED * chip.ici_link_gb_s * 1e9,
  )


DEFAULT_SLICES = (
  "v4-8",
  "v4-32",
  "v4-64",
  "v5e-16",
  "v5e-32",
  "v5p-8",
  "v5p-64",
  "v6e-8",
  "v6e-16",
)


@dataclasses.dataclass(frozen=True)
class Slice:
  name: str  # accelerator type as gcloud spells it (v5e -> v5litepod)
  gen: str
  chips: int
  hosts: int  # TPU VMs (workers)

  @property
  def chip(self) -> Chip:
    return CHIPS[self.gen]


def parse_slice(name: str) -> Slice:
  """``v4-32`` -> 16 chips on 4 hosts. v4-N / v5p-N count TensorCores (2 per chip),
  v5e-N (v5litepod-N) and v6e-N count chips; multi-host VMs hold 4 chips."""
  m = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
  if not m:
    raise ValueError(f"slice {name!r}: expected v4-N, v5p-N, v5e-N (v5litepod-N) or v6e-N")
  gen, n = ("v5e" if m[1] == "v5litepod" else m[1]), int(m[2])
  if gen in ("v4", "v5p"):
    if n < 8 or n % 8:
      raise ValueError(f"slice {name!r}: {gen}-N counts TensorCores; N is a multiple of 8")
    chips = n // 2
  else:
    if n not in (1, 4, 8, 16, 32, 64, 128, 256):
      raise ValueError(f"slice {name!r}: {gen}-N counts chips, one of 1..256 in powers of 2")
    chips = n
  hosts = 1 if gen in ("v5e", "v6e") and chips <= 8 else max(1, chips // 4)
  return Slice(f"v5litepod-{n}" if gen == "v5e" else f"{gen}-{n}", gen, chips, hosts)
