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
         split by where the array lives (``hlo_text.space_class``): ``bytes`` in
         HBM (memory space 0); ``onchip_bytes`` in the buffers the TPU compiler
         places on chip (``S(n)`` in their layout: VMEM, and on v4 the 128 MiB CMEM,
         which holds e.g. a KV block it cut out of the cache for two dots, or a
         layer's weights across the decode loop); ``host_bytes`` in the host's
         memory (``S(5)``, offloaded buffers, moved over PCIe). The asynchronous
         copies between spaces (copy-start, slice-start) count on both sides;
  collectives  ``collective_bytes``, each collective's result (the older count),
         and ``ici_bytes``, what one device sends over the inter-chip links by the
         ring algorithms (``_ici_bytes``), like for like across kinds.

The cost model (``times``; rates per chip from ``Rates``): the per-program roofline
max(FLOP time, HBM time) beside the per-operation one, each instruction outside fusions
(a fusion with the matmuls inside it) timed by its own bound and the times summed:
``op_s`` = sum of max(FLOP time, HBM time), on-chip traffic free and collectives hidden
(the optimistic end); ``op_honest_s`` = sum of max(FLOP time, HBM + on-chip + host time,
inter-chip time), on-chip traffic at the assumed bandwidth and nothing overlapped (the
honest end). On-chip time alone is the range [0, ``onchip_bytes`` / on-chip rate].
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

from capo_jax.run import hlo_text as ht
from capo_jax.run.hlo_text import Instr as _Instr

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


def _matmul_flops(ins: _Instr, shapes: dict[str, str]) -> float:
  out = ht.arrays(ins.shape)
  ops = ht.operands(ins.rest)
  if not out or len(ops) < 2:
    return 0.0
  lhs, rhs = (ht.arrays(shapes.get(o, "")) for o in ops[:2])
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


def _read_by_slices(
  pname: str, fused: list[_Instr], comps: dict[str, list[_Instr]], where: str = "all"
) -> float | None:
  """Bytes of parameter ``pname`` a fusion reads when it only slices or gathers from it
  (also through a nested fusion that does), else None."""
  total = 0.0
  uses = ht.users(fused).get(pname, [])
  pshape = next((i.shape for i in fused if i.name == pname), None)
  for u in uses:
    if u.op in ("slice", "dynamic-slice") or (u.op == "gather" and ht.operands(u.rest)[0] == pname):
      total += ht.nbytes(u.shape, where, space_of=pshape)
    elif u.op == "fusion":  # a nested fusion: its own parameter must be sliced only
      inner = comps.get(ht.called(u), [])
      idx = ht.operands(u.rest).index(pname)
      names = [n for n, i in ht.params(inner).items() if i == idx]
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
  params = ht.params(fused)
  users = ht.users(fused)
  operands = ht.operands(ins.rest)
  total = 0.0
  for pname, idx in params.items():
    full = ht.nbytes(shapes.get(operands[idx], ""), where) if idx < len(operands) else 0.0
    uses = users.get(pname, [])
    sliced = _read_by_slices(pname, fused, comps, where)
    if sliced is not None:
      total += min(full, sliced)
    elif uses and all(
      u.op in ("dynamic-update-slice", "scatter") and ht.operands(u.rest)[0] == pname for u in uses
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
      ht.nbytes(fshapes.get(o, ""), where)
      for u in updates
      for o in ht.operands(u.rest)[1 : (2 if u.op == "dynamic-update-slice" else 3)]
    )
  return total + ht.nbytes(ins.shape, where)


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
    arr = ht.array_texts(ins.shape)
    dst, src = (arr[0], arr[1]) if ins.op == "copy-start" else (arr[1], arr[0])
    return ht.nbytes(dst, where, space_of=src) + ht.nbytes(dst, where)
  if ins.op == "dynamic-slice":  # read where the source lives, written where it goes
    return ht.nbytes(ins.shape, where, space_of=shapes.get(ht.operands(ins.rest)[0])) + ht.nbytes(
      ins.shape, where
    )
  if ins.op == "dynamic-update-slice":
    ops = ht.operands(ins.rest)
    update = shapes.get(ops[1], "")
    return ht.nbytes(update, where) + ht.nbytes(update, where, space_of=shapes.get(ops[0]))
  if ins.op == "fusion":
    return _fusion_bytes(ins, shapes, comps[ht.called(ins)], comps, where)
  return ht.nbytes(ins.shape, where) + sum(
    ht.nbytes(shapes.get(o, ""), where) for o in ht.operands(ins.rest)
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
        cond, body = ht.called(ins, "condition"), ht.called(ins, "body")
        n = ht.trip_count(comps.get(cond, []))
        if n is None and not enter_unbounded:
          walk.unbounded.append((body, in_cond))
          continue
        visit(body, w * (n if n and trip_counts else 1), in_fusion, looped or n is None, in_cond)
      elif ins.op == "fusion":
        visit(ht.called(ins), w, True, looped, in_cond)
      elif ins.op == "call" or ins.op.endswith("-start"):
        for callee in re.findall(r"(?:to_apply|calls)=%([\w.\-]+)", ins.rest):
          visit(callee, w, in_fusion, looped, in_cond)
      elif ins.op == "conditional":
        for callee in re.findall(r"%([\w.\-]+)", ins.rest.split("branch_computations=")[-1]):
          if callee in comps:
            visit(callee, w, in_fusion, looped, True)

  visit(root, 1.0, False, False, False)
  return walk


@dataclasses.dataclass(frozen=True)
class Rates:
  """Per-chip rates an operation is timed by (units per second); the figures and their
  sources are the chip table's (``tools/tpu_chips.py``)."""

  flops: float  # peak dense bfloat16 FLOP/s
  hbm: float  # HBM bytes/s
  onchip: float  # on-chip memory (CMEM / VMEM) bytes/s: an assumption, not published
  host: float  # host memory (space 5) bytes/s, over PCIe
  ici: float  # bytes/s a chip sends in a collective over the inter-chip links


KEYS = (
  "flops",
  "bytes",
  "onchip_bytes",
  "host_bytes",
  "collective_bytes",
  "ici_bytes",
  "loop_flops",
  "loop_bytes",
  "op_s",
  "op_honest_s",
)


def _ici_bytes(ins: _Instr, shapes: dict[str, str], devices: int) -> float:
  """Bytes one device sends for a collective over groups of n devices, by the ring
  algorithms (the operand's bytes x): all-gather n - 1, reduce-scatter and all-to-all
  (n - 1) / n, all-reduce 2 (n - 1) / n (a reduce-scatter then an all-gather),
  collective-permute 1. Like for like across kinds, where ``collective_bytes`` (each
  collective's result, the older count) counts an all-gather whole and a reduce-scatter
  by its shard."""
  n = ht.group_size(ins, devices)
  size = sum(ht.nbytes(shapes.get(o, "")) for o in ht.operands(ins.rest))
  if ins.op.startswith("collective-permute"):
    return size
  if ins.op.startswith("all-gather"):
    return size * (n - 1)
  return size * (n - 1) / n * (2 if ins.op.startswith("all-reduce") else 1)


def _fused_flops(comp: str, comps: dict[str, list[_Instr]], memo: dict[str, float]) -> float:
  """Matmul FLOPs of a fused computation, its nested fusions included."""
  if comp not in memo:
    instrs = comps.get(comp, [])
    shapes = {i.name: i.shape for i in instrs}
    memo[comp] = sum(
      _matmul_flops(i, shapes)
      if i.op in ("dot", "convolution")
      else _fused_flops(ht.called(i), comps, memo)
      if i.op == "fusion"
      else 0.0
      for i in instrs
    )
  return memo[comp]


def _op_seconds(
  flops: float, moved: dict[str, float], ici: float, rates: Rates
) -> tuple[float, float]:
  """One operation's roofline: optimistic, max(FLOP time, HBM time) (on-chip traffic
  free, collectives hidden behind it); honest, the slowest of its FLOP time, its memory
  time (HBM + on-chip + host, one after another) and its inter-chip time."""
  t_flop, t_hbm = flops / rates.flops, moved["hbm"] / rates.hbm
  t_mem = t_hbm + moved["onchip"] / rates.onchip + moved["host"] / rates.host
  return max(t_flop, t_hbm), max(t_flop, t_mem, ici / rates.ici)


def _sum(
  comps: dict[str, list[_Instr]], walk: _Walk, devices: int, rates: Rates | None
) -> dict[str, float]:
  out = dict.fromkeys(KEYS, 0.0)
  memo: dict[str, float] = {}
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
      moved = {sp: _moved(ins, shapes, comps, sp) for sp in ht.SPACES}
      out["bytes"] += w * moved["hbm"]
      out["loop_bytes"] += walk.in_loop[name] * moved["hbm"]
      out["onchip_bytes"] += w * moved["onchip"]
      out["host_bytes"] += w * moved["host"]
      ici = 0.0
      if ins.op.startswith(_COLLECTIVES):
        out["collective_bytes"] += w * ht.nbytes(ins.shape)
        ici = _ici_bytes(ins, shapes, devices)
        out["ici_bytes"] += w * ici
      if rates is not None:
        own = _matmul_flops(ins, shapes) if ins.op in ("dot", "convolution") else 0.0
        f = _fused_flops(ht.called(ins), comps, memo) if ins.op == "fusion" else own
        op_s, honest_s = _op_seconds(f, moved, ici, rates)
        out["op_s"] += w * op_s
        out["op_honest_s"] += w * honest_s
  return out


def times(cost: dict[str, float], rates: Rates) -> dict[str, float]:
  """Seconds of a cost (``hlo_cost``'s keys, summed over calls as the caller likes):
  FLOP and HBM time, the per-program roofline max of the two, on-chip time at the
  assumed on-chip bandwidth (the top of its range; the bottom is 0), host and
  inter-chip time, and the per-operation sums (``op_s`` optimistic, ``op_honest_s``
  honest: ``_op_seconds``) when the cost was counted with rates."""
  t = {
    "flop_s": cost["flops"] / rates.flops,
    "hbm_s": cost["bytes"] / rates.hbm,
    "onchip_s": cost.get("onchip_bytes", 0.0) / rates.onchip,
    "host_s": cost.get("host_bytes", 0.0) / rates.host,
    "ici_s": cost.get("ici_bytes", 0.0) / rates.ici,
  }
  t["program_s"] = max(t["flop_s"], t["hbm_s"])
  t["op_s"], t["op_honest_s"] = cost.get("op_s", 0.0), cost.get("op_honest_s", 0.0)
  return t


def hlo_cost(text: str, trip_counts: bool = True, rates: Rates | None = None) -> dict[str, float]:
  """Per-device ``flops``, HBM ``bytes``, ``onchip_bytes``, ``host_bytes``,
  ``collective_bytes`` (results), ``ici_bytes`` (sent over the links) of one HLO module;
  with ``rates`` also the per-operation roofline sums ``op_s`` and ``op_honest_s``.

  Loops without a constant bound count once; ``loop_flops`` / ``loop_bytes``
  are the part inside them (one iteration), ``unbounded_loops`` their number.
  """
  comps, entry = ht.parse(text)
  walk = _walk(comps, entry, trip_counts, enter_unbounded=True)
  out = _sum(comps, walk, ht.num_partitions(text), rates)
  out["unbounded_loops"] = float(
    sum(
      1
      for name in walk.weight
      for ins in comps[name]
      if ins.op == "while" and ht.trip_count(comps.get(ht.called(ins, "condition"), [])) is None
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


def loop_tree(text: str, rates: Rates | None = None) -> tuple[dict[str, float], list[Loop]]:
  """The cost outside every unbounded loop, and the unbounded loops of the program in
  order, each with the unbounded loops nested in it: for the caller to weight each by
  its own expected trip count (bounded loops are counted by theirs, as in ``hlo_cost``)."""
  comps, entry = ht.parse(text)
  devices = ht.num_partitions(text)

  def loops(root: str) -> tuple[dict[str, float], list[Loop]]:
    walk = _walk(comps, root, True, enter_unbounded=False)
    inner = []
    for body, in_cond in walk.unbounded:
      cost, nested = loops(body)
      inner.append(Loop(cost, nested, in_cond))
    return _sum(comps, walk, devices, rates), inner

  return loops(entry)
