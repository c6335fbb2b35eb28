"""XLA's memory analysis of one compiled train micro-batch vs ``memory_plan``'s terms.

    python -m tools.train_memory                 # Qwen2.5-Math-1.5B shape, one 4,096-token row

Lowers (no weights allocated) the gradient of the policy loss of one row of
``--tokens`` tokens (1,024 prompt + the rest completion; one packed row is the
same shape) at the 1.5B shape, bfloat16 compute, remat, log-prob chunk 512,
once with the reference attention (the T x T scores) and once with the blocked
attention, and prints the compiled program's temporary bytes next to the
plan's activation terms for one row: the formula before (a T^2 score term)
and now (one attention block). Compiled for the CPU here; a TPU / GPU compile
lays buffers out differently (the plan is a model of the TPU's).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from capo_jax.rl import train_step as ts
from capo_jax.rl.losses import LossConfig
from models import qwen2
from models.config import Qwen2Config
from tests.batches import HostBatch
from tools import memory_terms

MiB = 1024**2


def compiled_bytes(cfg: Qwen2Config, P: int, C: int, chunk: int) -> dict[str, float]:
  """Argument / output / temporary bytes of the compiled micro-batch gradient."""
  tcfg = ts.TrainConfig(loss=LossConfig(), logprob_chunk_size=chunk)
  i32 = lambda n: np.ones((1, n), np.int32)
  host = HostBatch(
    i32(P), i32(P), i32(C), i32(C), np.zeros((1, C), np.float32), np.zeros(1, np.float32)
  ).train_batch(1)  # one row of P + C tokens
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
  params = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), qwen2.param_shapes(cfg)
  )
  fn = jax.jit(lambda p, b: ts.loss_and_grads(p, b, cfg, tcfg)[2])
  mem = fn.lower(params, batch).compile().memory_analysis()
  return {
    "arguments": mem.argument_size_in_bytes,
    "outputs": mem.output_size_in_bytes,
    "temporaries": mem.temp_size_in_bytes,
  }


def plan_terms(cfg: Qwen2Config, T: int, chunk: int) -> dict[str, float]:
  """The plan's activation terms for one row of T tokens on one chip (before / now)."""
  D, F, N, L, V = (
    cfg.hidden_size,
    cfg.intermediate_size,
    cfg.num_heads,
    cfg.num_layers,
    cfg.vocab_size,
  )
  act = 2
  block = memory_terms.ATTN_BLOCK
  common = T * F * act * 4 + T * D * act * 8
  return {
    "boundary activations": L * T * D * act,
    "layer working set, before (T^2 scores)": N * T * T * 10 + common,
    "layer working set, now (one block)": N * (block * block * 10 + T * 4) + common,
    "log-prob chunk": chunk * V * 4 * 3,
    "bf16 params copy": act * qwen2.num_params(qwen2.param_shapes(cfg)),
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--prompt", type=int, default=1024)
  parser.add_argument("--chunk", type=int, default=512)
  parser.add_argument("--preset", default="qwen2p5_math_1p5b")
  args = parser.parse_args(argv)
  P, C = args.prompt, args.tokens - args.prompt
  base = getattr(Qwen2Config, args.preset)(compute_dtype="bfloat16", remat=True)
  # One sequence per row: the model sees the row's T tokens.
  terms = plan_terms(base, args.tokens, args.chunk)
  print(
    f"{args.preset}, one row of {args.tokens} tokens ({P} + {C}), bf16 compute, remat, "
    f"log-prob chunk {args.chunk}; backend {jax.default_backend()}"
  )
  print("plan terms (MiB):")
  for k, v in terms.items():
    print(f"  {k:42s} {v / MiB:9.1f}")
  before = sum(v for k, v in terms.items() if "now" not in k)
  now = sum(v for k, v in terms.items() if "before" not in k)
  print(f"  {'sum, before':42s} {before / MiB:9.1f}\n  {'sum, now':42s} {now / MiB:9.1f}")
  print("XLA memory analysis of the compiled gradient (MiB):")
  for impl in ("reference", "flash"):
    got = compiled_bytes(base.replace(attention=impl), P, C, args.chunk)
    print(f"  attention={impl:9s} " + "  ".join(f"{k} {v / MiB:9.1f}" for k, v in got.items()))


if __name__ == "__main__":
  main()
