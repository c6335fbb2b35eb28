r"""Bytes per TPU chip of a CAPO run, the mesh that fits, and the step-time formula.

Prints, per model, one column per TPU slice: the mesh (data x fsdp x tensor)
chosen, every memory term in GiB per chip, the peak against the chip's HBM,
and lower bounds of the step time from HBM bandwidth and peak FLOP/s. The
peer of every number is the chip's HBM (the ``use`` row is the ratio).

  python -m tools.memory_plan                       # 1.5B and 7B, common slices
  python -m tools.memory_plan --slices v5e-16,v4-32 --sample-tok-s 900 --train-tok-s 2500

Assumptions (the code this mirrors, where it exists):
* Params, AdamW moments and gradients float32 (capo_jax/rl/train_step.py); per
  micro-batch the params are cast to bfloat16 once (a sharded copy) and XLA
  gathers one layer at a time under ``lax.scan`` (2 layers in flight). The
  frozen reference policy (CAPO noise mask, or KL with beta > 0) is kept in
  bfloat16, sharded like the policy.
* Train rules shard params over fsdp x tensor; sampling rules keep bfloat16
  params whole on every fsdp replica and split them over tensor only
  (capo_jax/runtime/mesh.py). Batch rows split over data x fsdp (an axis that does
  not divide the rows is replicated, as models/sharding.py does).
* Rollout (capo_jax/sampling/engine.py): one prefill of the Q prompts (their
  prompt cache, Q x P, stays while decoding), then W = ``rollout.max_active_rows``
  rows decode at once over a cache of W slots x (P + C) (continuous batching);
  P and C rounded up as the sampler does. The plan picks W: of B, B/2, ... B/16
  the one whose cache fits with the least expected rollout time, from
  tools/rollout_sim.py's scheduler simulation (long-tailed lengths)
  and bandwidth model per chip. The old sampler's decode loop held a second
  copy of its B-row cache (XLA memory analysis, GPU temp 1.0-1.3 x the cache);
  the engine's loop does not on CPU (temp 1.06-1.14 x its slot cache at W = 64
  / 16, the rest outputs and logits; not checked on TPU), so one copy is counted.
* Train activations with remat: the bfloat16 residual at every layer boundary
  is saved; one layer is recomputed at a time. Attention never holds the T x T
  scores (``models.attention``: splash on TPU, the blocked "flash" elsewhere):
  its working set is one ``ATTN_BLOCK`` x ``ATTN_BLOCK`` block of float32 scores +
  probabilities + gradient (10 bytes per score) per head and row, plus the
  float32 log-sum-exp per head and token; chunked log-probs hold
  ``logprob_chunk`` positions of float32 logits, log-softmax and gradient.
* Shapes: a rollout decodes up to C_max steps; the trainer sees rows of
  T = P_max + C_max tokens (packed rows are that long, ``train.pack_len``'s
  default; unpacked rows at most that), ``micro_batch_size`` rows at a time.
* When no W fits, the plan splits the rollout into 2, 4 or 8 sequential
  ``generate`` calls (fewer prompts at a time), printed as "rollout calls".
* ``--lora-rank R`` (models/lora.py, ``--config.model.lora_rank=R``): the base is
  frozen in bfloat16 (``--config.model.param_dtype=bfloat16``), sharded like
  params, and is also the reference (no second copy); adapters, their AdamW
  moments and gradients are float32; the sampler gets the adapters merged
  into a bfloat16 copy once per step (the same term as without LoRA) and the
  merge holds one layer's float32 product at a time. Activations and their
  gradients are those of full training (the backward still runs through every
  layer); the train FLOPs drop from 3 to 2 forward passes (no weight gradients).
  ``--compare`` prints, per model, the slices that fit with and without LoRA.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import math
import re
from typing import Any

import numpy as np

from capo_jax.sampling import engine
from capo_jax.sampling.sampler import bucket_length
from models import lora, qwen2
from models.config import Qwen2Config
from tools import rollout_sim

GiB = 1024**3
ATTN_BLOCK = 128  # models.config.Qwen2Config.attention_block (splash: VMEM, not HBM)


@dataclasses.dataclass(frozen=True)
class Chip:
  hbm_gib: float
  hbm_gb_s: float  # HBM bandwidth, GB/s
  bf16_tflops: float  # peak dense bfloat16 TFLOP/s


# Per-chip figures of Google's TPU pages (v4, v5e, v5p, v6e / Trillium).
CHIPS = {
  "v4": Chip(32, 1228, 275),
  "v5e": Chip(16, 819, 197),
  "v5p": Chip(95, 2765, 459),
  "v6e": Chip(32, 1640, 918),
}
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
CONFIGS = {"1.5B": "configs.capo_qwen2p5_math_1p5b", "7B": "configs.capo_qwen2p5_math_7b"}
PRESETS = {"1.5B": "qwen2p5_math_1p5b", "7B": "qwen2p5_math_7b"}  # when a config sets hf_path


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


@dataclasses.dataclass(frozen=True)
class Run:
  """The shapes of one RL step, read from a run config."""

  model: Qwen2Config
  num_prompts: int  # Q
  num_samples: int  # G
  max_prompt_len: int
  max_new_tokens: int
  micro_batch_size: int
  logprob_chunk: int
  reference: bool  # a frozen reference policy is kept (CAPO mask or KL)
  ppo_epochs: int = 1
  decode_copies_cache: bool = False  # the engine's loop keeps one cache (module docstring)
  lora: lora.LoraConfig | None = None  # adapters on a frozen base (module docstring)

  @classmethod
  def from_config(cls, c: Any, preset: str = "") -> Run:
    """``preset`` names the architecture when the config has none (only hf_path)."""
    model = getattr(Qwen2Config, c.model.preset or preset)(
      param_dtype=c.model.param_dtype, compute_dtype=c.model.compute_dtype, remat=c.model.remat
    )
    return cls(
      model=model,
      num_prompts=c.rollout.num_prompts,
      num_samples=c.rollout.num_samples,
      max_prompt_len=c.rollout.max_prompt_len,
      max_new_tokens=c.rollout.max_new_tokens,
      micro_batch_size=c.train.micro_batch_size,
      logprob_chunk=c.train.logprob_chunk,
      reference=_uses_reference(c),
      ppo_epochs=c.train.ppo_epochs,
    )


def _uses_reference(c: Any) -> bool:
  """Whether the trainer keeps a reference policy (its own rule: noise mask or KL)."""
  from capo_jax.run.spec import RunSpec

  # Validated against a device count the mesh fits (the plan is for any slice).
  fixed = max(c.mesh.data, 1) * max(c.mesh.fsdp, 1) * max(c.mesh.tensor, 1)
  return RunSpec.from_config(c, policy_given=True, num_devices=fixed).needs_reference


def load_run(model: str) -> Run:
  """The run shapes of the committed config of ``model`` ("1.5B" or "7B")."""
  return Run.from_config(importlib.import_module(CONFIGS[model]).get_config(), PRESETS[model])


def kv_bytes_per_token(cfg: Qwen2Config) -> int:
  """2 (K and V) * L * K * H * bytes of the compute dtype."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.dtype.dtype.itemsize


def with_lora(run: Run, rank: int, targets: str = lora.ALL_TARGETS) -> Run:
  """The run as LoRA: rank ``rank`` adapters (alpha is irrelevant to memory), bf16 base."""
  return dataclasses.replace(
    run,
    model=run.model.replace(param_dtype="bfloat16"),
    reference=False,
    lora=lora.LoraConfig.parse(rank, 1.0, targets),
  )


def adapter_count(run: Run) -> int:
  if run.lora is None:
    return 0
  return qwen2.num_params(lora.adapter_shapes(qwen2.param_shapes(run.model), run.lora))


@functools.lru_cache(maxsize=64)
def param_counts(cfg: Qwen2Config) -> tuple[int, int]:
  """(all params, params of one layer) from ``models.qwen2.param_shapes`` (cached: the
  plan asks for every candidate mesh and W)."""
  shapes = qwen2.param_shapes(cfg)
  return qwen2.num_params(shapes), qwen2.num_params(shapes["layers"]) // cfg.num_layers


def rows_per_chip(rows: int, data: int, fsdp: int) -> int:
  """Rows each chip holds: batch axes that do not divide are replicated over."""
  shards = 1
  for size in (data, fsdp):
    if rows % (shards * size) == 0:
      shards *= size
  return math.ceil(rows / shards)


def kv_slots(run: Run) -> int:
  """Cache slots per row: prompt and generation buffers rounded up as the sampler does."""
  return bucket_length(run.max_prompt_len, 16) + bucket_length(run.max_new_tokens, 16)


def tail_phases(slots: int, rows: int, shards: int) -> tuple[int, ...]:
  """The engine's loops on an accelerator: tail loops only with W < B rows."""
  return engine.tail_phases(slots, shards) if slots < rows else (slots,)


def memory_terms(
  run: Run, data: int, fsdp: int, tensor: int, rollout_chunks: int = 1, slots: int = 0
) -> dict[str, float]:
  """Bytes per chip of each term, plus the phase totals and the peak.

  ``rollout_chunks`` > 1: the Q prompts are sampled in that many sequential
  ``generate`` calls, dividing the rollout terms. ``slots``: the engine's W
  (0: all rows of a call).
  """
  cfg = run.model
  P, P_layer = param_counts(cfg)
  D, F, L, N, K = (
    cfg.hidden_size,
    cfg.intermediate_size,
    cfg.num_layers,
    cfg.num_heads,
    cfg.num_kv_heads,
  )
  V, act = cfg.vocab_size, cfg.dtype.dtype.itemsize
  master = cfg.weight_dtype.dtype.itemsize
  t = tensor
  t_kv = t if K % t == 0 else 1
  shard = fsdp * t
  Q = run.num_prompts // rollout_chunks
  B = Q * run.num_samples
  P_len = bucket_length(run.max_prompt_len, 16)
  S_len = kv_slots(run)
  kv_tok = kv_bytes_per_token(cfg) / t_kv
  q_rows, b_rows = rows_per_chip(Q, data, fsdp), rows_per_chip(min(slots or B, B), data, fsdp)
  r = rows_per_chip(run.micro_batch_size, data, fsdp)
  T = run.max_prompt_len + run.max_new_tokens
  m: dict[str, float] = {}
  # LoRA: the optimizer's params are the adapters; the base is frozen (and the reference).
  trained = adapter_count(run) if run.lora else P
  if run.lora:
    m["frozen base (bf16, = reference)"] = master * P / shard
    m["adapters (f32)"] = 4 * trained / shard
  else:
    m["params (f32 master)"] = master * P / shard
  m["AdamW moments (2 x f32)"] = 2 * 4 * trained / shard
  m["reference (bf16)"] = act * P / shard if run.reference else 0.0
  persistent = sum(m.values())
  # Rollout.
  m["sampling weights (bf16)"] = act * P / t
  m["KV cache (W slots)"] = b_rows * S_len * kv_tok
  m["prompt cache (Q rows)"] = q_rows * P_len * kv_tok
  m["prefill scores"] = q_rows * (N / t * P_len * P_len * 6 + V / t * 4)
  m["decode cache copy"] = m["KV cache (W slots)"] if run.decode_copies_cache else 0.0
  # With W < B the engine gathers the tail's rows into a cache of W/4 slots
  # (engine.Plan.phases). The caches are one buffer per layer and per k / v, so
  # each large one is freed once gathered: one small buffer beside the large
  # cache at the peak (see capo_jax/sampling/engine.py for the measurements).
  tail = tail_phases(min(slots or B, B), B, data * fsdp)
  m["tail loop gather (1 layer)"] = (
    m["KV cache (W slots)"] * tail[1] / tail[0] / (2 * L) if len(tail) > 1 else 0.0
  )
  decode = 3 * b_rows * V / t * 4
  # LoRA's merge into the sampling copy: one layer's float32 A @ B (+ W) at a time.
  m["LoRA merge (1 layer f32)"] = 2 * 4 * P_layer / t if run.lora else 0.0
  # The prefill's stacked cache and its per-layer copy, then the slots beside it.
  rollout = (
    m["sampling weights (bf16)"]
    + m["LoRA merge (1 layer f32)"]
    + m["prompt cache (Q rows)"]
    + max(
      m["prompt cache (Q rows)"] + m["prefill scores"],
      m["KV cache (W slots)"] + m["decode cache copy"] + m["tail loop gather (1 layer)"] + decode,
    )
  )
  # Train.
  # Gradients (and their accumulator) of what trains; the bf16 copy of the
  # weights only where they are not stored in bf16 already.
  m["grads (2 x f32) + bf16 copy"] = (2 * 4 * trained + (act * P if master != act else 0)) / shard
  m["gathered layers + unembed"] = act * (2 * P_layer + V * D) / t
  m["boundary activations"] = L * r * T * D * act
  m["layer working set"] = r * (
    N / t * (ATTN_BLOCK**2 * 10 + T * 4) + T * F / t * act * 4 + T * D * act * 8
  )
  m["log-prob chunk"] = r * run.logprob_chunk * V / t * 4 * 3
  train = sum(
    m[k]
    for k in (
      "grads (2 x f32) + bf16 copy",
      "gathered layers + unembed",
      "boundary activations",
      "layer working set",
      "log-prob chunk",
    )
  )
  m["rollout phase"] = persistent + rollout
  m["train phase"] = persistent + train
  m["peak"] = max(m["rollout phase"], m["train phase"])
  return m


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
  rows: int, samples: int, prompt_len: int, cap: int, slots: int, loops: int
) -> dict[str, float]:
  shape = rollout_sim.Shape(
    rows=rows, samples=samples, prompt_len=prompt_len, cap=cap, max_loops=loops
  )
  lengths = rollout_sim.sample_lengths(np.random.default_rng(0), shape)
  return rollout_sim.simulate(lengths, shape, slots)


def rollout_seconds(
  run: Run, chip: Chip, fsdp: int, tensor: int, chunks: int, slots: int, read: str = "kv_read"
) -> float:
  """Expected rollout seconds per chip: the scheduler simulation of
  tools/rollout_sim.py (long-tailed lengths) through its bandwidth
  model, with this chip's share of the weights and of the W slots' cache.
  ``read="kv_read_full"`` with W = B: the old lockstep sampler."""
  cfg, B = run.model, run.num_prompts * run.num_samples // chunks
  W = min(slots or B, B)
  P_len, C = bucket_length(run.max_prompt_len, 16), run.max_new_tokens
  sim = _simulated(B, run.num_samples, P_len, C, W, len(tail_phases(W, B, fsdp)))
  t_kv = tensor if cfg.num_kv_heads % tensor == 0 else 1
  shape = rollout_sim.Shape(
    rows=B,
    samples=run.num_samples,
    prompt_len=P_len,
    cap=C,
    weight_bytes=cfg.dtype.dtype.itemsize * param_counts(cfg)[0] / tensor,
    kv_bytes=kv_bytes_per_token(cfg) / t_kv * rows_per_chip(W, 1, fsdp) / W,
    bandwidth=chip.hbm_gb_s * 1e9,
  )
  return chunks * rollout_sim.seconds(sim, shape, read)


def plan(run: Run, sl: Slice, headroom: float = 0.9, tensor: int | None = None) -> Plan:
  """The cheapest mesh whose peak fits ``headroom`` x HBM, and the engine's W.

  Candidates: data = 1, tensor in 1, 2, 4, 8 (dividing the chips and the
  heads), fsdp = the rest; the first that fits wins, trying every tensor size
  with one rollout call before splitting the rollout into 2, 4 or 8
  sequential calls. Per mesh, W is the one of B, B/2, ... B/16 that fits
  with the least ``rollout_seconds``. A mesh whose fsdp leaves the micro-batch rows undivided
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
  best = None
  for chunks in (1, 2, 4, 8):
    for t in options:
      fsdp = sl.chips // t
      rows = run.num_prompts * run.num_samples // chunks
      fitting = [
        (rollout_seconds(run, sl.chip, fsdp, t, chunks, n), n)
        for n in (rows >> k for k in range(5))
        if memory_terms(run, 1, fsdp, t, chunks, n)["peak"] <= limit
      ]
      secs, slots = (
        min(fitting)
        if fitting
        else (rollout_seconds(run, sl.chip, fsdp, t, chunks, rows >> 4), rows >> 4)
      )
      terms = memory_terms(run, 1, fsdp, t, chunks, slots)
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
        notes.append(f"tensor={t} does not divide the {cfg.num_kv_heads} KV heads: KV replicated")
      candidate = Plan(
        sl, 1, fsdp, t, chunks, terms, terms["peak"] <= limit, tuple(notes), slots, secs
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
      run, chip, p.fsdp, p.tensor, p.rollout_chunks, 0, "kv_read_full"
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
    if args.compare:
      print(fit_summary(model, run, slices, args.headroom, args.lora_rank, args.lora_targets))
      continue
    if args.lora_rank:
      run = with_lora(run, args.lora_rank, args.lora_targets)
    print(_table(model, run, [plan(run, s, args.headroom) for s in slices], args.headroom, rates))
    print()


if __name__ == "__main__":
  main()
