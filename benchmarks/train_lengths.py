"""Train step at real lengths: packed vs today's padded step, CPU, alternated in one run.

    python -m benchmarks.train_lengths                 # 32 sequences, geometric(mean 128) lengths
    python -m benchmarks.train_lengths --rows 64 --repeats 5

One rollout batch of ``--rows`` sequences: prompts of 16-64 tokens, completion
lengths geometric with mean 128, capped at 1,024 (a long tail). Both steps get
the same model, weights, loss (PPO clip, seq-mean-token-mean), optimizer and
batch:

  padded   one sequence per row (``microbatches.plan_update(pack=False)``): rows of
           P + C tokens with C the longest completion (bucketed to 16, as
           ``rollout.collect`` does), ``--microbatches`` micro-batches of B / M
           rows, the reference (T x T) attention;
  packed   ``microbatches.plan_update(pack=True)`` into rows of P + 1,024 tokens (the
           longest possible sequence), ``--pack-rows`` rows per micro-batch,
           ``model.attention = "auto"`` (the blocked attention here).

Each side's host layout (``plan_update``) is inside the timed region.

Reported: real (unpadded) prompt + completion tokens per second of each, and
the ratio. The rounds alternate between the two (the machine is shared).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from capo_jax.rl import train_step as ts
from capo_jax.rl.losses import LossConfig
from capo_jax.rl.optim import OptimConfig
from capo_jax.runtime import mesh as mesh_lib
from models import qwen2
from models.config import Qwen2Config
from tests.batches import HostBatch

SMALL = dict(
  vocab_size=8192,
  hidden_size=256,
  intermediate_size=704,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  tie_word_embeddings=True,
)
CAP, BUCKET = 1024, 16


def long_tail_batch(rows: int, seed: int, vocab: int) -> tuple[HostBatch, int]:
  """A rollout batch with geometric(mean 128, cap 1,024) completions; and its real tokens."""
  rng = np.random.default_rng(seed)
  P = 64
  p_B = rng.integers(16, P + 1, rows)
  c_B = np.minimum(rng.geometric(1 / 128, rows), CAP)
  C = min(-(-int(c_B.max()) // BUCKET) * BUCKET, CAP)
  pmask = (np.arange(P)[None] >= P - p_B[:, None]).astype(np.int32)
  cmask = (np.arange(C)[None] < c_B[:, None]).astype(np.int32)
  batch = HostBatch(
    prompt_tokens_BP=rng.integers(1, vocab, (rows, P)).astype(np.int32) * pmask,
    prompt_mask_BP=pmask,
    completion_tokens_BC=rng.integers(1, vocab, (rows, C)).astype(np.int32) * cmask,
    completion_mask_BC=cmask,
    old_logp_BC=(rng.normal(size=(rows, C)) * 0.1 - np.log(vocab)).astype(np.float32) * cmask,
    adv_B=rng.normal(size=rows).astype(np.float32),
  )
  return batch, int(p_B.sum() + c_B.sum())


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--microbatches", type=int, default=4)
  parser.add_argument("--pack-rows", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.rows % args.microbatches:
    parser.error(f"--microbatches={args.microbatches} must divide --rows={args.rows}")

  cfg = Qwen2Config(**SMALL, attention="reference")
  params = jax.jit(qwen2.init_params, static_argnums=0)(cfg, jax.random.key(0))
  batch, real_tokens = long_tail_batch(args.rows, args.seed, cfg.vocab_size)
  B, P = batch.prompt_tokens_BP.shape
  C = batch.completion_tokens_BC.shape[1]
  pack_len = P + CAP
  mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  rules = mesh_lib.TRAIN_RULES
  tcfg = ts.TrainConfig(
    loss=LossConfig(agg="seq-mean-token-mean"), optim=OptimConfig(learning_rate=1e-6)
  )
  # Each side: its model config, rows per micro-batch and host layout of the batch.
  contenders = {
    "padded": (cfg, B // args.microbatches, dict(pack=False)),
    "packed": (cfg.replace(attention="auto"), args.pack_rows, dict(pack=True, row_len=pack_len)),
  }
  steps, states = {}, {}
  for name, (mcfg, rows_per_mb, _) in contenders.items():
    steps[name] = ts.make_train_step(mcfg, tcfg, mesh, rules, rows_per_mb)
    states[name] = ts.train_state_from_params(params, mcfg, tcfg, mesh, rules)

  def run(name: str) -> float:
    _, rows_per_mb, layout = contenders[name]
    t0 = time.perf_counter()
    states[name], metrics = steps[name](states[name], batch.train_batch(rows_per_mb, **layout))
    float(metrics["loss"])  # waits for the step
    return time.perf_counter() - t0

  compile_s = {name: run(name) for name in contenders}
  times: dict[str, list[float]] = {name: [] for name in contenders}
  for _ in range(args.repeats):
    for name in contenders:
      times[name].append(run(name))
  packed = batch.train_batch(args.pack_rows, pack=True, row_len=pack_len)
  used_rows = int((packed.rows.segment_ids_YT > 0).any(-1).sum())
  print(
    f"model: {qwen2.num_params(params) / 1e6:.1f}M params; {B} sequences, {real_tokens} real "
    f"tokens; padded grid {B} x ({P} + {C}) = {B * (P + C)} tokens "
    f"({real_tokens / (B * (P + C)):.0%} real); packed {used_rows} rows x {pack_len} = "
    f"{used_rows * pack_len} ({real_tokens / (used_rows * pack_len):.0%} real), "
    f"{args.pack_rows} rows per micro-batch; first call (compile) "
    + ", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items())
  )
  med = {k: statistics.median(v) for k, v in times.items()}
  for k, v in times.items():
    print(
      f"  {k:7s}: median {med[k]:6.2f} s ({min(v):.2f}-{max(v):.2f})  "
      f"{real_tokens / med[k]:7.0f} real tokens/s"
    )
  print(
    f"ratio packed / padded real tokens/s: {med['padded'] / med['packed']:.2f}x "
    f"({args.repeats} alternated rounds)"
  )


if __name__ == "__main__":
  main()
