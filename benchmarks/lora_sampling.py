"""Sampling a LoRA policy: adapters merged into the weights once vs the delta in every layer.

The trainer merges once per step (``models.lora.merge`` into the sampler's
copy); the alternative is to hand the sampler ``with_adapters(base, adapters)``,
whose decode step then runs the two extra low-rank matmuls per projection and
token. Both contenders run in the same process, alternated round by round; the
merge's own time is reported next to them (it is paid once per step).

  python -m benchmarks.lora_sampling [--rank 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from capo_jax import sampling
from models import lora, qwen2
from models.config import Qwen2Config


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rank", type=int, default=16)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--new_tokens", type=int, default=64)
  args = ap.parse_args()
  cfg = Qwen2Config.tiny(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
  )
  lcfg = lora.LoraConfig(args.rank, 2.0 * args.rank)
  base = qwen2.init_params(cfg, jax.random.key(0))
  ad = lora.init_adapters(qwen2.param_shapes(cfg), lcfg, jax.random.key(1))
  ad = jax.tree.map(lambda x: x + 0.01, ad)  # non-zero B
  merge = jax.jit(lora.merge, static_argnums=2)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, cfg.vocab_size, (4, 32)).astype(np.int32)
  mask = np.ones_like(tokens)

  def sample(params):
    return sampling.generate(
      params,
      cfg,
      tokens,
      mask,
      jax.random.key(2),
      sampling.SamplingSpec(num_samples=4, max_new_tokens=args.new_tokens, stop_ids=()),
    ).tokens_BC

  contenders = {
    "merged": lambda: sample(merge(base, ad, lcfg)),
    "in-layer delta": lambda: sample(lora.with_adapters(base, ad, lcfg)),
  }
  times = {k: [] for k in contenders}
  for name, fn in contenders.items():
    jax.block_until_ready(fn())  # compile
  merge_times = []
  for _ in range(args.rounds):
    for name, fn in contenders.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t)
    t = time.perf_counter()
    jax.block_until_ready(merge(base, ad, lcfg))
    merge_times.append(time.perf_counter() - t)
  med = {k: float(np.median(v)) for k, v in times.items()}
  for k, v in med.items():
    print(
      f"{k:>15}: median {v * 1e3:.1f} ms per generate (16 rows x {args.new_tokens} tokens); "
      f"rounds {[round(t * 1e3) for t in times[k]]}"
    )
  print(f"{'merge alone':>15}: median {np.median(merge_times) * 1e3:.2f} ms")
  print(f"in-layer / merged (merge included): {med['in-layer delta'] / med['merged']:.2f}")


if __name__ == "__main__":
  main()
