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

Then a roofline estimate of the step (``tools/step_estimate.py``): per program
max(FLOPs / peak bfloat16 FLOP/s, bytes / HBM bandwidth) per device with every loop
at its own trip count: the engine's decode loops by the scheduler simulation at the
README's length model (``--trunc`` at the cap), the log-prob calls and micro-batches
by packing those lengths plus ``--prompt_tokens`` a prompt; the HBM-time / FLOP-time
ratio and collectives per program, collectives per update, and how much a decode
step reads against the weights plus the filled KV blocks. Communication beyond its
HBM traffic, host work (grading) and overlap are left out: an estimate, not a
measurement.

Peer: ``memory_plan.py``'s terms for the same mesh, printed alongside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from capo_jax.run import aot, programs
from capo_jax.run.spec import RunSpec
from capo_jax.sampling import engine
from tools import memory_plan, step_estimate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).")
_ACCEL = flags.DEFINE_string("accelerator", None, "TPU slice: v4-32, v5e-16, v5p-64, v6e-16, ...")
_CHECK = flags.DEFINE_bool("check", False, "Exit 1 when a program does not fit in HBM.")
_ONLY = flags.DEFINE_list(
  "only", [], "Compile only these programs (prefill, decode, logprobs, logprobs_ref, train)."
)
_PROMPT_TOKENS = flags.DEFINE_integer(
  "prompt_tokens", 200, "Prompt tokens per question in the packing estimate."
)
_TRUNC = flags.DEFINE_float(
  "trunc", 0.045, "Fraction of samples at max_new_tokens in the length model."
)
_JSON = flags.DEFINE_string("json", "", "Also write the numbers to this JSON file.")
_DUMP = flags.DEFINE_string(
  "dump_hlo", "", "Write each compiled program's HLO text to this directory (<program>.hlo.txt)."
)
flags.mark_flags_as_required(["config", "accelerator"])

GiB = 1024**3


def _row(cells: list[str], widths: list[int]) -> str:
  return "  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths)))


def report(
  spec: RunSpec,
  mesh: Any,
  acc: aot.Accelerator,
  progs: list[aot.Compiled],
  resident: dict[str, int],
  trips: step_estimate.Trips,
) -> dict:
  chip = memory_plan.CHIPS[acc.gen]
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
  print(_row(head, widths))
  for r in rows:
    print(_row(r, widths))
  for p in progs:
    if p.error:
      print(f"  {p.name}: the compiler refused it: {p.error}")
    if p.resident:
      print(
        f"  {p.name} +resident: " + ", ".join(f"{k} {resident[k] / GiB:.2f}" for k in p.resident)
      )
  result.update(estimate(spec, mesh, chip, progs, resident, trips))
  return result


def estimate(
  spec: RunSpec,
  mesh: Any,
  chip: Any,
  progs: list[aot.Compiled],
  resident: dict[str, int],
  t: step_estimate.Trips,
) -> dict:
  """The step-time roofline from the programs' loops at their expected trip counts."""
  r = spec.rollout
  calls = {
    "prefill": aot.Shapes.from_spec(spec).num_calls,
    "decode": aot.Shapes.from_spec(spec).num_calls,
    "logprobs": t.logprob_calls,
    "logprobs_ref": t.logprob_calls,
    "train": spec.updates_per_step,
  }
  seconds = lambda c: max(
    c["flops"] / (chip.bf16_tflops * 1e12),  # noqa: E731
    c["bytes"] / (chip.hbm_gb_s * 1e9),
  )
  out: dict[str, Any] = {"trips": dataclasses.asdict(t), "estimate": {}}
  print(
    f"step estimate (roofline; {chip.bf16_tflops:g} bf16 TFLOP/s, {chip.hbm_gb_s:g} GB/s HBM "
    f"per chip), loops at the length model: decode steps per loop "
    + "/".join(f"{x:.0f}" for x in t.phase_steps)
    + f" per call, {t.microbatches:.1f} "
    f"micro-batches an update, {t.logprob_calls:.1f} log-prob calls a pass, packed rows "
    f"{t.real_token_fraction:.0%} real tokens:"
  )
  print(
    f"  {'program':13s} {'calls':>6s} {'TFLOP':>8s} {'GB':>8s} {'HBM/FLOP':>9s} "
    f"{'coll GB/step':>12s} {'seconds':>8s}  bound"
  )
  total, coll = 0.0, 0.0
  for p in progs:
    if p.compiled is None:
      print(f"  {p.name:13s} (not compiled)")
      continue
    c = step_estimate.weighted_cost(p.name, p.compiled.as_text(), t)
    n = calls[p.name]
    secs = seconds(c) * n
    t_flops, t_bytes = c["flops"] / (chip.bf16_tflops * 1e12), c["bytes"] / (chip.hbm_gb_s * 1e9)
    total, coll = total + secs, coll + c["collective_bytes"] * n
    out["estimate"][p.name] = dict(
      c, calls=n, seconds=secs, hbm_over_flop_time=t_bytes / t_flops if t_flops else None
    )
    print(
      f"  {p.name:13s} {n:6.1f} {c['flops'] / 1e12:8.2f} {c['bytes'] / 1e9:8.1f} "
      f"{(t_bytes / t_flops if t_flops else float('inf')):8.2f}x "
      f"{c['collective_bytes'] * n / 1e9:12.1f} {secs:8.1f}  "
      f"{'compute' if t_flops > t_bytes else 'HBM'}"
    )
  print(f"  {'step':13s} {'':6s} {'':8s} {'':8s} {'':9s} {coll / 1e9:12.1f} {total:8.1f}")
  out["step_s"], out["collective_gb_per_update"] = total, coll / 1e9 / spec.updates_per_step
  print(f"  collectives per update and chip: {coll / 1e12 / spec.updates_per_step:.2f} TB")
  dec = out["estimate"].get("decode")
  if dec:
    cfg = spec.model_config()
    smesh = programs.sampling_layout(spec, cfg, mesh).mesh  # the sampler's own mesh
    shards = smesh.shape["data"] * smesh.shape["fsdp"]  # the sampler's slots split over them
    tensor = smesh.shape["tensor"]  # its kv-head split
    kv_pos = (
      2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 / min(tensor, cfg.num_kv_heads)
    )
    slots = (
      min(r.max_active_rows or 10**9, r.num_samples * (r.prompts_per_call or r.num_prompts))
      / shards
    )
    kv = slots * dec["blocks_per_step"] * engine.KV_BLOCK * kv_pos
    ideal = resident["sampling params"] + kv
    out["decode_read_ratio"] = dec["step_bytes"] / ideal
    # The old count, HBM and on-chip traffic together (before the memory spaces were read).
    out["decode_read_ratio_all_spaces"] = (dec["step_bytes"] + dec["step_onchip_bytes"]) / ideal
    print(
      f"  decode step (first loop): reads {dec['step_bytes'] / 1e9:.2f} GB of HBM per chip "
      f"(and moves {dec['step_onchip_bytes'] / 1e9:.2f} GB on chip: "
      f"{out['decode_read_ratio_all_spaces']:.2f}x counted together) where "
      f"the weights ({resident['sampling params'] / 1e9:.2f}) and the filled KV blocks "
      f"({kv / 1e9:.2f}) make {ideal / 1e9:.2f}: {out['decode_read_ratio']:.2f}x; one "
      f"refill copy moves {dec['refill_bytes'] / 1e9:.2f} GB "
      f"({dec['refill_collective_bytes'] / 1e9:.2f} GB of it collectives)"
    )
  flop_s = sum(v["flops"] * v["calls"] for v in out["estimate"].values()) / (
    chip.bf16_tflops * 1e12
  )
  out["flop_s"] = flop_s
  print(f"  FLOP time alone: {flop_s:.1f} s. An estimate, not a measurement.")
  return out


def plan_terms(c, acc: aot.Accelerator) -> dict[str, float]:
  """memory_plan.py's GiB per chip for this config's mesh, for the side-by-side."""
  run = memory_plan.Run.from_config(c)
  sizes = {ax: c.mesh[ax] for ax in ("data", "fsdp", "tensor")}
  fsdp = sizes["fsdp"] if sizes["fsdp"] > 0 else acc.chips // (sizes["data"] * sizes["tensor"])
  chunks = c.rollout.num_prompts // (c.rollout.prompts_per_call or c.rollout.num_prompts)
  terms = memory_plan.memory_terms(run, sizes["data"], fsdp, sizes["tensor"], chunks)
  return {k: v / GiB for k, v in terms.items()}


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  acc = aot.parse_accelerator(_ACCEL.value)
  aot.set_tpu_env(acc)  # before anything initialises a jax backend
  c = _CONFIG.value
  spec = RunSpec.from_config(c, num_devices=len(aot.topology_devices(acc)), policy_given=True)
  spec = aot.architecture_spec(spec)  # offline: the run file's preset for an uncached hub id
  mesh = aot.topology_mesh(spec, acc)
  print(
    f"mesh {dict(mesh.shape)} over {acc.name}; config {c.model.preset or c.model.hf_path}, "
    f"Q={c.rollout.num_prompts} G={c.rollout.num_samples} P={c.rollout.max_prompt_len} "
    f"C={c.rollout.max_new_tokens}",
    flush=True,
  )
  progs = aot.compile_step(spec, mesh, only=tuple(_ONLY.value), log=lambda s: print(s, flush=True))
  if _DUMP.value:
    os.makedirs(_DUMP.value, exist_ok=True)
    for p in progs:
      if p.compiled is not None:
        with open(os.path.join(_DUMP.value, f"{p.name}.hlo.txt"), "w") as f:
          f.write(p.compiled.as_text())
  sh = aot.Shapes.from_spec(spec)
  plan = aot.sampler_plan(spec, spec.model_config(), mesh)
  trips = step_estimate.trips(
    sh,
    len(plan.phases),
    plan.num_slots,
    spec.updates_per_step,
    step_estimate.Lengths(_PROMPT_TOKENS.value, _TRUNC.value),
  )
  result = report(spec, mesh, acc, progs, aot.resident_bytes(spec, mesh), trips)
  result["mesh"] = dict(mesh.shape)
  result["shapes"] = dataclasses.asdict(aot.Shapes.from_spec(spec))
  if c.model.preset in ("qwen2p5_math_1p5b", "qwen2p5_math_7b"):
    terms = plan_terms(c, acc)
    result["plan_gib"] = terms
    print(
      "memory_plan.py for this mesh (GiB per chip): "
      + ", ".join(f"{k} {v:.2f}" for k, v in terms.items())
    )
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=1)
  if _CHECK.value and not all(p["fits"] for p in result["programs"].values()):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
