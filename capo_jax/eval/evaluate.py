"""Evaluate a policy on math benchmarks: sample, grade, score accuracy and calibration.

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
in the paper), graded by ``capo_jax.data.rewards``; the metrics are defined in
docs/algorithms.md ("Evaluation metrics"). The output directory gets
``samples.jsonl`` and ``results.json`` (schemas in ``capo_jax.eval.report``) and
three PNG plots per benchmark: ``<bench>_precision_coverage.png``,
``<bench>_scaling.png`` (PC / RPC / majority / best-of-N against N) and
``<bench>_auc_hist.png`` (per-question AUC). In-process callers (trainer,
demo) use ``evaluate_policy`` and ``write_outputs``.

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
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import auto as tqdm

from capo_jax.data import datasets as data
from capo_jax.data import prompts, reward_fns, rewards
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.eval import grouping as grouping_lib
from capo_jax.eval import inputs, report, scaling
from capo_jax.eval.inputs import InputError
from capo_jax.eval.report import SampleRecord
from capo_jax.masked import mean_logprob
from capo_jax.runtime import fs
from capo_jax.runtime.policy_io import load_policy
from capo_jax.sampling import sampler as sampling
from capo_jax.sampling import strategies
from models.config import Qwen2Config
from models.qwen2 import Params
from models.sharding import Layout, to_host

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Sampling settings of an evaluation (defaults: the paper's, 16 samples at T = 1)."""

  num_samples: int = 16
  max_new_tokens: int = 3072
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  batch_size: int = 8  # questions per sampler call (rows = batch_size * num_samples)
  max_active_rows: int = 0  # rows decoded at once (the engine's KV slots); 0: all
  progress: bool = True

  def __post_init__(self) -> None:
    for name in ("num_samples", "max_new_tokens", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"EvalConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.max_active_rows < 0:
      raise ValueError(
        f"EvalConfig.max_active_rows must be >= 0 (0: all rows), got {self.max_active_rows}"
      )


# --- sampling and grading -------------------------------------------------------


def _batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
  """Question indices by prompt length, so a batch pads little, cut into batches."""
  order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
  return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@dataclasses.dataclass(frozen=True)
class EvalPolicy:
  """What samples, the same for every benchmark of an evaluation.

  Attributes:
    params, cfg: the policy (params in any dtype; ``cfg.compute_dtype`` is used).
    tokenizer: renders the chat prompt, pads prompts, decodes completions.
    layout: device mesh and sampling rules for the sampler (e.g.
      ``Layout.of(mesh_lib.sampling_mesh(mesh, cfg), mesh_lib.SAMPLING_RULES)``);
      None: one device.
  """

  params: Params
  cfg: Qwen2Config
  tokenizer: Tokenizer
  layout: Layout | None = None


def _evaluate_benchmark(
  policy: EvalPolicy,
  examples: Sequence[data.Example],
  eval_cfg: EvalConfig,
  rng: jax.Array,
  benchmark: str,
  grader: Any,
) -> list[SampleRecord]:
  """Records of one benchmark in file order (question, then sample index)."""
  params, cfg, tokenizer, layout = policy.params, policy.cfg, policy.tokenizer, policy.layout
  ids = [ex.id for ex in examples]
  dup = next((i for i, c in collections.Counter(ids).items() if c > 1), None)
  if dup is not None:
    raise ValueError(f"benchmark {benchmark!r}: question id {dup!r} appears more than once")
  lengths = [len(tokenizer.encode(tokenizer.render_prompt(ex.problem))) for ex in examples]
  bs = min(eval_cfg.batch_size, len(examples))
  G = eval_cfg.num_samples
  per_question: list[list[SampleRecord]] = [[] for _ in examples]
  stats: collections.Counter[str] = collections.Counter()

  def dispatch(b: int, idx: list[int]) -> Any:
    # A short last batch repeats its last question: one batch shape, one compile.
    padded = idx + [idx[-1]] * (bs - len(idx))
    tokens, mask = tokenizer.encode_prompts([examples[i].problem for i in padded])
    return sampling.generate(
      params,
      cfg,
      tokens,
      mask,
      jax.random.fold_in(rng, b),
      sampling.SamplingSpec(
        num_samples=G,
        max_new_tokens=eval_cfg.max_new_tokens,
        strategy=strategies.make_strategy(eval_cfg.temperature, eval_cfg.top_p, eval_cfg.top_k),
        stop_ids=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
        max_active_rows=eval_cfg.max_active_rows or None,
      ),
      layout=layout,
    )

  def finish(idx: list[int], out: sampling.Samples, bar: Any) -> None:
    n = len(idx) * G  # rows past n belong to the padding repeats
    # The rows are host numpy arrays already (to_host); asarray says so to the type checker.
    tokens, mask = np.asarray(out.tokens_BC[:n]), np.asarray(out.mask_BC[:n], np.float64)
    logprobs = np.asarray(out.logprobs_BC[:n], np.float64)
    length_B = mask.sum(1)
    s_B = mean_logprob(logprobs, mask)  # the stop token counts in s
    texts = tokenizer.decode_completions(tokens, mask)
    golds = [examples[i].answer for i in idx for _ in range(G)]
    correct_B = np.asarray(grader.score(texts, golds)[0]) > 0
    stats["truncated"] += int(out.truncated_B[:n].sum())
    stats["tokens"] += int(length_B.sum())
    for r in range(n):
      q = idx[r // G]
      per_question[q].append(
        SampleRecord(
          benchmark=benchmark,
          question_id=examples[q].id,
          sample_index=r % G,
          completion=texts[r],
          answer=rewards.extract_answer(texts[r])[0],
          correct=bool(correct_B[r]),
          s=min(float(s_B[r]), 0.0),
          length=int(length_B[r]),
        )
      )
    stats["correct"] += int(correct_B.sum())
    stats["rows"] += n
    bar.update(len(idx))
    bar.set_postfix(acc=f"{stats['correct'] / stats['rows']:.3f}")

  start = time.perf_counter()
  bar = tqdm.tqdm(total=len(examples), desc=benchmark, unit="q", disable=not eval_cfg.progress)
  # Batch b+1 samples on the device while a host thread decodes and grades batch
  # b. device_get waits for batch b first, so one KV cache is live at a time.
  with futures.ThreadPoolExecutor(1) as host:
    prev: futures.Future[None] | None = None
    for b, idx in enumerate(_batches(lengths, bs)):
      # to_host gathers the rows of every process when the mesh spans several.
      out = jax.tree.map(to_host, dispatch(b, idx))
      if prev is not None:
        prev.result()  # re-raises a grading error; keeps the host one batch behind at most
      prev = host.submit(finish, idx, out, bar)
    if prev is not None:
      prev.result()
  bar.close()
  secs = time.perf_counter() - start
  n_rows = len(examples) * G
  log.info(
    "%s: %d questions x %d samples in %.1f s (%.0f tokens/s), accuracy %.4f, "
    "%d of %d truncated at max_new_tokens=%d",
    benchmark,
    len(examples),
    G,
    secs,
    stats["tokens"] / max(secs, 1e-9),
    stats["correct"] / n_rows,
    stats["truncated"],
    n_rows,
    eval_cfg.max_new_tokens,
  )
  return [rec for recs in per_question for rec in recs]


def evaluate_policy(
  policy: EvalPolicy,
  examples: Sequence[data.Example] | Mapping[str, Sequence[data.Example]],
  eval_cfg: EvalConfig,
  rng: jax.Array,
  *,
  benchmark: str = "eval",
  grader: Any = None,
) -> list[SampleRecord]:
  """Samples ``eval_cfg.num_samples`` responses per question and grades them.

  Args:
    policy: the policy, its tokenizer and where it samples.
    examples: one benchmark's questions (named ``benchmark``), or
      ``{benchmark name: questions}``.
    eval_cfg: sampling settings.
    rng: PRNG key; batch b of benchmark k samples with ``fold_in(fold_in(rng, k), b)``.
    grader: has ``score(completions, golds) -> (rewards, health)``, or ``{benchmark:
      grader}``; a benchmark without one is graded by its registry checker
      (``reward_fns.benchmark_checker``: the math grader unless e.g. ``countdown``).

  Returns:
    ``SampleRecord`` per sample (samples.jsonl rows), benchmarks and questions
    in the given order, samples by index. ``s`` is the mean token log-prob of
    the completion, stop token included when generated.
  """
  if not isinstance(examples, Mapping):
    examples = {benchmark: examples}
  records: list[SampleRecord] = []
  for k, (name, exs) in enumerate(examples.items()):
    if not exs:
      raise ValueError(f"benchmark {name!r} has no questions")
    g = grader.get(name) if isinstance(grader, Mapping) else grader
    g = g if g is not None else reward_fns.grader_for(reward_fns.benchmark_checker(name))
    records += _evaluate_benchmark(policy, list(exs), eval_cfg, jax.random.fold_in(rng, k), name, g)
  return records


# --- benchmarks and outputs ------------------------------------------------------


def load_benchmarks(
  specs: Sequence[str], data_dir: str | None = None, limit: int = 0
) -> dict[str, list[data.Example]]:
  """``{name: questions}`` of registry names or files (named by file stem).

  ``limit`` > 0 keeps the first ``limit`` questions of each benchmark.
  """
  out: dict[str, list[data.Example]] = {}
  for spec in specs:
    name = spec if spec in data.REGISTRY else fs.path(spec).stem
    if name in out:
      raise ValueError(f"--benchmarks: benchmark name {name!r} given twice ({spec})")
    exs = data.load_examples(spec, data_dir=data_dir or None).examples
    if not exs:
      raise ValueError(f"benchmark {spec}: no questions")
    out[name] = exs[:limit] if limit > 0 else exs
  return out


def write_outputs(
  records: Sequence[SampleRecord],
  out_dir: str | os.PathLike,
  *,
  run: str | None = None,
  config: Mapping[str, Any] | None = None,
  results_config: report.ResultsConfig = report.ResultsConfig(),
  plots: bool = True,
  samples: bool = True,
) -> dict[str, Any]:
  """Writes samples.jsonl, results.json (+ ``config``) and the plots; returns the results.

  ``out_dir`` may be local or ``gs://`` (files are staged locally and uploaded).
  """
  results = report.compute_results(records, results_config, run=run)
  if config is not None:
    results["config"] = dict(config)
  with fs.output_dir(out_dir) as local:
    if samples:
      report.write_samples(os.path.join(local, "samples.jsonl"), records)
    report.write_results(results, local)
    if plots:
      for bench, res in results["benchmarks"].items():
        # With one run, the overlay helper draws this run's curves.
        report.plot_benchmark(bench, {run or "policy": res}, local)
  return results


def results_config(
  num_samples: int, grouping: str = "rewards", limits: grouping_lib.Limits = grouping_lib.Limits()
) -> report.ResultsConfig:
  """ResultsConfig that also reports k = ``num_samples`` and N = 1, 2, 4, ... up to it."""
  ks = lambda base: tuple(sorted(set(base) | {num_samples}))  # noqa: E731
  ns = {1 << i for i in range(num_samples.bit_length()) if 1 << i <= num_samples}
  return report.ResultsConfig(
    mean_ks=ks((8, 16)),
    pass_ks=ks((1, 8, 16)),
    maj_ks=ks((8, 16)),
    grouping=grouping,
    grouping_limits=limits,
    scaling=scaling.ScalingConfig(ns=tuple(sorted(ns | {num_samples}))),
  )


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
  )  # no ECE: report.ECE_NOTE
  notes = [
    f"{bench}: {res['grouping_timeouts']} answer pairs timed out in grouping and "
    "count as different answers (maj@k, PC, RPC)\n"
    for bench, res in results["benchmarks"].items()
    if res.get("grouping_timeouts")
  ]
  return report.comparison_table({run: results}, columns) + "".join(notes)


# --- input checks ---------------------------------------------------------------


def _read_samples(path: str) -> list[SampleRecord]:
  try:
    return report.load_samples(path)
  except (OSError, ValueError) as e:  # ValueErrors name the file and line already
    raise InputError(f"--from-samples: {e}") from None


# --- command line ---------------------------------------------------------------


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
    "(capo_jax.runtime.mesh.sampling_mesh; 0: the chips of a host that split the kv heads)",
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
    path = report.compare(args.compare, args.out, args.names)
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
