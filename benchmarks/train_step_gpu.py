"""RL train-step tokens/s and model FLOPs utilisation at the Qwen2.5-1.5B shape, on a GPU.

  python -m benchmarks.train_step_gpu --out train_step_gpu.json           # H200 SXM
  python -m benchmarks.train_step_gpu --out t.json --peak 989e12          # other dense-bf16 peak
  python -m benchmarks.train_step_gpu --small --out /tmp/t.json           # CPU smoke run
  python -m benchmarks.train_step_gpu --out p.json --pack --attention auto  # packed, blocked

Random weights; float32 master params and Adam moments, bfloat16 compute
(params cast once per step, logits / log-softmax / loss in float32), each
layer rematerialised, completion log-probs in chunks of ``--chunk``
positions (never the full [B, C, V] logits). Default batch: 16 rows x
(512 prompt + 1536 completion) tokens = 32,768 tokens per update, the clipped
PPO loss (seq-mean-token-mean), AdamW, global-norm clipping.

The peer is the chip's dense bfloat16 peak (``--peak``, default 989 TFLOP/s,
H200 / H100 SXM datasheet). Model FLOPs per step (the convention of MFU:
recomputation not counted; "dense" attention counts the full T x T square
the implementation computes):
  forward = 2 * B*T * N_layers  +  2 * B*C * D*V  +  L * 4 * B*T^2 * N*H
  model   = 3 * forward;  hardware (with remat) = 4 * forward
Also timed: the forward-only log-prob function (old / reference log-probs).

``--attention`` picks ``model.attention`` (default "auto": the blocked
attention off TPU when a row is longer than one block). ``--pack``: the
completions get long-tailed lengths (geometric, mean ``--completion`` / 4,
capped at ``--completion``) and the step trains their packing
(``capo_jax.rl.packing``) into rows of P + C tokens, ``--pack-rows`` rows
per micro-batch; tokens/s and MFU then count the real tokens only (the
attention term summed per sequence). Unpacked, each sequence has a row of
P + C tokens, ``--micro`` micro-batches of B / micro rows.
Prints the numbers and writes them as JSON to ``--out``. About 1-2 minutes
on an H200 (compilation included).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import numpy as np

from capo_jax.rl import train_step as ts
from capo_jax.rl.optim import OptimConfig
from capo_jax.runtime import host
from capo_jax.runtime import mesh as mesh_lib
from models import qwen2
from models.config import PRESETS, Qwen2Config
from tests.batches import HostBatch, padded_pass


def forward_flops(cfg: Qwen2Config, B: int, P: int, C: int) -> float:
  """Model FLOPs of one forward over B rows of P + C tokens (module docstring)."""
  T = P + C
  D, F, N, K, H, L = (
    cfg.hidden_size,
    cfg.intermediate_size,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    cfg.num_layers,
  )
  layer_matmul = D * N * H * 2 + D * K * H * 2 + 3 * D * F
  return (
    2.0 * B * T * L * layer_matmul + 2.0 * B * C * D * cfg.vocab_size + L * 4.0 * B * T * T * N * H
  )


def _timed(fn, n: int) -> list[float]:
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="JSON results file")
  parser.add_argument("--preset", default="qwen2p5_1p5b", choices=sorted(PRESETS))
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--prompt", type=int, default=512)
  parser.add_argument("--completion", type=int, default=1536)
  parser.add_argument("--chunk", type=int, default=512, help="log-prob chunk (0: none)")
  parser.add_argument("--micro", type=int, default=1, help="micro-batches per update")
  parser.add_argument("--steps", type=int, default=5, help="timed train steps")
  parser.add_argument("--no-remat", dest="remat", action="store_false")
  parser.add_argument("--peak", type=float, default=989e12, help="dense bf16 FLOP/s of the chip")
  parser.add_argument("--small", action="store_true", help="tiny model and batch (CPU check)")
  parser.add_argument("--attention", default="auto", help="model.attention")
  parser.add_argument("--pack", action="store_true", help="long-tailed lengths, packed rows")
  parser.add_argument("--pack-rows", type=int, default=4, help="packed rows per micro-batch")
  args = parser.parse_args(argv)

  if args.small:
    cfg = Qwen2Config.tiny(
      vocab_size=1024, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2
    )
    args.batch, args.prompt, args.completion, args.chunk, args.steps = 4, 16, 48, 16, 2
  else:
    cfg = PRESETS[args.preset]()
  cfg = cfg.replace(
    param_dtype="float32", compute_dtype="bfloat16", remat=args.remat, attention=args.attention
  )
  B, P, C = args.batch, args.prompt, args.completion
  dev = jax.devices()[0]
  print(
    f"devices: {len(jax.devices())} x {dev.device_kind} ({dev.platform}); jax {jax.__version__}",
    flush=True,
  )

  mesh = mesh_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  rules = mesh_lib.TRAIN_RULES
  tcfg = ts.TrainConfig(optim=OptimConfig(learning_rate=1e-6), logprob_chunk_size=args.chunk)
  if not args.pack and B % args.micro:
    parser.error(f"--micro={args.micro} must divide --batch={B}")
  rows_per_mb = args.pack_rows if args.pack else B // args.micro
  t0 = time.perf_counter()
  state = ts.create_train_state(cfg, tcfg, jax.random.key(0), mesh, rules)
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  n_params = qwen2.num_params(state.params)
  print(
    f"model {args.preset if not args.small else 'small'}: {n_params / 1e9:.3f}B params, "
    f"init {init_s:.1f} s",
    flush=True,
  )

  rng = np.random.default_rng(0)
  prompt = rng.integers(0, cfg.vocab_size, (B, P)).astype(np.int32)
  prompt_mask = np.ones((B, P), np.int32)
  prompt_mask[:, : P // 8] = 0  # some left padding, as real prompts have
  completion = rng.integers(0, cfg.vocab_size, (B, C)).astype(np.int32)
  completion_mask = np.ones((B, C), np.int32)
  if args.pack:
    c_B = np.minimum(rng.geometric(4 / C, B), C)
    completion_mask = (np.arange(C)[None] < c_B[:, None]).astype(np.int32)
  adv = rng.normal(size=(B,)).astype(np.float32)

  # The old-policy pass: one call over B rows, one sequence per row (the padded grid).
  lp = padded_pass(cfg, mesh, rules, B, chunk_size=args.chunk)
  rows = lp.upload(prompt, prompt_mask, completion, completion_mask)
  mask = host.put_global(completion_mask, lp.index_sharding)
  logprob_fn = lambda: lp.run(state.params, rows, mask, ("logp_BC",))["logp_BC"]  # noqa: E731
  t0 = time.perf_counter()
  old = logprob_fn()
  old.block_until_ready()
  lp_compile_s = time.perf_counter() - t0
  lp_times = _timed(lambda: logprob_fn().block_until_ready(), max(args.steps, 2))
  print(
    f"logprob fn: first call {lp_compile_s:.1f} s, then median {statistics.median(lp_times):.3f} s",
    flush=True,
  )

  old = np.asarray(old) + rng.normal(scale=0.05, size=(B, C)).astype(np.float32)
  batch = HostBatch(prompt, prompt_mask, completion, completion_mask, old, adv).train_batch(
    rows_per_mb, pack=args.pack, row_len=P + C
  )
  batch = host.put_global(batch, ts.batch_sharding(mesh, rules, rows_per_mb))
  step_fn = ts.make_train_step(cfg, tcfg, mesh, rules, rows_per_mb)
  losses: list[float] = []

  def one_step() -> None:
    nonlocal state
    state, metrics = step_fn(state, batch)
    losses.append(float(metrics["loss"]))  # blocks until the step is done

  t0 = time.perf_counter()
  one_step()
  step_compile_s = time.perf_counter() - t0
  print(f"train step: first call (compile + run) {step_compile_s:.1f} s", flush=True)
  step_times = _timed(one_step, args.steps)
  step_s = statistics.median(step_times)

  seq_len_B = prompt_mask.sum(1) + completion_mask.sum(1)
  if args.pack:  # real tokens only; attention per sequence
    fwd = sum(
      forward_flops(cfg, 1, int(p), int(c))
      for p, c in zip(prompt_mask.sum(1), completion_mask.sum(1))
    )
  else:
    fwd = forward_flops(cfg, B, P, C)
  n_tok = int(seq_len_B.sum()) if args.pack else B * (P + C)
  mem = dev.memory_stats() or {}
  res = {
    "device": dev.device_kind,
    "platform": dev.platform,
    "jax": jax.__version__,
    "model": "small" if args.small else args.preset,
    "params": n_params,
    "batch": B,
    "prompt": P,
    "completion": C,
    "tokens_per_step": n_tok,
    "chunk": args.chunk,
    "micro_batches": args.micro,
    "remat": args.remat,
    "attention": args.attention,
    "pack": args.pack,
    "pack_rows": args.pack_rows,
    # The sequences' real lengths: the model FLOPs above can be recomputed from them.
    "prompt_lengths": prompt_mask.sum(1).tolist(),
    "completion_lengths": completion_mask.sum(1).tolist(),
    "compute_dtype": cfg.compute_dtype,
    "param_dtype": cfg.param_dtype,
    "init_s": init_s,
    "step_compile_s": step_compile_s,
    "step_times_s": step_times,
    "step_median_s": step_s,
    "tokens_per_s": n_tok / step_s,
    "model_flops_per_step": 3 * fwd,
    "peak_flops": args.peak,
    "mfu": 3 * fwd / step_s / args.peak,
    "hfu_with_remat": (4 if args.remat else 3) * fwd / step_s / args.peak,
    "logprob_compile_s": lp_compile_s,
    "logprob_times_s": lp_times,
    # The log-prob function timed here is the unpacked one, over the padded grid.
    "logprob_tokens_per_s": B * (P + C) / statistics.median(lp_times),
    "logprob_mfu": forward_flops(cfg, B, P, C) / statistics.median(lp_times) / args.peak,
    "losses": losses,
    "peak_bytes_in_use": mem.get("peak_bytes_in_use"),
    "bytes_limit": mem.get("bytes_limit"),
  }
  print(
    f"train step: median {step_s:.3f} s over {args.steps} "
    f"({min(step_times):.3f}-{max(step_times):.3f}), {res['tokens_per_s']:,.0f} tokens/s, "
    f"model FLOPs {3 * fwd / 1e12:.1f} T/step = {res['mfu']:.1%} MFU of "
    f"{args.peak / 1e12:.0f} TFLOP/s (HFU with remat {res['hfu_with_remat']:.1%})"
  )
  print(f"logprob fn: {res['logprob_tokens_per_s']:,.0f} tokens/s, {res['logprob_mfu']:.1%} MFU")
  if mem:
    print(
      f"device memory: peak {mem.get('peak_bytes_in_use', 0) / 2**30:.1f} GiB of "
      f"{mem.get('bytes_limit', 0) / 2**30:.1f} GiB"
    )
  print(f"losses: {losses}")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(res, indent=2))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
