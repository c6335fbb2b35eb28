"""One decode step over a KV cache of 4,096 columns: 128 filled vs all, and the old full read.

  python -m benchmarks.decode_filled            # 32 slots, the benchmark model, 7 rounds
  python -m benchmarks.decode_filled --small    # a seconds-long smoke run

The engine's step (capo_jax.sampling.decode.step) reads the cache in blocks
of ``plans.KV_BLOCK`` columns up to the longest active row. Timed, one jitted
step each (the benchmark model of benchmarks/sampling.py: hidden 512, 4
layers, vocab 32,000), alternated round by round after a warm-up:

- filled: rows at column 128 of 4,096 (one block read);
- full: rows at column 4,096 (every block read);
- all columns: the same step reading every column in one softmax, as the
  sampler did before the engine (its cost does not depend on the fill).

Reported: medians and filled / full. The weights (110 MB in float32) are
read every step whatever the fill, so the ratio falls with more slots.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import sampling as sampling_bench
from capo_jax.sampling import decode, plans
from models import qwen2


@functools.partial(jax.jit, static_argnames=("cfg", "block", "cols"), donate_argnames=("cache",))
def _step(params, tokens_W, cache, filled, *, cfg, block: int, cols: int):
  W = tokens_W.shape[0]
  w = decode.prepare(params, cfg, cols)
  col_W = jnp.full((W,), filled - 1, jnp.int32)
  where = decode.Where(col_W=col_W, pos_W=col_W, num_blocks=-(-filled // block), block=block)
  logits, cache = decode.step(w, cfg, tokens_W, cache, where)
  return logits.sum(), cache


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--slots", type=int, default=32)
  ap.add_argument("--cols", type=int, default=4096)
  ap.add_argument("--filled", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--small", action="store_true")
  args = ap.parse_args()
  if args.small:
    args.slots, args.cols, args.rounds = 4, 512, 2
  cfg = sampling_bench.bench_config(args.small)
  params = qwen2.init_params(cfg, jax.random.key(0))
  W, S = args.slots, args.cols
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, W), jnp.int32)
  blk = plans.KV_BLOCK
  cases = {
    f"filled {args.filled} of {S}": (args.filled, blk),
    f"full {S} of {S}": (S, blk),
    "all columns, one softmax": (args.filled, S),
  }  # block = S: attend_full
  caches = {}
  for name, (filled, block) in cases.items():  # warm-up: compile, first touch
    cache = decode.SlotCache.empty(cfg, W, S)
    cache = _all_real(cache)
    out, caches[name] = _step(
      params, tokens, cache, jnp.int32(filled), cfg=cfg, block=block, cols=S
    )
    jax.block_until_ready(out)
  times = {n: [] for n in cases}
  for r in range(args.rounds):
    for name, (filled, block) in cases.items():
      t0 = time.perf_counter()
      out, caches[name] = _step(
        params, tokens, caches[name], jnp.int32(filled), cfg=cfg, block=block, cols=S
      )
      jax.block_until_ready(out)
      times[name].append(time.perf_counter() - t0)
  med = {n: float(np.median(t)) for n, t in times.items()}
  kv_mb = 2 * cfg.num_layers * W * S * cfg.num_kv_heads * cfg.head_dim * 4 / 1e6
  print(
    f"{W} slots x {S} columns (KV {kv_mb:.0f} MB float32), block {blk}, "
    f"{qwen2.num_params(params) / 1e6:.1f}M params; jax {jax.__version__}"
  )
  names = list(cases)
  for n in names:
    print(f"{n:28s} {1e3 * med[n]:8.2f} ms/step  ({med[n] / med[names[1]]:.2f} x full)")
  print(
    f"filled / full = {med[names[0]] / med[names[1]]:.3f}; per round: "
    + " ".join(f"{a / b:.3f}" for a, b in zip(times[names[0]], times[names[1]]))
  )


def _all_real(cache: decode.SlotCache) -> decode.SlotCache:
  """Every column marked real, so a full read attends over all of them."""
  return decode.SlotCache(cache.k, cache.v, jnp.ones_like(cache.mask_WS))


if __name__ == "__main__":
  main()
