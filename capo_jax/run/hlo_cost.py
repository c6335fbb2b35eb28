"""FLOPs and bytes of a compiled XLA program with loop bodies counted per iteration.

XLA's own cost analysis (``compiled.cost_analysis()``) counts every while-loop
body once, whatever its trip count: on a TPU topology the 28-layer ``lax.scan``
of the model costs one layer, the micro-batch scan one micro-batch, the decode
loop one token. This reads the optimised HLO text (``compiled.as_text()``),
finds each loop's trip count in its condition (``i < constant``, the form
``lax.scan`` / ``fori_loop`` lower to) and weights every computation by the
trip counts of the loops around it. Loops without a constant bound (the
sampler's decode ``while_loop``, which stops when every row is done) count
once and are reported, so the caller multiplies by the steps it expects. What
each instruction costs is ``capo_jax.run.hlo_ops``'s.

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
         memory (``S(5)``, offloaded buffers, moved over PCIe). A copy between
         spaces (copy-start, slice-start, a dynamic-slice) counts on both sides;
  collectives  ``collective_bytes``, each collective's result (the older count),
         and ``ici_bytes``, what one device sends over the inter-chip links by the
         ring algorithms (``hlo_ops.ici_bytes``), like for like across kinds; a
         collective the TPU compiler fused (its reduce-scatter: an all-reduce sliced
         to the device's shard inside a ``kCustom`` fusion) counts as the
         reduce-scatter it runs (``hlo_ops.fused_collective``);
  kernels  a Pallas TPU kernel (``tpu_custom_call``) by the FLOPs and bytes it
         declares (``pl.CostEstimate``), else by its operands and results once each,
         with no FLOPs but jax's splash attention's (``hlo_ops.splash_flops``: the
         matmuls of the block pairs its causal mask computes); the ragged decode
         attention (``hlo_ops.ragged_kv``) by the
         columns each slot copies, which only the rows' lengths decide: ``cols``
         given by the caller's length model (``tools/step_estimate.py``), else every
         slot's whole cache, the most it can read. ``ragged_bytes`` is that read.

The cost model (``times``; rates per chip from ``Rates``): the per-program roofline
max(FLOP time, HBM time) beside the per-operation one, each instruction outside fusions
(a fusion with the matmuls inside it) timed by its own bound and the times summed:
``op_s`` = sum of max(FLOP time, HBM time), on-chip traffic free and collectives hidden
(the optimistic end); ``op_honest_s`` = sum of max(FLOP time, HBM + on-chip + host time,
inter-chip time), on-chip traffic at the assumed bandwidth and nothing overlapped (the
honest end), except that an operation that only moves an array (``hlo_ops.is_move``: a
copy, the ragged kernel's staging) is one DMA stream, timed by its slower side rather
than by both sides in turn. On-chip time alone is the range [0, ``onchip_bytes`` /
on-chip rate]. Given an ``ops`` table, each operation's seconds are also tallied by its
label (``hlo_ops.op_label``: its kind and JAX op name; ``OP_PARTS``): where the honest
seconds go.
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
import re

from capo_jax.run import hlo_ops
from capo_jax.run import hlo_text as ht
from capo_jax.run.hlo_text import Instr as _Instr


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
  "collectives",
  "loop_flops",
  "loop_bytes",
  "op_s",
  "op_honest_s",
  "ragged_bytes",
)
# Per column each slot of a ragged decode-attention call copies (``hlo_ops.ragged_kv``),
# the bytes by memory space its calls would add: ``with_ragged_cols`` adds them.
COL_KEYS = tuple(f"ragged_col_{sp}" for sp in ht.SPACES)

# The per-operation table: per label (``hlo_ops.op_label``, an operation's kind and JAX op
# name) the seconds of its honest bound and of its FLOPs and traffic, summed over its
# runs; the honest seconds of all labels sum to ``op_honest_s``.
OP_PARTS = ("honest_s", "flop_s", "hbm_s", "onchip_s", "host_s", "ici_s")
Ops = dict[str, list[float]]


def _tally(
  ops: Ops,
  label: str,
  w: float,
  honest_s: float,
  flops: float,
  moved: dict[str, float],
  ici: float,
  rates: Rates,
) -> None:
  row = ops.setdefault(label, [0.0] * len(OP_PARTS))
  parts = [honest_s, flops / rates.flops, moved["hbm"] / rates.hbm]
  parts += [moved["onchip"] / rates.onchip, moved["host"] / rates.host, ici / rates.ici]
  for i, x in enumerate(parts):
    row[i] += w * x


def add_ops(acc: Ops, ops: Ops, w: float) -> None:
  """``acc`` += ``w`` x ``ops``, label by label."""
  for label, row in ops.items():
    got = acc.setdefault(label, [0.0] * len(OP_PARTS))
    for i, x in enumerate(row):
      got[i] += w * x


def top_ops(ops: Ops, n: int) -> list[dict[str, float | str]]:
  """The ``n`` labels of the most honest seconds, each as {"op": label, part: seconds}."""
  rows = sorted(ops.items(), key=lambda kv: -kv[1][0])[:n]
  return [{"op": label, **dict(zip(OP_PARTS, row))} for label, row in rows]


def _op_seconds(
  flops: float, moved: dict[str, float], ici: float, rates: Rates, move: bool = False
) -> tuple[float, float]:
  """One operation's roofline: optimistic, max(FLOP time, HBM time) (on-chip traffic
  free, collectives hidden behind it); honest, the slowest of its FLOP time, its memory
  time and its inter-chip time. The memory time of an operation that computes is its
  HBM, on-chip and host times one after another. A ``move`` (``hlo_ops.is_move``) is one
  DMA stream, which writes its destination as it reads its source: its memory time is
  its slowest side's (summing them would time each byte twice; an XLA fusion's operands
  go through VMEM the same way, uncounted)."""
  t_flop, t_hbm = flops / rates.flops, moved["hbm"] / rates.hbm
  sides = (t_hbm, moved["onchip"] / rates.onchip, moved["host"] / rates.host)
  t_mem = max(sides) if move else sum(sides)
  return max(t_flop, t_hbm), max(t_flop, t_mem, ici / rates.ici)


def _sum(
  comps: dict[str, list[_Instr]],
  walk: _Walk,
  devices: int,
  rates: Rates | None,
  cols: float | None,
  ops: Ops | None = None,
  splash_share: float = 1.0,
) -> dict[str, float]:
  """``cols``: the columns each slot of a ragged call copies (None: its whole cache).
  ``ops``: with ``rates``, also tallies each operation's seconds by its label.
  ``splash_share``: the share of a causal splash call's block pairs computed."""
  out = dict.fromkeys(KEYS + COL_KEYS + ("ragged_cache_cols",), 0.0)
  memo: dict[str, float] = {}
  for name, w in walk.weight.items():
    instrs = comps[name]
    shapes = {i.name: i.shape for i in instrs}
    for ins in instrs:
      kernel = hlo_ops.kernel_flops(ins, shapes, splash_share)  # a Pallas kernel's, else None
      if ins.op in ("dot", "convolution") or kernel is not None:
        f = hlo_ops.matmul_flops(ins, shapes) if kernel is None else kernel
        out["flops"] += w * f
        out["loop_flops"] += walk.in_loop[name] * f
      if name in walk.fused or ins.op in hlo_ops.FREE or ins.op.endswith("-done"):
        continue
      moved = {sp: hlo_ops.moved_bytes(ins, shapes, comps, sp) for sp in ht.SPACES}
      ragged = hlo_ops.ragged_kv(ins, shapes)
      if ragged:
        per_col = hlo_ops.ragged_col_bytes(ins, shapes, *ragged)
        n = ragged[1] if cols is None else cols
        for sp in ht.SPACES:
          out[f"ragged_col_{sp}"] += w * per_col[sp]
          moved[sp] += n * per_col[sp]
        out["ragged_bytes"] += w * n * per_col["hbm"]
        out["ragged_cache_cols"] = max(out["ragged_cache_cols"], ragged[1])
      out["bytes"] += w * moved["hbm"]
      out["loop_bytes"] += walk.in_loop[name] * moved["hbm"]
      out["onchip_bytes"] += w * moved["onchip"]
      out["host_bytes"] += w * moved["host"]
      ici = 0.0
      if ins.op.startswith(hlo_ops.COLLECTIVES):
        out["collective_bytes"] += w * ht.nbytes(ins.shape)
        ici = hlo_ops.ici_bytes(ins, shapes, devices)
        out["ici_bytes"] += w * ici
      elif ins.op == "fusion":  # a collective the compiler fused (a reduce-scatter)
        ici, result = hlo_ops.fused_collective(ins, comps, devices)
        out["collective_bytes"] += w * result
        out["ici_bytes"] += w * ici
      if ici > 0:  # each collective that sends: the fixed costs no byte count holds
        out["collectives"] += w
      if rates is not None:
        own = hlo_ops.matmul_flops(ins, shapes) if ins.op in ("dot", "convolution") else 0.0
        own = own if kernel is None else kernel
        f = hlo_ops.fused_flops(ht.called(ins), comps, memo) if ins.op == "fusion" else own
        op_s, honest_s = _op_seconds(f, moved, ici, rates, hlo_ops.is_move(ins, shapes))
        out["op_s"] += w * op_s
        out["op_honest_s"] += w * honest_s
        if ops is not None:
          _tally(ops, hlo_ops.op_label(ins, shapes), w, honest_s, f, moved, ici, rates)
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


def with_ragged_cols(
  cost: dict[str, float], cols: float, rates: Rates | None = None, ops: Ops | None = None
) -> dict[str, float]:
  """``cost`` with each slot of its ragged calls copying ``cols`` more columns: their
  bytes per column (``COL_KEYS``) times ``cols`` added to the bytes of each memory
  space, to ``ragged_bytes`` and, with ``rates``, to the per-operation sums (a kernel's
  FLOPs are not counted, so its time is its memory time, which grows by as much) and
  to ``ops``' ragged label (in place)."""
  out = dict(cost)
  moved = {sp: cols * cost.get(f"ragged_col_{sp}", 0.0) for sp in ht.SPACES}
  for sp, key in zip(ht.SPACES, ("bytes", "onchip_bytes", "host_bytes")):
    out[key] = out.get(key, 0.0) + moved[sp]
  out["ragged_bytes"] = out.get("ragged_bytes", 0.0) + moved["hbm"]
  if rates is not None:
    op_s, honest_s = _op_seconds(0.0, moved, 0.0, rates, move=True)  # staging: a move
    out["op_s"] = out.get("op_s", 0.0) + op_s
    out["op_honest_s"] = out.get("op_honest_s", 0.0) + honest_s
    if ops is not None:
      _tally(ops, hlo_ops.RAGGED_LABEL, 1.0, honest_s, 0.0, moved, 0.0, rates)
  return out


def hlo_cost(
  text: str,
  trip_counts: bool = True,
  rates: Rates | None = None,
  cols: float | None = None,
  ops: Ops | None = None,
  splash_share: float = 1.0,
) -> dict[str, float]:
  """Per-device ``flops``, HBM ``bytes``, ``onchip_bytes``, ``host_bytes``,
  ``collective_bytes`` (results), ``ici_bytes`` (sent over the links) and
  ``collectives`` (how many collectives that send run) of one HLO module; with ``rates``
  also the per-operation roofline sums ``op_s`` and ``op_honest_s``.

  Loops without a constant bound count once; ``loop_flops`` / ``loop_bytes``
  are the part inside them (one iteration), ``unbounded_loops`` their number.
  Ragged decode-attention calls copy ``cols`` columns per slot (None: the whole cache,
  ``ragged_cache_cols``, the most they can read); ``ragged_bytes`` is what that reads.
  ``ops``: with ``rates``, filled with the per-operation table (``OP_PARTS``).
  ``splash_share``: the share of each causal splash call's block pairs its rows compute
  (``hlo_ops.splash_flops``; 1: the whole causal triangle).
  """
  comps, entry = ht.parse(text)
  walk = _walk(comps, entry, trip_counts, enter_unbounded=True)
  out = _sum(comps, walk, ht.num_partitions(text), rates, cols, ops, splash_share)
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
  it (``cost``, and with rates its per-operation table ``ops``), those loops, and whether
  it sits inside a conditional. The program itself is the root, run once."""

  cost: dict[str, float]
  nested: list[Loop]
  in_conditional: bool
  ops: Ops = dataclasses.field(default_factory=dict)


def loop_tree(text: str, rates: Rates | None = None, splash_share: float = 1.0) -> Loop:
  """The program as a tree of its unbounded loops: the root's cost is what runs outside
  every unbounded loop, its ``nested`` the loops in order, each with the unbounded loops
  nested in it: for the caller to weight each by its own expected trip count (bounded
  loops are counted by theirs, as in ``hlo_cost``). Ragged calls are counted without
  their keys and values, for the caller to add its columns per slot
  (``with_ragged_cols``); causal splash calls at ``splash_share`` of their block pairs."""
  comps, entry = ht.parse(text)
  devices = ht.num_partitions(text)

  def tree(root: str, in_cond: bool) -> Loop:
    walk = _walk(comps, root, True, enter_unbounded=False)
    nested = [tree(body, inside) for body, inside in walk.unbounded]
    ops: Ops = {}
    cost = _sum(comps, walk, devices, rates, 0.0, ops if rates is not None else None, splash_share)
    return Loop(cost, nested, in_cond, ops)

  return tree(entry, False)
