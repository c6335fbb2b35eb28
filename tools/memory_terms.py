r"""Bytes per TPU chip of each memory term of a CAPO run on a data x fsdp x tensor mesh:
what ``tools/memory_plan.py`` picks the mesh and the rollout's slots by.

Assumptions (the code this mirrors, where it exists):
* Params, AdamW moments and gradients float32 (capo_jax/rl/train_step.py); per
  micro-batch the params are cast to bfloat16 once (a sharded copy) and XLA
  gathers one layer at a time under ``lax.scan`` (2 layers in flight). The
  frozen reference policy (CAPO noise mask, or KL with beta > 0) is kept in
  bfloat16, sharded like the policy.
* Train rules shard params over fsdp x tensor. The sampler has a mesh of its own over
  the same chips (``capo_jax.runtime.mesh.sampling_mesh``): its bfloat16 weights split
  over a tensor group of g chips (``config.mesh.sampling_tensor``, 0: one host's chips,
  ``mesh.auto_sampling_tensor``: 4 on v4), whole on each of the n / g groups, which
  split the rollout's rows; the attention's weights and the kv heads split over
  gcd(g, K) chips, the rest of the group splitting the KV cache's rows
  (``mesh.tensor_split``, ``sampling_group``). Batch rows split over data x fsdp
  (an axis that does not divide the rows is replicated, as models/sharding.py does).
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
  is saved; one layer is recomputed at a time. ``model.remat_policy="projections"`` also keeps
  each layer's q / k / v / o / gate / up outputs (the backward then recomputes norms,
  activations and attention, not the projections). Attention never holds the T x T
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

import dataclasses
import functools
import importlib
import math
import types
from typing import Any

from capo_jax.runtime import mesh as mesh_lib
from capo_jax.sampling import plans
from capo_jax.sampling.sampler import bucket_length
from models import lora, qwen2
from models.config import Qwen2Config

ATTN_BLOCK = 128  # models.config.Qwen2Config.attention_block (splash: VMEM, not HBM)
CONFIGS = {"1.5B": "configs.capo_qwen2p5_math_1p5b", "7B": "configs.capo_qwen2p5_math_7b"}
PRESETS = {"1.5B": "qwen2p5_math_1p5b", "7B": "qwen2p5_math_7b"}  # when a config sets hf_path


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
  sampling_tensor: int = 0  # config.mesh.sampling_tensor: the sampler's group (0: auto)
  gather_once: bool = False  # config.mesh.gather_once: a whole bf16 copy per pass / update
  reduce_once: bool = False  # config.mesh.reduce_once: each chip's f32 gradient of it
  # config.mesh.logprob_data_parallel: the passes' copy whole on every chip
  logprob_data_parallel: bool = False

  @classmethod
  def from_config(cls, c: Any, preset: str = "") -> Run:
    """``preset`` names the architecture when the config has none (only hf_path)."""
    model = getattr(Qwen2Config, c.model.preset or preset)(
      param_dtype=c.model.param_dtype,
      compute_dtype=c.model.compute_dtype,
      remat=c.model.remat,
      remat_policy=c.model.remat_policy,
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
      sampling_tensor=c.mesh.sampling_tensor,
      gather_once=c.mesh.gather_once,
      reduce_once=c.mesh.reduce_once,
      logprob_data_parallel=c.mesh.logprob_data_parallel,
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
  return qwen2.num_params(lora.adapter_shapes(_param_shapes(run.model), run.lora))


@functools.lru_cache(maxsize=64)
def _param_shapes(cfg: Qwen2Config) -> Any:
  """``models.qwen2.param_shapes``, once per config: tracing the model's init takes ~0.1 s,
  and the plan asks for every candidate mesh and W (read only)."""
  return qwen2.param_shapes(cfg)


def param_counts(cfg: Qwen2Config) -> tuple[int, int]:
  """(all params, params of one layer)."""
  shapes = _param_shapes(cfg)
  return qwen2.num_params(shapes), qwen2.num_params(shapes["layers"]) // cfg.num_layers


def sampling_weight_params(cfg: Qwen2Config, group: int) -> float:
  """Params each chip of a sampling tensor group of ``group`` chips holds
  (``mesh.SAMPLING_RULES``): the attention's 1 / t_kv (whole kv heads with their query
  heads), the rest (MLP, vocabulary) 1 / group, the norms whole (counted as split)."""
  t_kv, _ = mesh_lib.tensor_split(cfg, group)
  lay = _param_shapes(cfg)["layers"]
  names = ("q_kernel", "k_kernel", "v_kernel", "o_kernel", "q_bias", "k_bias", "v_bias")
  attn = sum(lay[n].size for n in names if n in lay)
  return attn / t_kv + (param_counts(cfg)[0] - attn) / group


def attention_rows_per_chip(rows: int, groups: int, cfg: Qwen2Config, group: int) -> int:
  """KV cache rows each chip holds: the rows over the sampler's ``groups`` (its data
  axis), then over the group's tensor_q chips ("attn_batch")."""
  _, t_q = mesh_lib.tensor_split(cfg, group)
  return rows_per_chip(rows, groups, t_q)


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


def sampling_group(run: Run, chips: int, hosts: int) -> int:
  """The sampler's tensor group on a slice of ``chips`` over ``hosts``: the run's
  ``mesh.sampling_tensor``, or with 0 what the run picks on those chips
  (``mesh.auto_sampling_tensor``). Raises ValueError when the group does not divide
  the chips."""
  per_host = chips // hosts
  devices = [types.SimpleNamespace(process_index=i // per_host) for i in range(chips)]
  g = run.sampling_tensor or mesh_lib.auto_sampling_tensor(devices)
  mesh_lib.tensor_split(run.model, g)
  if chips % g:
    raise ValueError(f"sampling tensor group of {g} chips: does not divide {chips} chips")
  return g


def tail_phases(slots: int, shards: int) -> tuple[int, ...]:
  """The engine's loops on an accelerator, tail loops included (also with W = B:
  ``capo_jax.sampling.sampler.engine_plan``)."""
  return plans.tail_phases(slots, shards)


SAVED = "saved projections (remat, 2 copies as compiled)"


def memory_terms(
  run: Run,
  data: int,
  fsdp: int,
  tensor: int,
  rollout_chunks: int = 1,
  slots: int = 0,
  group: int = 0,
) -> dict[str, float]:
  """Bytes per chip of each term, plus the phase totals and the peak.

  ``rollout_chunks`` > 1: the Q prompts are sampled in that many sequential
  ``generate`` calls, dividing the rollout terms. ``slots``: the engine's W
  (0: all rows of a call). ``group``: the sampler's tensor group (``sampling_group``;
  0: ``tensor``), which splits the rollout's weights, heads and vocabulary.
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
  t, g = tensor, group or tensor
  shard = fsdp * t
  groups = data * fsdp * t // g  # the sampler's data axis: its rows split over it
  Q = run.num_prompts // rollout_chunks
  B = Q * run.num_samples
  P_len = bucket_length(run.max_prompt_len, 16)
  S_len = kv_slots(run)
  kv_tok = kv_bytes_per_token(cfg) / math.gcd(g, K)
  q_rows = rows_per_chip(Q, 1, groups)
  W = min(slots or B, B)
  g_rows, b_rows = rows_per_chip(W, 1, groups), attention_rows_per_chip(W, groups, cfg, g)
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
  m["sampling weights (bf16)"] = act * sampling_weight_params(cfg, g)
  m["KV cache (W slots)"] = b_rows * S_len * kv_tok
  # The prompt cache lies like the slots' cache (rows over the groups x tensor_q: the TPU
  # compiler keeps it so through the prefill too); the prefill's scores are counted at
  # the group's rows, every chip of a kv head's group holding them (an upper bound).
  m["prompt cache (Q rows)"] = attention_rows_per_chip(Q, groups, cfg, g) * P_len * kv_tok
  m["prefill scores"] = q_rows * (N / math.gcd(g, K) * P_len * P_len * 6 + V / g * 4)
  m["decode cache copy"] = m["KV cache (W slots)"] if run.decode_copies_cache else 0.0
  # The engine gathers the tail's rows into a cache of W/4 slots (plans.Plan.phases),
  # one layer's buffer after the other, each large one freed once gathered: the plan
  # counts the smaller cache whole beside the large one, an upper bound against the
  # TPU compiler's decode programs (docs/tpu.md, "Memory per chip").
  tail = tail_phases(W, groups * mesh_lib.tensor_split(cfg, g)[1])
  m["tail loop cache (W/4 slots)"] = (
    m["KV cache (W slots)"] * tail[1] / tail[0] if len(tail) > 1 else 0.0
  )
  decode = 3 * g_rows * V / g * 4
  # LoRA's merge into the sampling copy: one layer's float32 A @ B (+ W) at a time.
  m["LoRA merge (1 layer f32)"] = 2 * 4 * P_layer / g if run.lora else 0.0
  # The prefill's stacked cache and its per-layer copy, then the slots beside it.
  rollout = (
    m["sampling weights (bf16)"]
    + m["LoRA merge (1 layer f32)"]
    + m["prompt cache (Q rows)"]
    + max(
      m["prompt cache (Q rows)"] + m["prefill scores"],
      m["KV cache (W slots)"] + m["decode cache copy"] + m["tail loop cache (W/4 slots)"] + decode,
    )
  )
  # Train.
  # Gradients (and their accumulator) of what trains; the bf16 copy of the
  # weights only where they are not stored in bf16 already.
  m["grads (2 x f32) + bf16 copy"] = (2 * 4 * trained + (act * P if master != act else 0)) / shard
  # Layer by layer (two layers' weights in flight, and the unembedding), or the whole
  # model gathered once a log-prob pass and an update (config.mesh.gather_once): the
  # update's copy keeps the unembedding in its stored dtype (train_step.gathered_weights).
  # The sharded bf16 copy counted with the grads above is then not made: left in, on the
  # safe side.
  m["gathered layers + unembed"] = 0.0 if run.gather_once else act * (2 * P_layer + V * D) / t
  once = act * (P - V * D) + master * V * D
  m["gathered weights (once, bf16)"] = once / t if run.gather_once else 0.0
  # config.mesh.reduce_once: each chip sums its rows' float32 gradient of that copy over
  # the micro-batches (capo_jax/rl/local_grads.py): 4 bytes a param. The compiled 1.5B
  # v4-32 train program holds 10.5 GiB more than without it, about 8 bytes a param (its
  # micro-batch loop also carries the shards' bfloat16 copy), so 8 are counted.
  m["reduce_once (f32 sums, 8 B/param as compiled)"] = 8 * P / t if run.reduce_once else 0.0
  m["boundary activations"] = L * r * T * D * act
  # remat_policy "projections": every layer also keeps its projections' outputs that the
  # backward reads (q, k, v for the attention's backward; o for the MLP's norm; gate,
  # up for the MLP's product) and splash attention's output and float32 log-sum-exp (on
  # TPU: its backward then runs no forward kernel again), stacked over the layers. The
  # 1.5B train program holds twice those bytes (v4-32 by the TPU compiler and one row on
  # CPU: 333-336 MiB more a layer for a 4,096-token row, not 168, before the attention's
  # were kept), 7B on v4-64 and a LoRA run about once: two copies are counted, an upper
  # bound there (docs/results/tpu.md, train_remat_projections).
  H = cfg.head_dim
  attn = N * H / t + N / t * 4 / act  # output and log-sum-exp
  saved = N * H / t + 2 * K * H / math.gcd(t, K) + D + 2 * F / t + attn
  keeps = cfg.remat and cfg.remat_policy == "projections"
  m[SAVED] = 2 * L * r * T * saved * act if keeps else 0.0
  m["layer working set"] = r * (
    N / t * (ATTN_BLOCK**2 * 10 + T * 4) + T * F / t * act * 4 + T * D * act * 8
  )
  m["log-prob chunk"] = r * run.logprob_chunk * V / t * 4 * 3
  train = sum(
    m[k]
    for k in (
      "grads (2 x f32) + bf16 copy",
      "gathered layers + unembed",
      "gathered weights (once, bf16)",
      "reduce_once (f32 sums, 8 B/param as compiled)",
      "boundary activations",
      SAVED,
      "layer working set",
      "log-prob chunk",
    )
  )
  m["rollout phase"] = persistent + rollout
  m["train phase"] = persistent + train
  m["peak"] = max(m["rollout phase"], m["train phase"])
  if run.logprob_data_parallel:
    # The passes' whole compute-dtype copy on every chip beside the train state and the
    # sampling weights (a pass call's own buffers: one row's layer and chunk, small).
    m["log-prob pass copy (whole, bf16)"] = act * P
    m["log-prob pass phase"] = (
      persistent
      + m["sampling weights (bf16)"]
      + m["log-prob pass copy (whole, bf16)"]
      + m["layer working set"]
      + m["log-prob chunk"]
    )
    m["peak"] = max(m["peak"], m["log-prob pass phase"])
  return m
