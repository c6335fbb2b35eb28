"""Decode tokens/s of capo_jax.sampling.sampler at the Qwen2.5-1.5B shape vs the bandwidth bound.

  python -m benchmarks.sampling_gpu --out sampling_gpu.json            # H200 (4.8 TB/s)
  python -m benchmarks.sampling_gpu --out s.json --bandwidth 3.35e12   # H100 SXM
  python -m benchmarks.sampling_gpu --small --out /tmp/s.json          # CPU smoke run

Random bfloat16 weights (params and compute in bfloat16, the KV cache too),
32 prompts x 8 samples = 256 rows, prompts of 64-128 real tokens (left-padded
to 128), 512 new tokens, no stop token (every row runs the full length).
Per mode (sampling at T = 1, greedy): one untimed call (compilation), then
``--rounds`` timed calls of ``generate`` and of its prefill alone; decode
time = generate - prefill.

The peer is the memory-bandwidth bound of a decode step: every parameter is
read once per step (the tied embedding is the output projection) plus the KV
cache of the tokens so far, averaged over the completion, so
``bound tokens/s = rows / (bytes per step / bandwidth)``. The bound for all
cache columns (prompt bucket + completion bucket, what the lockstep sampler
read) is printed too; the engine reads blocks up to the longest row. Results are
printed and written as JSON to ``--out``. About 2-3 minutes on an H200.

``--lengths``: long-tailed lengths at the 1.5B shape instead (``long_tailed``):
the engine's useful tokens/s next to the bandwidth bound.

  python -m benchmarks.sampling_gpu --lengths --out l.json --prompt-len 512 --mean-length 867
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from capo_jax.sampling import engine, plans, strategies
from capo_jax.sampling import sampler as sampling
from models import kv_cache, qwen2
from models.config import Qwen2Config


def step_bytes(cfg: Qwen2Config, rows: int, kv_len: float) -> dict[str, float]:
  """Bytes one decode step must read: params once, plus ``kv_len`` cached tokens per row."""
  param_bytes = qwen2.num_params(qwen2.param_shapes(cfg)) * jnp.dtype(cfg.weight_dtype).itemsize
  if not cfg.tie_word_embeddings:  # an untied embedding is only gathered, row by row
    param_bytes -= (cfg.vocab_size - rows) * cfg.hidden_size * jnp.dtype(cfg.weight_dtype).itemsize
  kv_bytes = (
    2
    * cfg.num_layers
    * rows
    * kv_len
    * cfg.num_kv_heads
    * cfg.head_dim
    * jnp.dtype(cfg.dtype).itemsize
  )
  return {"params": float(param_bytes), "kv": float(kv_bytes)}


def time_forward_with_cache(
  params, cfg: Qwen2Config, rows: int, slots: int, steps: int = 16
) -> float:
  """Seconds per decode step of ``models.qwen2.forward_with_cache`` (stacked cache, layer scan).

  For comparison: the sampler decodes over per-layer cache buffers instead.
  """
  cache = kv_cache.init_cache(cfg, rows, slots)
  cache = kv_cache.KVCache(
    cache.k_LBSKH,
    cache.v_LBSKH,
    jnp.ones_like(cache.mask_BS),
    cache.positions_B,
    jnp.asarray(slots // 2, jnp.int32),
  )
  tokens = jnp.ones((rows, 1), jnp.int32)

  @jax.jit
  def run(params, cache):
    def body(_, carry):
      c, acc = carry
      logits, c = qwen2.forward_with_cache(params, cfg, tokens, tokens > 0, c)
      return kv_cache.KVCache(c.k_LBSKH, c.v_LBSKH, c.mask_BS, c.positions_B, c.index - 1), (
        acc + logits[:, 0, 0]
      )

    return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros(rows)))[1]

  jax.block_until_ready(run(params, cache))
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    jax.block_until_ready(run(params, cache))
    best = min(best, time.perf_counter() - t0)
  return best / steps


def time_choice(strategy, rows: int, vocab: int) -> float:
  """Seconds per token choice + untempered log-prob over [vocab, rows] float32 logits."""
  logits = jax.random.normal(jax.random.key(0), (vocab, rows), jnp.float32)
  f = jax.jit(lambda l, k: strategy.choose(l, jax.random.uniform(k, (rows,))))
  jax.block_until_ready(f(logits, jax.random.key(1)))
  best = float("inf")
  for i in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(f(logits, jax.random.key(i)))
    best = min(best, time.perf_counter() - t0)
  return best


def long_tailed(args: argparse.Namespace) -> None:
  """Useful tokens/s of the engine on geometric lengths, next to the bandwidth bound.

  The Qwen2.5-1.5B shape in bfloat16, 128 prompts x 8 samples = 1,024 rows of
  ``--prompt-len`` (default 128) tokens, cap ``--new-tokens`` (default 3,072);
  random weights (a near-uniform next-token distribution) with V / m stop ids,
  m = ``--mean-length`` (default 600): geometric lengths of mean about m. The
  length model of ``tools/rollout_sim.py`` (lognormal, median 550, mean 867)
  cannot be imposed on random weights, as token choice sees no row or step:
  ``--mean-length 867`` gives its mean and cap with a geometric shape. The
  bound is the bandwidth model of tools/rollout_sim.py on the lengths the run
  produced, for the same W: every step reads the weights once plus each
  active row's own cache ("own"), or, as the engine reads it, every slot up to
  the longest active row ("engine reads").
  """
  from benchmarks import rollout_lengths  # pylint: disable=g-import-not-at-top
  from tools import rollout_sim  # pylint: disable=g-import-not-at-top

  small = args.small
  cfg = (
    Qwen2Config.tiny(param_dtype="bfloat16", compute_dtype="bfloat16")
    if small
    else Qwen2Config.qwen2p5_1p5b(param_dtype="bfloat16", compute_dtype="bfloat16")
  )
  Q, G = (4, 4) if small else (args.prompts or 128, args.num_samples)
  P, C = (16, 256) if small else (args.prompt_len or 128, args.new_tokens or 3072)
  mean = args.mean_length or (50 if small else 600)
  W = min(args.max_active_rows, Q * G)
  params = jax.jit(qwen2.init_params, static_argnums=0)(cfg, jax.random.key(0))
  prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, (Q, P))
  stops = (
    np.random.default_rng(1)
    .choice(np.arange(3, cfg.vocab_size), cfg.vocab_size // mean, replace=False)
    .tolist()
  )
  spec = sampling.SamplingSpec(num_samples=G, max_new_tokens=C, stop_ids=stops, max_active_rows=W)
  gen = lambda seed: sampling.generate(
    params, cfg, prompts, np.ones_like(prompts), jax.random.key(seed), spec
  )
  t0 = time.perf_counter()
  np.asarray(gen(0).lengths_B)
  print(f"first call (compiles) {time.perf_counter() - t0:.1f}s", flush=True)
  shape = rollout_sim.Shape(
    rows=Q * G,
    samples=G,
    prompt_len=P,
    cap=C,
    weight_bytes=step_bytes(cfg, Q * G, 0)["params"],
    kv_bytes=step_bytes(cfg, 1, 1)["kv"],
    bandwidth=args.bandwidth,
    # The engine's loops as it runs them here (one with W = B on CPU).
    max_loops=len(sampling.engine_plan(cfg, spec, None, Q).phases),
  )
  dev = jax.devices()[0]
  result = {
    "device": dev.device_kind,
    "platform": dev.platform,
    "jax": jax.__version__,
    "rows": Q * G,
    "max_active_rows": W,
    "prompt_len": P,
    "cap": C,
    "stop_ids": len(stops),
    "shape": dataclasses.asdict(shape),
    "rounds": [],
  }
  for r in range(args.rounds):
    t0 = time.perf_counter()
    lengths = np.asarray(gen(r + 1).lengths_B)
    dt = time.perf_counter() - t0
    sim = rollout_sim.simulate(lengths.astype(np.int64), shape, W)
    row = {
      "seconds": dt,
      "useful_tokens_per_s": lengths.sum() / dt,
      "bound_own_tokens_per_s": lengths.sum() / rollout_sim.seconds(sim, shape, "kv_read_own"),
      "bound_engine_reads_tokens_per_s": lengths.sum() / rollout_sim.seconds(sim, shape),
      "lengths": lengths.tolist(),
    }
    result["rounds"].append(row)
    print(
      f"round {r + 1}: lengths {rollout_lengths.describe(lengths, C)}; useful "
      f"{row['useful_tokens_per_s']:.0f} tokens/s = "
      f"{row['useful_tokens_per_s'] / row['bound_own_tokens_per_s']:.1%} of the bound "
      f"({row['useful_tokens_per_s'] / row['bound_engine_reads_tokens_per_s']:.1%} of the "
      "bound for the blocks the engine reads)",
      flush=True,
    )
  pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
  print("wrote", args.out)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="JSON results path")
  ap.add_argument(
    "--bandwidth",
    type=float,
    default=4.8e12,
    help="memory bandwidth, bytes/s (H200: 4.8e12, H100 SXM: 3.35e12)",
  )
  ap.add_argument("--prompts", type=int, help="default 32 (--lengths: 128)")
  ap.add_argument("--num-samples", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, help="default 128")
  ap.add_argument("--new-tokens", type=int, help="default 512 (--lengths: the cap, 3,072)")
  ap.add_argument("--mean-length", type=int, help="--lengths: mean completion (default 600)")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--modes", default="sample,greedy")
  ap.add_argument("--small", action="store_true", help="tiny model and batch (CPU smoke run)")
  ap.add_argument(
    "--lengths",
    action="store_true",
    help="long-tailed lengths instead (see long_tailed): the engine vs the bound",
  )
  ap.add_argument("--max-active-rows", type=int, default=256, help="--lengths: the engine's W")
  args = ap.parse_args()
  if args.lengths:
    long_tailed(args)
    return
  args.prompts, args.prompt_len = args.prompts or 32, args.prompt_len or 128
  args.new_tokens = args.new_tokens or 512
  if args.small:
    cfg = Qwen2Config.tiny(param_dtype="bfloat16", compute_dtype="bfloat16")
    args.prompts, args.num_samples, args.prompt_len, args.new_tokens = 2, 2, 16, 32
    args.rounds = 2
  else:
    cfg = Qwen2Config.qwen2p5_1p5b(param_dtype="bfloat16", compute_dtype="bfloat16")
  Q, G, P, C = args.prompts, args.num_samples, args.prompt_len, args.new_tokens
  B = Q * G
  dev = jax.devices()[0]
  print(
    f"{dev.platform} {dev.device_kind} x{jax.device_count()}, jax {jax.__version__}; "
    f"{Q} prompts x {G} samples = {B} rows, prompt <= {P}, {C} new tokens",
    flush=True,
  )

  t0 = time.perf_counter()
  params = jax.jit(qwen2.init_params, static_argnums=0)(cfg, jax.random.key(0))
  jax.block_until_ready(params)
  print(
    f"{qwen2.num_params(params) / 1e6:.1f}M params initialised in {time.perf_counter() - t0:.1f}s",
    flush=True,
  )
  rng = np.random.default_rng(0)
  lengths = rng.integers(P // 2, P + 1, Q)
  mask = (np.arange(P)[None, :] >= P - lengths[:, None]).astype(np.int32)
  tokens = (rng.integers(0, cfg.vocab_size, (Q, P)) * mask).astype(np.int32)
  p_slots = sampling.bucket_length(P, sampling.PROMPT_BUCKET_MIN)
  c_slots = sampling.bucket_length(C, sampling.GEN_BUCKET_MIN)

  # The prefill alone, with generate's own arguments (so its compiled program is reused).
  def prefill(strategy, seed):
    pad = p_slots - P
    t = jnp.asarray(np.pad(tokens, ((0, 0), (pad, 0))))
    m = jnp.asarray(np.pad(mask, ((0, 0), (pad, 0))).astype(bool))
    _, first = engine.prefill(
      params,
      t,
      m,
      jax.random.key(seed),
      plan=plans.PrefillPlan(cfg=cfg, strategy=strategy, num_samples=G),
    )
    return first.token_B

  live = {"ideal": float(lengths.mean()) + (C - 1) / 2, "as_run": float(p_slots + c_slots)}
  result = {
    "device": dev.device_kind,
    "platform": dev.platform,
    "jax": jax.__version__,
    "rows": B,
    "prompts": Q,
    "num_samples": G,
    "prompt_len": P,
    "new_tokens": C,
    "bandwidth_bytes_per_s": args.bandwidth,
    "modes": {},
  }
  for kind, kv_len in live.items():
    nbytes = step_bytes(cfg, B, kv_len)
    total = nbytes["params"] + nbytes["kv"]
    result[f"bytes_per_step_{kind}"] = nbytes
    result[f"bound_tokens_per_s_{kind}"] = B * args.bandwidth / total
  for mode in args.modes.split(","):
    strategy = strategies.make_strategy(temperature=1.0 if mode == "sample" else 0.0)
    gen = lambda seed: sampling.generate(
      params,
      cfg,
      tokens,
      mask,
      jax.random.key(seed),
      sampling.SamplingSpec(num_samples=G, max_new_tokens=C, strategy=strategy),
    )
    t0 = time.perf_counter()
    out = gen(0)
    jax.block_until_ready(out.tokens_BC)
    compile_s = time.perf_counter() - t0
    if int(np.asarray(out.lengths_B).min()) != C:
      raise RuntimeError(f"{mode}: some rows stopped early: {np.asarray(out.lengths_B)}")
    jax.block_until_ready(prefill(strategy, 0))
    full, pre = [], []
    for r in range(args.rounds):
      t0 = time.perf_counter()
      np.asarray(gen(r + 1).tokens_BC)
      full.append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      np.asarray(prefill(strategy, r + 1))
      pre.append(time.perf_counter() - t0)
    t_full, t_pre = float(np.median(full)), float(np.median(pre))
    t_dec = t_full - t_pre
    decode_tps = B * (C - 1) / t_dec
    row = {
      "first_call_s": compile_s,
      "generate_s": t_full,
      "prefill_s": t_pre,
      "decode_s": t_dec,
      "tokens_per_s": B * C / t_full,
      "decode_tokens_per_s": decode_tps,
      "decode_ms_per_step": 1e3 * t_dec / (C - 1),
      "choice_ms": 1e3 * time_choice(strategy, B, cfg.vocab_size),
      "fraction_of_bound_ideal": decode_tps / result["bound_tokens_per_s_ideal"],
      "fraction_of_bound_as_run": decode_tps / result["bound_tokens_per_s_as_run"],
    }
    result["modes"][mode] = row
    print(
      f"{mode}: first call {compile_s:.1f}s; generate {t_full:.3f}s "
      f"({row['tokens_per_s']:.0f} tokens/s), prefill {t_pre:.3f}s, decode "
      f"{row['decode_ms_per_step']:.2f} ms/step = {decode_tps:.0f} tokens/s = "
      f"{row['fraction_of_bound_ideal']:.1%} of the bandwidth bound "
      f"({row['fraction_of_bound_as_run']:.1%} of the bound for the slots it reads); "
      f"token choice {row['choice_ms']:.2f} ms",
      flush=True,
    )
  model_s = time_forward_with_cache(params, cfg, B, p_slots + c_slots)
  result["forward_with_cache_step_ms"] = 1e3 * model_s
  stats = dev.memory_stats() or {}
  result["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
  step_ms = {
    k: 1e3 * (v["params"] + v["kv"]) / args.bandwidth
    for k, v in ((k, result[f"bytes_per_step_{k}"]) for k in live)
  }
  print(
    f"bandwidth bound: {result['bound_tokens_per_s_ideal']:.0f} tokens/s "
    f"({step_ms['ideal']:.2f} ms/step at {args.bandwidth / 1e12:.2f} TB/s); for the "
    f"{p_slots + c_slots} slots read: {result['bound_tokens_per_s_as_run']:.0f} tokens/s "
    f"({step_ms['as_run']:.2f} ms/step); models.qwen2.forward_with_cache alone (stacked "
    f"cache in a layer scan) {1e3 * model_s:.2f} ms/step; peak memory "
    f"{result['peak_bytes_in_use']}",
    flush=True,
  )
  pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
  print("wrote", args.out)


if __name__ == "__main__":
  main()
