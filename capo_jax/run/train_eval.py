"""Evaluation during training: the evaluator's own code, every ``eval.every_steps``.

The current policy samples ``eval.num_samples`` responses per question of the
held-out validation split and of each ``data.eval`` benchmark (first
``eval.limit`` questions, 0: all), graded like every rollout. The metrics are
those of ``python -m capo_jax.eval`` (``capo_jax.eval.report``): mean@k,
pass@k, AUC-mean, pooled AUC, AURC, ECE and AUC by difficulty bucket, logged
as ``eval/<benchmark>/<metric>``; each evaluation's results.json goes to
``<workdir>/eval/step_<N>/``. The sampling seed is the same at every step, so
a change between steps is the policy's, not the draw's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from capo_jax.data import datasets as data
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.eval import evaluate, report
from capo_jax.run.sections import ConfigError
from capo_jax.run.spec import Eval, RunSpec
from capo_jax.runtime import fs
from capo_jax.runtime.distributed import is_main_process
from models.config import Qwen2Config
from models.sharding import Layout

EvalFn = Callable[[int, Any], dict[str, float]]
VAL_BENCHMARK = "val"


def flat_metrics(results: Mapping[str, Any]) -> dict[str, float]:
  """``{"<benchmark>/<metric>": value}`` of the headline numbers of a results dict."""
  out: dict[str, float] = {}
  for bench, r in results["benchmarks"].items():
    for key, value in r.items():
      if key.startswith("mean@") and value is not None:
        out[f"{bench}/{key}"] = value
    for kind in ("pass@k", "maj@k"):
      for k, value in r[kind].items():
        if value is not None:
          out[f"{bench}/{kind[:-1]}{k}"] = value
    for key in (
      "auc_mean",
      "auc_n_used",
      "pooled_auc",
      "aurc",
      "ece",
      "mean_length",
      "grouping_timeouts",
    ):
      if r.get(key) is not None:
        out[f"{bench}/{key}"] = r[key]
    for label, b in r["auc_by_bucket"].items():
      if b["auc_mean"] is not None:
        out[f"{bench}/auc_bucket_{label}"] = b["auc_mean"]
  return out


def eval_benchmarks(spec: RunSpec, val: Sequence[data.Example]) -> dict[str, list[data.Example]]:
  """The validation split (when there is one) and the ``data.eval`` benchmarks."""
  limit = spec.eval.limit
  out = {VAL_BENCHMARK: list(val[:limit] if limit > 0 else val)} if val else {}
  names = [b for b in spec.data.eval if b]
  if names:
    try:
      out.update(evaluate.load_benchmarks(names, spec.data.data_dir or None, limit))
    except (OSError, ImportError, RuntimeError) as e:
      raise ConfigError(_missing_benchmarks(spec, names, e)) from e
  return out


def _missing_benchmarks(spec: RunSpec, names: Sequence[str], error: Exception) -> str:
  """Why the ``data.eval`` benchmarks did not load, naming the data directory searched."""
  data_dir = spec.data.data_dir or os.environ.get("CAPO_DATA_DIR", "")
  where = (
    f"the data directory {data_dir!r}"
    if data_dir
    else "no data directory (config.data.data_dir and $CAPO_DATA_DIR are both unset)"
  )
  # Registry names not found as files there (the loader then tried the hub).
  missing = [
    n
    for n in names
    if n in data.REGISTRY and isinstance(data.resolve(n, data_dir or None), data.DatasetSpec)
  ]
  files = ", ".join(data.REGISTRY[n].filenames[0] for n in missing)
  return (
    f"config.eval.every_steps={spec.eval.every_steps} evaluates config.data.eval "
    f"{tuple(names)} during training, but {', '.join(missing) or 'a benchmark'} could "
    f"not be loaded from {where} ({error}). Put {files or 'the files'} there "
    "(--config.data.data_dir=DIR, local or gs://), or evaluate less: "
    "--config.data.eval=\"()\" (the validation split only) or "
    "--config.eval.every_steps=0."
  )


@dataclasses.dataclass(frozen=True)
class EvalSetup:
  """What the evaluator needs of the run: its ``eval`` settings and the objects the
  trainer has already built (model, tokenizer, the sampling layout, grader)."""

  spec: Eval
  model_cfg: Qwen2Config
  tokenizer: Tokenizer
  layout: Layout
  grader: Any = None


def make_eval_fn(
  setup: EvalSetup,
  benchmarks: Mapping[str, Sequence[data.Example]],
  workdir: str,
  to_sampling: Callable[[Any], Any],
) -> EvalFn:
  """``eval_fn(step, params) -> {"<benchmark>/<metric>": value}``, as the trainer calls it.

  ``to_sampling`` casts and reshards the train params for the sampler; every
  process samples its share and grades all rows, process 0 writes results.
  """
  if not benchmarks:
    raise ValueError(
      "config.eval.every_steps > 0 but there is nothing to evaluate: "
      "config.data.val_size is 0 and config.data.eval is empty"
    )
  e = setup.spec
  eval_cfg = evaluate.EvalConfig(
    num_samples=e.num_samples,
    max_new_tokens=e.max_new_tokens,
    temperature=e.temperature,
    batch_size=e.batch_size,
    max_active_rows=e.max_active_rows,
    progress=is_main_process(),
  )
  rcfg = evaluate.results_config(eval_cfg.num_samples)
  rng = jax.random.key(e.seed)

  def eval_fn(step: int, params: Any) -> dict[str, float]:
    policy = evaluate.EvalPolicy(
      to_sampling(params), setup.model_cfg, setup.tokenizer, setup.layout
    )
    records = evaluate.evaluate_policy(policy, benchmarks, eval_cfg, rng, grader=setup.grader)
    results = report.compute_results(records, rcfg, run=f"step {step}")
    if is_main_process():
      report.write_results(results, fs.join(workdir, "eval", f"step_{step:06d}"))
    return flat_metrics(results)

  return eval_fn
