"""The one builder of an RL step's jitted programs, from a ``RunSpec`` and a mesh.

The trainer (``capo_jax.run.loop``) runs what ``build`` returns, and the
ahead-of-time compile (``capo_jax.run.aot``, ``tools/aot_tpu.py``) lowers
the same objects at the run's largest shapes, so what the compiler checks for a
TPU slice is what the run executes: the engine's prefill and decode loop, the
old-policy and reference log-prob passes (packed or one sequence per row, LoRA
or not) and the train step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from capo_jax.data.tokenizer import Tokenizer
from capo_jax.rl import train_state as state_lib
from capo_jax.rl import train_step as ts
from capo_jax.rl.drawing import Drawer
from capo_jax.rl.logprob_pass import LogprobPass
from capo_jax.rl.microbatches import RowLayout
from capo_jax.rl.rollout import RolloutContext
from capo_jax.rl.uploader import BatchLayout, Uploader
from capo_jax.run.spec import ConfigError, RunSpec
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.sampling import sampler as sampling
from capo_jax.sampling import strategies
from models.config import Qwen2Config
from models.sharding import Layout


@dataclasses.dataclass(frozen=True)
class StepPrograms:
  """What one RL step runs.

  Attributes:
    model_cfg: the policy's architecture.
    tcfg: the train step's static configuration.
    sampling: the rollout's sampler calls (``sampling.SamplingSpec``).
    sampling_layout: the sampler's mesh and rules (``sampling_layout``).
    logprobs: the old / reference log-prob pass.
    batch_layout: how an update's sequences become a train batch.
    train_step: ``step(state, batch[, base]) -> (state, metrics)``, jitted, state donated.
    state_shardings: the train state's shardings.
  """

  model_cfg: Qwen2Config
  tcfg: state_lib.TrainConfig
  sampling: sampling.SamplingSpec
  sampling_layout: Layout
  logprobs: LogprobPass
  batch_layout: BatchLayout
  train_step: Callable[..., Any]
  state_shardings: Any


def build(spec: RunSpec, model_cfg: Qwen2Config, mesh: jax.sharding.Mesh) -> StepPrograms:
  """Every jitted program of an RL step of ``spec`` on ``mesh`` (nothing compiles yet)."""
  rules = mesh_lib.TRAIN_RULES
  tcfg = spec.train_config()
  row_len, rows_per_mb = spec.packing_shape()
  r = spec.rollout
  rows_per_call = spec.logprob_rows_per_call
  B = r.num_prompts * r.num_samples
  pack = spec.train.pack
  # Shared prompts: the G completions of a prompt are consecutive rows of the step.
  share = r.num_samples if spec.model.shared_prompts else 0
  # Unpacked rows are as wide as the step's sequences (0: the batch's own width).
  row_len = row_len if pack else 0
  # The passes' own split: the train mesh's, or every chip's rows on a whole copy.
  pass_rules = mesh_lib.PASS_RULES if spec.mesh.logprob_data_parallel else rules
  whole = mesh_lib.PASS_RULES if spec.mesh.logprob_data_parallel else mesh_lib.GATHERED_RULES
  logprobs = LogprobPass(
    fn=ts.make_logprob_fn(
      model_cfg,
      mesh,
      pass_rules,
      rows_per_call,
      chunk_size=spec.train.logprob_chunk,
      top_k=spec.simko_k,
      lora=tcfg.lora,
    ),
    layout=RowLayout(row_len, rows_per_call, pack, share, model_cfg.shared_prompt_cols),
    rows_sharding=mesh_lib.batch_sharding(mesh, pass_rules, rows_per_call, name="model rows"),
    index_sharding=mesh_lib.batch_sharding(mesh, rules, B),
    gather=ts.make_gather(model_cfg, mesh, whole) if spec.mesh.gather_once else None,
  )
  batch_layout = BatchLayout(
    rows=RowLayout(row_len, rows_per_mb, pack, share, model_cfg.shared_prompt_cols),
    sharding=ts.batch_sharding(mesh, rules, rows_per_mb),
    prompts=spec.train.mini_batch_prompts,
  )
  return StepPrograms(
    model_cfg=model_cfg,
    tcfg=tcfg,
    sampling=sampling_spec(spec),
    sampling_layout=sampling_layout(spec, model_cfg, mesh),
    logprobs=logprobs,
    batch_layout=batch_layout,
    train_step=ts.make_train_step(model_cfg, tcfg, mesh, rules, rows_per_mb),
    state_shardings=state_lib.state_shardings(model_cfg, tcfg, mesh, rules),
  )


def rollout_context(
  spec: RunSpec, progs: StepPrograms, model_cfg: Qwen2Config, tokenizer: Tokenizer, grader: Any
) -> RolloutContext:
  """What every step's rollout calls, built once: the sampler (``model_cfg``: its
  architecture) and the grader, the step's upload and the log-prob pass."""
  r = spec.rollout_spec()
  layout = progs.sampling_layout
  drawer = Drawer(
    r.num_samples,
    r.max_prompt_len,
    r.prompts_per_call,
    model_cfg,
    tokenizer,
    grader,
    dataclasses.replace(
      progs.sampling, stop_ids=tuple(tokenizer.stop_ids), pad_id=tokenizer.pad_id
    ),
    layout,
    spec.reward_fns(),
    r.dynamic_max_draws,
  )
  uploader = Uploader(
    progs.batch_layout,
    per_group=NamedSharding(layout.mesh, PartitionSpec()),
    per_row=progs.logprobs.index_sharding,
    row_labels=bool(r.simko_k),
    keep_rows=r.mismatch.mask_truncated,
  )
  return RolloutContext(r, drawer, uploader, progs.logprobs)


def sampling_layout(spec: RunSpec, model_cfg: Qwen2Config, mesh: jax.sharding.Mesh) -> Layout:
  """The sampler's own mesh over ``mesh``'s devices (a tensor group of
  ``config.mesh.sampling_tensor`` chips splits the weights) and the sampling rules."""
  try:
    sampling_mesh = mesh_lib.sampling_mesh(mesh, model_cfg, spec.mesh.sampling_tensor)
  except ValueError as e:
    raise ConfigError(f"config.mesh.sampling_tensor={spec.mesh.sampling_tensor}: {e}") from e
  return Layout.of(sampling_mesh, mesh_lib.SAMPLING_RULES)


def sampling_spec(spec: RunSpec) -> sampling.SamplingSpec:
  """The rollout's sampler calls (the stop and pad ids are the tokenizer's: the trainer
  sets them; they are arguments of the programs, not part of their shape)."""
  r = spec.rollout
  return sampling.SamplingSpec(
    num_samples=r.num_samples,
    max_new_tokens=r.max_new_tokens,
    strategy=strategies.make_strategy(r.temperature, r.top_p, r.top_k),
    max_active_rows=r.max_active_rows or None,
  )
