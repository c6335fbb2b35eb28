"""Forward-pass throughput of the JAX Qwen2 port vs transformers (PyTorch), CPU.

Both run the same random weights on the same batch in one process, repeats
alternating between them (the machines are shared, so only a ratio measured
side by side means anything); medians are reported.

    python -m benchmarks.forward                      # 27.7M-param config, 8 x 128 tokens
    python -m benchmarks.forward --batch 4 --seq 512 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from models import hf_weights, qwen2
from models.config import Qwen2Config
from tests import hf_utils

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


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--torch_threads", type=int, default=0, help="0: torch's default")
  args = parser.parse_args(argv)

  import torch  # pylint: disable=g-import-not-at-top

  if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
  hf_model, _ = hf_utils.make_hf_model(None, seed=0, std=0.05, **MID_CONFIG)
  hf_model.eval()
  cfg = Qwen2Config.from_hf(hf_model.config.to_dict())
  state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
  params = hf_weights.params_from_state_dict(cfg, state)
  n_params = qwen2.num_params(params)

  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
  mask = np.ones_like(tokens)
  tokens_pt = torch.as_tensor(tokens, dtype=torch.long)
  mask_pt = torch.ones_like(tokens_pt)

  fwd = jax.jit(qwen2.forward, static_argnums=1)
  tokens_j, mask_j = jax.device_put(tokens), jax.device_put(mask)

  def run_jax() -> np.ndarray:
    return fwd(params, cfg, tokens_j, mask_j).block_until_ready()

  def run_torch() -> torch.Tensor:
    with torch.no_grad():
      return hf_model(input_ids=tokens_pt, attention_mask=mask_pt).logits

  # Warm-up (jit compile, torch allocator) and an agreement check.
  diff = np.abs(np.asarray(run_jax()) - run_torch().numpy()).max()
  times: dict[str, list[float]] = {"jax": [], "torch": []}
  for _ in range(args.repeats):
    for name, fn in (("jax", run_jax), ("torch", run_torch)):
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  n_tok = args.batch * args.seq
  med = {k: statistics.median(v) for k, v in times.items()}
  print(
    f"config: {n_params / 1e6:.1f}M params, batch {args.batch} x {args.seq} tokens, "
    f"{args.repeats} alternating repeats, torch threads {torch.get_num_threads()}, "
    f"max |logit diff| {diff:.2e}"
  )
  for k in ("jax", "torch"):
    spread = f"{min(times[k]) * 1e3:.0f}-{max(times[k]) * 1e3:.0f} ms"
    print(f"  {k:5s}: median {med[k] * 1e3:7.1f} ms ({spread})  {n_tok / med[k]:9.0f} tokens/s")
  print(f"ratio jax / transformers tokens/s: {med['torch'] / med['jax']:.2f}x")


if __name__ == "__main__":
  main()
