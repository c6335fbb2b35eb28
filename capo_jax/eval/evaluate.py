"""Evaluate a policy on math benchmarks: sample, grade, score accuracy and calibration.

In-process callers (trainer, demo, the command line ``capo_jax.eval.cli``) use
``evaluate_policy`` and ``write_outputs``. Every question gets ``num_samples`` responses,
graded by ``capo_jax.data.rewards``; the metrics are defined in docs/algorithms.md
("Evaluation metrics"). The output directory gets ``samples.jsonl`` and ``results.json``
(schemas in ``capo_jax.eval.report``) and three PNG plots per benchmark:
``<bench>_precision_coverage.png``, ``<bench>_scaling.png`` (PC / RPC / majority /
best-of-N against N) and ``<bench>_auc_hist.png`` (per-question AUC).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import numpy as np
from tqdm import auto as tqdm

from capo_jax.data import answers, reward_fns
from capo_jax.data import datasets as data
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.eval import comparison, report, scaling
from capo_jax.eval import grouping as grouping_lib
from capo_jax.eval.report import SampleRecord
from capo_jax.masked import mean_logprob
from capo_jax.runtime import fs
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
          answer=answers.extract_answer(texts[r])[0],
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
        comparison.plot_benchmark(bench, {run or "policy": res}, local)
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
