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
         nothing (tuples, bitcasts, parameters).
With ``trip_counts=False`` each body counts once, XLA's convention: the
matmul FLOPs then come within ~10% under ``cost_analysis()`` (which adds the
elementwise work), the bytes at 0.4-0.8 of it (XLA also charges reads inside
fusions). ``scaled_cost`` therefore keeps XLA's own numbers and multiplies
them by the ratio this count gives with and without trip counts.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|token|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s16": 16,
         "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64, "c64": 64,
         "c128": 128}
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
         "conditional", "after-all", "opt-barrier", "partition-id", "replica-id", "iota"}
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  op: str
  rest: str


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


def _bytes(shape: str) -> float:
  return sum(_BITS.get(dt, 32) / 8 * math.prod(dims) for dt, dims in _arrays(shape))


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
  field = lambda key, d, default: (attrs[key].split("x")[d] if key in attrs else default)
  pairs = 1
  for d, c in enumerate(spatial):
    size = kernel[rhs_l.index(c)]
    n_in, n_out = in_dims[lhs_l.index(c)], out_dims[out_l.index(c)]
    stride, lhs_dil, rhs_dil = (int(field(k, d, "1")) for k in ("stride", "lhs_dilate",
                                                                 "rhs_dilate"))
    lo = int(field("pad", d, "0_0").split("_")[0])
    span = (n_in - 1) * lhs_dil + 1
    pairs *= sum(1 for o in range(n_out) for w in range(size)
                 if 0 <= (p := o * stride + w * rhs_dil - lo) < span and p % lhs_dil == 0)
  macs = (out_dims[out_l.index("b")] * kernel[rhs_l.index("o")] * kernel[rhs_l.index("i")]
          * pairs)
  return 2.0 * macs


def _trip_count(cond: list[_Instr]) -> int | None:
  consts = {i.name: int(m[1]) for i in cond
            if i.op == "constant" and (m := re.match(r"(-?\d+)\)", i.rest))}
  for i in cond:
    if i.op == "compare" and "direction=LT" in i.rest:
      bounds = [consts[o] for o in _operands(i.rest) if o in consts]
      if len(bounds) == 1:
        return bounds[0]
  return None


def hlo_cost(text: str, trip_counts: bool = True) -> dict[str, float]:
  """``{"flops", "bytes", "collective_bytes", "unbounded_loops"}`` of one HLO module."""
  comps, entry = _parse(text)
  weight: dict[str, float] = collections.defaultdict(float)
  fused: set[str] = set()
  unbounded = 0

  def visit(name: str, w: float, in_fusion: bool) -> None:
    nonlocal unbounded
    weight[name] += w
    if in_fusion:
      fused.add(name)
    for ins in comps.get(name, []):
      if ins.op == "while":
        cond, body = (re.search(rf"{k}=%([\w.\-]+)", ins.rest)[1] for k in ("condition", "body"))
        n = _trip_count(comps.get(cond, [])) if trip_counts else 1
        unbounded += n is None
        visit(body, w * (n or 1), in_fusion)
      elif ins.op == "fusion":
        visit(re.search(r"calls=%([\w.\-]+)", ins.rest)[1], w, True)
      elif ins.op in ("call", "async-start") or ins.op.endswith("-start"):
        for callee in re.findall(r"(?:to_apply|calls)=%([\w.\-]+)", ins.rest):
          visit(callee, w, in_fusion)
      elif ins.op == "conditional":
        for callee in re.findall(r"%([\w.\-]+)", ins.rest.split("branch_computations=")[-1]):
          if callee in comps:
            visit(callee, w, in_fusion)

  visit(entry, 1.0, False)
  flops = bytes_ = coll = 0.0
  for name, w in weight.items():
    instrs = comps[name]
    shapes = {i.name: i.shape for i in instrs}
    for ins in instrs:
      if ins.op in ("dot", "convolution"):
        flops += w * _matmul_flops(ins, shapes)
      if name in fused or ins.op in _FREE or ins.op.endswith("-done"):
        continue
      moved = _bytes(ins.shape) + sum(_bytes(shapes.get(o, "")) for o in _operands(ins.rest))
      bytes_ += w * moved
      if ins.op.startswith(_COLLECTIVES):
        coll += w * _bytes(ins.shape)
  return {"flops": flops, "bytes": bytes_, "collective_bytes": coll,
          "unbounded_loops": float(unbounded)}


def scaled_cost(text: str, xla_cost: dict[str, float]) -> dict[str, float]:
  """XLA's per-device ``flops`` / ``bytes`` with every loop body counted per iteration."""
  once, full = hlo_cost(text, trip_counts=False), hlo_cost(text)
  ratio = lambda k: full[k] / once[k] if once[k] else 1.0
  return {"flops": xla_cost["flops"] * ratio("flops"),
          "bytes": xla_cost["bytes"] * ratio("bytes"),
          "collective_bytes": full["collective_bytes"],
          "unbounded_loops": full["unbounded_loops"]}
