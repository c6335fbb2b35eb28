"""RL train-step throughput of capo_jax vs a plain PyTorch loop, CPU, same run.

    python -m benchmarks.train_step                          # 27.7M-param config, 8 x 256 tokens
    python -m benchmarks.train_step --batch 4 --prompt 64 --completion 448 --chunk 64

Both sides do the same work on the same random weights and batch: forward
over prompt + completion, float32 log-softmax of the completion positions,
the clipped PPO surrogate with token-mean aggregation, backward, global-norm
clipping (1.0) and one AdamW update. The peer is transformers'
``Qwen2ForCausalLM`` (``logits_to_keep`` so it too unembeds only the
completion positions) with ``torch.optim.AdamW`` and
``clip_grad_norm_``.

Both sides run on ``--threads`` CPUs (default 2): the process is pinned to
that many CPUs before JAX starts, which sizes XLA:CPU's thread pool, and torch
gets as many intra-op threads (``benchmarks/threads.py``).

Timing: ``--repeats`` rounds, each a block of ``--block`` consecutive steps of
capo_jax and one of torch, capo_jax first in even rounds and torch first in odd
ones (the machines are shared, so the two alternate). A real
run takes the same step back to back, so the ratio compares the steady-state
steps, each block's first step left out; those first steps are printed beside
it (the first capo_jax step after any other computation, the torch block or the
matmul-peak probe that ends each round, has run slower: docs/benchmarks.md).
The ratio comes with the range of the per-round ratios (block medians).
Like ``python -m capo_jax.main``, the benchmark first re-executes
itself with glibc's transparent huge pages for the host heap
(``capo_jax/hugepages.py``; both peers get them; ``CAPO_HUGEPAGES=0`` runs
without), and it prints the page faults per step.

Model FLOPs per step (stated, not measured; "dense" counts the full T x T
attention square that both implementations compute):
  forward = 2 * B*T * N_layers  +  2 * B*C * D*V  +  L * 4 * B*T^2 * N*H
  step    = 3 * forward         (backward = 2 x forward)
where N_layers is the matmul parameter count of the decoder layers (norms and
biases excluded), D*V the unembedding. Achieved FLOP/s is divided by the
float32 matmul peak measured in the same run (``jnp.dot`` 2048 x 2048).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

if __name__ == "__main__":  # before JAX is imported (capo_jax/hugepages.py)
  from capo_jax import hugepages

  hugepages.reexec_with_hugepages()

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import threads
from capo_jax.rl import train_step as ts
from capo_jax.rl.losses import LossConfig
from capo_jax.rl.optim import OptimConfig
from capo_jax.runtime import mesh as mesh_lib
from models import hf_weights, qwen2
from models.config import Qwen2Config
from tests import hf_utils
from tests.batches import HostBatch, padded_pass

# A mid-size Qwen2 config (27.7M parameters, tied embeddings), the same in every CPU benchmark.
MID_CONFIG = dict(
  vocab_size=32000,
  hidden_size=512,
  intermediate_size=1408,
  num_hidden_layers=4,
  num_attention_heads=8,
  num_key_value_heads=2,
  tie_word_embeddings=True,
  rope_theta=10000.0,
)
LR, WD, CLIP, EPS = 1e-6, 0.01, 1.0, 0.2


def step_flops(cfg: Qwen2Config, B: int, P: int, C: int) -> float:
  """Model FLOPs of one train step (formula in the module docstring)."""
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
  fwd = 2 * B * T * L * layer_matmul + 2 * B * C * D * cfg.vocab_size + L * 4 * B * T * T * N * H
  return 3.0 * fwd


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
  """Float32 FLOP/s of one jnp.dot of two n x n matrices (median of reps)."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, a).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    dot(a, a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n**3 / statistics.median(times)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=64)
  parser.add_argument("--completion", type=int, default=192)
  parser.add_argument("--chunk", type=int, default=0, help="capo_jax logprob chunk (0: none)")
  parser.add_argument("--repeats", type=int, default=3, help="rounds of one block each")
  parser.add_argument(
    "--block", type=int, default=3, help="consecutive steps per framework and round (>= 2)"
  )
  parser.add_argument("--attention", default="auto", help="model.attention of capo_jax")
  parser.add_argument(
    "--threads", type=int, default=2, help="CPUs and intra-op threads of each side"
  )
  parser.add_argument("--json", help="write the medians and ratios here")
  args = parser.parse_args(argv)
  if args.block < 2 or args.repeats < 1:
    parser.error(
      f"--block must be >= 2 (its first step is left out) and --repeats >= 1, got "
      f"{args.block} and {args.repeats}"
    )
  B, P, C = args.batch, args.prompt, args.completion
  threads.pin(args.threads)  # before JAX's backend starts
  thread_check = threads.check(args.threads)

  import torch  # pylint: disable=g-import-not-at-top

  hf_model, _ = hf_utils.make_hf_model(None, seed=0, std=0.02, **MID_CONFIG)
  cfg = Qwen2Config.from_hf(hf_model.config.to_dict(), attention=args.attention)
  state_dict = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
  params = hf_weights.params_from_state_dict(cfg, state_dict)
  n_params = qwen2.num_params(params)

  rng = np.random.default_rng(0)
  prompt = rng.integers(0, cfg.vocab_size, (B, P)).astype(np.int32)
  completion = rng.integers(0, cfg.vocab_size, (B, C)).astype(np.int32)
  ones_p, ones_c = np.ones((B, P), np.int32), np.ones((B, C), np.int32)
  adv = rng.normal(size=(B,)).astype(np.float32)

  # capo_jax: one device, float32, token-mean PPO loss.
  mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  rules = mesh_lib.TRAIN_RULES
  tcfg = ts.TrainConfig(
    loss=LossConfig(agg="token-mean", eps_low=EPS, eps_high=EPS),
    optim=OptimConfig(learning_rate=LR, weight_decay=WD, grad_clip=CLIP),
    logprob_chunk_size=args.chunk,
  )
  state = ts.train_state_from_params(params, cfg, tcfg, mesh, rules)
  lp = padded_pass(cfg, mesh, rules, B, chunk_size=args.chunk)
  old = lp.run(state.params, lp.upload(prompt, ones_p, completion, ones_c), ones_c, ("logp_BC",))[
    "logp_BC"
  ]
  # Perturbed old log-probs so some ratios clip, as in a real update.
  old = np.asarray(old) + rng.normal(scale=0.1, size=(B, C)).astype(np.float32)
  # One micro-batch of B rows, one sequence of P + C tokens per row.
  batch = jax.device_put(
    HostBatch(prompt, ones_p, completion, ones_c, old, adv).train_batch(B),
    ts.batch_sharding(mesh, rules, B),
  )
  step_fn = ts.make_train_step(cfg, tcfg, mesh, rules, B)

  # PyTorch: the same loss written out, AdamW, clip_grad_norm_.
  hf_model.train()
  opt = torch.optim.AdamW(
    hf_model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD
  )
  ids_pt = torch.as_tensor(np.concatenate([prompt, completion], 1), dtype=torch.long)
  mask_pt = torch.ones_like(ids_pt)
  comp_pt = torch.as_tensor(completion, dtype=torch.long)
  old_pt, adv_pt = torch.as_tensor(old), torch.as_tensor(adv)[:, None]

  def torch_step() -> float:
    logits = hf_model(input_ids=ids_pt, attention_mask=mask_pt, logits_to_keep=C + 1).logits
    logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp_all.gather(-1, comp_pt[..., None])[..., 0]
    ratio = torch.exp(logp - old_pt)
    obj = torch.minimum(ratio * adv_pt, torch.clamp(ratio, 1 - EPS, 1 + EPS) * adv_pt)
    loss = -obj.mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf_model.parameters(), CLIP)
    opt.step()
    return loss.item()

  def jax_step() -> float:
    nonlocal state
    state, metrics = step_fn(state, batch)
    return float(metrics["loss"])  # blocks until the step is done

  t0 = time.perf_counter()
  loss_jax = jax_step()  # compiles
  compile_s = time.perf_counter() - t0
  loss_torch = torch_step()
  times: dict[str, list[float]] = {"capo_jax": [], "torch": []}
  first: dict[str, list[float]] = {"capo_jax": [], "torch": []}  # each block's first step
  faults: dict[str, list[int]] = {"capo_jax": [], "torch": []}
  peaks = []
  sides = (("capo_jax", jax_step), ("torch", torch_step))
  rounds: dict[str, list[float]] = {"capo_jax": [], "torch": []}  # each block's median
  for r in range(args.repeats):
    for name, fn in sides if r % 2 == 0 else sides[::-1]:
      for i in range(args.block):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        fn()
        (first if i == 0 else times)[name].append(time.perf_counter() - t0)
        faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
      rounds[name].append(statistics.median(times[name][-(args.block - 1) :]))
    peaks.append(matmul_peak(reps=3))
  med = {k: statistics.median(v) for k, v in times.items()}
  peak = statistics.median(peaks)
  flops = step_flops(cfg, B, P, C)
  n_tok = B * (P + C)
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  print(
    f"config: {n_params / 1e6:.1f}M params, batch {B} x ({P} prompt + {C} completion) tokens, "
    f"logprob chunk {args.chunk}, attention {args.attention}, {args.repeats} rounds of "
    f"{args.block} steps each, torch threads {torch.get_num_threads()}, jax compile "
    f"{compile_s:.1f} s; host heap huge pages: "
    f"{'on' if 'malloc.hugetlb' in tunables else 'off'} (GLIBC_TUNABLES={tunables!r})"
  )
  print(
    f"first-step loss: capo_jax {loss_jax:.6f}, torch {loss_torch:.6f} "
    f"(|diff| {abs(loss_jax - loss_torch):.1e})"
  )
  print(
    f"model FLOPs per step {flops / 1e9:.1f} G; float32 matmul peak (jnp.dot 2048^2) "
    f"{peak / 1e9:.0f} GFLOP/s"
  )
  for k in ("capo_jax", "torch"):
    spread = f"{min(times[k]):.2f}-{max(times[k]):.2f} s"
    print(
      f"  {k:8s}: median {med[k]:6.2f} s ({spread})  {n_tok / med[k]:7.0f} tokens/s  "
      f"{flops / med[k] / 1e9:6.1f} GFLOP/s = {flops / med[k] / peak:5.1%} of peak, "
      f"{statistics.median(faults[k]):,.0f} page faults per step"
    )
  after = {k: statistics.median(v) for k, v in first.items()}
  print(
    f"first step of each block: capo_jax {after['capo_jax']:.2f} s, torch "
    f"{after['torch']:.2f} s (ratio {after['torch'] / after['capo_jax']:.2f}x)"
  )
  paired = [t / j for t, j in zip(rounds["torch"], rounds["capo_jax"])]
  ratio = med["torch"] / med["capo_jax"]
  print(
    f"ratio capo_jax / torch tokens/s: {ratio:.2f}x (rounds {min(paired):.2f}-{max(paired):.2f}x)"
  )
  if args.json:
    result = {
      "batch": B,
      "prompt": P,
      "completion": C,
      "repeats": args.repeats,
      "block": args.block,
      "threads": thread_check,
      "step_s": med,
      "ratio_vs_torch": ratio,
      "ratio_range_vs_torch": [min(paired), max(paired)],
      "ratio_rounds_vs_torch": paired,
      "matmul_peak_flops": peak,
      "model_flops_per_step": flops,
      "loss_diff": abs(loss_jax - loss_torch),
    }
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
