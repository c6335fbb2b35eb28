"""The evaluator's command line: ``python -m capo_jax.eval`` (``capo_jax.eval.__main__``).

    python -m capo_jax.eval --policy=DIR --benchmarks=math500,aime24 \
        --num_samples=16 --max_new_tokens=3072 --out=DIR
    python -m capo_jax.eval --from-samples=samples.jsonl --out=DIR   # e.g. from vLLM
    python -m capo_jax.eval --compare DIR DIR ... --out=DIR          # markdown table

``--policy`` is a Hugging Face model directory, or a trainer workdir: then its
HF export ``<workdir>/export_hf`` when present, else the params of the latest
Orbax checkpoint in ``<workdir>/checkpoints`` (``runtime.policy_io.load_policy``). The
prompt is the one the policy was trained with (an export's ``prompt.json``, a
workdir's ``config.json``), else the paper's; ``--system_prompt``,
``--prompt_template``, ``--chat_template`` and ``--enable_thinking`` change it. Every
question gets ``num_samples`` responses (T = 1.0, top_p = 1.0 by default, as
in the paper); ``capo_jax.eval.evaluate`` samples, grades and writes them. The
printed table has the headline numbers at k = ``num_samples``.

Answer grouping (maj@k, PC, RPC) has ``--grouping_budget_s`` per question
(``capo_jax.eval.grouping``); the pairs it leaves unchecked are ``grouping_timeouts`` in
results.json and noted under the printed table. Input errors name the file, and the command
line prints them without a traceback (``capo_jax.eval.inputs``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from capo_jax.data import prompts, reward_fns
from capo_jax.eval import comparison, inputs, report
from capo_jax.eval import grouping as grouping_lib
from capo_jax.eval.evaluate import (
  EvalConfig,
  EvalPolicy,
  evaluate_policy,
  load_benchmarks,
  results_config,
  write_outputs,
)
from capo_jax.eval.inputs import InputError
from capo_jax.eval.report import SampleRecord
from capo_jax.runtime import fs
from capo_jax.runtime.policy_io import load_policy
from models.config import Qwen2Config
from models.sharding import Layout

log = logging.getLogger(__name__)


def summary_table(results: Mapping[str, Any], run: str, num_samples: int) -> str:
  """Markdown table of the headline numbers at k = ``num_samples``, and a note per
  benchmark whose answer grouping left pairs unchecked."""
  g = num_samples
  columns = (
    (f"mean@{g}", f"mean@{g}"),
    ("AUC", "auc_mean"),
    ("AURC", "aurc"),
    ("pooled AUC", "pooled_auc"),
    (f"PC@{g}", "scaling/pc/-1"),
    (f"maj@{g}", f"maj@k/{g}"),
  )  # no ECE: comparison.ECE_NOTE
  notes = [
    f"{bench}: {res['grouping_timeouts']} answer pairs timed out in grouping and "
    "count as different answers (maj@k, PC, RPC)\n"
    for bench, res in results["benchmarks"].items()
    if res.get("grouping_timeouts")
  ]
  return comparison.comparison_table({run: results}, columns) + "".join(notes)


def _read_samples(path: str) -> list[SampleRecord]:
  try:
    return report.load_samples(path)
  except (OSError, ValueError) as e:  # ValueErrors name the file and line already
    raise InputError(f"--from-samples: {e}") from None


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m capo_jax.eval",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  mode = p.add_mutually_exclusive_group(required=True)
  mode.add_argument(
    "--policy", help="HF model dir, hub id (Qwen/...) or trainer workdir (see load_policy)"
  )
  mode.add_argument(
    "--from-samples",
    "--from_samples",
    dest="from_samples",
    metavar="FILE",
    help="compute every metric from a samples.jsonl written elsewhere",
  )
  mode.add_argument(
    "--compare",
    nargs="+",
    metavar="DIR",
    help="result dirs to compare in OUT/comparison.md (+ overlaid plots)",
  )
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument(
    "--benchmarks",
    default="math500,aime24,aime25,amc23,minerva_math,olympiadbench",
    help="comma-separated registry names or files (.jsonl/.json/.parquet)",
  )
  p.add_argument(
    "--data_dir", default="", help="where registry names are looked up (default $CAPO_DATA_DIR)"
  )
  p.add_argument("--limit", type=int, default=0, help="first N questions per benchmark (0: all)")
  p.add_argument("--num_samples", type=int, default=16)
  p.add_argument("--max_new_tokens", type=int, default=3072)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top_p", type=float, default=1.0)
  p.add_argument("--top_k", type=int, default=0)
  p.add_argument("--batch_size", type=int, default=8, help="questions per sampler call")
  p.add_argument(
    "--max_active_rows",
    type=int,
    default=0,
    help="rows decoded at once (continuous batching); 0: all rows of a call",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="params and compute dtype"
  )
  p.add_argument("--tokenizer", default="", help="tokenizer dir (default: next to the policy)")
  p.add_argument(
    "--base_model",
    default="",
    help="HF dir or hub id of the run's base model: config and tokenizer for an Orbax checkpoint",
  )
  p.add_argument(
    "--tensor_parallel",
    type=int,
    default=0,
    help="chips that split the sampler's weights when several devices are visible "
    "(capo_jax.runtime.mesh.sampling_mesh; 0: one host's chips)",
  )
  p.add_argument(
    "--checker",
    default="auto",
    help="what decides 'correct': auto (each "
    "benchmark's registry checker: math, countdown), math, countdown, or a "
    "plug-in module:function / file.py:function (docs/rewards.md)",
  )
  p.add_argument(
    "--grouping",
    default="rewards",
    choices=("rewards", "exact"),
    help="answer equivalence of maj@k / PC / RPC",
  )
  p.add_argument(
    "--grouping_budget_s",
    type=float,
    default=grouping_lib.Limits.budget_s,
    help="seconds per question for the answer checks of --grouping; pairs "
    "left unchecked count as different (results.json: grouping_timeouts)",
  )
  p.add_argument("--run", default="", help="run name in results.json (default: out dir name)")
  p.add_argument("--names", nargs="*", help="--compare: run names")
  prompts.add_flags(p)
  p.add_argument("--no_plots", action="store_true")
  p.add_argument("--no_progress", action="store_true")
  return p


def _sampling_layout(tensor: int, cfg: Qwen2Config) -> Layout | None:
  if jax.device_count() == 1:
    return None
  from capo_jax.runtime import mesh as mesh_lib  # pylint: disable=import-outside-toplevel

  try:
    mesh = mesh_lib.sampling_mesh(mesh_lib.make_mesh({"data": -1}), cfg, tensor)
  except ValueError as e:
    raise ValueError(f"--tensor_parallel={tensor}: {e}") from e
  return Layout.of(mesh, mesh_lib.SAMPLING_RULES)


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | str:
  """CLI entry; returns the results dict (or comparison.md's path with --compare)."""
  args = _parser().parse_args(argv)
  if not logging.getLogger().handlers:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  try:
    limits = grouping_lib.Limits(budget_s=args.grouping_budget_s)
  except ValueError as e:
    raise InputError(f"--grouping_budget_s: {e}") from None
  if args.compare:
    try:
      for d in args.compare:  # read first: errors that name the file, before any output
        report.load_results(d)
    except (OSError, ValueError) as e:
      raise InputError(f"--compare: {e}") from None
    path = comparison.compare(args.compare, args.out, args.names)
    print(path)
    return path
  run = args.run or fs.path(args.out).name
  if args.from_samples:
    records = _read_samples(args.from_samples)
    per_q = collections.Counter((r.benchmark, r.question_id) for r in records)
    num_samples = min(per_q.values(), default=1)
    rcfg = results_config(num_samples, args.grouping, limits)
    results = write_outputs(
      records,
      args.out,
      run=run,
      results_config=rcfg,
      config={
        "from_samples": args.from_samples
        if fs.is_remote(args.from_samples)
        else os.path.abspath(args.from_samples)
      },
      plots=not args.no_plots,
      samples=False,
    )
  else:
    # Flags and benchmark files are checked before the (slow) policy load.
    eval_cfg = EvalConfig(
      num_samples=args.num_samples,
      max_new_tokens=args.max_new_tokens,
      temperature=args.temperature,
      top_p=args.top_p,
      top_k=args.top_k,
      batch_size=args.batch_size,
      max_active_rows=args.max_active_rows,
      progress=not args.no_progress,
    )
    benchmarks = load_benchmarks(
      [b.strip() for b in args.benchmarks.split(",") if b.strip()], args.data_dir, args.limit
    )
    grader = None if args.checker == "auto" else reward_fns.grader_for(args.checker)
    prompts.from_flags(args, None)
    inputs.check_policy_config(args.policy)
    policy = load_policy(
      args.policy, base_model=args.base_model or None, dtype=jnp.dtype(args.dtype)
    )
    tok_dir = args.tokenizer or policy.tokenizer_dir
    if not tok_dir:
      raise FileNotFoundError(
        f"no tokenizer next to {policy.source}: pass --tokenizer=DIR (or --base_model=DIR)"
      )
    from capo_jax.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel

    prompt = prompts.from_flags(args, policy.prompt)  # the run's prompt, unless overridden
    tokenizer = load_tokenizer(tok_dir, prompt=prompt)
    if tokenizer.vocab_size > policy.cfg.vocab_size:
      raise ValueError(
        f"tokenizer {tok_dir} has {tokenizer.vocab_size} tokens but the policy's "
        f"vocab_size is {policy.cfg.vocab_size}: wrong --tokenizer?"
      )
    log.info("policy %s (%s), tokenizer %s", policy.source, args.dtype, tok_dir)
    sampler = EvalPolicy(
      policy.params, policy.cfg, tokenizer, _sampling_layout(args.tensor_parallel, policy.cfg)
    )
    records = evaluate_policy(
      sampler, benchmarks, eval_cfg, jax.random.key(args.seed), grader=grader
    )
    config = dict(
      dataclasses.asdict(eval_cfg),
      policy=policy.source,
      tokenizer=tok_dir,
      seed=args.seed,
      dtype=args.dtype,
      limit=args.limit,
      prompt=prompt.to_json(),
      benchmarks={k: len(v) for k, v in benchmarks.items()},
    )
    num_samples = args.num_samples
    results = write_outputs(
      records,
      args.out,
      run=run,
      config=config,
      results_config=results_config(num_samples, args.grouping, limits),
      plots=not args.no_plots,
    )
  print(summary_table(results, run, num_samples))
  return results


def cli(argv: Sequence[str] | None = None) -> None:
  """``python -m capo_jax.eval``: ``main``, with an ``InputError`` printed, not raised."""
  try:
    main(argv)
  except InputError as e:
    sys.exit(f"python -m capo_jax.eval: error: {e}")


if __name__ == "__main__":
  cli()
