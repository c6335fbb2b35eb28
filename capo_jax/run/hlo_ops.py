"""What one HLO instruction costs: matmul FLOPs, bytes moved, bytes sent between chips.

The per-instruction rules of ``capo_jax.run.hlo_cost`` (which weights them by how many
times each computation runs): ``matmul_flops`` of a ``dot`` / ``convolution`` (TPU's
dilated, padded convolutions counted by the window positions that land on real input),
``moved_bytes`` of an instruction outside fusions in one memory space (a fusion's
operands read only through slices cost the slices, an in-place update its update),
``ici_bytes`` of a collective by the ring algorithms, and ``fused_flops`` of a fused
computation. Pallas TPU kernels: ``declared_cost`` (what a kernel declares), the FLOPs of
jax's splash attention by its causal blocks (``splash_flops``), and the ragged decode
attention's keys and values (``ragged_kv``, ``ragged_col_bytes``), which it reads per
slot up to that slot's length.
"""

from __future__ import annotations

import math
import re

from capo_jax.run import hlo_text as ht
from capo_jax.run.hlo_text import Instr as _Instr

FREE = {
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
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


def matmul_flops(ins: _Instr, shapes: dict[str, str]) -> float:
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


def _updates_in_place(u: _Instr, pname: str) -> bool:
  return u.op in ("dynamic-update-slice", "scatter") and ht.operands(u.rest)[0] == pname


def _read_by_slices(
  pname: str,
  fused: list[_Instr],
  comps: dict[str, list[_Instr]],
  where: str = "all",
  in_place: bool = False,
) -> float | None:
  """Bytes of parameter ``pname`` a fusion reads when it only slices or gathers from it
  (also through a nested fusion that does), else None. ``in_place``: a use that updates
  it in place (the buffer of a dynamic-update-slice or scatter) reads nothing (a slot's
  old block read, then written back over the cache: the buffer is not read whole)."""
  total = 0.0
  uses = ht.users(fused).get(pname, [])
  pshape = next((i.shape for i in fused if i.name == pname), None)
  for u in uses:
    if in_place and _updates_in_place(u, pname):
      continue
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
  (dynamic-update-slice, scatter) costs the update, read and written, not the buffer
  (plus what is sliced from it: the old block a select keeps where a row is not copied)."""
  params = ht.params(fused)
  operands = ht.operands(ins.rest)
  total = 0.0
  for pname, idx in params.items():
    full = ht.nbytes(shapes.get(operands[idx], ""), where) if idx < len(operands) else 0.0
    # Slices (and an in-place update's buffer, neither read nor rewritten) cost what
    # they read.
    sliced = _read_by_slices(pname, fused, comps, where, in_place=True)
    total += full if sliced is None else min(full, sliced)
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


def declared_cost(ins: _Instr) -> tuple[float, float] | None:
  """(FLOPs, bytes) a Pallas TPU kernel declares (``pl.CostEstimate``, printed in its
  backend config's ``cost_estimate``), or None when it declares none."""
  if 'custom_call_target="tpu_custom_call"' not in ins.rest:
    return None
  m = re.search(r'"cost_estimate":\{([^}]*)\}', ins.rest)
  if m is None:
    return None
  got = dict(re.findall(r'"(\w+)":"?(\d+)', m[1]))
  return float(got.get("flops", 0)), float(got.get("bytes_accessed", 0))


# Matmuls a splash-attention kernel runs per (query block, key block) pair and query head:
# the forward's scores and output; the backward's key / value kernel recomputes the scores
# and forms dV, dP and dK; its query kernel recomputes the scores, dP and dQ.
SPLASH_MATMULS = {"splash_mha_fwd": 2, "splash_mha_dkv": 4, "splash_mha_dq": 3}
# The JAX scope of splash calls with per-row block tables (``models.splash_blocks.SCOPE``;
# this module reads HLO text and imports no model code).
ROW_BLOCKS_SCOPE = "splash_row_blocks"


def _op_name(ins: _Instr) -> str:
  m = re.search(r'op_name="([^"]*)"', ins.rest)
  return m.group(1) if m else ""


def _splash_kind(ins: _Instr) -> str | None:
  """Which splash-attention kernel ``ins`` calls (a ``SPLASH_MATMULS`` key), or None: by
  its name, or where vmap runs it in a loop (per-row block tables: an anonymous
  ``closed_call``) by the innermost kernel scope of its JAX op name."""
  if 'custom_call_target="tpu_custom_call"' not in ins.rest:
    return None
  kind = next((k for k in SPLASH_MATMULS if ins.name.startswith(k)), None)
  if kind is None:
    scopes = re.findall(r"(splash_mha_(?:fwd|dkv|dq))_", _op_name(ins))
    kind = scopes[-1] if scopes else None
  return kind


def splash_flops(ins: _Instr, shapes: dict[str, str], causal_share: float = 1.0) -> float | None:
  """FLOPs of a splash-attention kernel call (jax's Pallas TPU kernel, which declares no
  cost), None for any other instruction.

  Known by its name (``SPLASH_MATMULS``, the kernel's own: ``%splash_mha_fwd_...``); its
  first operand is the mask's block map [1, query blocks, key blocks], its first two
  float operands q [..., N, T, H] and k [..., K, S, H]. The model's splash masks are
  causal over a row's own keys (S = T: ``models.attention.splash``, the own call of
  ``models.shared_prefix``) and full over a row's gathered prompt keys (S < T, the
  prompt call). The kernel skips only the blocks the mask leaves empty, not those that
  the segment ids mask (it applies them inside a block): with S = T every block pair
  holding some key column at or before some query row is computed whole, so a packed
  row costs its whole causal triangle, whatever its sequences; with S < T every pair.
  The model's own calls also skip, row by row, the blocks two of its sequences meet in
  (``models.splash_blocks``), which only the rows' layout decides: a causal call in that
  scope (``ROW_BLOCKS_SCOPE`` in its op name) counts ``causal_share`` of its pairs, the
  share the caller's length model leaves; any other (compiled before) all of them.
  """
  kind = _splash_kind(ins)
  if kind is None:
    return None
  arrs = [ht.arrays(shapes.get(o, "")) for o in ht.operands(ins.rest)]
  flat = [a[0] for a in arrs if len(a) == 1]
  floats = [dims for dt, dims in flat if dt in ("bf16", "f32", "f16") and len(dims) >= 3]
  if not flat or len(flat[0][1]) != 3 or len(floats) < 2:
    return None
  (_, (_, nq, nk)), q, k = flat[0], floats[0], floats[1]
  T, S, H = q[-2], k[-2], q[-1]
  bq, bk = T // nq, S // nk
  causal = sum(min(nk, ((i + 1) * bq - 1) // bk + 1) for i in range(nq))
  share = causal_share if ROW_BLOCKS_SCOPE in _op_name(ins) else 1.0
  pairs = causal * share if S == T else nq * nk
  return float(SPLASH_MATMULS[kind] * 2 * math.prod(q[:-2]) * bq * bk * H * pairs)


def kernel_flops(ins: _Instr, shapes: dict[str, str], splash_share: float = 1.0) -> float | None:
  """A Pallas kernel's FLOPs: what it declares, else a splash kernel's
  (``splash_flops``, its causal pairs times ``splash_share``); None for anything else."""
  declared = declared_cost(ins)
  return declared[0] if declared else splash_flops(ins, shapes, splash_share)


def ragged_kv(ins: _Instr, shapes: dict[str, str]) -> tuple[list[str], int] | None:
  """The keys and values a ragged decode-attention call reads by the rows' lengths, and
  their columns S; None for any other instruction.

  The call is ``capo_jax.sampling.ragged``'s Pallas kernel, known by its signature: a
  ``tpu_custom_call`` (declaring no cost) of (start s32[W], end s32[W], queries
  [W, K, R, H], keys [W, S, K*H], values alike) -> [W, K, R, H]. Its queries, lengths
  and output move whole (block specs over the slots); the keys and values stay where
  they live (``memory_space=ANY``) and the kernel copies, per slot, the blocks of
  columns its own range covers, which the HLO cannot say: ``hlo_cost`` counts them by
  the columns the caller's length model gives.
  """
  if ins.op != "custom-call" or 'custom_call_target="tpu_custom_call"' not in ins.rest:
    return None
  ops = ht.operands(ins.rest)
  arrs = [ht.arrays(shapes.get(o, "")) for o in ops]
  out = ht.arrays(ins.shape)
  if len(ops) != 5 or len(out) != 1 or any(len(a) != 1 for a in arrs) or declared_cost(ins):
    return None
  (ds, start), (de, end), (_, q), (_, k), (_, v) = (a[0] for a in arrs)
  ok = (ds, de) == ("s32", "s32") and len(start) == 1 and end == start and len(q) == 4
  ok = ok and out[0][1] == q and q[0] == start[0] and k == v and len(k) == 3
  if not ok or k[0] != q[0] or k[2] != q[1] * q[3]:
    return None
  return ops[3:], k[1]


def ragged_col_bytes(
  ins: _Instr, shapes: dict[str, str], kv: list[str], cols: int
) -> dict[str, float]:
  """Bytes per memory space a ragged call (``ragged_kv``) moves per column each slot
  copies: one column of every slot's keys and values read where they live, and written
  into the kernel's VMEM buffers (on chip), as a copy between spaces counts."""
  one = {sp: sum(ht.nbytes(shapes.get(o, ""), sp) for o in kv) / cols for sp in ht.SPACES}
  one["onchip"] += sum(ht.nbytes(shapes.get(o, "")) for o in kv) / cols
  return one


# Operations that only move one array from one place to another: the DMA engine writes
# the destination as it reads the source, one stream (``hlo_cost._op_seconds``).
MOVES = ("copy", "copy-start", "slice-start", "dynamic-slice")


def is_move(ins: _Instr, shapes: dict[str, str]) -> bool:
  """Whether ``ins`` only moves bytes between memory spaces (or within one): a copy, an
  asynchronous copy or slice, a dynamic-slice outside a fusion, or the ragged decode
  attention's staging of its keys and values into VMEM (``ragged_kv``)."""
  return ins.op in MOVES or ragged_kv(ins, shapes) is not None


RAGGED_LABEL = "ragged decode attention"


def op_label(ins: _Instr, shapes: dict[str, str]) -> str:
  """Where an operation comes from, for the per-operation table of ``hlo_cost``: its
  kind and the last three parts of the JAX op name it was lowered from (``jit(...)``
  scopes dropped), e.g. ``fusion layers.attention_output/dot_general``; the ragged decode
  attention and the splash kernels by name. Operations of one source line share a label."""
  if ragged_kv(ins, shapes) is not None:
    return RAGGED_LABEL
  splash = _splash_kind(ins)
  if splash is not None:
    return f"splash attention ({splash.removeprefix('splash_mha_')})"
  name = re.sub(r"jit\([^)]*\)/?", "", _op_name(ins)).replace("\\'", "'")
  tail = "/".join(name.split("/")[-3:])
  return f"{ins.op} {tail}" if tail else ins.op


def moved_bytes(
  ins: _Instr, shapes: dict[str, str], comps: dict[str, list[_Instr]], where: str = "all"
) -> float:
  """Bytes ``ins`` reads and writes, in the memory spaces ``where`` names (``hlo_text.nbytes``).

  A Pallas TPU kernel (``tpu_custom_call``) moves what it declares (HBM), else its
  operands and results once each (a kernel that re-reads a block counts it once), the
  ragged decode attention's keys and values left out (``ragged_kv``)."""
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
  declared = declared_cost(ins)
  if declared is not None:
    return declared[1] if where in ("all", "hbm") else 0.0
  ragged = ragged_kv(ins, shapes)
  skip = ragged[0] if ragged else []
  return ht.nbytes(ins.shape, where) + sum(
    ht.nbytes(shapes.get(o, ""), where) for o in ht.operands(ins.rest) if o not in skip
  )


def ici_bytes(ins: _Instr, shapes: dict[str, str], devices: int) -> float:
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


def fused_collective(
  ins: _Instr, comps: dict[str, list[_Instr]], devices: int
) -> tuple[float, float]:
  """(bytes sent, result bytes) of the collectives inside a fusion (0, 0 when none).

  The TPU compiler fuses a reduce-scatter as an all-reduce whose result the fusion's
  root slices to this device's shard (``calls=%all-reduce-scatter...``, emitter
  ``SingleInputAllReduceScatterFusion``): that is counted as the reduce-scatter it
  runs, (n - 1) / n of the input sent and the shard as its result. Any other fused
  collective counts as ``ici_bytes`` says and its whole result."""
  instrs = comps.get(ht.called(ins), [])
  shapes = {i.name: i.shape for i in instrs}
  root = instrs[-1] if instrs else None
  sent = result = 0.0
  for c in instrs:
    if not c.op.startswith(COLLECTIVES):
      continue
    scattered = (
      c.op.startswith("all-reduce")
      and root is not None
      and root.op == "dynamic-slice"
      and ht.operands(root.rest)[:1] == [c.name]
    )
    if scattered:
      assert root is not None
      sent += ici_bytes(c, shapes, devices) / 2  # an all-reduce is a reduce-scatter, twice
      result += ht.nbytes(root.shape)
    else:
      sent += ici_bytes(c, shapes, devices)
      result += ht.nbytes(c.shape)
  return sent, result


def fused_flops(comp: str, comps: dict[str, list[_Instr]], memo: dict[str, float]) -> float:
  """Matmul FLOPs of a fused computation, its nested fusions included."""
  if comp not in memo:
    instrs = comps.get(comp, [])
    shapes = {i.name: i.shape for i in instrs}
    memo[comp] = sum(
      matmul_flops(i, shapes)
      if i.op in ("dot", "convolution")
      else fused_flops(ht.called(i), comps, memo)
      if i.op == "fusion"
      else 0.0
      for i in instrs
    )
  return memo[comp]
