"""The sampler / trainer mismatch on the demo's warm start, by sampler and trainer dtype.

  python -m studies.mismatch.run --workdir=/tmp/capo_demo          # the demo's cached warm start
  python -m studies.mismatch.run --workdir=/tmp/x --small          # seconds: a tiny SFT, 2 batches
  python -m studies.mismatch.run --workdir=/tmp/capo_demo --rl_steps=10 --correction=icepop

Each configuration runs the run's own rollout (``rollout.collect``: the engine's
samples, the demo's grader, the old-policy pass the trainer builds with
``programs.build``) over ``--batches`` batches of the demo's Q x G training
prompts, on the warm start's params (no update in between: the mismatch of an
on-policy step), and prints the mean of the logged ``mismatch/*`` metrics
(``capo_jax.rl.mismatch``). Configurations (sampler / trainer compute dtype;
params are float32 masters, the sampler reads them cast to its dtype, as
``setup.policy_weights`` does):

  float32 / float32    the demo (``configs/demo.py``: both float32 on a CPU)
  bfloat16 / float32   a bfloat16 sampler against a float32 trainer
  bfloat16 / bfloat16  the paper configs' compute dtype for both (the TPU runs)

``--rl_steps=N``: instead, N steps of the demo's RL run (CAPO, ``loop.train``) from
the warm start with the trainer's old log-probs and ``--correction``, once with
float32 and once with bfloat16 compute (sampler and trainer alike: a run has one
compute dtype), printing each step's ``mismatch/*`` row of metrics.jsonl: the
mismatch as the policy moves away from the warm start.

The figures and what they mean: ``docs/mismatch.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from capo_jax.data import rewards
from capo_jax.demo import run as demo_run
from capo_jax.demo import task as task_lib
from capo_jax.rl import rollout
from capo_jax.run import loop
from capo_jax.run import programs as programs_lib
from configs import demo as demo_config

CONFIGS = (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"))
KEYS = (
  "abs_log_ratio",
  "seq_abs_log_ratio",
  "k3_kl",
  "ratio_p01",
  "ratio_p50",
  "ratio_p99",
  "ratio_min",
  "ratio_max",
)


def measure(
  spec, ws, examples, sampler_dtype: str, trainer_dtype: str, batches: int, seed: int
) -> dict[str, float]:
  """Mean over ``batches`` rollouts of the logged mismatch metrics (and the accuracy)."""
  spec = spec.with_overrides(
    {"model.compute_dtype": trainer_dtype, "rollout.old_logprobs": "trainer"}, policy_given=True
  )
  trainer_cfg = ws.cfg.replace(compute_dtype=trainer_dtype)
  sampler_cfg = ws.cfg.replace(compute_dtype=sampler_dtype)
  progs = programs_lib.build(spec, trainer_cfg, spec.make_mesh())
  tok = ws.tokenizer
  ctx = programs_lib.rollout_context(spec, progs, sampler_cfg, tok, rewards.default_grader())
  cast = lambda dt: jax.tree.map(lambda x: x.astype(dt), ws.params)  # noqa: E731
  policy = rollout.PolicyArgs(
    sampling=cast(sampler_cfg.dtype),
    train=cast("float32"),
    reference=cast(trainer_cfg.dtype) if spec.needs_reference else None,
  )
  Q = spec.rollout.num_prompts
  rows = []
  for i in range(batches):
    ro = rollout.collect(
      examples[i * Q : (i + 1) * Q], ctx, policy, step=0, rng=jax.random.key(seed + i)
    )
    m = jax.device_get(ro.metrics)
    rows.append(
      {k: float(m[f"mismatch/{k}"]) for k in KEYS}
      | {"accuracy": m["accuracy"], "response_len": m["response_len"]}
    )
  out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
  out["ratio_min"] = min(r["ratio_min"] for r in rows)
  out["ratio_max"] = max(r["ratio_max"] for r in rows)
  return out


def rl_steps(spec, ws, examples, workdir: str, steps: int, correction: str) -> None:
  """``steps`` RL steps per compute dtype; prints the logged mismatch of each step."""
  for dt in ("float32", "bfloat16"):
    run = spec.with_overrides(
      {
        "model.compute_dtype": dt,
        "rollout.old_logprobs": "trainer",
        "rollout.is_correction": correction,
        "train.num_steps": steps,
        "eval.every_steps": 0,
        "checkpoint.export_hf": False,
        "checkpoint.every_steps": steps,
      },
      policy_given=True,
    )
    out = os.path.join(workdir, f"mismatch_rl_{dt}_{correction}")
    loop.train(
      run,
      out,
      policy=loop.Policy(ws.cfg.replace(compute_dtype=dt), ws.params),
      tokenizer=ws.tokenizer,
      train_examples=examples,
    )
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
      rows = [json.loads(line) for line in f]
    keys = [k for k in rows[0] if k.startswith("mismatch/")]
    print(f"\n{dt} sampler and trainer, is_correction={correction} ({out})")
    print("| step | accuracy | " + " | ".join(k[len("mismatch/") :] for k in keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for r in rows:
      print(
        f"| {r['step']} | {r['accuracy']:.3f} | " + " | ".join(f"{r[k]:.3g}" for k in keys) + " |",
        flush=True,
      )


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument(
    "--workdir",
    default="/tmp/capo_demo",
    help="the demo's workdir: its warm start is loaded (or trained) and cached",
  )
  ap.add_argument("--batches", type=int, default=4, help="rollouts of Q x G per configuration")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--small", action="store_true", help="the demo's shrunk config (smoke)")
  ap.add_argument("--rl_steps", type=int, default=0, help="> 0: RL steps instead (see doc)")
  ap.add_argument("--correction", default="none", help="rollout.is_correction of --rl_steps")
  args = ap.parse_args()
  config = demo_config.get_config("shrink" if args.small else None)
  spec = demo_run.spec_of(config)
  t0 = time.perf_counter()
  ws = demo_run.get_warm_start(spec, args.workdir)
  train, _ = task_lib.make_splits(demo_run.Demo.of(spec).task)
  if args.rl_steps:
    rl_steps(
      spec.with_overrides(demo_run.compare.VARIANTS["capo"], policy_given=True),
      ws,
      train,
      args.workdir,
      args.rl_steps,
      args.correction,
    )
    return
  batches = 2 if args.small else args.batches
  Q, G = spec.rollout.num_prompts, spec.rollout.num_samples
  print(
    f"warm start {ws.info.get('path')} ({time.perf_counter() - t0:.0f} s); {batches} "
    f"rollouts of {Q} x {G} per configuration, max_new_tokens "
    f"{spec.rollout.max_new_tokens}, jax {jax.__version__} on {jax.devices()[0].platform}"
  )
  print("| sampler / trainer | " + " | ".join(KEYS) + " | accuracy |")
  print("|---" * (len(KEYS) + 2) + "|")
  for s_dt, t_dt in CONFIGS:
    m = measure(spec, ws, train, s_dt, t_dt, batches, args.seed)
    print(
      f"| {s_dt} / {t_dt} | "
      + " | ".join(f"{m[k]:.3g}" for k in KEYS)
      + f" | {m['accuracy']:.3f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
