"""Reading the text of a compiled XLA program: computations, instructions, array shapes,
the memory space of each array and the size of a collective's device groups.

``capo_jax.run.hlo_cost`` counts FLOPs and bytes on what this parses. The text is
``compiled.as_text()``: one computation per block (``%name (params) -> shape {``), one
instruction per line (``%name = shape op(operands), attributes``).

Memory spaces: the TPU compiler writes ``S(n)`` into the layout of a buffer it does not
keep in HBM (space 0). Space 5 is the host's memory (XLA's ``kHostMemorySpace``: buffers
offloaded to the host, moved over PCIe); the others are on the chip (VMEM, on v4 also
the 128 MiB CMEM, scalar memory). ``SPACES`` names the three classes the cost model
times apart.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

HOST_SPACE = 5  # XLA's kHostMemorySpace
SPACES = ("hbm", "onchip", "host")

_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|token|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_BITS = {
  "pred": 8,
  "s4": 4,
  "u4": 4,
  "s8": 8,
  "u8": 8,
  "bf16": 16,
  "f16": 16,
  "s16": 16,
  "u16": 16,
  "f32": 32,
  "s32": 32,
  "u32": 32,
  "f64": 64,
  "s64": 64,
  "u64": 64,
  "c64": 64,
  "c128": 128,
}


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  op: str
  rest: str


def group(pattern: str, ins: Instr) -> str:
  """Group 1 of ``pattern`` in the instruction's operands and attributes; an HLO
  instruction without it (a new XLA text format) fails here, naming both."""
  m = re.search(pattern, ins.rest)
  if m is None:
    raise ValueError(f"hlo_cost: {ins.op} %{ins.name} has no {pattern!r} in {ins.rest!r}")
  return m[1]


def called(ins: Instr, attr: str = "calls") -> str:
  """The computation an instruction's ``calls=`` / ``condition=`` / ``body=`` names."""
  return group(rf"{attr}=%([\w.\-]+)", ins)


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [
    (dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims, _ in _ARRAY.findall(shape)
  ]


def array_texts(shape: str) -> list[str]:
  """Each array of a (tuple) shape as its own text, layout included."""
  return [f"{dt}[{dims}]{lay}" for dt, dims, lay in _ARRAY.findall(shape)]


def space_class(layout: str) -> str:
  """``"hbm"`` (space 0, no ``S(n)``), ``"host"`` (space 5) or ``"onchip"`` (the rest)."""
  m = _SPACE.search(layout or "")
  n = int(m[1]) if m else 0
  return "hbm" if n == 0 else "host" if n == HOST_SPACE else "onchip"


def nbytes(shape: str, where: str = "all", space_of: str | None = None) -> float:
  """Bytes of the arrays in ``shape`` that live in ``where`` (one of ``SPACES``, or
  "all"). ``space_of``: take the memory space from this shape instead (a slice read
  from a fusion's parameter is read where the parameter lives)."""
  spaces = [space_class(lay) for _, _, lay in _ARRAY.findall(space_of)] if space_of else None
  total = 0.0
  for i, (dt, dims, lay) in enumerate(_ARRAY.findall(shape)):
    sp = spaces[min(i, len(spaces) - 1)] if spaces else space_class(lay)
    if where in ("all", sp):
      total += _BITS.get(dt, 32) / 8 * math.prod(int(d) for d in dims.split(",") if d)
  return total


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
  """Each computation's instructions, and the entry computation's name."""
  comps: dict[str, list[Instr]] = {}
  entry, current = "", None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m:
      current = comps.setdefault(m[2], [])
      entry = m[2] if m[1] else entry
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      current.append(Instr(m[1], m[2], m[3], m[4]))
    elif current and line.strip() not in ("", "}"):
      # An instruction printed over several lines (a Pallas call whose config holds a
      # newline): the rest, its JAX op name with it, belongs to the last instruction.
      current[-1].rest += "\n" + line
  return comps, entry


def num_partitions(text: str) -> int:
  """The module's ``num_partitions`` (its SPMD devices), 1 when the header has none."""
  m = re.search(r"num_partitions=(\d+)", text.split("\n", 1)[0])
  return int(m[1]) if m else 1


def operands(rest: str) -> list[str]:
  # Operands are the %names before the closing parenthesis of the op call.
  depth, end = 1, len(rest)
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", rest[:end])


def group_size(ins: Instr, devices: int) -> int:
  """Devices in each group a collective runs over: ``replica_groups={{0,1},{2,3}}``
  (explicit lists), ``replica_groups=[G,N]<=[...]`` (the iota form: G groups of N),
  ``replica_groups=mesh['a'=2,'b'=8] {'b'}`` (the mesh form: the named axes' sizes
  multiplied), or every one of ``devices`` when the groups are empty."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", ins.rest)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m[1])}
    return math.prod(sizes[k] for k in re.findall(r"'([^']+)'", m[2]))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", ins.rest)
  if m:
    return int(m[2])
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", ins.rest)
  if m:
    return len([d for d in m[1].split(",") if d])
  return devices


def trip_count(cond: list[Instr]) -> int | None:
  """A loop's bound when its condition is ``i < constant``, else None."""
  consts = {
    i.name: int(m[1]) for i in cond if i.op == "constant" and (m := re.match(r"(-?\d+)\)", i.rest))
  }
  for i in cond:
    if i.op == "compare" and "direction=LT" in i.rest:
      bounds = [consts[o] for o in operands(i.rest) if o in consts]
      if len(bounds) == 1:
        return bounds[0]
  return None


def users(fused: list[Instr]) -> dict[str, list[Instr]]:
  out: dict[str, list[Instr]] = collections.defaultdict(list)
  for i in fused:
    for o in operands(i.rest):
      out[o].append(i)
  return out


def params(fused: list[Instr]) -> dict[str, int]:
  return {i.name: int(group(r"^(\d+)\)", i)) for i in fused if i.op == "parameter"}
