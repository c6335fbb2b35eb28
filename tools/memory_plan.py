r"""Bytes per TPU chip of a CAPO run, the mesh that fits, and the step-time formula.

Prints, per model, one column per TPU slice: the mesh (data x fsdp x tensor)
chosen, every memory term in GiB per chip, the peak against the chip's HBM,
and lower bounds of the step time from HBM bandwidth and peak FLOP/s. The
peer of every number is the chip's HBM (the ``use`` row is the ratio).

  python -m tools.memory_plan                       # 1.5B and 7B, common slices
  python -m tools.memory_plan --slices v5e-16,v4-32 --sample-tok-s 900 --train-tok-s 2500

The memory terms and their assumptions: ``tools/memory_terms.py``; the chips and slices:
``tools/tpu_chips.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from typing import Any

import numpy as np

from capo_jax.runtime import mesh as mesh_lib
from capo_jax.sampling.sampler import bucket_length
from models import lora
from models.config import REMAT_POLICIES, Qwen2Config
from tools import rollout_sim
from tools.memory_terms import (
  CONFIGS,
  Run,
  adapter_count,
  attention_rows_per_chip,
  kv_bytes_per_token,
  kv_slots,
  load_run,
  memory_terms,
  param_counts,
  sampling_group,
  sampling_weight_params,
  tail_phases,
  with_lora,
)
from tools.tpu_chips import DEFAULT_SLICES, Chip, Slice, parse_slice

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Plan:
  slice: Slice
  data: int
  fsdp: int
  tensor: int
  rollout_chunks: int
  terms: dict[str, float]
  fits: bool
  notes: tuple[str, ...]
  slots: int = 0  # the engine's W (rollout.max_active_rows) per generate call
  rollout_s: float = 0.0  # expected (bandwidth-bound) rollout seconds
  sampling_tensor: int = 1  # the sampler's tensor group (memory_terms.sampling_group)

  @property
  def mesh_overrides(self) -> str:
    """Config flags that build this mesh (empty when the config's defaults do)."""
    if self.data == 1 and self.tensor == 1:
      return ""
    return (
      f"--config.mesh.data={self.data} --config.mesh.fsdp=-1 --config.mesh.tensor={self.tensor}"
    )


@functools.lru_cache(maxsize=256)
def _simulated(
  rows: int, samples: int, prompt_len: int, cap: int, slots: int | None, loops: int
) -> dict[str, float]:
  shape = rollout_sim.Shape(
    rows=rows, samples=samples, prompt_len=prompt_len, cap=cap, max_loops=loops
  )
  lengths = rollout_sim.sample_lengths(np.random.default_rng(0), shape)
  return rollout_sim.simulate(lengths, shape, slots)


def rollout_seconds(
  run: Run,
  chip: Chip,
  fsdp: int,
  tensor: int,
  chunks: int,
  slots: int,
  read: str = "ragged_cols",
  group: int = 0,
) -> float:
  """Expected rollout seconds per chip: the scheduler simulation of
  tools/rollout_sim.py (long-tailed lengths) through its bandwidth
  model, with this chip's share of the weights and of the W slots' cache on the
  sampler's mesh (``group``: its tensor group, 0: ``tensor``). ``read``: the KV
  columns a step reads (``rollout_sim.seconds``): by default each active row's own
  blocks, as the ragged kernel copies them on TPU; ``"kv_read_full"``: the old
  lockstep sampler (all B rows over the whole cache, no tail loops)."""
  cfg, B = run.model, run.num_prompts * run.num_samples // chunks
  W, g = min(slots or B, B), group or tensor
  groups = fsdp * tensor // g  # the sampler's row shards
  P_len, C = bucket_length(run.max_prompt_len, 16), run.max_new_tokens
  t_q = mesh_lib.tensor_split(cfg, g)[1]
  lockstep = read == "kv_read_full"  # the old sampler: no slots, no tail loops
  loops = 1 if lockstep else len(tail_phases(W, groups * t_q))
  sim = _simulated(B, run.num_samples, P_len, C, None if lockstep else W, loops)
  shape = rollout_sim.Shape(
    rows=B,
    samples=run.num_samples,
    prompt_len=P_len,
    cap=C,
    weight_bytes=cfg.dtype.dtype.itemsize * sampling_weight_params(cfg, g),
    kv_bytes=kv_bytes_per_token(cfg)
    / math.gcd(g, cfg.num_kv_heads)
    * attention_rows_per_chip(W, groups, cfg, g)
    / W,
    bandwidth=chip.hbm_gb_s * 1e9,
  )
  return chunks * rollout_sim.seconds(sim, shape, read)


def plan(run: Run, sl: Slice, headroom: float = 0.9, tensor: int | None = None) -> Plan:
  """The cheapest mesh whose peak fits ``headroom`` x HBM, and the engine's W.

  Candidates: data = 1, tensor in 1, 2, 4, 8 (dividing the chips and the
  heads), fsdp = the rest; the first that fits wins, trying every tensor size
  with one rollout call before splitting the rollout into 2, 4 or 8
  sequential calls. Per mesh, W is the one of B, B/2, ... B/16 that fits
  with the least ``rollout_seconds``. The sampler's weights, heads and rows follow its own
  mesh, its tensor group the run's (``sampling_group``), whatever the train mesh. A mesh
  whose fsdp leaves the micro-batch rows undivided
  (so they replicate) only wins when nothing else fits. With nothing
  fitting, the smallest peak is returned with ``fits`` False.
  """
  cfg = run.model
  limit = headroom * sl.chip.hbm_gib * GiB
  options = (
    [tensor]
    if tensor
    else [t for t in (1, 2, 4, 8) if sl.chips % t == 0 and cfg.num_heads % t == 0]
  )
  if not options:
    raise ValueError(f"no tensor size divides {sl.chips} chips and {cfg.num_heads} heads")
  g = sampling_group(run, sl.chips, sl.hosts)
  best = None
  for chunks in (1, 2, 4, 8):
    for t in options:
      fsdp = sl.chips // t
      rows = run.num_prompts * run.num_samples // chunks
      fitting = [
        (rollout_seconds(run, sl.chip, fsdp, t, chunks, n, group=g), n)
        for n in (rows >> k for k in range(5))
        if memory_terms(run, 1, fsdp, t, chunks, n, g)["peak"] <= limit
      ]
      secs, slots = (
        min(fitting)
        if fitting
        else (rollout_seconds(run, sl.chip, fsdp, t, chunks, rows >> 4, group=g), rows >> 4)
      )
      terms = memory_terms(run, 1, fsdp, t, chunks, slots, g)
      notes = []
      if chunks > 1:
        notes.append(
          f"needs the rollout in {chunks} sequential generate calls of "
          f"{run.num_prompts // chunks} prompts"
        )
      if run.micro_batch_size % fsdp:
        notes.append(
          f"micro_batch_size={run.micro_batch_size} is not divisible by fsdp={fsdp}:"
          f" rows replicate; use --config.train.micro_batch_size={fsdp}"
        )
      if cfg.num_kv_heads % t:
        notes.append(
          f"tensor={t} does not divide the {cfg.num_kv_heads} KV heads: the train mesh "
          "replicates their weights"
        )
      candidate = Plan(
        sl, 1, fsdp, t, chunks, terms, terms["peak"] <= limit, tuple(notes), slots, secs, g
      )
      if candidate.fits and (chunks > 1 or not notes):
        return candidate
      if best is None or (candidate.fits, -terms["peak"]) > (best.fits, -best.terms["peak"]):
        best = candidate
  return best


def flops_per_token(cfg: Qwen2Config, seq_len: int) -> tuple[float, float]:
  """(forward, forward + backward) FLOPs per token: 2 per weight MAC plus attention
  over the whole sequence (QK and PV, every T x S score, as a dense count; the blocked
  attentions skip the blocks above the diagonal, about half of it)."""
  P, _ = param_counts(cfg)
  # The embedding lookup costs nothing, the unembedding V * D MACs: tied, P counts it once.
  matmul = P - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
  attn = 2 * 2 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
  fwd = 2 * matmul + attn
  return fwd, 3 * fwd


def step_time_bounds(run: Run, p: Plan) -> dict[str, float]:
  """Lower bounds in seconds: the rollout from HBM bandwidth (``rollout_seconds``:
  the engine with the plan's W, and the old lockstep sampler reading the whole
  B-row cache for the longest row's steps), log-prob and train passes from peak
  bfloat16 FLOP/s. Communication and the prefill are left out."""
  cfg, chip, n = run.model, p.slice.chip, p.slice.chips
  B = run.num_prompts * run.num_samples
  T = run.max_prompt_len + run.max_new_tokens
  fwd, train = flops_per_token(cfg, T)
  if run.lora:
    train = 2 * fwd  # no weight gradients: forward + the activations' backward
  passes = 1 + int(run.reference)  # old log-probs (+ reference log-probs)
  peak = chip.bf16_tflops * 1e12 * n
  return {
    "rollout": p.rollout_s,
    "rollout, lockstep": rollout_seconds(
      run, chip, p.fsdp, p.tensor, p.rollout_chunks, 0, "kv_read_full", p.sampling_tensor
    ),
    "log-probs": passes * B * T * fwd / peak,
    "train": run.ppo_epochs * B * T * train / peak,
  }


def step_time(
  run: Run,
  n_chips: int,
  sample_tok_s: float | None,
  logprob_tok_s: float | None,
  train_tok_s: float | None,
) -> float | None:
  """Expected seconds per RL step from measured per-chip throughputs:

    t = Q*G*C / (n * sample) + passes * Q*G*T / (n * logprob) + epochs * Q*G*T / (n * train)

  with C = max_new_tokens (padded decode), T = max_prompt_len + max_new_tokens,
  passes = 1 (old) + 1 if a reference is kept. None while a rate is unmeasured.
  """
  if not (sample_tok_s and logprob_tok_s and train_tok_s):
    return None
  B = run.num_prompts * run.num_samples
  T = run.max_prompt_len + run.max_new_tokens
  passes = 1 + int(run.reference)
  return (
    B * run.max_new_tokens / (n_chips * sample_tok_s)
    + passes * B * T / (n_chips * logprob_tok_s)
    + run.ppo_epochs * B * T / (n_chips * train_tok_s)
  )


def _table(model: str, run: Run, plans: list[Plan], headroom: float, rates: dict[str, Any]) -> str:
  cols = [p.slice.name.replace("v5litepod", "v5e") for p in plans]
  width = max(11, *(len(c) + 2 for c in cols))
  lines = []
  row = lambda label, vals: lines.append(f"{label:<30}" + "".join(f"{v:>{width}}" for v in vals))
  P, _ = param_counts(run.model)
  if run.lora:
    model += (
      f" LoRA rank {run.lora.rank} on {','.join(run.lora.targets)} "
      f"({adapter_count(run) / 1e6:.1f} M adapter params)"
    )
  lines.append(
    f"== Qwen2.5-Math-{model}: {P / 1e9:.3f} B params, Q={run.num_prompts} x "
    f"G={run.num_samples}, prompt {run.max_prompt_len} + response "
    f"{run.max_new_tokens} tokens, micro-batch {run.micro_batch_size}; KV "
    f"{kv_bytes_per_token(run.model)} B/token x {kv_slots(run)} slots/row"
  )
  row("slice", cols)
  row("chips / hosts", [f"{p.slice.chips}/{p.slice.hosts}" for p in plans])
  row("mesh data x fsdp x tensor", [f"{p.data}x{p.fsdp}x{p.tensor}" for p in plans])
  row("sampler tensor group", [str(p.sampling_tensor) for p in plans])
  row("rollout calls per step", [str(p.rollout_chunks) for p in plans])
  row("active rows W (KV slots)", [str(p.slots) for p in plans])
  for key in plans[0].terms:
    if key == "peak":
      continue
    row(f"  {key} GiB", [f"{p.terms[key] / GiB:.2f}" for p in plans])
  row("peak GiB per chip", [f"{p.terms['peak'] / GiB:.2f}" for p in plans])
  row("HBM GiB per chip", [f"{p.slice.chip.hbm_gib:g}" for p in plans])
  row("use = peak / HBM", [f"{p.terms['peak'] / (p.slice.chip.hbm_gib * GiB):.2f}" for p in plans])
  row(f"fits (<= {headroom:.0%} of HBM)", ["yes" if p.fits else "NO" for p in plans])
  for key in ("rollout", "rollout, lockstep", "log-probs", "train"):
    row(f"lower bound {key} s", [f"{step_time_bounds(run, p)[key]:.1f}" for p in plans])
  expected = [step_time(run, p.slice.chips, **rates) for p in plans]
  todo = any(e is None for e in expected)
  row(
    "expected step s" + (" TODO(measured)" if todo else ""),
    ["-" if e is None else f"{e:.0f}" for e in expected],
  )
  for p, col in zip(plans, cols):
    flags = p.mesh_overrides + f" --config.rollout.max_active_rows={p.slots}"
    for note in (f"flags: {flags.strip()}",) + p.notes:
      if note:
        lines.append(f"  {col}: {note}")
  return "\n".join(lines)


def fit_summary(
  model: str, run: Run, slices: list[Slice], headroom: float, rank: int, targets: str
) -> str:
  """Per slice: peak GiB per chip and whether it fits, full training vs LoRA rank ``rank``."""
  lines = [
    f"== Qwen2.5-Math-{model}: peak GiB per chip (mesh, rollout calls); * = fits in "
    f"{headroom:.0%} of HBM"
  ]
  runs = {"full": run, f"LoRA r={rank}": with_lora(run, rank or 64, targets)}
  for name, r in runs.items():
    cells = []
    for sl in slices:
      p = plan(r, sl, headroom)
      cells.append(
        f"{sl.name.replace('v5litepod', 'v5e')}: {p.terms['peak'] / GiB:.1f}"
        f" ({p.data}x{p.fsdp}x{p.tensor}, {p.rollout_chunks}){'*' if p.fits else ''}"
      )
    lines.append(f"  {name:<10} " + "; ".join(cells))
  return "\n".join(lines)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="1.5B,7B", help="comma list of " + ",".join(CONFIGS))
  ap.add_argument("--slices", default=",".join(DEFAULT_SLICES))
  ap.add_argument(
    "--decode-copy",
    action="store_true",
    help="plan for a decode loop that keeps a second copy of its cache",
  )
  ap.add_argument(
    "--headroom",
    type=float,
    default=0.9,
    help="fraction of HBM the plan may use (XLA temporaries, fragmentation)",
  )
  ap.add_argument(
    "--sample-tok-s",
    type=float,
    default=None,
    help="measured generated tokens/s per chip (TODO(measured))",
  )
  ap.add_argument(
    "--logprob-tok-s",
    type=float,
    default=None,
    help="measured forward tokens/s per chip (TODO(measured))",
  )
  ap.add_argument(
    "--train-tok-s",
    type=float,
    default=None,
    help="measured train (fwd+bwd) tokens/s per chip (TODO(measured))",
  )
  ap.add_argument(
    "--lora-rank",
    type=int,
    default=0,
    help="plan a LoRA run of this rank (bf16 frozen base; module docstring)",
  )
  ap.add_argument("--lora-targets", default=lora.ALL_TARGETS)
  ap.add_argument(
    "--remat-policy",
    choices=REMAT_POLICIES,
    default=None,
    help="plan with this model.remat_policy (default: the run file's)",
  )
  ap.add_argument(
    "--compare",
    action="store_true",
    help="only list the slices that fit, full training vs --lora-rank",
  )
  args = ap.parse_args()
  rates = dict(
    sample_tok_s=args.sample_tok_s, logprob_tok_s=args.logprob_tok_s, train_tok_s=args.train_tok_s
  )
  slices = [parse_slice(s) for s in args.slices.split(",")]
  for model in args.models.split(","):
    if model not in CONFIGS:
      raise SystemExit(f"--models: unknown model {model!r}; known: {', '.join(CONFIGS)}")
    run = dataclasses.replace(load_run(model), decode_copies_cache=args.decode_copy)
    if args.remat_policy:
      policy = args.remat_policy
      run = dataclasses.replace(run, model=dataclasses.replace(run.model, remat_policy=policy))
    if args.compare:
      print(fit_summary(model, run, slices, args.headroom, args.lora_rank, args.lora_targets))
      continue
    if args.lora_rank:
      run = with_lora(run, args.lora_rank, args.lora_targets)
    print(_table(model, run, [plan(run, s, args.headroom) for s in slices], args.headroom, rates))
    print()


if __name__ == "__main__":
  main()
