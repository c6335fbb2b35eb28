r"""Compile every program of one RL step for a TPU slice, ahead of time, on this CPU.

  benchmarks/setup_aot_tpu.sh                          # once: benchmarks/.venv-tpu with libtpu
  benchmarks/.venv-tpu/bin/python -m benchmarks.aot_tpu \
      --config=configs/capo_qwen2p5_math_1p5b.py --accelerator=v5e-32 --config.mesh.tensor=2

Builds the run's mesh over the slice's devices (``jax.experimental.topologies``;
no TPU needed), compiles the programs the trainer runs (``capo_jax.run.programs``:
prefill, the decode loop, the log-prob pass(es), the train step's micro-batch loop +
AdamW; packed when ``train.pack``, with LoRA's adapters when set) at the run's largest
shapes with its shardings (``capo_jax.run.aot``), and prints per program and per device XLA's memory
analysis, what else is resident on the chip while it runs (train state,
reference, sampler weights), the total against the chip's HBM, and the FLOPs
and bytes of XLA's cost analysis with loop bodies counted per iteration
(``capo_jax.runtime.hlo_cost``). ``--check`` exits 1 when a program does not fit.

Then a roofline estimate of the step: per program max(FLOPs / peak bfloat16
FLOP/s, bytes / HBM bandwidth) per device, times its calls per step; the
decode loop's body (one token for every row) times ``--decode_steps`` (default
max_new_tokens: the loop runs until every row has stopped, and among Q*G = 1024
rows one nearly always runs to the limit). Communication, host work (grading)
and overlap are left out: an estimate, not a measurement.

Peer: ``memory_plan.py``'s terms for the same mesh, printed alongside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from benchmarks import memory_plan
from capo_jax.run import aot
from capo_jax.run.spec import RunSpec

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).")
_ACCEL = flags.DEFINE_string("accelerator", None, "TPU slice: v4-32, v5e-16, v5p-64, v6e-16, ...")
_CHECK = flags.DEFINE_bool("check", False, "Exit 1 when a program does not fit in HBM.")
_ONLY = flags.DEFINE_list("only", [], "Compile only these programs (prefill, decode, logprobs, "
                          "logprobs_ref, train).")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 0, "Decode steps per sampler call for the "
                                     "roofline (0: max_new_tokens).")
_JSON = flags.DEFINE_string("json", "", "Also write the numbers to this JSON file.")
_DUMP = flags.DEFINE_string("dump_hlo", "", "Write each compiled program's HLO text to this "
                            "directory (<program>.hlo.txt).")
flags.mark_flags_as_required(["config", "accelerator"])

GiB = 1024**3


def _row(cells: list[str], widths: list[int]) -> str:
  return "  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths)))


def report(c, acc: aot.Accelerator, progs: list[aot.Compiled], resident: dict[str, int],
           decode_steps: int) -> dict:
  chip = memory_plan.CHIPS[acc.gen]
  hbm = chip.hbm_gib * GiB
  rows, result = [], {"accelerator": acc.name, "hbm_gib": chip.hbm_gib, "programs": {},
                      "resident_gib": {k: v / GiB for k, v in resident.items()}}
  for p in progs:
    mem = p.memory
    extra = sum(resident[k] for k in p.resident)
    total = mem["peak"] + extra
    cost = p.cost
    # Unbounded loops (the decode loop) hold one iteration in loop_*: the rest
    # runs once per call, the iteration once per decode step.
    seconds = lambda flops, bytes_: max(flops / (chip.bf16_tflops * 1e12),
                                        bytes_ / (chip.hbm_gb_s * 1e9))
    t_call = seconds(cost.get("flops", 0) - cost.get("loop_flops", 0),
                     cost.get("bytes", 0) - cost.get("loop_bytes", 0))
    t_iter = seconds(cost.get("loop_flops", 0), cost.get("loop_bytes", 0))
    steps = decode_steps if cost.get("unbounded_loops") else 0
    t_flops = cost.get("flops", 0) / (chip.bf16_tflops * 1e12)
    t_bytes = cost.get("bytes", 0) / (chip.hbm_gb_s * 1e9)
    fits = total <= hbm and not p.error
    result["programs"][p.name] = dict(
        compile_s=p.compile_s, error=p.error, calls_per_step=p.calls_per_step,
        memory_gib={k: v / GiB for k, v in mem.items()}, resident=list(p.resident),
        resident_gib=extra / GiB, total_gib=total / GiB, fits=fits,
        margin_gib=(hbm - total) / GiB, cost=cost, loop_steps=steps,
        roofline_s=(t_call + steps * t_iter) * p.calls_per_step,
        bound="compute" if t_flops > t_bytes else "HBM",
        hbm_over_flop_time=t_bytes / t_flops if t_flops else float("inf"),
        collective_gb_per_step=cost.get("collective_bytes", 0) * p.calls_per_step / 1e9)
    rows.append([p.name, f"{p.compile_s:.0f}", *(f"{mem[k] / GiB:.2f}" for k in
                 ("arguments", "outputs", "temporaries", "aliased", "peak")),
                 f"{extra / GiB:.2f}", f"{total / GiB:.2f}",
                 ("fits" if fits else "does not fit") + f" {(hbm - total) / GiB:+.2f}",
                 f"{cost.get('flops', 0) / 1e12:.3f}" if cost else "-",
                 f"{cost.get('bytes', 0) / 1e9:.2f}" if cost else "-"])
  head = ["program", "compile s", "args", "outputs", "temps", "aliased", "peak", "+resident",
          "total", f"vs {chip.hbm_gib:g} GiB HBM", "TFLOP", "GB"]
  widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
  print(f"== {acc.name} ({acc.topology}, {acc.chips} chips), GiB per device; FLOPs and bytes per "
        "device per call, loop bodies x trip counts (the decode loop: one step)")
  print(_row(head, widths))
  for r in rows:
    print(_row(r, widths))
  for p in progs:
    if p.error:
      print(f"  {p.name}: the compiler refused it: {p.error}")
    if p.resident:
      print(f"  {p.name} +resident: " + ", ".join(
          f"{k} {resident[k] / GiB:.2f}" for k in p.resident))
  total_s = 0.0
  print(f"roofline estimate per RL step (peak {chip.bf16_tflops:g} bf16 TFLOP/s, "
        f"{chip.hbm_gb_s:g} GB/s HBM per chip; decode x {decode_steps} steps per call):")
  for name, r in result["programs"].items():
    if r["error"]:
      print(f"  {name:13s} -  (not compiled)")
      continue
    total_s += r["roofline_s"]
    steps = f" x {r['loop_steps']} steps" if r["loop_steps"] else ""
    print(f"  {name:13s} {r['roofline_s']:8.1f} s  ({r['calls_per_step']} calls{steps}, "
          f"{r['bound']} bound)")
  print(f"  {'step':13s} {total_s:8.1f} s")
  print("per program and device: HBM-traffic time / FLOP time (one call; unbounded loops "
        "once), collectives per call and per step:")
  for name, r in result["programs"].items():
    if not r["error"]:
      print(f"  {name:13s} {r['hbm_over_flop_time']:7.2f}x  "
            f"{r['cost'].get('collective_bytes', 0) / 1e9:9.2f} GB  "
            f"{r['collective_gb_per_step']:9.1f} GB/step")
  result["roofline_step_s"] = total_s
  return result


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
  mesh = aot.topology_mesh(spec, acc)
  print(f"mesh {dict(mesh.shape)} over {acc.name}; config {c.model.preset or c.model.hf_path}, "
        f"Q={c.rollout.num_prompts} G={c.rollout.num_samples} P={c.rollout.max_prompt_len} "
        f"C={c.rollout.max_new_tokens}", flush=True)
  progs = aot.compile_step(spec, mesh, only=tuple(_ONLY.value),
                           log=lambda s: print(s, flush=True))
  if _DUMP.value:
    os.makedirs(_DUMP.value, exist_ok=True)
    for p in progs:
      if p.compiled is not None:
        with open(os.path.join(_DUMP.value, f"{p.name}.hlo.txt"), "w") as f:
          f.write(p.compiled.as_text())
  steps = _DECODE_STEPS.value or c.rollout.max_new_tokens
  result = report(c, acc, progs, aot.resident_bytes(spec, mesh), steps)
  result["mesh"] = dict(mesh.shape)
  result["shapes"] = dataclasses.asdict(aot.Shapes.from_spec(spec))
  if c.model.preset in ("qwen2p5_math_1p5b", "qwen2p5_math_7b"):
    terms = plan_terms(c, acc)
    result["plan_gib"] = terms
    print("memory_plan.py for this mesh (GiB per chip): " + ", ".join(
        f"{k} {v:.2f}" for k, v in terms.items()))
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=1)
  if _CHECK.value and not all(p["fits"] for p in result["programs"].values()):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
