"""The programs of one RL step as abstract calls, at the run's largest shapes.

Each ``Lowerable`` is a jitted function and abstract arguments
(``jax.ShapeDtypeStruct`` with the run's shardings) from the one builder
(``capo_jax.run.programs.build``); ``capo_jax.run.aot`` compiles them. Nothing is
allocated. ``resident_bytes`` counts the buffers that live across programs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from capo_jax.rl import microbatches, packing
from capo_jax.rl import train_step as ts
from capo_jax.rl.batch import ModelRows, Sequences, TrainBatch
from capo_jax.run import programs as programs_lib
from capo_jax.run.programs import StepPrograms
from capo_jax.run.spec import RunSpec
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.sampling import engine, plans
from capo_jax.sampling import sampler as sampling
from models import qwen2, sharding

# --------------------------------------------------------------------------
# Abstract arguments with the run's shardings.
# --------------------------------------------------------------------------


def _sds(shape: tuple[int, ...], dtype: Any, sh: jax.sharding.Sharding) -> Any:
  """An abstract array to lower with. Typed Any: it fills the ``jax.Array`` fields of the
  containers the programs take (ModelRows, TrainBatch, plans.Ends)."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)


def _abstract_params(model_cfg: Any, mesh: Mesh, rules: Any, dtype: Any) -> Any:
  shardings = mesh_lib.param_shardings(model_cfg, mesh, rules)
  return jax.tree.map(
    lambda s, sh: _sds(s.shape, dtype, sh), qwen2.param_shapes(model_cfg), shardings
  )


def _rows(mesh: Mesh, rules: Any, shape: tuple[int, ...], dtype: Any) -> Any:
  """A batch array: leading axis over the batch mesh axes, the rest whole."""
  spec = sharding.logical_to_spec(("batch",) + (None,) * (len(shape) - 1), rules, shape, mesh)
  return _sds(shape, dtype, NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The largest shapes of one RL step's programs, from the spec."""

  prompts_per_call: int  # Q of one sampler call
  num_calls: int
  num_samples: int  # G
  prompt_len: int  # the sampler's bucketed P (the trainer sees <= max_prompt_len)
  gen_len: int  # the sampler's bucketed generation buffer
  max_prompt_len: int
  max_new_tokens: int
  rows: int  # Q*G
  rows_per_update: int
  row_len: int  # tokens of a model row of the log-prob passes and the train step
  rows_per_call: int  # model rows per log-prob call
  logprob_calls: int  # calls per pass
  targets_per_row: int  # Z: target slots of a model row
  microbatches: int  # M of one update
  rows_per_microbatch: int
  slots_per_microbatch: int  # sequence slots of a micro-batch

  @classmethod
  def from_spec(cls, spec: RunSpec) -> Shapes:
    r = spec.rollout
    per_call = r.prompts_per_call or r.num_prompts
    row_len, Y = spec.packing_shape()
    B, R = r.num_prompts * r.num_samples, spec.rows_per_update
    L = spec.logprob_rows_per_call
    # Upper bounds, each over the step's possible lengths (packing's own bucketing and
    # power-of-two counts): the most rows when every sequence is as long as allowed
    # (``per_row`` a row), the most targets when rows are full of completion tokens
    # (each sequence keeps one prompt token) in every row, the most slots when a micro-batch holds
    # every sequence of the update.
    per_row = -(-row_len // (r.max_prompt_len + r.max_new_tokens))
    rows_needed = lambda n: -(-n // per_row)  # noqa: E731
    return cls(
      prompts_per_call=per_call,
      num_calls=r.num_prompts // per_call,
      num_samples=r.num_samples,
      prompt_len=sampling.bucket_length(r.max_prompt_len, sampling.PROMPT_BUCKET_MIN),
      gen_len=sampling.bucket_length(r.max_new_tokens, sampling.GEN_BUCKET_MIN),
      max_prompt_len=r.max_prompt_len,
      max_new_tokens=r.max_new_tokens,
      rows=B,
      rows_per_update=R,
      row_len=row_len,
      rows_per_call=L,
      logprob_calls=-(-rows_needed(B) // L),
      targets_per_row=packing.bucket(row_len - 1),
      microbatches=microbatches.pow2(-(-rows_needed(R) // Y)),
      rows_per_microbatch=Y,
      slots_per_microbatch=Y * microbatches.pow2(-(-R // Y)),
    )


@dataclasses.dataclass(frozen=True)
class Lowerable:
  """A jitted function and the abstract arguments of one call."""

  name: str
  fn: Any
  args: tuple[Any, ...]
  kwargs: dict[str, Any]
  calls_per_step: int  # how many times one RL step runs it
  resident: tuple[str, ...]  # live device buffers that are not among its arguments


def sampler_plan(spec: RunSpec, model_cfg: Any, mesh: Mesh) -> plans.Plan:
  """The engine's plan of one sampler call at the run's largest prompts (``generate``'s)."""
  return sampling.engine_plan(
    model_cfg,
    programs_lib.sampling_spec(spec),
    programs_lib.sampling_layout(spec, model_cfg, mesh),
    Shapes.from_spec(spec).prompts_per_call,
  )


def sampler_programs(spec: RunSpec, model_cfg: Any, mesh: Mesh) -> tuple[Lowerable, Any]:
  """The prefill, and a function of its compiled form giving the decode loop."""
  sh = Shapes.from_spec(spec)
  plan = sampler_plan(spec, model_cfg, mesh)
  layout = programs_lib.sampling_layout(spec, model_cfg, mesh)
  mesh, rules = layout.mesh, layout.rules  # the sampler's own mesh
  rep = mesh_lib.replicated(mesh)
  params = _abstract_params(model_cfg, mesh, rules, model_cfg.dtype)
  key = jax.eval_shape(lambda: jax.random.key(0))
  rng, stops, pad = _sds((), key.dtype, rep), _sds((8,), jnp.int32, rep), _sds((), jnp.int32, rep)
  QP = (sh.prompts_per_call, sh.prompt_len)
  prefill = Lowerable(
    "prefill",
    engine.prefill,
    (params, _rows(mesh, rules, QP, jnp.int32), _rows(mesh, rules, QP, jnp.bool_), rng),
    dict(plan=plan.prefill_plan),
    sh.num_calls,
    ("train state", "reference"),
  )

  def decode(prefill_compiled: Any) -> Lowerable:
    out = jax.eval_shape(functools.partial(engine.prefill, **prefill.kwargs), *prefill.args)
    prompts, first = jax.tree.map(
      lambda s, o: _sds(s.shape, s.dtype, o), out, prefill_compiled.output_shardings
    )
    ends = plans.Ends(stops, pad, _sds((), jnp.int32, rep))
    return Lowerable(
      "decode",
      engine.decode_loop,
      (params, prompts, first, rng, ends),
      dict(plan=plan),
      sh.num_calls,
      ("train state", "reference"),
    )

  return prefill, decode


def trainer_programs(
  spec: RunSpec, mesh: Mesh, progs: StepPrograms | None = None
) -> list[Lowerable]:
  """The log-prob passes and the train step the trainer runs (``programs.build``), at the
  largest shapes a step can give them (``Shapes.from_spec``)."""
  rules = mesh_lib.TRAIN_RULES
  progs = progs or programs_lib.build(spec, spec.model_config(), mesh)
  sh = Shapes.from_spec(spec)
  model_cfg, tcfg = progs.model_cfg, progs.tcfg
  T, Y, Z, calls = sh.row_len, sh.rows_per_call, sh.targets_per_row, sh.logprob_calls
  dp = spec.mesh.logprob_data_parallel  # the passes' rows over every chip, weights whole
  pass_rules = mesh_lib.PASS_RULES if dp else rules
  rows = lambda shape, dtype=jnp.int32: _rows(mesh, pass_rules, shape, dtype)  # noqa: E731
  J = spec.simko_k
  call_rows = ModelRows(
    tokens_YT=rows((Y, T)),
    segment_ids_YT=rows((Y, T)),
    positions_YT=rows((Y, T)),
    target_col_YZ=rows((Y, Z)),
    targets_YZ=rows((Y, Z)),
    target_mask_YZ=rows((Y, Z)),
  )
  lora_cfg = tcfg.lora
  trained_params = _abstract_params(model_cfg, mesh, rules, model_cfg.weight_dtype)
  adapters = (
    None
    if lora_cfg is None
    else _abstract_tree(
      ts.trainable_shapes(model_cfg, tcfg),
      ts.trainable_shardings(model_cfg, tcfg, mesh, rules),
      jnp.float32,
    )
  )
  ref = trained_params if lora_cfg else _abstract_params(model_cfg, mesh, rules, model_cfg.dtype)
  # The sampler's bfloat16 params are still referenced while the rollout scores its samples.
  out = []
  if progs.logprobs.gather is None:
    out.append(
      Lowerable(
        "logprobs",
        progs.logprobs.fn,
        (trained_params, call_rows),
        {"adapters": adapters},
        calls,
        ("optimizer state", "reference", "sampling params"),
      )
    )
    if spec.needs_reference:
      out.append(
        Lowerable(
          "logprobs_ref",
          progs.logprobs.fn,
          (ref, call_rows),
          {},
          calls,
          ("train state", "sampling params"),
        )
      )
  else:  # each pass gathers its weights once (config.mesh.gather_once)
    gathered = mesh_lib.PASS_RULES if dp else mesh_lib.GATHERED_RULES
    whole = _abstract_params(model_cfg, mesh, gathered, model_cfg.dtype)
    policy_resident: tuple[str, ...] = ("optimizer state", "reference", "sampling params")
    passes = [("", trained_params, {"adapters": adapters}, policy_resident)]
    if spec.needs_reference:
      passes.append(("_ref", ref, {}, ("train state", "sampling params")))
    for suffix, stored, kwargs, resident in passes:
      out.append(Lowerable(f"gather{suffix}", progs.logprobs.gather, (stored,), {}, 1, resident))
      out.append(
        Lowerable(
          f"logprobs{suffix}",
          progs.logprobs.fn,
          (whole, call_rows),
          kwargs,
          calls,
          ("train state", "reference", "sampling params"),
        )
      )
  state = _abstract_tree(
    jax.eval_shape(lambda p: ts.init_train_state(p, tcfg), ts.trainable_shapes(model_cfg, tcfg)),
    progs.state_shardings,
  )
  M, Ym, Bm, C = sh.microbatches, sh.rows_per_microbatch, sh.slots_per_microbatch, sh.max_new_tokens
  mb = lambda *shape, dtype=jnp.int32: _sds(shape, dtype, progs.batch_layout.sharding)  # noqa: E731
  f32 = lambda *shape: mb(*shape, dtype=jnp.float32)  # noqa: E731
  batch = TrainBatch(
    rows=ModelRows(
      tokens_YT=mb(M, Ym, T),
      segment_ids_YT=mb(M, Ym, T),
      positions_YT=mb(M, Ym, T),
      target_col_YZ=mb(M, Ym, Z),
      targets_YZ=mb(M, Ym, Z),
      target_mask_YZ=mb(M, Ym, Z),
      topk_ids_YZJ=mb(M, Ym, Z, J) if J else None,
    ),
    index_MBC=mb(M, Bm, C),
    seqs=Sequences(
      completion_mask_BC=mb(M, Bm, C),
      old_logp_BC=f32(M, Bm, C),
      adv_B=f32(M, Bm),
      ref_logp_BC=f32(M, Bm, C) if spec.needs_reference else None,
      correct_B=mb(M, Bm, dtype=jnp.bool_) if J else None,
      old_topk_ids_BCJ=mb(M, Bm, C, J) if J else None,
      old_topk_logp_BCJ=f32(M, Bm, C, J) if J else None,
      is_weight_BC=(f32(M, Bm, C) if spec.rollout.is_correction != "none" else None),
    ),
  )
  base = () if lora_cfg is None else (trained_params,)
  out.append(
    Lowerable(
      "train", progs.train_step, (state, batch) + base, {}, spec.updates_per_step, ("reference",)
    )
  )
  return out


def _abstract_tree(shapes: Any, shardings: Any, dtype: Any = None) -> Any:
  return jax.tree.map(lambda s, o: _sds(s.shape, dtype or s.dtype, o), shapes, shardings)


def device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
  size = lambda dt: 8 if jax.dtypes.issubdtype(dt, jax.dtypes.extended) else jnp.dtype(dt).itemsize
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * size(x.dtype) for x in jax.tree.leaves(tree)
  )


def resident_bytes(spec: RunSpec, mesh: Mesh) -> dict[str, int]:
  """Per-device bytes of the buffers that live across programs (``Lowerable.resident``)."""
  model_cfg = spec.model_config()
  tcfg = spec.train_config()
  state = _abstract_tree(
    jax.eval_shape(lambda p: ts.init_train_state(p, tcfg), ts.trainable_shapes(model_cfg, tcfg)),
    ts.state_shardings(model_cfg, tcfg, mesh, mesh_lib.TRAIN_RULES),
  )
  ref = _abstract_params(model_cfg, mesh, mesh_lib.TRAIN_RULES, model_cfg.dtype)
  # LoRA's reference is its frozen base: one copy, counted as the reference.
  base = _abstract_params(model_cfg, mesh, mesh_lib.TRAIN_RULES, model_cfg.weight_dtype)
  return {
    "train state": device_bytes(state),
    "optimizer state": device_bytes(state.opt_state),
    "reference": (device_bytes(base) if tcfg.lora else device_bytes(ref))
    if spec.needs_reference or tcfg.lora
    else 0,
    "sampling params": device_bytes(
      _abstract_params(
        model_cfg,
        programs_lib.sampling_layout(spec, model_cfg, mesh).mesh,
        mesh_lib.SAMPLING_RULES,
        model_cfg.dtype,
      )
    ),
  }
