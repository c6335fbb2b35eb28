r"""Compile every program of one RL step for a TPU slice, ahead of time, on this CPU.

  tools/setup_aot_tpu.sh                               # once: tools/.venv-tpu with libtpu
  tools/.venv-tpu/bin/python -m tools.aot_tpu \
      --config=configs/capo_qwen2p5_math_1p5b.py --accelerator=v5e-32 --config.mesh.tensor=2

Builds the run's mesh over the slice's devices (``jax.experimental.topologies``;
no TPU needed), compiles the programs the trainer runs (``capo_jax.run.programs``:
prefill, the decode loop, the log-prob pass(es), the train step's micro-batch loop +
AdamW; packed when ``train.pack``, with LoRA's adapters when set) at the run's largest
shapes with its shardings (``capo_jax.run.aot``), and prints per program and per device XLA's memory
analysis, what else is resident on the chip while it runs (train state,
reference, sampler weights), the total against the chip's HBM, and the FLOPs
and bytes of XLA's cost analysis with loop bodies counted per iteration
(``capo_jax.run.hlo_cost``). ``--check`` exits 1 when a program does not fit.

Then the step estimate (``tools/step_estimate.py``), every loop at its own trip count:
the engine's decode loops by the scheduler simulation at the README's length model
(``--trunc`` forced to the cap), the log-prob calls and micro-batches by packing those
lengths plus ``--prompt_tokens`` a prompt. Per program and device (``hlo_cost``'s cost
model, the chip's rates from ``tools/tpu_chips.py``): FLOP time, HBM time, on-chip time as
a range (free .. at the assumed on-chip bandwidth), host and inter-chip (ICI) time, the
per-program roofline max(FLOP, HBM time) beside the per-operation one summed, and the
honest per-operation sum (every traffic timed, nothing overlapped, a copy one DMA
stream: ``hlo_cost._op_seconds``); the step as
optimistic .. honest; collectives per update at the length model and at full lengths;
how much a decode step reads against the weights plus each row's own-length KV (the
filled KV blocks without the ragged kernel); and where the honest seconds go, each
program's ``--top_ops`` largest operations by their JAX op names. Host work
(grading) is left out: an estimate, not a measurement.

Peer: ``memory_terms.py``'s terms for the same mesh, printed alongside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from capo_jax.run import aot, aot_programs, programs, tpu_topology
from capo_jax.run.spec import RunSpec
from tools import memory_terms, step_estimate, step_report, tpu_chips

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).")
_ACCEL = flags.DEFINE_string("accelerator", None, "TPU slice: v4-32, v5e-16, v5p-64, v6e-16, ...")
_CHECK = flags.DEFINE_bool("check", False, "Exit 1 when a program does not fit in HBM.")
_ONLY = flags.DEFINE_list(
  "only",
  [],
  "Compile only these programs (prefill, decode, gather, logprobs, gather_ref, logprobs_ref, "
  "train; the gathers with --config.mesh.gather_once).",
)
_PROMPT_TOKENS = flags.DEFINE_integer(
  "prompt_tokens", 200, "Prompt tokens per question in the packing estimate."
)
_TRUNC = flags.DEFINE_float(
  "trunc",
  0.045,
  "Fraction of samples forced to max_new_tokens in the length model (the lognormal's "
  "tail clips more there: 6.1% at the cap in all at 0.045).",
)
_JSON = flags.DEFINE_string("json", "", "Also write the numbers to this JSON file.")
_TOP_OPS = flags.DEFINE_integer(
  "top_ops",
  5,
  "Print each program's this many largest operations by honest seconds a step (their "
  "kind, JAX op name and what bounds them; 0: none).",
)
_DUMP = flags.DEFINE_string(
  "dump_hlo", "", "Write each compiled program's HLO text to this directory (<program>.hlo.txt)."
)
_FROM_HLO = flags.DEFINE_string(
  "from_hlo",
  "",
  "Estimate the step from the HLO a --dump_hlo run wrote to this directory, compiling "
  "nothing (no memory table).",
)
flags.mark_flags_as_required(["config", "accelerator"])

GiB = 1024**3


def report(
  spec: RunSpec,
  mesh: Any,
  acc: tpu_topology.Accelerator,
  progs: list[aot.Compiled],
  resident: dict[str, int],
  trips: step_estimate.Trips,
) -> dict:
  chip = tpu_chips.CHIPS[acc.gen]
  hbm = chip.hbm_gib * GiB
  rows, result = (
    [],
    {
      "accelerator": acc.name,
      "hbm_gib": chip.hbm_gib,
      "programs": {},
      "resident_gib": {k: v / GiB for k, v in resident.items()},
    },
  )
  for p in progs:
    mem = p.memory
    extra = sum(resident[k] for k in p.resident)
    total = mem["peak"] + extra
    cost = p.cost
    fits = total <= hbm and not p.error
    result["programs"][p.name] = dict(
      compile_s=p.compile_s,
      error=p.error,
      memory_gib={k: v / GiB for k, v in mem.items()},
      resident=list(p.resident),
      resident_gib=extra / GiB,
      total_gib=total / GiB,
      fits=fits,
      margin_gib=(hbm - total) / GiB,
      cost=cost,
    )
    rows.append(
      [
        p.name,
        f"{p.compile_s:.0f}",
        *(
          f"{mem[k] / GiB:.2f}" for k in ("arguments", "outputs", "temporaries", "aliased", "peak")
        ),
        f"{extra / GiB:.2f}",
        f"{total / GiB:.2f}",
        ("fits" if fits else "does not fit") + f" {(hbm - total) / GiB:+.2f}",
        f"{cost.get('flops', 0) / 1e12:.3f}" if cost else "-",
        f"{cost.get('bytes', 0) / 1e9:.2f}" if cost else "-",
      ]
    )
  head = [
    "program",
    "compile s",
    "args",
    "outputs",
    "temps",
    "aliased",
    "peak",
    "+resident",
    "total",
    f"vs {chip.hbm_gib:g} GiB HBM",
    "TFLOP",
    "GB",
  ]
  widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
  print(
    f"== {acc.name} ({acc.topology}, {acc.chips} chips), GiB per device; FLOPs and bytes per "
    "device per call, constant-bound loops x trip counts, others once"
  )
  print(step_report.row(head, widths))
  for r in rows:
    print(step_report.row(r, widths))
  for p in progs:
    if p.error:
      print(f"  {p.name}: the compiler refused it: {p.error}")
    if p.resident:
      print(
        f"  {p.name} +resident: " + ", ".join(f"{k} {resident[k] / GiB:.2f}" for k in p.resident)
      )
  result.update(step_report.estimate(spec, mesh, chip, progs, resident, trips, _TOP_OPS.value))
  return result


def plan_terms(c, acc: tpu_topology.Accelerator, group: int) -> dict[str, float]:
  """memory_plan.py's GiB per chip for this config's mesh and the sampler's tensor group
  ``group``, for the side-by-side."""
  run = memory_terms.Run.from_config(c)
  sizes = {ax: c.mesh[ax] for ax in ("data", "fsdp", "tensor")}
  fsdp = sizes["fsdp"] if sizes["fsdp"] > 0 else acc.chips // (sizes["data"] * sizes["tensor"])
  chunks = c.rollout.num_prompts // (c.rollout.prompts_per_call or c.rollout.num_prompts)
  slots = c.rollout.max_active_rows or 0  # the engine's W (0: every row of a call)
  terms = memory_terms.memory_terms(run, sizes["data"], fsdp, sizes["tensor"], chunks, slots, group)
  return {k: v / GiB for k, v in terms.items()}


@dataclasses.dataclass
class _Text:
  """A dumped program's HLO text where ``estimate`` reads a compiled program's."""

  text: str

  def as_text(self) -> str:
    return self.text


def _dumped(folder: str) -> list[aot.Compiled]:
  """The programs a ``--dump_hlo`` run wrote, in the step's order."""
  names = ("prefill", "decode", "gather", "logprobs", "gather_ref", "logprobs_ref", "train")
  paths = {n: os.path.join(folder, f"{n}.hlo.txt") for n in names}
  if not any(os.path.exists(p) for p in paths.values()):
    raise app.UsageError(f"--from_hlo: no <program>.hlo.txt in {folder}")
  return [
    aot.Compiled(n, _Text(open(p).read()), 0.0, 0, (), 0)
    for n, p in paths.items()
    if os.path.exists(p)
  ]


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  acc = tpu_topology.parse_accelerator(_ACCEL.value)
  tpu_topology.set_tpu_env(acc)  # before anything initialises a jax backend
  c = _CONFIG.value
  spec = RunSpec.from_config(
    c, num_devices=len(tpu_topology.topology_devices(acc)), policy_given=True
  )
  spec = aot.architecture_spec(spec)  # offline: the run file's preset for an uncached hub id
  mesh = tpu_topology.topology_mesh(spec, acc)
  print(
    f"mesh {dict(mesh.shape)} over {acc.name}; config {c.model.preset or c.model.hf_path}, "
    f"Q={c.rollout.num_prompts} G={c.rollout.num_samples} P={c.rollout.max_prompt_len} "
    f"C={c.rollout.max_new_tokens}",
    flush=True,
  )
  if _FROM_HLO.value:
    progs = _dumped(_FROM_HLO.value)
  else:
    progs = aot.compile_step(
      spec, mesh, only=tuple(_ONLY.value), log=lambda s: print(s, flush=True)
    )
  if _DUMP.value:
    os.makedirs(_DUMP.value, exist_ok=True)
    for p in progs:
      if p.compiled is not None:
        with open(os.path.join(_DUMP.value, f"{p.name}.hlo.txt"), "w") as f:
          f.write(p.compiled.as_text())
  sh = aot_programs.Shapes.from_spec(spec)
  plan = aot_programs.sampler_plan(spec, spec.model_config(), mesh)
  trips = step_estimate.trips(
    sh,
    len(plan.phases),
    plan.num_slots,
    spec.updates_per_step,
    step_estimate.Lengths(
      _PROMPT_TOKENS.value,
      _TRUNC.value,
      shared=spec.model.shared_prompts,
      prompt_cap=spec.model.shared_prompt_cols,
    ),
  )
  resident = aot_programs.resident_bytes(spec, mesh)
  if _FROM_HLO.value:
    result = {"accelerator": acc.name, "from_hlo": _FROM_HLO.value}
    result.update(
      step_report.estimate(
        spec, mesh, tpu_chips.CHIPS[acc.gen], progs, resident, trips, _TOP_OPS.value
      )
    )
  else:
    result = report(spec, mesh, acc, progs, resident, trips)
  result["mesh"] = dict(mesh.shape)
  result["shapes"] = dataclasses.asdict(aot_programs.Shapes.from_spec(spec))
  if c.model.preset in ("qwen2p5_math_1p5b", "qwen2p5_math_7b"):
    smesh = programs.sampling_layout(spec, spec.model_config(), mesh).mesh
    terms = plan_terms(c, acc, smesh.shape["tensor"] * smesh.shape["tensor_q"])
    result["plan_gib"] = terms
    print(
      "memory_plan.py for this mesh and the sampler's (GiB per chip): "
      + ", ".join(f"{k} {v:.2f}" for k, v in terms.items())
    )
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=1)
  if _CHECK.value and not all(p["fits"] for p in result["programs"].values()):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
