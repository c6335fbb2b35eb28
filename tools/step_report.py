"""The step estimate ``tools/aot_tpu.py`` prints after compiling: per program the FLOP,
HBM, on-chip, host and inter-chip times of ``capo_jax.run.hlo_cost``'s model at the chip's
rates, every loop at its trip count (``tools/step_estimate.py``), the step as optimistic
.. honest, collectives per update, and what a decode step reads against its floor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from capo_jax.run import aot, aot_programs, hlo_cost, programs
from capo_jax.run.spec import RunSpec
from capo_jax.sampling import plans
from tools import step_estimate, tpu_chips


def row(cells: list[str], widths: list[int]) -> str:
  return "  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths)))


def estimate(
  spec: RunSpec,
  mesh: Any,
  chip: Any,
  progs: list[aot.Compiled],
  resident: dict[str, int],
  t: step_estimate.Trips,
  top: int = 0,
) -> dict:
  """The step-time roofline from the programs' loops at their expected trip counts;
  ``top``: also each program's ``top`` operations by honest seconds (``_print_ops``)."""
  r = spec.rollout
  calls = {
    "prefill": aot_programs.Shapes.from_spec(spec).num_calls,
    "decode": aot_programs.Shapes.from_spec(spec).num_calls,
    "logprobs": t.logprob_calls,
    "logprobs_ref": t.logprob_calls,
    "gather": 1,  # once a pass (config.mesh.gather_once)
    "gather_ref": 1,
    "train": spec.updates_per_step,
  }
  rates = tpu_chips.rates(chip)
  out: dict[str, Any] = {"trips": dataclasses.asdict(t), "estimate": {}, "rates": vars(rates)}
  print(
    "step estimate per chip, loops at the length model: decode steps per loop "
    + "/".join(f"{x:.0f}" for x in t.phase_steps)
    + f" per call, {t.microbatches:.1f} micro-batches an update, {t.logprob_calls:.1f} "
    f"log-prob calls a pass, packed rows {t.real_token_fraction:.0%} real tokens, splash "
    f"attention's causal block pairs {t.splash_pairs:.0%} computed (the rest two sequences "
    "meet in; a program compiled before per-row tables: all). Rates: "
    f"{chip.bf16_tflops:g} bf16 TFLOP/s, HBM {chip.hbm_gb_s:g} GB/s, on chip "
    f"{tpu_chips.ONCHIP_OVER_HBM:g}x HBM (assumed), host {chip.host_gb_s:g} GB/s, ICI "
    f"{tpu_chips.ICI_LINKS_USED} x {chip.ici_link_gb_s:g} GB/s (a ring on one axis of "
    f"the {chip.ici_links}-link {chip.topology}); seconds per step:"
  )
  head = ["program", "calls", "TFLOP", "HBM GB", "chip GB", "host GB", "ICI GB"]
  head += ["FLOP s", "HBM s", "on-chip s", "host s", "ICI s", "program", "per-op", "honest"]
  rows, sums = [head], dict.fromkeys(("program_s", "op_s", "op_honest_s", "coll", "ici"), 0.0)
  count: dict[str, float] = {}  # collectives that send, a step, by program
  for p in progs:
    if p.compiled is None:
      print(f"  {p.name}: not compiled")
      continue
    c, ops = step_estimate.weighted(p.name, p.compiled.as_text(), t, rates)
    n = calls[p.name]
    secs = {k: v * n for k, v in hlo_cost.times(c, rates).items()}
    for k in ("program_s", "op_s", "op_honest_s"):
      sums[k] += secs[k]
    sums["coll"] += c["collective_bytes"] * n
    sums["ici"] += c["ici_bytes"] * n
    count[p.name] = c["collectives"] * n
    out["estimate"][p.name] = dict(
      c,
      calls=n,
      seconds=secs["program_s"],
      times=secs,
      hbm_over_flop_time=secs["hbm_s"] / secs["flop_s"] if secs["flop_s"] else None,
      top_ops=[  # seconds a step, like ``times``
        {k: v * n if isinstance(v, float) else v for k, v in row.items()}
        for row in hlo_cost.top_ops(ops, top)
      ],
    )
    gb = [c[k] * n / 1e9 for k in ("bytes", "onchip_bytes", "host_bytes", "ici_bytes")]
    rows.append(
      [p.name, f"{n:.1f}", f"{c['flops'] * n / 1e12:.1f}", *(f"{x:.1f}" for x in gb)]
      + [f"{secs[k]:.2f}" for k in ("flop_s", "hbm_s")]
      + [f"0..{secs['onchip_s']:.2f}"]
      + [f"{secs[k]:.2f}" for k in ("host_s", "ici_s", "program_s", "op_s", "op_honest_s")]
    )
  rows.append(
    ["step"] + [""] * 11 + [f"{sums[k]:.1f}" for k in ("program_s", "op_s", "op_honest_s")]
  )
  widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
  for cells in rows:
    print("  " + row(cells, widths))
  out["step_s"], out["step_honest_s"] = sums["program_s"], sums["op_honest_s"]
  out["step_op_s"] = sums["op_s"]
  out["collective_gb_per_update"] = sums["coll"] / 1e9 / spec.updates_per_step
  out["ici_gb_per_step"] = sums["ici"] / 1e9
  print(
    f"  step {sums['program_s']:.1f} .. {sums['op_honest_s']:.1f} s: optimistic (each program "
    "one roofline of FLOPs and HBM) .. honest (each operation its own, on-chip traffic at "
    "the assumed bandwidth, host and inter-chip traffic timed, nothing overlapped; "
    "a copy one stream)"
  )
  full = _full_length_collectives(progs, t, calls, aot_programs.Shapes.from_spec(spec))
  out["collective_gb_per_update_full_lengths"] = full / 1e9 / spec.updates_per_step
  print(
    f"  collectives per update and chip (results, the older count): "
    f"{out['collective_gb_per_update'] / 1e3:.2f} TB at the length model; log-prob passes "
    f"and train at full lengths (every sequence at its longest, as the 1452f23 comparison "
    f"counted): {out['collective_gb_per_update_full_lengths'] / 1e3:.2f} TB; sent over ICI "
    f"per step: {out['ici_gb_per_step'] / 1e3:.2f} TB"
  )
  out["collectives_per_step"] = total = sum(count.values())
  by = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(count.items(), key=lambda x: -x[1]) if v)
  print(
    f"  collectives that send, a step: {total:,.0f} ({by}). What each costs besides its bytes "
    f"(latency, synchronisation) is in no sum above: each microsecond of it would add "
    f"{total * 1e-6:.2f} s a step"
  )
  if top:
    _print_ops(out["estimate"], top)
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
    kv = slots * dec["blocks_per_step"] * plans.KV_BLOCK * kv_pos
    kv_name = "the filled KV blocks"
    if dec["step_ragged_bytes"]:  # the ragged kernel: the floor is each row's own columns
      kv, kv_name = dec["step_own_kv_bytes"], "each row's own-length KV"
      _print_ragged(dec, t, spec)
    ideal = resident["sampling params"] + kv
    out["decode_read_ratio"] = dec["step_bytes"] / ideal
    # The old count, HBM and on-chip traffic together (before the memory spaces were read).
    out["decode_read_ratio_all_spaces"] = (dec["step_bytes"] + dec["step_onchip_bytes"]) / ideal
    print(
      f"  decode step (first loop): reads {dec['step_bytes'] / 1e9:.2f} GB of HBM per chip "
      f"(and moves {dec['step_onchip_bytes'] / 1e9:.2f} GB on chip: "
      f"{out['decode_read_ratio_all_spaces']:.2f}x counted together) where "
      f"the weights ({resident['sampling params'] / 1e9:.2f}) and {kv_name} "
      f"({kv / 1e9:.2f}) make {ideal / 1e9:.2f}: {out['decode_read_ratio']:.2f}x; one "
      f"refill iteration (a chunk of a row's prompt, {t.refill_chunks:.0f} a row) moves "
      f"{dec['refill_bytes'] / 1e9:.3f} GB ({dec['refill_collective_bytes'] / 1e9:.3f} GB "
      f"of it collectives)"
    )
  flop_s = sum(v["times"]["flop_s"] for v in out["estimate"].values())
  out["flop_s"] = flop_s
  print(f"  FLOP time alone: {flop_s:.1f} s. An estimate, not a measurement.")
  return out


def _print_ops(estimate: dict[str, dict], top: int) -> None:
  """Each program's ``top`` operations by honest seconds a step: what bounds each."""
  print(
    f"  where the honest seconds go: each program's {top} largest operations (a kind and "
    "the JAX op name it came from; seconds a step: honest, then its FLOP, HBM, on-chip, "
    "host and inter-chip times)"
  )
  for name, est in estimate.items():
    total = est["times"]["op_honest_s"]
    shown = [r for r in est["top_ops"] if r["honest_s"] >= 0.005]  # not what prints 0.00
    for r in shown:
      parts = ", ".join(
        f"{label} {r[k]:.2f}"
        for k, label in zip(hlo_cost.OP_PARTS[1:], ("FLOP", "HBM", "on chip", "host", "ICI"))
        if r[k] >= 0.005
      )
      share = r["honest_s"] / total if total else 0.0
      print(f"    {name:<12} {r['honest_s']:6.2f} ({share:4.0%})  {r['op']}  [{parts}]")


def _print_ragged(dec: dict, t: step_estimate.Trips, spec: RunSpec) -> None:
  """How the ragged decode attention (a Pallas kernel) was counted: its length model."""
  sh = aot_programs.Shapes.from_spec(spec)
  print(
    "  ragged decode attention (Pallas, reads each slot's own blocks): counted by the "
    "columns a slot copies a step at the length model, "
    + " / ".join(f"{c:.0f}" for c in t.phase_cols)
    + f" in the engine's loops (prompts of {t.prompt_tokens} tokens left-padded to "
    f"{sh.prompt_len}, blocks of {plans.RAGGED_BLOCK} columns from a row's first column "
    f"rounded down to {plans.RAGGED_ALIGN}, the last cut to {plans.RAGGED_ALIGN}-column "
    f"tiles, idle slots none): "
    f"{dec['step_ragged_bytes'] / 1e9:.2f} GB of keys and values a step of the first loop, "
    f"{dec['step_ragged_bytes'] / max(dec['step_own_kv_bytes'], 1.0):.2f}x the rows' own "
    f"{dec['step_own_kv_bytes'] / 1e9:.2f}, where every slot's whole cache would be "
    f"{dec['step_ragged_whole_bytes'] / 1e9:.2f}"
  )


def _full_length_collectives(
  progs: list[aot.Compiled],
  t: step_estimate.Trips,
  calls: dict[str, float],
  sh: aot_programs.Shapes,
) -> float:
  """Collective bytes (results) per step of the log-prob passes and the train updates
  with every sequence at its longest: the calls and micro-batches of ``sh`` (upper
  bounds) in place of the length model's."""
  full = dataclasses.replace(t, logprob_calls=sh.logprob_calls, microbatches=sh.microbatches)
  total = 0.0
  for p in progs:
    if p.compiled is not None and p.name in ("logprobs", "logprobs_ref", "train"):
      n = sh.logprob_calls if p.name != "train" else calls["train"]
      total += (
        step_estimate.weighted_cost(p.name, p.compiled.as_text(), full)["collective_bytes"] * n
      )
  return total
