"""Tunix's JAX sampler on a HF Qwen2 checkpoint: the peer of benchmarks/sampling.py.

Runs in its own virtual environment (Tunix pins ``safetensors<0.8``)::

  python3 -m venv benchmarks/.venv-tunix
  benchmarks/.venv-tunix/bin/pip install google-tunix "safetensors<0.8"

``benchmarks/sampling.py --tunix`` starts it with ``--serve`` and alternates
with it; alone it times ``--rounds`` calls per mode itself::

  benchmarks/.venv-tunix/bin/python benchmarks/tunix_sampling.py \
      --ckpt DIR --prompts prompts.npy --new-tokens 128 --rounds 5

Prompts are token ids (no padding, no id 0); a stand-in tokenizer passes them
through. No stop token is set, so every row generates ``--new-tokens``. Tunix
treats a temperature without ``top_p`` as greedy, so sampling passes
``top_p=1.0`` (it then draws with ``jax.random.categorical``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen2 import model as model_lib
from tunix.models.qwen2 import params as params_lib


class _IdTokenizer:
  """Space-separated token ids in, out; no BOS, pad 0, EOS never produced."""

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self) -> None:
    return None

  def eos_id(self) -> int:
    return -1

  def pad_id(self) -> int:
    return 0


def _model_config(hf: dict) -> model_lib.ModelConfig:
  return model_lib.ModelConfig(
    num_layers=hf["num_hidden_layers"],
    vocab_size=hf["vocab_size"],
    embed_dim=hf["hidden_size"],
    hidden_dim=hf["intermediate_size"],
    num_heads=hf["num_attention_heads"],
    head_dim=hf["head_dim"],
    num_kv_heads=hf["num_key_value_heads"],
    rope_theta=int(hf["rope_theta"]),
    norm_eps=hf["rms_norm_eps"],
    use_tied_embedding=hf["tie_word_embeddings"],
  )


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--ckpt", required=True, help="HF Qwen2 checkpoint directory")
  ap.add_argument("--prompts", required=True, help=".npy int array [B, P], ids >= 1")
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument(
    "--serve",
    action="store_true",
    help="after warm-up, answer 'sample' / 'greedy' lines on stdin with JSON",
  )
  args = ap.parse_args()

  with open(f"{args.ckpt}/config.json", encoding="utf-8") as f:
    hf = json.load(f)
  model = params_lib.create_model_from_safe_tensors(args.ckpt, _model_config(hf), dtype=jnp.float32)
  prompts = np.load(args.prompts)
  texts = [" ".join(map(str, row)) for row in prompts]
  B, P = prompts.shape
  sampler = sampler_lib.Sampler(
    model,
    _IdTokenizer(),
    sampler_lib.CacheConfig(
      cache_size=P + args.new_tokens,
      num_layers=hf["num_hidden_layers"],
      num_kv_heads=hf["num_key_value_heads"],
      head_dim=hf["head_dim"],
    ),
  )

  def run(mode: str, seed: int) -> tuple[float, np.ndarray]:
    kw = dict(temperature=1.0, top_p=1.0) if mode == "sample" else {}
    t0 = time.perf_counter()
    out = sampler(
      texts,
      max_generation_steps=args.new_tokens,
      max_prompt_length=P,
      eos_tokens=[-1],
      seed=seed,
      **kw,
    )
    seconds = time.perf_counter() - t0
    tokens = np.stack([np.asarray(t) for t in out.tokens])
    if tokens.shape != (B, args.new_tokens):
      raise RuntimeError(f"tunix returned {tokens.shape}, expected {(B, args.new_tokens)}")
    return seconds, tokens

  for mode in ("sample", "greedy"):
    run(mode, 0)  # compile
  if args.serve:
    print(json.dumps({"ready": True, "jax": jax.__version__}), flush=True)
    for seed, line in enumerate(sys.stdin, start=1):
      mode = line.strip()
      if mode == "quit":
        break
      seconds, tokens = run(mode, seed)
      print(
        json.dumps({"mode": mode, "seconds": seconds, "first_row": tokens[0].tolist()}), flush=True
      )
    return
  for mode in ("sample", "greedy"):
    times = [run(mode, r + 1)[0] for r in range(args.rounds)]
    med = float(np.median(times))
    print(f"tunix {mode}: median {med:.3f} s, {B * args.new_tokens / med:.0f} tokens/s")


if __name__ == "__main__":
  main()
