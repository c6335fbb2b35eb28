"""This checkout vs another one of capo-jax (e.g. before a rewrite), alternated round by round.

    git worktree add /tmp/before <commit>
    python -m benchmarks.ab_checkouts --baseline /tmp/before          # sampler + train step
    python -m benchmarks.ab_checkouts --baseline /tmp/before --small  # a smoke run

Each checkout runs in its own worker process (``PYTHONPATH`` = that checkout)
that builds the workloads of ``benchmarks/sampling.py`` and
``benchmarks/train_step.py`` once: the same 27.7M-parameter float32 Qwen2,
random weights from one seed, then waits for commands. The driver alternates
the two workers round by round (A, B, B, A, ... so neither always goes first)
and times one call per round: a ``generate`` of 32 prompts x 64 tokens, 128
new tokens at T = 1 (no stop id, so every row generates all of them) and a
greedy one; a train step on 8 x (64 + 192) tokens (PPO token-mean loss,
AdamW). Both workers run on the same ``--threads`` CPUs (default 2), which
sizes XLA:CPU's thread pool (``benchmarks/threads.py``). Compilation happens in
an untimed warm-up. Reported: medians per
checkout and the ratio this / baseline of throughput (> 1: this checkout is
faster), with the range of the per-round paired ratios.

Workers speak the APIs the package has had: ``generate(temperature=)`` with
``Samples.tokens``, ``generate(strategy=)`` and ``generate(spec)`` with
``Samples.tokens_BC``; the train step's batch as one ``capo_jax.rl.batch.TrainBatch`` of
model rows (``tests/batches.py``: one sequence per row, one micro-batch) or, before it, the
padded ``train_step.TrainBatch`` placed with ``shard_batch`` from ``tests/host_utils.py``,
``runtime.host`` or ``runtime.mesh``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parent.parent

_WORKER = textwrap.dedent("""
    import json, sys, time
    import jax, numpy as np
    from models import qwen2
    from models.config import Qwen2Config
    from capo_jax.sampling import sampler as sampling
    from capo_jax.sampling import strategies
    from capo_jax.rl import train_step as ts
    from capo_jax.rl.losses import LossConfig
    from capo_jax.rl.optim import OptimConfig
    from capo_jax.runtime import mesh as mesh_lib
    try:
      from tests.batches import HostBatch  # the one TrainBatch of model rows
    except ImportError:
      HostBatch = None
    try:
      from tests.host_utils import shard_batch
    except ImportError:
      try:
        from capo_jax.runtime.host import shard_batch
      except ImportError:
        shard_batch = mesh_lib.shard_batch
    small = sys.argv[1] == "small"
    D, F, L, V = (64, 128, 2, 2048) if small else (512, 1408, 4, 32000)
    cfg = Qwen2Config(vocab_size=V, hidden_size=D, intermediate_size=F, num_layers=L,
                      num_heads=8, num_kv_heads=2, tie_word_embeddings=True, rope_theta=1e4)
    params = qwen2.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    Q, P, C_new = (4, 16, 16) if small else (32, 64, 128)
    prompts = rng.integers(0, V, (Q, P)).astype(np.int32)

    def generate(greedy, seed):
      kw = dict(num_samples=1, max_new_tokens=C_new)
      if hasattr(sampling, "SamplingSpec"):  # generate(..., spec)
        strategy = strategies.make_strategy(0.0 if greedy else 1.0)
        spec = sampling.SamplingSpec(strategy=strategy, **kw)
        out = sampling.generate(params, cfg, prompts, np.ones_like(prompts), jax.random.key(seed),
                                spec)
        return np.asarray(out.tokens_BC)
      try:
        strategy = strategies.make_strategy(0.0 if greedy else 1.0)
        out = sampling.generate(params, cfg, prompts, np.ones_like(prompts), jax.random.key(seed),
                                strategy=strategy, **kw)
      except TypeError:  # the API before strategies were the only way in
        out = sampling.generate(params, cfg, prompts, np.ones_like(prompts), jax.random.key(seed),
                                temperature=0.0 if greedy else 1.0, **kw)
      tokens = getattr(out, "tokens_BC", None)
      return np.asarray(out.tokens if tokens is None else tokens)

    B, TP, TC = (2, 16, 32) if small else (8, 64, 192)
    mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
    rules = mesh_lib.TRAIN_RULES
    tcfg = ts.TrainConfig(loss=LossConfig(agg="token-mean"),
                          optim=OptimConfig(learning_rate=1e-6, weight_decay=0.01, grad_clip=1.0))
    state = ts.train_state_from_params(params, cfg, tcfg, mesh, rules)
    ones = lambda n: np.ones((B, n), np.int32)
    arrays = (rng.integers(0, V, (B, TP)).astype(np.int32), ones(TP),
              rng.integers(0, V, (B, TC)).astype(np.int32), ones(TC),
              rng.normal(scale=0.1, size=(B, TC)).astype(np.float32) - 10.0,
              rng.normal(size=(B,)).astype(np.float32))
    if HostBatch is not None:
      batch = jax.device_put(HostBatch(*arrays).train_batch(B), ts.batch_sharding(mesh, rules, B))
    else:
      batch = shard_batch(ts.TrainBatch(*arrays), mesh, rules)
    step_fn = ts.make_train_step(cfg, tcfg, mesh, rules, B)

    def train(_greedy, _seed):
      global state
      state, metrics = step_fn(state, batch)
      return jax.block_until_ready(metrics)

    work = {"sample": lambda s: generate(False, s), "greedy": lambda s: generate(True, s),
            "train": lambda s: train(False, s)}
    for name, fn in work.items():
      fn(0)  # compile
    print(json.dumps({"ready": True, "tokens": {"sample": Q * C_new, "greedy": Q * C_new,
                                                 "train": B * (TP + TC)}}), flush=True)
    for line in sys.stdin:
      name, seed = line.split()
      t0 = time.perf_counter()
      work[name](int(seed))
      print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
""")


class _Worker:
  def __init__(self, root: pathlib.Path, small: bool, cpus: list[int]):
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    self.proc = subprocess.Popen(
      [sys.executable, "-c", _WORKER, "small" if small else "full"],
      cwd=root,
      env=env,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      # The same CPUs for both checkouts, set before JAX starts (benchmarks/threads.py).
      preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    self.tokens = self._read()["tokens"]

  def _read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"worker exited with {self.proc.wait()}; see its stderr above")
    return json.loads(line)

  def time(self, name: str, seed: int) -> float:
    self.proc.stdin.write(f"{name} {seed}\n")
    self.proc.stdin.flush()
    return self._read()["seconds"]

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--baseline", required=True, help="the other checkout's root directory")
  ap.add_argument("--rounds", type=int, default=10)
  ap.add_argument("--small", action="store_true", help="tiny shapes: a seconds-long smoke run")
  ap.add_argument("--json", help="write the result here")
  ap.add_argument("--threads", type=int, default=2, help="CPUs of each worker (the same ones)")
  args = ap.parse_args(argv)
  baseline = pathlib.Path(args.baseline).resolve()
  if not (baseline / "models" / "qwen2.py").is_file():
    raise SystemExit(f"--baseline={baseline}: not a capo-jax checkout (no models/qwen2.py)")
  cpus = sorted(os.sched_getaffinity(0))[: args.threads]
  workers = {
    "this": _Worker(REPO, args.small, cpus),
    "baseline": _Worker(baseline, args.small, cpus),
  }
  times: dict[tuple[str, str], list[float]] = {}
  try:
    for r in range(args.rounds):
      order = ["this", "baseline"] if r % 2 == 0 else ["baseline", "this"]
      for name in ("sample", "greedy", "train"):
        for who in order:
          times.setdefault((who, name), []).append(workers[who].time(name, r + 1))
      print(
        f"round {r + 1}: "
        + ", ".join(
          f"{n} {times['this', n][-1]:.2f}s / {times['baseline', n][-1]:.2f}s"
          for n in ("sample", "greedy", "train")
        ),
        flush=True,
      )
  finally:
    for w in workers.values():
      w.close()
  result: dict = {
    "rounds": args.rounds,
    "baseline": str(baseline),
    "small": args.small,
    "cpus": cpus,
  }
  print(f"\n{'workload':9s} {'this s':>8s} {'baseline s':>10s} {'this/baseline':>14s}  rounds")
  for name in ("sample", "greedy", "train"):
    ours, base = times["this", name], times["baseline", name]
    ratio = statistics.median(base) / statistics.median(ours)  # throughput ratio
    paired = [b / o for b, o in zip(base, ours)]
    result[name] = {
      "this_s": statistics.median(ours),
      "baseline_s": statistics.median(base),
      "ratio": ratio,
      "paired_range": [min(paired), max(paired)],
      "tokens_per_call": workers["this"].tokens[name],
    }
    print(
      f"{name:9s} {statistics.median(ours):8.3f} {statistics.median(base):10.3f} "
      f"{ratio:13.3f}x  {min(paired):.2f}-{max(paired):.2f}x"
    )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
