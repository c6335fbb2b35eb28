"""Generated tokens/s of capo_jax.sampling.sampler vs transformers generate (and Tunix).

  python -m benchmarks.sampling              # 32 prompts x 64 tokens, 128 new, 5 rounds
  python -m benchmarks.sampling --tunix      # also Tunix (benchmarks/.venv-tunix, see
                                             # benchmarks/tunix_sampling.py)
  python -m benchmarks.sampling --small      # a seconds-long smoke run

A random Qwen2 (hidden 512, MLP 1408, 4 layers, 8 heads / 2 kv heads, vocab
32,000, tied; float32) is saved once as a HF checkpoint that every sampler
loads. No stop token is set, so every row generates exactly ``--new-tokens``
tokens in every sampler. Per mode (sampling at T = 1 over the full vocabulary,
greedy) the samplers take turns, round after round, after one untimed warm-up
(compilation); reported are medians and the ratio of our tokens/s to each
peer's. transformers is told ``top_k=0, top_p=1.0`` (its default top_k is 50).

Both samplers run on ``--threads`` CPUs (default 2): the process is pinned to
that many CPUs before JAX starts, which sizes XLA:CPU's thread pool, and torch
gets as many intra-op threads (``benchmarks/threads.py``, which also prints how
many threads each side kept busy). The order within a round alternates (A B,
then B A), so neither sampler always runs first.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import tempfile
import time
from typing import Callable

import jax
import numpy as np

from benchmarks import threads
from capo_jax.sampling import sampler as sampling
from capo_jax.sampling import strategies
from models import hf_weights, qwen2
from models.config import Qwen2Config

REPO = pathlib.Path(__file__).resolve().parent.parent
TUNIX_PYTHON = REPO / "benchmarks" / ".venv-tunix" / "bin" / "python"
MODES = ("sample", "greedy")


def bench_config(small: bool) -> Qwen2Config:
  if small:
    return Qwen2Config(
      vocab_size=2048,
      hidden_size=64,
      intermediate_size=128,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      tie_word_embeddings=True,
    )
  return Qwen2Config(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    tie_word_embeddings=True,
  )


def ours_runner(params, cfg, prompts: np.ndarray, new_tokens: int) -> Callable:
  mask = np.ones_like(prompts)

  def run(mode: str, seed: int) -> np.ndarray:
    out = sampling.generate(
      params,
      cfg,
      prompts,
      mask,
      jax.random.key(seed),
      sampling.SamplingSpec(
        num_samples=1,
        max_new_tokens=new_tokens,
        strategy=strategies.make_strategy(1.0 if mode == "sample" else 0.0),
      ),
    )
    return np.asarray(out.tokens_BC)

  return run


def transformers_runner(ckpt: str, prompts: np.ndarray, new_tokens: int) -> Callable:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  model = transformers.Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
  ids = torch.as_tensor(prompts, dtype=torch.long)
  mask = torch.ones_like(ids)

  def run(mode: str, seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    kw = (
      dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
      if mode == "sample"
      else dict(do_sample=False)
    )
    with torch.inference_mode():
      out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        **kw,
      )
    return out[:, prompts.shape[1] :].numpy()

  return run


class TunixRunner:
  """benchmarks/tunix_sampling.py --serve in the Tunix venv, driven over stdin."""

  def __init__(self, ckpt: str, prompts_path: str, new_tokens: int):
    cmd = [
      str(TUNIX_PYTHON),
      str(REPO / "benchmarks" / "tunix_sampling.py"),
      "--ckpt",
      ckpt,
      "--prompts",
      prompts_path,
      "--new-tokens",
      str(new_tokens),
      "--serve",
    ]
    print("starting:", " ".join(cmd), flush=True)
    self.proc = subprocess.Popen(
      cmd,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"tunix worker exited with {self.proc.wait()} before it was ready")
    print("tunix worker ready:", line.strip(), flush=True)

  def __call__(self, mode: str, seed: int) -> np.ndarray:
    del seed
    self.proc.stdin.write(mode + "\n")
    self.proc.stdin.flush()
    reply = json.loads(self.proc.stdout.readline())
    self.last_seconds = reply["seconds"]  # its own timing, without the pipe round trip
    return np.asarray(reply["first_row"])[None]

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.stdin.write("quit\n")
      self.proc.stdin.flush()
      self.proc.wait(timeout=60)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--prompt-len", type=int, default=64)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--tunix", action="store_true", help="also time Tunix (needs its venv)")
  ap.add_argument("--small", action="store_true", help="tiny model and batch: a smoke run")
  ap.add_argument("--threads", type=int, default=2, help="CPUs and intra-op threads of each side")
  ap.add_argument("--json", help="write the medians here")
  args = ap.parse_args()
  if args.small:
    args.batch, args.prompt_len, args.new_tokens, args.rounds = 4, 8, 16, 2
  threads.pin(args.threads)  # before JAX's backend starts
  thread_check = threads.check(args.threads)
  cfg = bench_config(args.small)
  params = qwen2.init_params(cfg, jax.random.key(0))
  prompts = (
    np.random.default_rng(0)
    .integers(3, cfg.vocab_size, (args.batch, args.prompt_len))
    .astype(np.int32)
  )
  n_tokens = args.batch * args.new_tokens
  print(
    f"model {qwen2.num_params(params) / 1e6:.1f}M params; {args.batch} prompts x "
    f"{args.prompt_len} tokens, {args.new_tokens} new tokens each; jax {jax.__version__}, "
    f"{os.cpu_count()} CPUs",
    flush=True,
  )

  with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt")
    hf_weights.save_pretrained(cfg, params, ckpt)
    runners: dict[str, Callable] = {
      "capo_jax": ours_runner(params, cfg, prompts, args.new_tokens),
      "transformers": transformers_runner(ckpt, prompts, args.new_tokens),
    }
    tunix = None
    if args.tunix:
      if not TUNIX_PYTHON.exists():
        raise SystemExit(
          f"--tunix: {TUNIX_PYTHON} not found; create the venv as in benchmarks/tunix_sampling.py"
        )
      np.save(os.path.join(tmp, "prompts.npy"), prompts)
      tunix = runners["tunix"] = TunixRunner(
        ckpt, os.path.join(tmp, "prompts.npy"), args.new_tokens
      )
    try:
      firsts = {}
      for mode in MODES:  # warm-up: compilation, one-time allocations
        for name, run in runners.items():
          firsts[name, mode] = run(mode, 0)
      times: dict[tuple[str, str], list[float]] = {k: [] for k in firsts}
      names = list(runners)
      for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # who goes first rotates
        for mode in MODES:
          for name in order:
            run = runners[name]
            t0 = time.perf_counter()
            tokens = run(mode, r + 1)
            dt = time.perf_counter() - t0
            if name == "tunix":
              dt = tunix.last_seconds
            elif tokens.shape != (args.batch, args.new_tokens):
              raise RuntimeError(f"{name} {mode}: got {tokens.shape} tokens")
            times[name, mode].append(dt)
          print(
            f"round {r + 1} {mode}: "
            + ", ".join(f"{n} {times[n, mode][-1]:.2f}s" for n in runners),
            flush=True,
          )
    finally:
      if tunix is not None:
        tunix.close()

  agree = {
    n: float((firsts[n, "greedy"][0] == firsts["capo_jax", "greedy"][0]).mean())
    for n in runners
    if n != "capo_jax"
  }
  result = {
    "batch": args.batch,
    "prompt_len": args.prompt_len,
    "new_tokens": args.new_tokens,
    "rounds": args.rounds,
    "threads": thread_check,
    "greedy_row0_agreement": agree,
  }
  print(f"\n{'sampler':14s} {'mode':7s} {'median s':>9s} {'tokens/s':>9s} {'ours / it':>9s}")
  for mode in MODES:
    ours = np.median(times["capo_jax", mode])
    for name in runners:
      med = float(np.median(times[name, mode]))
      result[f"{name}_{mode}_tokens_per_s"] = n_tokens / med
      ratio = ours and med / ours
      result[f"ratio_vs_{name}_{mode}"] = ratio
      # Round by round (the samplers of a round run back to back): the spread
      # shows how much of the ratio is the machine's drift.
      paired = [t / o for t, o in zip(times[name, mode], times["capo_jax", mode])]
      result[f"ratio_range_vs_{name}_{mode}"] = [min(paired), max(paired)]
      result[f"ratio_rounds_vs_{name}_{mode}"] = paired
      spread = "" if name == "capo_jax" else f"  (rounds {min(paired):.2f}-{max(paired):.2f}x)"
      print(f"{name:14s} {mode:7s} {med:9.3f} {n_tokens / med:9.0f} {ratio:8.2f}x{spread}")
  print("greedy tokens of row 0 equal to ours (fraction):", agree)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
