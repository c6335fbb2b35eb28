"""The rollout engine's scheduler, simulated at the real job's shape, and its bandwidth model.

Pure NumPy, no model: the memory plan picks the engine's slot count with it
(``tools/memory_plan.py``), the step estimate weights the compiled decode loops by
its trip counts (``tools/step_estimate.py``) and the rollout benchmark prints it
beside its CPU measurement (``benchmarks/rollout_lengths.py``).

Lengths come from a model of Qwen2.5-Math under GRPO (``sample_lengths``): ``trunc``
of the samples are forced to the cap (3,072), the rest lognormal (median 550, sigma 0.7)
times a per-prompt factor (sigma 0.4) shared by the G samples and clipped at the cap,
which puts more at it: 6.1% in all at the default 0.045. Per decode step
``simulate`` counts the rows decoded and the KV positions read, as the engine
reads them (every slot, up to the longest active row in ``block`` columns; once
no row waits, the active rows move to a quarter of the slots as they fit, at most
twice, as ``plans.Plan.phases`` does) and, for the lockstep decode, every row over
the whole cache (the old sampler) or up to the longest row; and the columns the ragged
kernel copies on TPU, each row its own blocks (``ragged_prefix``); ``seconds`` turns them
into time: (weight bytes x replicas + KV bytes read + refill copies, each row its
prompt's chunks: ``refill_chunks``) / HBM
bandwidth, a decode step being bandwidth-bound on accelerators.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
  """The real job's rollout shape and the bandwidth model's constants."""

  rows: int = 1024  # Q*G
  samples: int = 8  # G
  prompt_len: int = 512  # P columns every slot holds (the step's longest prompt, padded)
  cap: int = 3072  # max_new_tokens
  block: int = 128  # the engine's KV_BLOCK
  weight_bytes: float = 3.09e9  # Qwen2.5-Math-1.5B in bfloat16
  kv_bytes: float = 28_672  # per position: 2 x 28 layers x 2 kv heads x 128 x 2 bytes
  bandwidth: float = 819e9  # bytes/s (one v5e chip)
  replicas: int = 1  # weight copies read per step (data-parallel sampler replicas)
  shrink: int = 4  # plans.SHRINK: each tail loop has a quarter of the slots
  max_loops: int = 3  # plans.MAX_PHASES (1: no tail loops)
  ragged_block: int = 512  # plans.RAGGED_BLOCK: the ragged kernel's columns per copy
  ragged_align: int = 128  # plans.RAGGED_ALIGN: a row's copies start at its first column
  # rounded down to a multiple of this (and of the block's gcd with it)
  prompt_tokens: int = 0  # a prompt's real tokens, left-padded to prompt_len (0: all of it)
  refill_chunk: int = 128  # slots.REFILL_CHUNK: prompt columns a refill copies at a time


def sample_lengths(
  rng: np.random.Generator,
  shape: Shape,
  median: float = 550,
  sigma: float = 0.7,
  prompt_sigma: float = 0.4,
  trunc: float = 0.045,
) -> np.ndarray:
  """Lengths [B] in row order (the G samples of a prompt adjacent)."""
  Q, G = shape.rows // shape.samples, shape.samples
  f_Q = rng.lognormal(0.0, prompt_sigma, Q)
  L_QG = np.ceil(median * f_Q[:, None] * rng.lognormal(0.0, sigma, (Q, G)))
  L_QG = np.where(rng.random((Q, G)) < trunc, shape.cap, np.clip(L_QG, 1, shape.cap))
  return L_QG.astype(np.int64).reshape(-1)


def _blocks(cols: np.ndarray, block: int) -> np.ndarray:
  return -(-cols // block) * block


def refill_chunks(shape: Shape) -> tuple[int, int]:
  """The chunks a refill copies of one row's prompt and their columns: those of
  ``refill_chunk`` columns, counted from the prompt's end, that hold its real tokens
  (``capo_jax.sampling.slots``); one of the whole prompt when the chunk does not divide it."""
  P = shape.prompt_len
  width = shape.refill_chunk if P % shape.refill_chunk == 0 else P
  return -(-(min(shape.prompt_tokens, P) or P) // max(width, 1)), width


def ragged_prefix(shape: Shape, own: bool = False) -> np.ndarray:
  """[cap + 1]: the columns the ragged kernel copies for one row over its first t decode
  steps, t = 0 .. cap. At step t (0-based) the engine's slot attends to columns
  [P - p, P + max(t, 1)) (``capo_jax.sampling.engine``: prompt of p real tokens
  left-padded to P, then the completion); the kernel copies ``ragged_block``s of
  columns laid from P - p rounded down to u = gcd(``ragged_align``, ``ragged_block``),
  the last cut to the u-column tiles that reach the range's end: the range from that
  edge rounded up to u (``capo_jax.sampling.ragged``). ``own``: the range's columns
  alone, each row's own length (the floor a step's KV read is held to)."""
  P, unit = shape.prompt_len, math.gcd(shape.ragged_align, shape.ragged_block)
  start = P - (min(shape.prompt_tokens, P) or P)
  end_T = P + np.maximum(np.arange(shape.cap), 1)
  base = start - start % unit
  cols_T = end_T - start if own else -(-(end_T - base) // unit) * unit
  return np.concatenate([[0], np.cumsum(cols_T)])


def simulate(lengths: np.ndarray, shape: Shape, slots: int | None) -> dict[str, float]:
  """Steps, row-steps, KV positions read and prompt copies of one rollout.

  ``slots`` None: the lockstep decode (all rows until the longest stops), with
  the full-cache read of the old sampler and the blocked read. Otherwise the
  engine with min(slots, B) slots (B: every row in a slot from the start, then
  the tail loops): slots take rows in order, and every step reads all slots up to
  the longest active row (whole blocks). A row of length l holds
  its slot for l steps. Event-driven: between two rows' ends the active set
  is fixed, so each interval's reads are one vectorised sum.
  """
  P, blk, B = shape.prompt_len, shape.block, lengths.size
  own_total = int((P * lengths + lengths * (lengths + 1) // 2).sum())  # each row its own
  F, F_own = ragged_prefix(shape), ragged_prefix(shape, own=True)
  if slots is None:
    steps = int(lengths.max())
    t = np.arange(1, steps + 1)
    return {
      "steps": steps,
      "row_steps": steps * B,
      "kv_read": B * int(_blocks(P + t, blk).sum()),
      "kv_read_full": steps * B * (P + shape.cap),
      "kv_read_own": own_total,
      "ragged_cols": int(F[lengths].sum()),
      "copies": B,
      "gathered": 0,
    }
  slots = min(slots, B)
  ends: list[tuple[int, int]] = []  # (step the row ends at, slot)
  start: dict[int, int] = {}  # active slot -> the step its row started after
  free, nxt, k, kv = list(range(slots)), 0, 0, 0
  cur, loops, gathered = slots, 1, 0  # the engine's tail loops (plans.Plan.phases)
  # Per loop of the engine: its decode steps, and the KV blocks its steps read per layer
  # (the trip counts of the step's per-layer block loops, summed over its steps).
  phase_steps, phase_blocks = [0] * shape.max_loops, [0] * shape.max_loops
  # And the columns the ragged kernel copies in each loop, over its slots and steps, and
  # the rows' own columns it holds.
  phase_ragged, phase_slots = [0] * shape.max_loops, [slots] * shape.max_loops
  phase_own = [0] * shape.max_loops
  while True:
    while free and nxt < B:
      n = free.pop()
      start[n] = k
      heapq.heappush(ends, (k + int(lengths[nxt]), n))
      nxt += 1
    if not ends:
      break
    while (
      nxt >= B
      and loops < shape.max_loops
      and cur // shape.shrink >= 1
      and len(ends) <= cur // shape.shrink
    ):
      cur //= shape.shrink
      loops += 1
      phase_slots[loops - 1] = cur
      gathered += cur * (P + shape.cap)  # the smaller cache, copied whole
    k1 = ends[0][0]
    ks = np.arange(k + 1, k1 + 1)
    cols = int(_blocks(P + ks - min(start.values()), blk).sum())
    kv += cur * cols
    phase_steps[loops - 1] += len(ks)
    phase_blocks[loops - 1] += cols // blk
    began = np.fromiter(start.values(), np.int64)  # a row's step t = step - began - 1
    phase_ragged[loops - 1] += int((F[k1 - began] - F[k - began]).sum())
    phase_own[loops - 1] += int((F_own[k1 - began] - F_own[k - began]).sum())
    k = k1
    while ends and ends[0][0] == k:
      n = heapq.heappop(ends)[1]
      del start[n]
      free.append(n)
  return {
    "steps": k,
    "row_steps": k * slots,
    "kv_read": kv,
    "kv_read_full": kv,
    "kv_read_own": own_total,
    "ragged_cols": sum(phase_ragged),
    "copies": B,
    "gathered": gathered,
    "phase_steps": phase_steps[:loops],
    "phase_blocks": phase_blocks[:loops],
    "phase_ragged_cols": phase_ragged[:loops],
    "phase_own_cols": phase_own[:loops],
    "phase_slots": phase_slots[:loops],
  }


def seconds(sim: dict[str, float], shape: Shape, read: str = "kv_read") -> float:
  """The bandwidth model: every byte a step reads, over the HBM bandwidth.

  ``read``: "kv_read" (the engine: all slots up to the longest active row),
  "kv_read_full" (the whole cache), "kv_read_own" (each row its own length) or
  "ragged_cols" (each row its own blocks, as the ragged kernel copies them).
  """
  kv = sim[read]
  weights = sim["steps"] * shape.weight_bytes * shape.replicas
  chunks, width = refill_chunks(shape)
  copies = sim["copies"] * chunks * width * 2  # read the prompt cache, write the slot
  copies += sim.get("gathered", 0) * 2  # the tail loops' caches: read and written
  return (weights + (kv + copies) * shape.kv_bytes) / shape.bandwidth


def expected_speedup(shape: Shape, slots: int, seeds: int = 4) -> float:
  """Lockstep (old sampler: full cache) time over the engine's with ``slots``, mean of seeds."""
  ratios = []
  for s in range(seeds):
    L = sample_lengths(np.random.default_rng(s), shape)
    ratios.append(
      seconds(simulate(L, shape, None), shape, read="kv_read_full")
      / seconds(simulate(L, shape, slots), shape)
    )
  return float(np.mean(ratios))
