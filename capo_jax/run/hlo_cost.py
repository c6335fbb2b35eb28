"""FLOPs and bytes of a compiled XLA program with loop bodies counted per iteration.

XLA's own cost analysis (``compiled.cost_analysis()``) counts every while-loop
body once, whatever its trip count: on a TPU topology the 28-layer ``lax.scan``
of the model costs one layer, the micro-batch scan one micro-batch, the decode
loop one token. This reads the optimised HLO text (``compiled.as_text()``),
finds each loop's trip count in its condition (``i < constant``, the form
``lax.scan`` / ``fori_loop`` lower to) and weights every computation by the
trip counts of the loops around it. Loops without a constant bound (the
sampler's decode ``while_loop``, which stops when every row is done) count
once and are reported, so the caller multiplies by the steps it expects.

What is counted, per device (the SPMD program):
  flops  2 x multiply-adds of every ``dot`` / ``convolution`` (the matmuls),
         counting only window positions that land on real input elements (TPU
         lowers batched matmuls to dilated, padded convolutions);
  bytes  operands + result of every instruction outside fusions (what a fusion
         reads from and writes to memory), leaving out the ones that move
         nothing (tuples, bitcasts, parameters); an operand a fusion only slices or
         gathers from costs what is sliced or gathered, and a buffer updated in place
         (dynamic-update-slice, scatter: the loop-carried KV cache) costs the update;
         only arrays in HBM (memory space 0) count: the TPU compiler places some
         buffers on chip (``S(n)`` in their layout: VMEM, and on v4 the 128 MiB CMEM,
         which holds e.g. a KV block it cut out of the cache for two dots, or a layer's
         weights across the decode loop), and what moves there is ``onchip_bytes``,
         reported but not timed (its bandwidth is higher and not published); the
         asynchronous copies that fill and drain those buffers (copy-start,
         slice-start) count on both sides.
With ``trip_counts=False`` each body counts once, XLA's usual convention: the
matmul FLOPs then come within ~10% under ``cost_analysis()`` (which adds the
elementwise work). XLA's own figures are not used for totals because, for the
same program, libtpu's cost analysis sometimes multiplied a body by its trip
count and sometimes not (seen on the tiny config's prefill: 6.3 vs 12.6 MFLOP
across runs).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

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
_FREE = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "while",
  "call",
  "conditional",
  "after-all",
  "opt-barrier",
  "partition-id",
  "replica-id",
  "iota",
}
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  op: str
  rest: str


def _group(pattern: str, ins: _Instr) -> str:
  """Group 1 of ``pattern`` in the instruction's operands and attributes; an HLO
  instruction without it (a new XLA text format) fails here, naming both."""
  m = re.search(pattern, ins.rest)
  if m is None:
    raise ValueError(f"hlo_cost: {ins.op} %{ins.name} has no {pattern!r} in {ins.rest!r}")
  return m[1]


def _called(ins: _Instr, attr: str = "calls") -> str:
  """The computation an instruction's ``calls=`` / ``condition=`` / ``body=`` names."""
  return _group(rf"{attr}=%([\w.\-]+)", ins)


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [
    (dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims, _ in _ARRAY.findall(shape)
  ]


def _space(layout: str) -> int:
  """The memory space of an array's layout: 0 (HBM) unless the layout says ``S(n)``."""
  m = _SPACE.search(layout or "")
  return int(m[1]) if m else 0


def _bytes(shape: str, where: str = "all", space_of: str | None = None) -> float:
  """Bytes of the arrays in ``shape``; ``where`` "hbm" keeps those in memory space 0,
  "onchip" the others (on TPU the compiler places buffers in VMEM, or CMEM on v4,
  with ``S(n)`` in their layout). ``space_of``: take the memory space from this shape
  instead (a slice read from a fusion's parameter is read where the parameter lives)."""
  spaces = [_space(lay) for _, _, lay in _ARRAY.findall(space_of)] if space_of else None
  total = 0.0
  for i, (dt, dims, lay) in enumerate(_ARRAY.findall(shape)):
    sp = spaces[min(i, len(spaces) - 1)] if spaces else _space(lay)
    if where == "all" or (where == "hbm") == (sp == 0):
      total += _BITS.get(dt, 32) / 8 * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str]:
  comps: dict[str, list[_Instr]] = {}
  entry, current = "", None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m:
      current = comps.setdefault(m[2], [])
      entry = m[2] if m[1] else entry
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      current.append(_Instr(m[1], m[2], m[3], m[4]))
  return comps, entry


def _operands(rest: str) -> list[str]:
  # Operands are the %names before the closing parenthesis of the op call.
  depth, end = 1, len(rest)
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", rest[:end])


def _matmul_flops(ins: _Instr, shapes: dict[str, str]) -> float:
  out = _arrays(ins.shape)
  ops = _operands(ins.rest)
  if not out or len(ops) < 2:
    return 0.0
  lhs, rhs = (_arrays(shapes.get(o, "")) for o in ops[:2])
  if not lhs or not rhs:
    return 0.0
  out_elems = math.prod(out[0][1])
  if ins.op == "dot":
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
    k = math.prod(lhs[0][1][int(d)] for d in m[1].split(",") if d) if m else 1
    return 2.0 * out_elems * k
  m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.rest)
  if not m:
    return 0.0
  lhs_l, rhs_l, out_l = m[1], m[2], m[3]
  kernel, in_dims, out_dims = rhs[0][1], lhs[0][1], out[0][1]
  # TPU lowers batched matmuls to convolutions that put batch dims in spatial
  # windows with dilation and padding, so count, per spatial dim, the (output,
  # window) position pairs that land on a real input element, as XLA does.
  window = re.search(r"window=\{([^}]*)\}", ins.rest)
  attrs = dict(kv.split("=") for kv in window[1].split()) if window else {}
  spatial = sorted(c for c in rhs_l if c.isdigit())
  field = lambda key, d, default: attrs[key].split("x")[d] if key in attrs else default
  pairs = 1
  for d, c in enumerate(spatial):
    size = kernel[rhs_l.index(c)]
    n_in, n_out = in_dims[lhs_l.index(c)], out_dims[out_l.index(c)]
    stride, lhs_dil, rhs_dil = (
      int(field(k, d, "1")) for k in ("stride", "lhs_dilate", "rhs_dilate")
    )
    lo = int(field("pad", d, "0_0").split("_")[0])
    span = (n_in - 1) * lhs_dil + 1
    pairs *= sum(
      1
      for o in range(n_out)
      for w in range(size)
      if 0 <= (p := o * stride + w * rhs_dil - lo) < span and p % lhs_dil == 0
    )
  macs = out_dims[out_l.index("b")] * kernel[rhs_l.index("o")] * kernel[rhs_l.index("i")] * pairs
  return 2.0 * macs


def _trip_count(cond: list[_Instr]) -> int | None:
  consts = {
    i.name: int(m[1]) for i in cond if i.op == "constant" and (m := re.match(r"(-?\d+)\)", i.rest))
  }
  for i in cond:
    if i.op == "compare" and "direction=LT" in i.rest:
      bounds = [consts[o] for o in _operands(i.rest) if o in consts]
      if len(bounds) == 1:
        return bounds[0]
  return None


def _users(fused: list[_Instr]) -> dict[str, list[_Instr]]:
  users: dict[str, list[_Instr]] = collections.defaultdict(list)
  for i in fused:
    for o in _operands(i.rest):
      users[o].append(i)
  return users


def _params(fused: list[_Instr]) -> dict[str, int]:
  return {i.name: int(_group(r"^(\d+)\)", i)) for i in fused if i.op == "parameter"}


def _read_by_slices(
  pname: str, fused: list[_Instr], comps: dict[str, list[_Instr]], where: str = "all"
) -> float | None:
  """Bytes of parameter ``pname`` a fusion reads when it only slices or gathers from it
  (also through a nested fusion that does), else None."""
  total = 0.0
  uses = _users(fused).get(pname, [])
  pshape = next((i.shape for i in fused if i.name == pname), None)
  for u in uses:
    if u.op in ("slice", "dynamic-slice") or (u.op == "gather" and _operands(u.rest)[0] == pname):
      total += _bytes(u.shape, where, space_of=pshape)
    elif u.op == "fusion":  # a nested fusion: its own parameter must be sliced only
      inner = comps.get(_called(u), [])
      idx = _operands(u.rest).index(pname)
      names = [n for n, i in _params(inner).items() if i == idx]
      got = _read_by_slices(names[0], inner, comps, where) if names else None
      if got is None:
        return None
      total += got
    else:
      return None
  return total if uses else None


def _fusion_bytes(
  ins: _Instr,
  shapes: dict[str, str],
  fused: list[_Instr],
  comps: dict[str, list[_Instr]],
  where: str = "all",
) -> float:
  """Bytes a fusion moves: each operand once, except that an operand read only
  through slices or gathers costs what they read, and a buffer updated in place
  (dynamic-update-slice, scatter) costs the update, read and written, not the buffer."""
  params = _params(fused)
  users = _users(fused)
  operands = _operands(ins.rest)
  total = 0.0
  for pname, idx in params.items():
    full = _bytes(shapes.get(operands[idx], ""), where) if idx < len(operands) else 0.0
    uses = users.get(pname, [])
    sliced = _read_by_slices(pname, fused, comps, where)
    if sliced is not None:
      total += min(full, sliced)
    elif uses and all(
      u.op in ("dynamic-update-slice", "scatter") and _operands(u.rest)[0] == pname for u in uses
    ):
      total += 0.0  # the buffer itself is neither read nor rewritten
    else:
      total += full
  updates = [i for i in fused if i.op in ("dynamic-update-slice", "scatter")]
  root_in_place = fused and fused[-1].op in ("dynamic-update-slice", "scatter", "tuple") and updates
  if root_in_place:
    fshapes = {i.name: i.shape for i in fused}
    # dynamic-update-slice(buffer, update, ...); scatter(buffer, indices, updates): the
    # update is written (and the indices read), the rest of the buffer stays in place.
    return total + sum(
      _bytes(fshapes.get(o, ""), where)
      for u in updates
      for o in _operands(u.rest)[1 : (2 if u.op == "dynamic-update-slice" else 3)]
    )
  return total + _bytes(ins.shape, where)


def _moved(
  ins: _Instr, shapes: dict[str, str], comps: dict[str, list[_Instr]], where: str = "all"
) -> float:
  """Bytes ``ins`` reads and writes, in the memory spaces ``where`` names (``_bytes``)."""
  # TPU views: slices and concatenations the compiler lays out as bitcasts.
  if "bitcast_fusion" in ins.name or 'custom_call_target="ConcatBitcast"' in ins.rest:
    return 0.0
  if ins.op in ("copy-start", "slice-start"):
    # TPU's asynchronous moves between memory spaces (HBM <-> VMEM / CMEM: prefetches
    # and evictions): shaped (destination, source, context) for a copy and ((source),
    # destination, context) for a slice; the destination's bytes are read where the
    # source lives and written where the destination does.
    arrays = [f"{dt}[{dims}]{lay}" for dt, dims, lay in _ARRAY.findall(ins.shape)]
    dst, src = (arrays[0], arrays[1]) if ins.op == "copy-start" else (arrays[1], arrays[0])
    return _bytes(dst, where, space_of=src) + _bytes(dst, where)
  if ins.op == "dynamic-slice":  # read where the source lives, written where it goes
    return _bytes(ins.shape, where, space_of=shapes.get(_operands(ins.rest)[0])) + _bytes(
      ins.shape, where
    )
  if ins.op == "dynamic-update-slice":
    ops = _operands(ins.rest)
    update = shapes.get(ops[1], "")
    return _bytes(update, where) + _bytes(update, where, space_of=shapes.get(ops[0]))
  if ins.op == "fusion":
    return _fusion_bytes(ins, shapes, comps[_called(ins)], comps, where)
  return _bytes(ins.shape, where) + sum(
    _bytes(shapes.get(o, ""), where) for o in _operands(ins.rest)
  )


@dataclasses.dataclass
class _Walk:
  weight: dict[str, float]
  in_loop: dict[str, float]  # weight reached through unbounded loops
  fused: set[str]
  unbounded: list[tuple[str, bool]]  # (body, inside a conditional) of loops not entered


def _walk(
  comps: dict[str, list[_Instr]], root: str, trip_counts: bool, enter_unbounded: bool
) -> _Walk:
  """Each computation's weight (how many times it runs per run of ``root``)."""
  walk = _Walk(collections.defaultdict(float), collections.defaultdict(float), set(), [])

  def visit(name: str, w: float, in_fusion: bool, looped: bool, in_cond: bool) -> None:
    walk.weight[name] += w
    walk.in_loop[name] += w if looped else 0.0
    if in_fusion:
      walk.fused.add(name)
    for ins in comps.get(name, []):
      if ins.op == "while":
        cond, body = _called(ins, "condition"), _called(ins, "body")
        n = _trip_count(comps.get(cond, []))
        if n is None and not enter_unbounded:
          walk.unbounded.append((body, in_cond))
          continue
        visit(body, w * (n if n and trip_counts else 1), in_fusion, looped or n is None, in_cond)
      elif ins.op == "fusion":
        visit(_called(ins), w, True, looped, in_cond)
      elif ins.op == "call" or ins.op.endswith("-start"):
        for callee in re.findall(r"(?:to_apply|calls)=%([\w.\-]+)", ins.rest):
          visit(callee, w, in_fusion, looped, in_cond)
      elif ins.op == "conditional":
        for callee in re.findall(r"%([\w.\-]+)", ins.rest.split("branch_computations=")[-1]):
          if callee in comps:
            visit(callee, w, in_fusion, looped, True)

  visit(root, 1.0, False, False, False)
  return walk


def _sum(comps: dict[str, list[_Instr]], walk: _Walk) -> dict[str, float]:
  out = dict.fromkeys(
    ("flops", "bytes", "collective_bytes", "loop_flops", "loop_bytes", "onchip_bytes"), 0.0
  )
  for name, w in walk.weight.items():
    instrs = comps[name]
    shapes = {i.name: i.shape for i in instrs}
    for ins in instrs:
      if ins.op in ("dot", "convolution"):
        f = _matmul_flops(ins, shapes)
        out["flops"] += w * f
        out["loop_flops"] += walk.in_loop[name] * f
      if name in walk.fused or ins.op in _FREE or ins.op.endswith("-done"):
        continue
      moved, onchip = _moved(ins, shapes, comps, "hbm"), _moved(ins, shapes, comps, "onchip")
      out["bytes"] += w * moved
      out["loop_bytes"] += walk.in_loop[name] * moved
      out["onchip_bytes"] += w * onchip
      if ins.op.startswith(_COLLECTIVES):
        out["collective_bytes"] += w * _bytes(ins.shape)
  return out


def hlo_cost(text: str, trip_counts: bool = True) -> dict[str, float]:
  """Per-device ``flops``, ``bytes`` and ``collective_bytes`` of one HLO module.

  Loops without a constant bound count once; ``loop_flops`` / ``loop_bytes``
  are the part inside them (one iteration), ``unbounded_loops`` their number.
  """
  comps, entry = _parse(text)
  walk = _walk(comps, entry, trip_counts, enter_unbounded=True)
  out = _sum(comps, walk)
  out["unbounded_loops"] = float(
    sum(
      1
      for name in walk.weight
      for ins in comps[name]
      if ins.op == "while" and _trip_count(comps.get(_called(ins, "condition"), [])) is None
    )
  )
  return out


@dataclasses.dataclass
class Loop:
  """An unbounded loop: one iteration of its body without the unbounded loops nested in
  it (``cost``), those loops, and whether it sits inside a conditional."""

  cost: dict[str, float]
  nested: list[Loop]
  in_conditional: bool


def loop_tree(text: str) -> tuple[dict[str, float], list[Loop]]:
  """The cost outside every unbounded loop, and the unbounded loops of the program in
  order, each with the unbounded loops nested in it: for the caller to weight each by
  its own expected trip count (bounded loops are counted by theirs, as in ``hlo_cost``)."""
  comps, entry = _parse(text)

  def loops(root: str) -> tuple[dict[str, float], list[Loop]]:
    walk = _walk(comps, root, True, enter_unbounded=False)
    inner = []
    for body, in_cond in walk.unbounded:
      cost, nested = loops(body)
      inner.append(Loop(cost, nested, in_cond))
    return _sum(comps, walk), inner

  return loops(entry)
