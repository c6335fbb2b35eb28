"""The step-time estimate of ``aot_tpu.py``: each compiled program's loops by their own trip
counts, at the README's length model.

The compiled programs carry loops whose trip count is known only at run time: the
engine's decode loops (one per tail phase; inside each, one KV-block loop per layer
and, in the first, the refill copies) and the train step's micro-batch loop.
``hlo_cost.loop_tree`` gives the cost of one iteration of each; this module weights
them by what the rollout would do:

* decode: the scheduler simulation (``tools.rollout_sim.simulate``) of one
  sampler call's rows at the length model (lognormal median 550, sigma 0.7,
  per-prompt sigma 0.4, ``--trunc`` of the samples forced to the cap) gives each phase's
  steps and KV blocks read (the block loops' trip counts, summed); each row's prompt
  is copied into a slot once, a loop iteration per chunk of 128 columns that holds its
  tokens (the refill loop: ``rollout_sim.refill_chunks``, 2 for prompts of 200
  tokens). On TPU the ragged kernel reads each
  slot's own blocks: the same simulation, every prompt ``prompt_tokens`` long
  left-padded to the compiled P, gives the columns a slot copies per step in each
  loop (idle slots none), by which ``hlo_cost.with_ragged_cols`` counts its keys and
  values.
* log-prob passes and train step: the same lengths plus ``prompt_tokens`` a prompt,
  packed first-fit into the run's rows (``packing.first_fit``), give the calls of a
  pass and the micro-batches of each update, and the share of splash attention's causal
  block pairs the rows compute (``splash_pair_share``: the blocks two sequences meet in
  are skipped, ``models.splash_blocks``).

Per program, the time is a range (``tools/aot_tpu.py`` prints both ends): optimistic,
max(FLOPs / peak, HBM bytes / HBM bandwidth) per device, summed over its calls (the
whole program one roofline, on-chip traffic free, collectives hidden); honest, each
operation's own roofline with on-chip, host and inter-chip traffic timed, summed
(``hlo_cost``'s ``op_honest_s``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from capo_jax.rl import packing
from capo_jax.run import hlo_cost
from capo_jax.sampling import plans
from models.attention import SPLASH_BLOCK, splash_width
from tools import rollout_sim


@dataclasses.dataclass(frozen=True)
class Lengths:
  """The length model (``rollout_sim.sample_lengths``'s) and the prompts' tokens."""

  prompt_tokens: int = 200
  trunc: float = 0.045
  seeds: int = 4
  # Shared prompts (``model.shared_prompts``): a group's prompt laid once a chunk, at most
  # ``prompt_cap`` prompt tokens a row (``packing.plan``); False: each sequence whole.
  shared: bool = False
  prompt_cap: int = 0


@dataclasses.dataclass(frozen=True)
class Trips:
  """Expected trip counts of one RL step's loops (means over the seeds)."""

  phase_steps: tuple[float, ...]  # decode steps of each engine loop, per sampler call
  phase_blocks: tuple[float, ...]  # KV blocks read per layer, summed over those steps
  refills: float  # rows copied into slots per sampler call
  logprob_calls: float  # calls of one log-prob pass per step
  microbatches: float  # micro-batches per update
  real_token_fraction: float  # real tokens / the rows' token slots
  # Columns the ragged kernel copies per slot and step in each engine loop (its slots'
  # mean, idle ones included): () when the length model gives none.
  phase_cols: tuple[float, ...] = ()
  # Refill loop iterations per row copied: the chunks of its prompt that hold tokens.
  refill_chunks: float = 1.0
  prompt_tokens: int = 200  # each prompt's tokens in the length model (``Lengths``)
  # The rows' own columns per slot and step in each loop (prompt tokens + completion so
  # far, idle slots none): what the decode's KV floor holds a step to.
  phase_own_cols: tuple[float, ...] = ()
  # The share of splash attention's causal block pairs the packed rows compute.
  splash_pairs: float = 1.0


def trips(sh: Any, phases: int, slots: int, updates: int, lengths: Lengths) -> Trips:
  """``sh``: ``capo_jax.run.aot_programs.Shapes`` of the run."""
  rows_call = sh.prompts_per_call * sh.num_samples
  shape = rollout_sim.Shape(
    rows=rows_call,
    samples=sh.num_samples,
    prompt_len=sh.prompt_len,
    cap=sh.max_new_tokens,
    max_loops=phases,
    ragged_block=plans.RAGGED_BLOCK,
    ragged_align=plans.RAGGED_ALIGN,
    prompt_tokens=lengths.prompt_tokens,
  )
  steps, blocks, cols, own, calls, mbs, fill, pairs = [], [], [], [], [], [], [], []
  for seed in range(lengths.seeds):
    rng = np.random.default_rng(seed)
    per_call = [
      rollout_sim.sample_lengths(rng, shape, trunc=lengths.trunc) for _ in range(sh.num_calls)
    ]
    sims = [rollout_sim.simulate(L, shape, slots) for L in per_call]
    steps.append(np.sum([_pad(s.get("phase_steps", [s["steps"]]), phases) for s in sims], 0))
    blocks.append(
      np.sum(
        [
          _pad(s.get("phase_blocks", [s["kv_read"] // max(rows_call, 1) // shape.block]), phases)
          for s in sims
        ],
        0,
      )
      / sh.num_calls
    )
    slot_steps = np.sum(
      [
        _pad(s.get("phase_steps", [s["steps"]]), phases)
        * _pad(s.get("phase_slots", [rows_call]), phases)
        for s in sims
      ],
      0,
    )
    copied = np.sum([_pad(s.get("phase_ragged_cols", [s["ragged_cols"]]), phases) for s in sims], 0)
    cols.append(copied / np.maximum(slot_steps, 1))
    held = np.sum([_pad(s.get("phase_own_cols", [0]), phases) for s in sims], 0)
    own.append(held / np.maximum(slot_steps, 1))
    steps[-1] = steps[-1] / sh.num_calls
    p = min(lengths.prompt_tokens, sh.max_prompt_len)
    comp = np.concatenate(per_call)
    rows = lambda c: layout(p, c, sh.row_len, sh.num_samples, lengths)  # noqa: E731
    laid_R = rows(comp)
    n_rows, laid = len(laid_R), sum(map(sum, laid_R))
    calls.append(-(-n_rows // sh.rows_per_call))
    per_update = np.array_split(comp, updates)
    mbs.append(np.mean([-(-len(rows(u)) // sh.rows_per_microbatch) for u in per_update]))
    fill.append(laid / (n_rows * sh.row_len))
    pairs.append(splash_pair_share(laid_R, sh.row_len, splash_width(sh.row_len, SPLASH_BLOCK)))
  return Trips(
    tuple(np.mean(steps, 0)),
    tuple(np.mean(blocks, 0)),
    rows_call / 1.0,
    float(np.mean(calls)),
    float(np.mean(mbs)),
    float(np.mean(fill)),
    tuple(np.mean(cols, 0)),
    float(rollout_sim.refill_chunks(shape)[0]),
    lengths.prompt_tokens,
    tuple(np.mean(own, 0)),
    float(np.mean(pairs)),
  )


def layout(p: int, comp: np.ndarray, row_len: int, G: int, lengths: Lengths) -> list[list[int]]:
  """The packed rows of completions ``comp`` (each after a ``p``-token prompt, G a
  prompt), each as its segments' lengths in column order: each sequence whole, or with
  shared prompts a group's prompt once a chunk, then its completions (each of them a
  segment of the own splash call: ``models.shared_prefix``)."""
  B = len(comp)
  if not lengths.shared:
    row_B, start_B = packing.first_fit(p + comp, row_len)
    return [
      list(p + comp[np.flatnonzero(row_B == r)][np.argsort(start_B[row_B == r])])
      for r in range(int(row_B.max()) + 1)
    ]
  p_B, group_B = np.full(B, p), np.arange(B) // G
  chunks, row_K, start_K = packing._chunks(p_B, comp, row_len, group_B, lengths.prompt_cap)  # noqa: SLF001
  rows: list[list[int]] = [[] for _ in range(int(row_K.max()) + 1)]
  for k in np.argsort(start_K, kind="stable"):
    rows[row_K[k]] += [p] + [int(comp[b]) for b in chunks[k]]
  return rows


def splash_pair_share(rows: list[list[int]], row_len: int, block: int) -> float:
  """The share of the causal (query block, key block) pairs of ``row_len``-token rows that
  splash computes once each row skips the pairs two of its segments meet in
  (``models.splash_blocks``' rule: blocks meet when the ranges of their segments
  intersect, or both hold tail padding). ``rows``: each row's segment lengths in order."""
  X = -(-row_len // block)
  causal = np.tril(np.ones((X, X), bool))
  met = 0
  for lengths in rows:
    ids = np.zeros(X * block, np.int64)
    ids[: sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    ids_XB = ids.reshape(X, block)
    real = ids_XB > 0
    lo = np.where(real, ids_XB, np.iinfo(np.int64).max).min(1)
    hi = np.where(real, ids_XB, 0).max(1)
    pad = (~real).any(1)
    meet = (lo[:, None] <= hi[None, :]) & (lo[None, :] <= hi[:, None]) | (
      pad[:, None] & pad[None, :]
    )
    met += int((meet & causal).sum())
  return met / max(len(rows) * int(causal.sum()), 1)


def _pad(xs: list[float], n: int) -> np.ndarray:
  return np.array(list(xs) + [0.0] * (n - len(xs)), np.float64)[:n]


def _add(acc: dict[str, float], cost: dict[str, float], w: float) -> None:
  for k in hlo_cost.KEYS:
    acc[k] = acc.get(k, 0.0) + w * cost.get(k, 0.0)


def _ragged(
  loop: hlo_cost.Loop, t: Trips, i: int, rates: hlo_cost.Rates | None
) -> tuple[dict[str, float], hlo_cost.Ops]:
  """One iteration of decode loop ``i`` with its ragged calls' keys and values at the
  length model's columns per slot (``Trips.phase_cols``), and its operations' table."""
  if not any(loop.cost.get(k) for k in hlo_cost.COL_KEYS):
    return loop.cost, loop.ops
  if i >= len(t.phase_cols):
    raise ValueError(
      f"decode loop {i}: ragged attention calls, but Trips.phase_cols has no columns "
      "per slot for it (step_estimate.trips gives them)"
    )
  ops = {label: list(row) for label, row in loop.ops.items()}
  return hlo_cost.with_ragged_cols(loop.cost, t.phase_cols[i], rates, ops), ops


def _parts(
  name: str, root: hlo_cost.Loop, t: Trips, rates: hlo_cost.Rates | None
) -> list[tuple[dict[str, float], hlo_cost.Ops, float]]:
  """The pieces of one call of program ``name`` (``hlo_cost.loop_tree``'s), each with its
  operations' table and the times it runs a call: the decode loops by their steps,
  their block loops by the blocks read, the refill loop by the prompt chunks copied;
  the train step's micro-batch loop by the micro-batches."""
  parts = [(root.cost, root.ops, 1.0)]
  loops = root.nested
  if name == "decode":
    if len(loops) > len(t.phase_steps):
      raise ValueError(f"decode: {len(loops)} unbounded loops, {len(t.phase_steps)} phases")
    for i, loop in enumerate(loops):
      parts.append((*_ragged(loop, t, i, rates), t.phase_steps[i]))
      for inner in loop.nested:
        chunks = t.refills * t.refill_chunks  # an iteration a chunk of a row's prompt
        parts.append((inner.cost, inner.ops, chunks if inner.in_conditional else t.phase_blocks[i]))
  elif name == "train":
    if len(loops) > 1 or any(loop.nested for loop in loops):
      raise ValueError(f"train: expected one micro-batch loop, got {len(loops)}")
    parts += [(loop.cost, loop.ops, t.microbatches) for loop in loops]
  elif loops:
    raise ValueError(f"{name}: {len(loops)} loops without a constant trip count")
  return parts


def weighted(
  name: str, text: str, t: Trips, rates: hlo_cost.Rates | None = None
) -> tuple[dict[str, float], hlo_cost.Ops]:
  """Per-device FLOPs, bytes and collective bytes of one call of program ``name`` with its
  unbounded loops at their expected trips, and with ``rates`` its per-operation table
  (``hlo_cost.OP_PARTS`` by label, weighted alike); for decode also ``step_bytes`` (HBM
  bytes of one step of the first loop, its blocks included), ``step_onchip_bytes`` (what
  that step moves on chip, ``hlo_cost``) and ``blocks_per_step``. ``rates``: also the
  per-operation roofline sums (``hlo_cost.hlo_cost``). Ragged decode attention: each
  loop's calls at ``Trips.phase_cols``; ``step_ragged_bytes`` what they read in that
  step, ``step_ragged_whole_bytes`` what they would with every slot's whole cache;
  ``refill_bytes`` / ``refill_collective_bytes`` one iteration of the refill loop (one
  chunk of a row's prompt)."""
  root = hlo_cost.loop_tree(text, rates, t.splash_pairs)
  out: dict[str, float] = {}
  ops: hlo_cost.Ops = {}
  for cost, part_ops, w in _parts(name, root, t, rates):
    _add(out, cost, w)
    hlo_cost.add_ops(ops, part_ops, w)
  if name != "decode":
    return out, ops
  loops = root.nested
  blocks = t.phase_blocks[0] / max(t.phase_steps[0], 1.0)
  step = {}
  _add(step, _ragged(loops[0], t, 0, rates)[0], 1.0)
  for inner in loops[0].nested:
    if not inner.in_conditional:
      _add(step, inner.cost, blocks)
  out["step_bytes"], out["blocks_per_step"] = step["bytes"], blocks
  out["step_onchip_bytes"] = step["onchip_bytes"]
  out["step_ragged_bytes"] = step["ragged_bytes"]
  whole = loops[0].cost.get("ragged_cache_cols", 0.0)  # every slot its whole cache
  out["step_ragged_whole_bytes"] = loops[0].cost.get("ragged_col_hbm", 0.0) * whole
  out["ragged_cols_per_step"] = t.phase_cols[0] if step["ragged_bytes"] else 0.0
  # Each row's own columns at the same bytes per column: the KV floor of a step.
  own_cols = t.phase_own_cols[0] if t.phase_own_cols else 0.0
  out["step_own_kv_bytes"] = loops[0].cost.get("ragged_col_hbm", 0.0) * own_cols
  refill = {}
  for inner in loops[0].nested:
    if inner.in_conditional:
      _add(refill, inner.cost, 1.0)
  out["refill_bytes"] = refill.get("bytes", 0.0)
  out["refill_collective_bytes"] = refill.get("collective_bytes", 0.0)
  return out, ops


def weighted_cost(
  name: str, text: str, t: Trips, rates: hlo_cost.Rates | None = None
) -> dict[str, float]:
  """``weighted``'s cost alone."""
  return weighted(name, text, t, rates)[0]
