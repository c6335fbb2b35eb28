"""Ahead-of-time compilation of one RL step's programs for a TPU topology, on any host.

With ``jax[tpu]`` installed (libtpu), ``jax.experimental.topologies`` describes
the devices of a TPU slice without the hardware, and ``jax.jit(f).lower(abstract
args).compile()`` over a mesh of those devices runs XLA's TPU compiler: the
result carries the per-device memory analysis (arguments, outputs,
temporaries, aliased bytes) and cost analysis (FLOPs, bytes accessed) of the
program that would run on the chip. Nothing is allocated.

The programs are the ones the trainer runs, from the one builder
(``capo_jax.run.programs.build``), at the run's largest shapes (prompt
``max_prompt_len``, completion ``max_new_tokens``, every sequence that long) and
with its shardings:

  prefill   ``engine.prefill`` over one sampler call's prompts
  decode    ``engine.decode_loop``, the engine's ``lax.while_loop`` over its W-slot cache
  logprobs  the old-policy pass over one call of model rows (packed when
            ``train.pack``; LoRA: base + adapters), float32 params
  logprobs_ref  the same program with the reference (when the run keeps one)
  train     the train step: micro-batch loop + AdamW update

A program whose temporaries exceed the chip's HBM is refused by the compiler
(RESOURCE_EXHAUSTED); it is reported, with the bytes the error names, not raised.

Typical use (tools/aot_tpu.py is the command line)::

  acc = parse_accelerator("v5e-16")
  set_tpu_env(acc)                           # before jax initialises a backend
  spec = RunSpec.from_config(config, policy_given=True, num_devices=acc.chips)
  for prog in compile_step(spec, topology_mesh(spec, acc)):
    print(prog.name, prog.memory, prog.cost)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from capo_jax.rl import packing
from capo_jax.rl import train_step as ts
from capo_jax.rl.batch import ModelRows, Sequences, TrainBatch
from capo_jax.run import hlo_cost
from capo_jax.run import programs as programs_lib
from capo_jax.run.programs import StepPrograms
from capo_jax.run.sections import ConfigError
from capo_jax.run.spec import RunSpec
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.sampling import engine
from capo_jax.sampling import sampler as sampling
from models import hub, qwen2, sharding

# Chips per slice -> the topology string libtpu takes ("<gen>:<chip grid>").
# v4 and v5p are 3-D tori counted in TensorCores (2 per chip); v5e and v6e are
# 2-D grids counted in chips.
_GRID_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
_GRID_2D = {
  1: "1x1",
  4: "2x2",
  8: "2x4",
  16: "4x4",
  32: "4x8",
  64: "8x8",
  128: "8x16",
  256: "16x16",
}
# gcloud's accelerator-type prefix of each generation (TPU_ACCELERATOR_TYPE).
_GCLOUD = {"v4": "v4", "v5p": "v5p", "v5e": "v5litepod", "v6e": "v6e"}


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str  # as the user wrote it, e.g. "v5e-16"
  gen: str  # v4, v5p, v5e, v6e
  chips: int

  @property
  def topology(self) -> str:
    grid = (_GRID_3D if self.gen in ("v4", "v5p") else _GRID_2D).get(self.chips)
    if grid is None:
      raise ValueError(f"accelerator {self.name!r}: no known topology for {self.chips} chips")
    return f"{self.gen}:{grid}"

  @property
  def gcloud_type(self) -> str:
    cores = self.chips * 2 if self.gen in ("v4", "v5p") else self.chips
    return f"{_GCLOUD[self.gen]}-{cores}"


def parse_accelerator(name: str) -> Accelerator:
  """``v4-32`` -> 16 chips (v4-N / v5p-N count TensorCores), ``v5e-16`` -> 16 chips."""
  m = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
  if not m:
    raise ValueError(f"accelerator {name!r}: expected v4-N, v5p-N, v5e-N (v5litepod-N) or v6e-N")
  gen, n = ("v5e" if m[1] == "v5litepod" else m[1]), int(m[2])
  chips = n // 2 if gen in ("v4", "v5p") else n
  acc = Accelerator(name, gen, chips)
  acc.topology  # raises for a size with no known grid
  return acc


def set_tpu_env(acc: Accelerator) -> None:
  """What libtpu reads at load; without them it queries the GCE metadata server
  (absent off Cloud) and logs errors. JAX itself stays on the CPU backend: the
  TPU devices come from the topology description, not from a TPU client."""
  # jax read $JAX_PLATFORMS when it was imported. Config sets its options as attributes at
  # run time, so its type has none of them.
  if not jax.config.jax_platforms:  # type: ignore[attr-defined]
    jax.config.update("jax_platforms", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", acc.gcloud_type)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_WORKER_ID", "0")
  # libtpu takes /tmp/libtpu_lockfile to own the chips; compiling owns none, so
  # several compiling processes (a test next to a benchmark) may share the host.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_devices(acc: Accelerator) -> list[Any]:
  """The slice's TPU devices (for compiling only), all of them, every host's."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  # v4 / v5p chips have 2 TensorCores; "megacore" fuses them into one device per
  # chip, as jax.devices() shows on those VMs (jax's TPU mesh builder requires it).
  kw = {"chip_config_name": "megacore"} if acc.gen in ("v4", "v5p") else {}
  return list(topologies.get_topology_desc(acc.topology, "tpu", **kw).devices)


def architecture_spec(spec: RunSpec, log: Callable[[str], None] = print) -> RunSpec:
  """The spec to compile: the architecture needs ``config.json``, never the weights.

  A run file names a hub id. When that id's config.json is neither local nor fetchable
  (offline, not in the hub cache), the run file's ``model.preset``, the same architecture,
  stands in, and ``log`` says so in one line; any other model error is raised as is.
  """
  m = spec.model
  if not m.hf_path or not m.preset or not hub.is_hub_id(m.hf_path) or os.path.exists(m.hf_path):
    return spec
  try:
    spec.model_config()
    return spec
  except ConfigError as e:
    if not isinstance(e.__cause__, FileNotFoundError):
      raise
  log(
    f"config.model.hf_path={m.hf_path!r}: config.json not found locally nor on the hub; "
    f"compiling the run file's preset {m.preset!r} (the same architecture) instead"
  )
  return dataclasses.replace(spec, model=dataclasses.replace(m, hf_path="", random_init=True))


def topology_mesh(spec: RunSpec, acc: Accelerator) -> Mesh:
  """The run's mesh (``spec.mesh``) over the slice's devices (``spec`` validated for them)."""
  devices = topology_devices(acc)
  spec.validate(num_devices=len(devices), policy_given=True)
  return spec.make_mesh(devices)


# --------------------------------------------------------------------------
# Abstract arguments with the run's shardings.
# --------------------------------------------------------------------------


def _sds(shape: tuple[int, ...], dtype: Any, sh: jax.sharding.Sharding) -> Any:
  """An abstract array to lower with. Typed Any: it fills the ``jax.Array`` fields of the
  containers the programs take (ModelRows, TrainBatch, engine.Ends)."""
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
      microbatches=packing.pow2(-(-rows_needed(R) // Y)),
      rows_per_microbatch=Y,
      slots_per_microbatch=Y * packing.pow2(-(-R // Y)),
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


def sampler_plan(spec: RunSpec, model_cfg: Any, mesh: Mesh) -> engine.Plan:
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
    ends = engine.Ends(stops, pad, _sds((), jnp.int32, rep))
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
  rows = lambda shape, dtype=jnp.int32: _rows(mesh, rules, shape, dtype)  # noqa: E731
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
  # The sampler's bfloat16 params are still referenced while the rollout scores its samples.
  out = [
    Lowerable(
      "logprobs",
      progs.logprobs.fn,
      (trained_params, call_rows),
      {"adapters": adapters},
      calls,
      ("optimizer state", "reference", "sampling params"),
    )
  ]
  if spec.needs_reference:
    ref = trained_params if lora_cfg else _abstract_params(model_cfg, mesh, rules, model_cfg.dtype)
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


def _device_bytes(tree: Any) -> int:
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
    "train state": _device_bytes(state),
    "optimizer state": _device_bytes(state.opt_state),
    "reference": (_device_bytes(base) if tcfg.lora else _device_bytes(ref))
    if spec.needs_reference or tcfg.lora
    else 0,
    "sampling params": _device_bytes(
      _abstract_params(
        model_cfg,
        programs_lib.sampling_layout(spec, model_cfg, mesh).mesh,
        mesh_lib.SAMPLING_RULES,
        model_cfg.dtype,
      )
    ),
  }


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One compiled program (``compiled`` None when the compiler ran out of HBM)."""

  name: str
  compiled: Any
  compile_s: float
  calls_per_step: int
  resident: tuple[str, ...]
  argument_bytes: int  # from the abstract arguments; the compiler's when it compiled
  error: str = ""

  @property
  def memory(self) -> dict[str, int]:
    """Per-device bytes; ``peak`` = arguments + outputs - aliased + temporaries.

    When the compiler refused the program, ``temporaries`` is what its error
    said they need and outputs / aliasing are unknown (0): a lower bound.
    """
    if self.compiled is None:
      m = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\)", self.error)
      temp = int(float(m[1]) * 1024 ** "KMGT".index(m[2]) * 1024) if m else 0
      out = {"arguments": self.argument_bytes, "outputs": 0, "temporaries": temp, "aliased": 0}
    else:
      m = self.compiled.memory_analysis()
      out = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
      }
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out

  @property
  def cost(self) -> dict[str, float]:
    """Per-device matmul FLOPs and memory bytes with loop bodies times their trip
    counts (``hlo_cost``); ``xla_flops`` / ``xla_bytes``: ``cost_analysis()`` as is."""
    if self.compiled is None:
      return {}
    ca = self.compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    out = hlo_cost.hlo_cost(self.compiled.as_text())
    out.update(
      xla_flops=float(ca.get("flops", 0.0)), xla_bytes=float(ca.get("bytes accessed", 0.0))
    )
    return out


def _compile(p: Lowerable) -> Compiled:
  t0 = time.perf_counter()
  args = _device_bytes([a for a in jax.tree.leaves(p.args) if hasattr(a, "sharding")])
  try:
    compiled, error = p.fn.lower(*p.args, **p.kwargs).compile(), ""
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    compiled, error = None, str(e).splitlines()[0]
  return Compiled(
    p.name, compiled, time.perf_counter() - t0, p.calls_per_step, p.resident, args, error
  )


def compile_step(
  spec: RunSpec, mesh: Mesh, only: tuple[str, ...] = (), log: Any = None
) -> list[Compiled]:
  """Compiles every program of one RL step of ``spec`` on ``mesh`` (``programs.build``'s,
  at ``Shapes.from_spec``); ``only``: a subset of program names."""
  want = lambda name: not only or name in only
  out = []
  prefill, decode = sampler_programs(spec, spec.model_config(), mesh)
  progs: list[Any] = [prefill, decode] + trainer_programs(spec, mesh)
  prefill_compiled = None
  for p in progs:
    if not isinstance(p, Lowerable):  # the decode loop takes the prefill's output shardings
      if not want("decode"):
        continue
      prefill_compiled = prefill_compiled or _compile(prefill).compiled
      if prefill_compiled is None:
        continue
      p = p(prefill_compiled)
    if not want(p.name):
      continue
    if log:
      log(f"compiling {p.name} ...")
    done = _compile(p)
    if p.name == "prefill":
      prefill_compiled = done.compiled
    out.append(done)
    if log:
      log(f"  {p.name}: {done.compile_s:.1f} s" + (f" ({done.error})" if done.error else ""))
  return out
