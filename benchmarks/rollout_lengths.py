"""Long-tailed rollouts: the engine vs the all-rows decode, measured on CPU and simulated at scale.

  python -m benchmarks.rollout_lengths               # CPU measurement, then the simulation
  python -m benchmarks.rollout_lengths --simulate    # the simulation alone (seconds)
  python -m benchmarks.rollout_lengths --small       # a tiny smoke run of both

Measurement (CPU): the 27.7M-parameter benchmark model of benchmarks/sampling.py
(hidden 512, 4 layers, vocab 32,000; random weights, so its next-token
distribution is near uniform) with V / 100 stop ids, so a row stops at each
step with probability about 1/100: geometric lengths, capped at 1,024. 16
prompts x 8 samples. Contenders, alternated round by round after a warm-up:
``generate(max_active_rows=B/4)`` (the engine), ``generate()`` (all B rows
decode at once until the last stops) and transformers ``generate`` on the
same rows and weights, all on ``--threads`` CPUs and as many threads each
(``benchmarks/threads.py``). Reported: the length distribution, then useful
(generated, unpadded: up to and including the stop) tokens/s and the ratios.
The engine's and the all-rows samples must be identical (same rng).

Simulation: the engine's scheduler at the real job's shape, Q*G = 1,024 rows,
lengths from a model of Qwen2.5-Math under GRPO, and a bandwidth model that
turns the KV positions each decode reads into time (``tools/rollout_sim.py``),
against the lockstep decode over the whole cache and up to the longest row.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import numpy as np

from tools.rollout_sim import Shape, expected_speedup, sample_lengths, seconds, simulate

# --- the CPU measurement ----------------------------------------------------------


def useful_lengths(tokens_BC: np.ndarray, stop_ids: np.ndarray) -> np.ndarray:
  """Tokens up to and including the first stop id (all of them when none)."""
  hit_BC = np.isin(tokens_BC, stop_ids)
  first_B = np.where(hit_BC.any(1), hit_BC.argmax(1) + 1, tokens_BC.shape[1])
  return first_B


def describe(lengths: np.ndarray, cap: int) -> str:
  q = np.percentile(lengths, [10, 25, 50, 75, 90, 99])
  return (
    f"mean {lengths.mean():.0f}, max {lengths.max()}, at cap {np.mean(lengths >= cap):.1%}; "
    f"percentiles 10/25/50/75/90/99: "
    + "/".join(f"{x:.0f}" for x in q)
    + f"; longest / mean = {lengths.max() / lengths.mean():.1f}"
  )


def measure(args: argparse.Namespace) -> None:
  # Imported here: --simulate needs none of them.
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  from benchmarks import sampling as sampling_bench  # pylint: disable=g-import-not-at-top
  from benchmarks import threads  # pylint: disable=g-import-not-at-top
  from capo_jax.sampling import sampler as sampling  # pylint: disable=g-import-not-at-top
  from models import hf_weights, qwen2  # pylint: disable=g-import-not-at-top

  threads.pin(args.threads)  # before JAX's backend starts: both sides on as many CPUs
  threads.check(args.threads)
  cfg = sampling_bench.bench_config(args.small)
  params = qwen2.init_params(cfg, jax.random.key(0))
  Q, G, C = args.prompts, args.samples, args.cap
  B = Q * G
  W = B // 4
  prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, (Q, args.prompt_len))
  mask = np.ones_like(prompts)
  stops = (
    np.random.default_rng(1)
    .choice(np.arange(3, cfg.vocab_size), cfg.vocab_size // 100, replace=False)
    .astype(np.int32)
  )
  print(
    f"model {qwen2.num_params(params) / 1e6:.1f}M params; {Q} prompts x {G} samples = {B} "
    f"rows, prompt {args.prompt_len}, cap {C}; {stops.size} stop ids of {cfg.vocab_size}; "
    f"engine W = {W}; jax {jax.__version__}, {os.cpu_count()} CPUs",
    flush=True,
  )

  def engine(n):
    def run(seed):
      out = sampling.generate(
        params,
        cfg,
        prompts,
        mask,
        jax.random.key(seed),
        sampling.SamplingSpec(
          num_samples=G, max_new_tokens=C, stop_ids=stops.tolist(), max_active_rows=n
        ),
      )
      return np.asarray(out.tokens_BC), np.asarray(out.lengths_B)

    return run

  with tempfile.TemporaryDirectory() as tmp:
    hf_weights.save_pretrained(cfg, params, tmp)
    model = transformers.Qwen2ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
  ids = torch.as_tensor(np.repeat(prompts, G, 0), dtype=torch.long)

  def hf(seed):
    torch.manual_seed(seed)
    with torch.inference_mode():
      out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=C,
        eos_token_id=stops.tolist(),
        pad_token_id=0,
      )
    tokens = out[:, prompts.shape[1] :].numpy()
    return tokens, useful_lengths(tokens, stops)

  runners = {f"engine W={W}": engine(W), f"all {B} rows": engine(None), "transformers": hf}
  if args.no_transformers:
    del runners["transformers"]
  names = list(runners)
  warm = {}
  for name, run in runners.items():  # warm-up: compilation (and one whole rollout)
    t0 = time.perf_counter()
    warm[name] = run(0)
    dt = time.perf_counter() - t0
    print(
      f"warm-up {name} (compiles): {dt:.1f}s, {warm[name][1].sum() / dt:.0f} useful "
      f"tokens/s; lengths {describe(warm[name][1], C)}",
      flush=True,
    )
  print(
    "warm-up: engine samples identical to all-rows:",
    np.array_equal(warm[names[0]][0], warm[names[1]][0]),
    flush=True,
  )
  secs = {n: [] for n in names}
  useful = {n: [] for n in names}
  for r in range(args.rounds):
    outs = {}
    for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
      t0 = time.perf_counter()
      outs[name] = runners[name](r + 1)
      secs[name].append(time.perf_counter() - t0)
      useful[name].append(int(outs[name][1].sum()))
    same = np.array_equal(outs[names[0]][0], outs[names[1]][0])
    if not same:
      raise RuntimeError(f"round {r + 1}: the engine's samples differ from the all-rows decode")
    print(
      f"round {r + 1}: "
      + ", ".join(f"{n} {secs[n][-1]:.1f}s" for n in names)
      + "; engine samples identical to all-rows: yes",
      flush=True,
    )
    print(f"  lengths (ours): {describe(outs[names[0]][1], C)}", flush=True)
    if "transformers" in outs:
      print(f"  lengths (transformers): {describe(outs['transformers'][1], C)}", flush=True)
  if not args.rounds:
    return
  rate = {n: sum(useful[n]) / sum(secs[n]) for n in names}
  print(f"\n{'sampler':18s} {'useful tok/s':>12s} {'vs all rows':>11s}  per-round ratio")
  for n in names:
    paired = [
      (u / s) / (ua / sa)
      for u, s, ua, sa in zip(useful[n], secs[n], useful[names[1]], secs[names[1]])
    ]
    print(
      f"{n:18s} {rate[n]:12.0f} {rate[n] / rate[names[1]]:10.2f}x  "
      + " ".join(f"{x:.2f}" for x in paired)
    )
  if "transformers" in rate:
    print(f"engine / transformers: {rate[names[0]] / rate['transformers']:.2f}x", flush=True)


# --- the scheduler simulation -------------------------------------------------------


def simulation(shape: Shape, slot_counts: list[int]) -> None:
  L = sample_lengths(np.random.default_rng(0), shape)
  print(
    f"\n== simulation: {shape.rows} rows, prompt {shape.prompt_len} + cap {shape.cap}, "
    f"block {shape.block}; weights {shape.weight_bytes / 1e9:.2f} GB x {shape.replicas}, "
    f"KV {shape.kv_bytes} B/position, {shape.bandwidth / 1e9:.0f} GB/s"
  )
  print(f"lengths: {describe(L, shape.cap)}; useful tokens {L.sum()}")
  lock = simulate(L, shape, None)
  t_old = seconds(lock, shape, read="kv_read_full")
  t_lock = seconds(lock, shape)
  print(
    f"{'decode':24s} {'steps':>6s} {'rows/step':>9s} {'KV GiB':>7s} {'KV read/step GB':>15s} "
    f"{'time s':>7s} {'speedup':>8s}"
  )
  kv_gib = lambda n: n * (shape.prompt_len + shape.cap) * shape.kv_bytes / 1024**3
  print(
    f"{'lockstep, full cache':24s} {lock['steps']:6d} {shape.rows:9d} {kv_gib(shape.rows):7.1f} "
    f"{lock['kv_read_full'] * shape.kv_bytes / lock['steps'] / 1e9:15.1f} {t_old:7.1f} "
    f"{1.0:7.2f}x"
  )
  print(
    f"{'lockstep, filled blocks':24s} {lock['steps']:6d} {shape.rows:9d} "
    f"{kv_gib(shape.rows):7.1f} {lock['kv_read'] * shape.kv_bytes / lock['steps'] / 1e9:15.1f}"
    f" {t_lock:7.1f} {t_old / t_lock:7.2f}x"
  )
  for n in slot_counts:
    sim = simulate(L, shape, n)
    for read, label in (("kv_read", f"engine W={n}"), ("kv_read_own", "  each row its own")):
      t = seconds(sim, shape, read)
      print(
        f"{label:24s} {sim['steps']:6d} {n:9d} {kv_gib(n):7.1f} "
        f"{sim[read] * shape.kv_bytes / sim['steps'] / 1e9:15.1f} {t:7.1f} "
        f"{t_old / t:7.2f}x"
      )
  print(
    "expected speedup over the lockstep full-cache decode (mean of 4 length draws): "
    + ", ".join(f"W={n}: {expected_speedup(shape, n):.2f}x" for n in slot_counts)
  )


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--cap", type=int, default=1024)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--threads", type=int, default=2, help="CPUs and intra-op threads of each side")
  ap.add_argument("--small", action="store_true", help="tiny model and batch: a smoke run")
  ap.add_argument("--no-transformers", action="store_true", help="our two decodes only")
  ap.add_argument("--simulate", action="store_true", help="the simulation only")
  ap.add_argument("--slots", default="128,256,512", help="engine W values to simulate")
  ap.add_argument("--replicas", type=int, default=1, help="weight copies read per step")
  args = ap.parse_args()
  if args.small:
    args.prompts, args.samples, args.cap, args.rounds = 4, 4, 64, 1
  if not args.simulate:
    measure(args)
  shape = Shape(replicas=args.replicas)
  if args.small:
    shape = dataclasses.replace(shape, rows=64, cap=256)
  simulation(shape, [int(n) for n in args.slots.split(",") if int(n) < shape.rows])


if __name__ == "__main__":
  main()
