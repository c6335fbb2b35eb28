"""Ahead-of-time compilation of one RL step's programs for a TPU topology, on any host.

With ``jax[tpu]`` installed (libtpu), ``jax.experimental.topologies`` describes
the devices of a TPU slice without the hardware, and ``jax.jit(f).lower(abstract
args).compile()`` over a mesh of those devices runs XLA's TPU compiler: the
result carries the per-device memory analysis (arguments, outputs,
temporaries, aliased bytes) and cost analysis (FLOPs, bytes accessed) of the
program that would run on the chip. Nothing is allocated.

The programs are the ones ``capo_jax.rl.loop.train`` jits, built by the same
functions, at the run's padded shapes (prompt ``max_prompt_len``, completion
``max_new_tokens``: the largest shapes a step can see) and with its shardings:

  prefill   ``engine.prefill`` over one sampler call's prompts
  decode    ``engine.decode_loop``, the engine's ``lax.while_loop`` over its W-slot cache
  logprobs  ``train_step.make_logprob_fn`` over one call of ``train.logprob_rows``
            rows, as the trainer calls it (0: all Q*G rows), float32 params
  logprobs_ref  the same program with the bfloat16 reference (when the run keeps one)
  train     ``train_step.make_train_step``: micro-batch scan + AdamW update

A program whose temporaries exceed the chip's HBM is refused by the compiler
(RESOURCE_EXHAUSTED); it is reported, with the bytes the error names, not raised.

Typical use (benchmarks/aot_tpu.py is the command line)::

  acc = parse_accelerator("v5e-16")
  set_tpu_env(acc)                           # before jax initialises a backend
  for prog in compile_step(c, topology_mesh(c, acc)):
    print(prog.name, prog.memory, prog.cost)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh, NamedSharding

from capo_jax.rl import experiment
from capo_jax.rl import train_step as ts
from capo_jax.runtime import hlo_cost
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.sampling import engine
from capo_jax.sampling import sampler as sampling
from models import qwen2, sharding
from models.sharding import Layout

# Chips per slice -> the topology string libtpu takes ("<gen>:<chip grid>").
# v4 and v5p are 3-D tori counted in TensorCores (2 per chip); v5e and v6e are
# 2-D grids counted in chips.
_GRID_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
_GRID_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
            256: "16x16"}
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
  if not jax.config.jax_platforms:  # jax read $JAX_PLATFORMS when it was imported
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


def topology_mesh(c: ml_collections.ConfigDict, acc: Accelerator) -> Mesh:
  """The run's mesh (``config.mesh``) over the slice's devices."""
  devices = topology_devices(acc)
  experiment.validate(c, num_devices=len(devices), policy_given=True)
  return mesh_lib.make_mesh({ax: c.mesh[ax] for ax in mesh_lib.MESH_AXES}, devices=devices)


# --------------------------------------------------------------------------
# Abstract arguments with the run's shardings.
# --------------------------------------------------------------------------


def _sds(shape: tuple[int, ...], dtype: Any, sh: NamedSharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)


def _abstract_params(model_cfg: Any, mesh: Mesh, rules: Any, dtype: Any) -> Any:
  shardings = mesh_lib.param_shardings(model_cfg, mesh, rules)
  return jax.tree.map(lambda s, sh: _sds(s.shape, dtype, sh), qwen2.param_shapes(model_cfg),
                      shardings)


def _rows(mesh: Mesh, rules: Any, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
  """A batch array: leading axis over the batch mesh axes, the rest whole."""
  spec = sharding.logical_to_spec(("batch",) + (None,) * (len(shape) - 1), rules, shape, mesh)
  return _sds(shape, dtype, NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The padded shapes of one RL step, from the config."""
  prompts_per_call: int  # Q of one sampler call
  num_calls: int
  num_samples: int  # G
  prompt_len: int  # the sampler's bucketed P (the trainer sees <= max_prompt_len)
  gen_len: int  # the sampler's bucketed generation buffer
  max_prompt_len: int
  max_new_tokens: int
  rows: int  # Q*G
  rows_per_update: int

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> Shapes:
    r = c.rollout
    per_call = r.prompts_per_call or r.num_prompts
    return cls(prompts_per_call=per_call, num_calls=r.num_prompts // per_call,
               num_samples=r.num_samples,
               prompt_len=sampling.bucket_length(r.max_prompt_len, sampling.PROMPT_BUCKET_MIN),
               gen_len=sampling.bucket_length(r.max_new_tokens, sampling.GEN_BUCKET_MIN),
               max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
               rows=r.num_prompts * r.num_samples,
               rows_per_update=c.train.mini_batch_prompts * r.num_samples)


@dataclasses.dataclass(frozen=True)
class Lowerable:
  """A jitted function and the abstract arguments of one call."""
  name: str
  fn: Any
  args: tuple[Any, ...]
  kwargs: dict[str, Any]
  calls_per_step: int  # how many times one RL step runs it
  resident: tuple[str, ...]  # live device buffers that are not among its arguments


def _sampler_programs(c: ml_collections.ConfigDict, model_cfg: Any, mesh: Mesh, sh: Shapes
                      ) -> tuple[Lowerable, Any]:
  """The prefill, and a function of its compiled form giving the decode loop."""
  rules = mesh_lib.SAMPLING_RULES
  layout = Layout.of(mesh, rules)  # the value generate() is given, so the same jit cache key
  rep = mesh_lib.replicated(mesh)
  params = _abstract_params(model_cfg, mesh, rules, model_cfg.dtype)
  strategy = sampling.make_strategy(c.rollout.temperature, c.rollout.top_p, c.rollout.top_k)
  key = jax.eval_shape(lambda: jax.random.key(0))
  rng, stops, pad = _sds((), key.dtype, rep), _sds((8,), jnp.int32, rep), _sds((), jnp.int32, rep)
  QP = (sh.prompts_per_call, sh.prompt_len)
  prefill = Lowerable(
      "prefill", engine.prefill,
      (params, _rows(mesh, rules, QP, jnp.int32), _rows(mesh, rules, QP, jnp.bool_), rng),
      dict(plan=engine.PrefillPlan(cfg=model_cfg, strategy=strategy,
                                   num_samples=sh.num_samples, layout=layout)),
      sh.num_calls, ("train state", "reference"))
  rows = sh.prompts_per_call * sh.num_samples
  slots = min(c.rollout.get("max_active_rows", 0) or rows, rows)
  plan = engine.Plan(cfg=model_cfg, strategy=strategy, num_samples=sh.num_samples,
                     num_slots=slots, gen_len=sh.gen_len, layout=layout, block=engine.KV_BLOCK,
                     shrink=slots < rows)

  def decode(prefill_compiled: Any) -> Lowerable:
    out = jax.eval_shape(functools.partial(engine.prefill, **prefill.kwargs), *prefill.args)
    prompts, first = jax.tree.map(lambda s, o: _sds(s.shape, s.dtype, o), out,
                                  prefill_compiled.output_shardings)
    ends = engine.Ends(stops, pad, _sds((), jnp.int32, rep))
    return Lowerable("decode", engine.decode_loop, (params, prompts, first, rng, ends),
                     dict(plan=plan), sh.num_calls, ("train state", "reference"))

  return prefill, decode


def _trainer_programs(c: ml_collections.ConfigDict, model_cfg: Any, mesh: Mesh, sh: Shapes,
                      logprob_rows: int) -> list[Lowerable]:
  rules = mesh_lib.TRAIN_RULES
  # The padded step ([B, P + C] rows): the packed step (train.pack) is not compiled
  # ahead of time yet; its rows are as long, so this is its upper bound per row.
  tcfg = experiment.train_config(c).replace(pack_len=0, pack_rows=1)
  simko_k = c.loss.simko_k if c.algo.name == "simko" else 0
  reference = experiment.needs_reference(c)
  P, C = sh.max_prompt_len, sh.max_new_tokens
  rows = logprob_rows or sh.rows
  if sh.rows % rows:
    raise ValueError(f"logprob_rows={rows} must divide the step's Q*G = {sh.rows} rows")
  logprob = ts.make_logprob_fn(model_cfg, mesh, rules, rows, chunk_size=c.train.logprob_chunk,
                               top_k=simko_k)
  inputs = lambda B: (_rows(mesh, rules, (B, P), jnp.int32), _rows(mesh, rules, (B, P), jnp.int32),
                      _rows(mesh, rules, (B, C), jnp.int32), _rows(mesh, rules, (B, C), jnp.int32))
  # The sampler's bfloat16 params are still referenced while the rollout scores its samples.
  out = [Lowerable("logprobs", logprob,
                   (_abstract_params(model_cfg, mesh, rules, model_cfg.weight_dtype),)
                   + inputs(rows), {}, sh.rows // rows,
                   ("optimizer state", "reference", "sampling params"))]
  if reference:
    out.append(Lowerable("logprobs_ref", logprob,
                         (_abstract_params(model_cfg, mesh, rules, model_cfg.dtype),)
                         + inputs(rows), {}, sh.rows // rows, ("train state", "sampling params")))
  state_sh = ts.state_shardings(model_cfg, tcfg, mesh, rules)
  state = jax.tree.map(lambda s, o: _sds(s.shape, s.dtype, o),
                       jax.eval_shape(lambda p: ts.init_train_state(p, tcfg),
                                      qwen2.param_shapes(model_cfg)), state_sh)
  B = sh.rows_per_update
  f32 = lambda *shape: _rows(mesh, rules, shape, jnp.float32)
  prompt, pmask, comp, cmask = inputs(B)
  batch = ts.TrainBatch(
      prompt_tokens_BP=prompt, prompt_mask_BP=pmask, completion_tokens_BC=comp,
      completion_mask_BC=cmask, old_logp_BC=f32(B, C), adv_B=f32(B),
      ref_logp_BC=f32(B, C) if reference else None,
      correct_B=_rows(mesh, rules, (B,), jnp.bool_) if simko_k else None,
      old_topk_ids_BCJ=_rows(mesh, rules, (B, C, simko_k), jnp.int32) if simko_k else None,
      old_topk_logp_BCJ=f32(B, C, simko_k) if simko_k else None)
  updates = c.rollout.num_prompts // c.train.mini_batch_prompts * c.train.ppo_epochs
  step = ts.make_train_step(model_cfg, tcfg, mesh, rules, B)
  out.append(Lowerable("train", step, (state, batch), {}, updates, ("reference",)))
  return out


def _device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
  size = lambda dt: 8 if jax.dtypes.issubdtype(dt, jax.dtypes.extended) else jnp.dtype(dt).itemsize
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * size(x.dtype)
             for x in jax.tree.leaves(tree))


def resident_bytes(c: ml_collections.ConfigDict, mesh: Mesh) -> dict[str, int]:
  """Per-device bytes of the buffers that live across programs (``Lowerable.resident``)."""
  model_cfg = experiment.model_config(c)
  tcfg = experiment.train_config(c)
  sh = ts.state_shardings(model_cfg, tcfg, mesh, mesh_lib.TRAIN_RULES)
  state = jax.tree.map(lambda s, o: _sds(s.shape, s.dtype, o),
                       jax.eval_shape(lambda p: ts.init_train_state(p, tcfg),
                                      qwen2.param_shapes(model_cfg)), sh)
  ref = _abstract_params(model_cfg, mesh, mesh_lib.TRAIN_RULES, model_cfg.dtype)
  return {"train state": _device_bytes(state), "optimizer state": _device_bytes(state.opt_state),
          "reference": _device_bytes(ref) if experiment.needs_reference(c) else 0,
          "sampling params": _device_bytes(_abstract_params(
              model_cfg, mesh, mesh_lib.SAMPLING_RULES, model_cfg.dtype))}


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
      out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
             "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes}
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
    out.update(xla_flops=float(ca.get("flops", 0.0)), xla_bytes=float(ca.get("bytes accessed", 0.0)))
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
  return Compiled(p.name, compiled, time.perf_counter() - t0, p.calls_per_step, p.resident,
                  args, error)


def compile_step(c: ml_collections.ConfigDict, mesh: Mesh, only: tuple[str, ...] = (),
                 log: Any = None, logprob_rows: int = 0) -> list[Compiled]:
  """Compiles every program of one RL step of config ``c`` on ``mesh``.

  ``only``: a subset of program names. ``logprob_rows`` > 0 compiles the
  log-prob pass for that many rows per call instead of all Q*G (the trainer
  runs it ``Q*G / logprob_rows`` times per pass; ``train.logprob_rows``).
  """
  model_cfg = experiment.model_config(c)
  sh = Shapes.from_config(c)
  want = lambda name: not only or name in only
  out = []
  prefill, decode = _sampler_programs(c, model_cfg, mesh, sh)
  progs: list[Any] = [prefill, decode] + _trainer_programs(c, model_cfg, mesh, sh, logprob_rows)
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
