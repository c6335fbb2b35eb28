"""The cued testbed's RL train updates (``configs/cued.py``), timed phase by phase on the CPU.

    python -m benchmarks.cued_step                          # 5 rounds, per-phase medians
    python -m benchmarks.cued_step --model layer_unroll=4,trim_last_layer=true \
        --baseline layer_unroll=1,trim_last_layer=false     # and A/B against a model variant
    python -m benchmarks.cued_step --pack_len 34 --pack_rows 64   # another row layout

The workload is one RL step of the testbed as the trainer runs it: the demo's model
(``warm_start.default_model_config``: 4 layers, hidden 128, float32, char vocabulary)
with random weights, 32 of the task's RL prompts x 8 completions of 1-3 digits and
``<eos>`` (the answers' lengths), planned into the two updates' packed micro-batches
by ``microbatches.plan_step`` with the config's row layout, the config's loss (CAPO) and
AdamW. Each round times, after a warm-up that compiles everything:

  update   the step's two jitted train updates (``train_step.make_train_step``);
  grad     the loss and gradient of one update alone (``train_step.loss_and_grads``);
  forward  one micro-batch's log-prob forward (``make_logprob_fn``: the reference pass);
  optim    AdamW on a gradient alone (``optim.make_optimizer``);

each phase ``--repeats`` times in a row (median kept), phases in a rotated order from round
to round (the machine is shared). ``--baseline FIELD=VALUE,...`` adds the two updates
under the model config with those fields changed, alternated with this one's within
each round, and prints the ratio baseline / this of the update time (> 1: this is
faster), with the range of the per-round ratios. Times are wall clock and process
CPU seconds (both threads), medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

if __name__ == "__main__":  # before JAX is imported (capo_jax/hugepages.py)
  from capo_jax import hugepages

  hugepages.reexec_with_hugepages()

# pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import threads


def cued_rollout(seed: int = 0) -> dict[str, Any]:
  """A step's sequences of the testbed: prompts [B, P] left-padded, completions [B, C]
  right-padded, and the loss's per-sequence arrays (random but plausible)."""
  from capo_jax.demo import cued  # pylint: disable=g-import-not-at-top
  from configs import cued as cued_cfg  # pylint: disable=g-import-not-at-top

  c = cued_cfg.get_config()
  task = cued.CuedConfig(**c.demo.task.to_dict())
  tok = cued.tokenizer()
  rl, _ = cued.make_splits(task)
  r = c.rollout
  Q, G, P, C = r.num_prompts, r.num_samples, r.max_prompt_len, r.max_new_tokens
  rng = np.random.default_rng(seed)
  B = Q * G
  prompt = np.full((B, P), tok.pad_id, np.int32)
  pmask = np.zeros((B, P), np.int32)
  comp = np.full((B, C), tok.pad_id, np.int32)
  cmask = np.zeros((B, C), np.int32)
  digits = tok.encode("0123456789")
  for q, ex in enumerate(rng.choice(len(rl), Q, replace=False)):
    ids = tok.encode_prompt(rl[ex].problem)
    for g in range(G):
      b = q * G + g
      prompt[b, P - len(ids) :], pmask[b, P - len(ids) :] = ids, 1
      n = int(rng.integers(1, 4))
      comp[b, : n + 1] = [*rng.choice(digits, n), tok.eos_id]
      cmask[b, : n + 1] = 1
  old = np.where(cmask > 0, -rng.exponential(0.5, (B, C)), 0).astype(np.float32)
  ref = np.where(cmask > 0, old + rng.normal(0, 0.05, (B, C)), 0).astype(np.float32)
  adv = rng.normal(size=B).astype(np.float32)
  return dict(config=c, tokenizer=tok, prompt=prompt, pmask=pmask, comp=comp, cmask=cmask,
              old=old, ref=ref, adv=adv)  # fmt: skip


def _median_of(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
  """Median wall and process-CPU seconds of ``repeats`` calls."""
  wall, cpu = [], []
  for _ in range(repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return statistics.median(wall), statistics.median(cpu)


def _overrides(text: str) -> dict[str, Any]:
  """``"a=1,b=false,c=x"`` -> ``{"a": 1, "b": False, "c": "x"}``."""
  out: dict[str, Any] = {}
  for item in filter(None, text.split(",")):
    key, _, value = item.partition("=")
    flags = {"true": True, "false": False}
    out[key] = int(value) if value.lstrip("-").isdigit() else flags.get(value.lower(), value)
  return out


class Workload:
  """The step's two train updates (and its phases) under one model config."""

  def __init__(self, cfg: Any, spec: Any, batches: list[Any], rows: int) -> None:
    # pylint: disable=g-import-not-at-top
    import jax

    from capo_jax.rl import train_step as ts
    from capo_jax.rl.optim import make_optimizer
    from capo_jax.runtime import mesh as mesh_lib
    from models import qwen2

    tcfg = spec.train_config()
    mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
    rules = mesh_lib.TRAIN_RULES
    params = qwen2.init_params(cfg, jax.random.key(0))
    self.state = ts.train_state_from_params(params, cfg, tcfg, mesh, rules)
    self.batches = batches
    self.step_fn = ts.make_train_step(cfg, tcfg, mesh, rules, rows)
    grad_fn = jax.jit(lambda p, b: ts.loss_and_grads(p, b, cfg, tcfg)[2])
    lp_fn = ts.make_logprob_fn(cfg, mesh, rules, rows)
    optimizer = make_optimizer(tcfg.optim)
    opt_fn = jax.jit(optimizer.update)
    grads = grad_fn(self.state.params, batches[0])
    mb0 = jax.tree.map(lambda x: x[0], batches[0].rows)
    block = jax.block_until_ready
    self.phases: dict[str, Callable[[], Any]] = {
      "update": self.updates,
      "grad": lambda: block(grad_fn(self.state.params, batches[0])),
      "forward": lambda: block(lp_fn(self.state.params, mb0)),
      "optim": lambda: block(opt_fn(grads, self.state.opt_state, self.state.params)),
    }
    t0 = time.perf_counter()
    for fn in self.phases.values():  # compiles
      fn()
    self.compile_s = time.perf_counter() - t0  # the four programs' compiles and first runs

  def updates(self) -> None:
    import jax  # pylint: disable=g-import-not-at-top

    for b in self.batches:
      self.state, metrics = self.step_fn(self.state, b)
    jax.block_until_ready(metrics)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per phase and round")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--model", default="", help="model config fields of this side")
  parser.add_argument("--baseline", default="", help="model config fields of the B side")
  parser.add_argument("--pack_len", type=int, default=-1, help="train.pack_len (-1: config's)")
  parser.add_argument("--pack_rows", type=int, default=-1, help="train.pack_rows (-1: config's)")
  parser.add_argument("--json", help="write the per-phase medians here")
  args = parser.parse_args(argv)
  threads.pin(args.threads)  # before JAX's backend starts

  # pylint: disable=g-import-not-at-top
  import jax

  from capo_jax.demo import warm_start
  from capo_jax.rl import microbatches
  from capo_jax.rl import train_step as ts
  from capo_jax.rl.batch import Sequences
  from capo_jax.run.spec import RunSpec
  from capo_jax.runtime import mesh as mesh_lib

  d = cued_rollout()
  c = d["config"]
  if args.pack_len >= 0:
    c.train.pack_len = args.pack_len
  if args.pack_rows >= 0:
    c.train.pack_rows = args.pack_rows
  spec = RunSpec.from_config(c, policy_given=True, num_devices=1)
  row_len, rows = spec.packing_shape()
  layout = microbatches.RowLayout(row_len, rows, spec.train.pack)
  plans = microbatches.plan_step(
    d["prompt"], d["pmask"], d["comp"], d["cmask"], layout, spec.rows_per_update
  )
  seqs = Sequences(
    completion_mask_BC=d["cmask"], old_logp_BC=d["old"], adv_B=d["adv"], ref_logp_BC=d["ref"]
  )
  mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  sh = ts.batch_sharding(mesh, mesh_lib.TRAIN_RULES, rows)
  batches = [jax.device_put(p.batch(seqs), sh) for p in plans]
  real = int(d["pmask"].sum() + d["cmask"].sum())
  computed = sum(int(np.prod(b.rows.tokens_YT.shape)) for b in batches)
  M, Y, T = batches[0].rows.tokens_YT.shape
  used = sum(int((p.rows.segment_ids_YT > 0).any(-1).sum()) for p in plans)
  print(
    f"{len(plans)} updates of {spec.rows_per_update} sequences; the first {M} micro-batch(es) "
    f"of {Y} rows x {T} tokens, {batches[0].rows.targets_YZ.shape[-1]} target slots a row; "
    f"rows holding tokens {used} of {sum(b.rows.tokens_YT.shape[0] * Y for b in batches)}; "
    f"tokens computed {computed}, real {real} ({computed / real:.2f}x)"
  )
  cfg = warm_start.default_model_config(d["tokenizer"])
  if args.model:
    cfg = cfg.replace(**_overrides(args.model))
  sides = {"this": Workload(cfg, spec, batches, rows)}
  if args.baseline:
    base = cfg.replace(**_overrides(args.baseline))
    sides["baseline"] = Workload(base, spec, batches, rows)
  print(f"model: {cfg}" + (f"; baseline: {args.baseline}" if args.baseline else ""))
  print("compile + first call of the phases: " + ", ".join(
    f"{side} {w.compile_s:.1f} s" for side, w in sides.items()
  ))  # fmt: skip
  timed = [(side, k) for side in sides for k in sides[side].phases]
  if args.baseline:  # the A/B pair only: "update" of each side
    timed = [(side, "update") for side in sides]
  wall: dict[str, list[float]] = {f"{s}/{k}": [] for s, k in timed}
  cpu: dict[str, list[float]] = {f"{s}/{k}": [] for s, k in timed}
  for r in range(args.rounds):
    for side, k in timed[r % len(timed) :] + timed[: r % len(timed)]:
      w, c_s = _median_of(sides[side].phases[k], args.repeats)
      wall[f"{side}/{k}"].append(w)
      cpu[f"{side}/{k}"].append(c_s)
  med = {k: statistics.median(v) for k, v in wall.items()}
  med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
  for k, v in wall.items():
    print(
      f"  {k:16s} wall {med[k] * 1e3:8.1f} ms (rounds {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}), "
      f"CPU {med_cpu[k] * 1e3:8.1f} ms"
    )
  result: dict[str, Any] = {"wall_s": med, "cpu_s": med_cpu, "rounds_wall_s": wall}
  if args.baseline:
    paired = [b / a for a, b in zip(wall["this/update"], wall["baseline/update"])]
    paired_cpu = [b / a for a, b in zip(cpu["this/update"], cpu["baseline/update"])]
    result.update(ratio_rounds=paired, ratio_cpu_rounds=paired_cpu)
    print(
      f"  baseline / this, the two updates: wall {statistics.median(paired):.2f}x (rounds "
      f"{min(paired):.2f}-{max(paired):.2f}), CPU {statistics.median(paired_cpu):.2f}x "
      f"(rounds {min(paired_cpu):.2f}-{max(paired_cpu):.2f})"
    )
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
