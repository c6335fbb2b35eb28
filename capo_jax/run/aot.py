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
  gather, gather_ref  with ``mesh.gather_once``: the policy's (the reference's) weights
            gathered whole over fsdp in bfloat16, once a pass; the passes' calls then
            take that copy
  train     the train step: micro-batch loop + AdamW update

A program whose temporaries exceed the chip's HBM is refused by the compiler
(RESOURCE_EXHAUSTED); it is reported, with the bytes the error names, not raised.
The slice's devices and mesh come from ``capo_jax.run.tpu_topology``; the abstract
programs and their shapes from ``capo_jax.run.aot_programs``.

Typical use (tools/aot_tpu.py is the command line)::

  acc = tpu_topology.parse_accelerator("v5e-16")
  tpu_topology.set_tpu_env(acc)              # before jax initialises a backend
  spec = RunSpec.from_config(config, policy_given=True, num_devices=acc.chips)
  for prog in compile_step(spec, tpu_topology.topology_mesh(spec, acc)):
    print(prog.name, prog.memory, prog.cost)
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from capo_jax.run import hlo_cost
from capo_jax.run.aot_programs import Lowerable, device_bytes, sampler_programs, trainer_programs
from capo_jax.run.sections import ConfigError
from capo_jax.run.spec import RunSpec
from models import hub


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
  args = device_bytes([a for a in jax.tree.leaves(p.args) if hasattr(a, "sharding")])
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
