"""Per-sample evaluation records -> results.json (tables and plots: ``capo_jax.eval.comparison``).

``samples.jsonl`` (written by the evaluate CLI, one JSON object per line;
extra fields are allowed and ignored):

  benchmark     str, non-empty     e.g. "aime25"; part of file names, so no
                                   '/', '\\' or control characters
  question_id   str, non-empty     the benchmark file's ``id``
  sample_index  int >= 0           unique within a question; orders "first k"
  completion    str                the decoded response
  answer        str or null        extracted final answer (null: none found)
  correct       bool               graded against the gold answer
  s             float, finite, <= 0  mean token log-prob of the completion
  length        int >= 0           completion tokens

``results.json`` (``write_results`` / ``load_results``; NaN is written null):

  {"format": "capo_jax.results", "version": 1, "run": str | null,
   "benchmarks": {name: {
      "n_questions", "n_samples", "samples_per_question": [min, max],
      "mean@8", "mean@16",            null when a question has fewer samples
      "pass@k": {"1": .., "8": .., "16": ..}, "maj@k": {"8": .., "16": ..},
      "auc_mean", "auc_n_used", "pooled_auc", "aurc", "ece", "brier",
                                      (ece / brier: of exp(s); see
                                      comparison.ECE_NOTE)
      "auc_by_bucket": {"(0, 0.25]": {"lo", "hi", "auc_mean", "n"}, ...},
      "auc_per_question": [auc or null per question, in file order],
      "question_ids": [...], "acc_per_question": [...],  (same order; the
                                      pairing of --compare matches by id)
      "precision_coverage": {"coverage": [...], "precision": [...]},
      "scaling": {"n": [1, 2, 4, 8, 16], "n_questions": [...], "n_subsets",
                  "seed", "pc": [...], "rpc": [...], "majority": [...],
                  "best_of_n": [...]},
      "no_answer_rate", "mean_length", "mean_s",
      "grouping_timeouts"}}}          answer pairs counted as different because
                                      their check timed out or the question's
                                      grouping budget ran out

Metric definitions: ``capo_jax.eval.calibration`` and ``capo_jax.eval.scaling``.
maj@k and the scaling methods group answers with the same equivalence
(``grouping``; default ``capo_jax.data.rewards``), within
``grouping_limits`` (``capo_jax.eval.grouping``: 30 s per question by default).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from capo_jax.eval import calibration as cal
from capo_jax.eval import grouping as grouping_lib
from capo_jax.eval import inputs, scaling
from capo_jax.runtime import fs

log = logging.getLogger(__name__)

FORMAT, VERSION = "capo_jax.results", 1
_FIELDS: dict[str, tuple[type, ...]] = {
  "benchmark": (str,),
  "question_id": (str,),
  "sample_index": (int,),
  "completion": (str,),
  "answer": (str, type(None)),
  "correct": (bool,),
  "s": (int, float),
  "length": (int,),
}


@dataclasses.dataclass(frozen=True)
class SampleRecord:
  """One row of samples.jsonl (see the module docstring)."""

  benchmark: str
  question_id: str
  sample_index: int
  completion: str
  answer: str | None
  correct: bool
  s: float
  length: int


def parse_sample(row: Any, where: str) -> SampleRecord:
  """Checks one samples.jsonl row; errors name ``where`` (file:line)."""
  if not isinstance(row, Mapping):
    raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
  vals: dict[str, Any] = {}  # each field's type is checked here, before SampleRecord
  for name, types in _FIELDS.items():
    if name not in row:
      raise ValueError(f"{where}: missing field {name!r}")
    val = row[name]
    # bool is an int subclass: only the field 'correct' may be a bool.
    if not isinstance(val, types) or (isinstance(val, bool) and bool not in types):
      raise ValueError(
        f"{where}: field {name!r} must be {'/'.join(t.__name__ for t in types)}, got {val!r}"
      )
    vals[name] = val
  for name in ("benchmark", "question_id"):
    if not vals[name]:
      raise ValueError(f"{where}: field {name!r} is empty")
  inputs.check_benchmark_name(vals["benchmark"], f"{where}: field 'benchmark'")
  for name in ("sample_index", "length"):
    if vals[name] < 0:
      raise ValueError(f"{where}: field {name!r} must be >= 0, got {vals[name]}")
  s = float(vals["s"])
  if not math.isfinite(s) or s > 1e-6:
    raise ValueError(
      f"{where}: field 's' (mean log-prob) must be finite and <= 0, got {vals['s']!r}"
    )
  vals["s"] = min(s, 0.0)
  return SampleRecord(**vals)


def load_samples(path: str | os.PathLike[str]) -> list[SampleRecord]:
  """Reads samples.jsonl; blank lines are skipped, bad rows and a file without rows raise
  ValueError naming the file (and line)."""
  records: list[SampleRecord] = []
  first_line: dict[tuple[str, str, int], int] = {}
  with fs.path(path).open("r", encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{os.fspath(path)}:{lineno}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
      rec = parse_sample(row, where)
      key = (rec.benchmark, rec.question_id, rec.sample_index)
      if key in first_line:
        raise ValueError(f"{where}: duplicate sample {key} (first at line {first_line[key]})")
      first_line[key] = lineno
      records.append(rec)
  if not records:
    raise ValueError(f"{os.fspath(path)}: no samples (the file is empty)")
  return records


def write_samples(path: str | os.PathLike[str], records: Iterable[SampleRecord]) -> None:
  """Writes records as samples.jsonl (UTF-8, one object per line; local or gs://)."""
  with fs.path(path).open("w", encoding="utf-8") as f:
    for rec in records:
      f.write(json.dumps(dataclasses.asdict(rec), ensure_ascii=False) + "\n")


@dataclasses.dataclass(frozen=True)
class ResultsConfig:
  """What compute_results reports; ``grouping`` ("rewards", "exact", a callable or a
  ``PairCheck``) and ``grouping_limits`` make its ``capo_jax.eval.grouping.AnswerGrouper``."""

  mean_ks: tuple[int, ...] = (8, 16)
  pass_ks: tuple[int, ...] = (1, 8, 16)
  maj_ks: tuple[int, ...] = (8, 16)
  buckets: tuple[tuple[float, float], ...] = cal.DEFAULT_BUCKETS
  ece_bins: int = 10
  curve_points: int = 201  # precision-coverage points kept in results.json
  grouping: str | Callable[[str, str], bool] | grouping_lib.PairCheck = "rewards"
  grouping_limits: grouping_lib.Limits = grouping_lib.Limits()
  scaling: scaling.ScalingConfig = scaling.ScalingConfig()


def _clean(x: Any) -> Any:
  """JSON-ready copy: NaN -> None, NumPy scalars / arrays -> Python."""
  if isinstance(x, Mapping):
    return {str(k): _clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple, np.ndarray)):
    return [_clean(v) for v in x]
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return None if math.isnan(x) else float(x)
  return x


def _benchmark_results(
  questions: list[list[SampleRecord]], config: ResultsConfig, grouper: grouping_lib.AnswerGrouper
) -> dict[str, Any]:
  n_q, g_max = len(questions), max(len(q) for q in questions)
  n_min = min(len(q) for q in questions)
  s_QG, correct_QG = np.zeros((n_q, g_max)), np.zeros((n_q, g_max), bool)
  valid_QG = np.zeros((n_q, g_max), bool)
  keys_QG: list[list[int | None]] = []
  prepared = []
  for i, q in enumerate(questions):
    g = len(q)
    s_QG[i, :g] = [r.s for r in q]
    correct_QG[i, :g] = [r.correct for r in q]
    valid_QG[i, :g] = True
    prep = scaling.prepare_question(
      [r.answer for r in q], [r.completion for r in q], s_QG[i, :g], correct_QG[i, :g], grouper
    )
    prepared.append(prep)
    keys_QG.append([int(k) if k >= 0 else None for k in prep.group_G] + [None] * (g_max - g))
  auc_Q = cal.auc_per_question(s_QG, correct_QG, valid_QG)
  auc_m, auc_n = cal.auc_mean(s_QG, correct_QG, valid_QG)
  coverage, precision, _ = cal.precision_coverage(s_QG, correct_QG, valid_QG)
  keep = np.unique(
    np.linspace(0, coverage.size - 1, min(coverage.size, config.curve_points)).round().astype(int)
  )
  out: dict[str, Any] = {
    "n_questions": n_q,
    "n_samples": int(valid_QG.sum()),
    "samples_per_question": [n_min, g_max],
  }
  for k in config.mean_ks:
    out[f"mean@{k}"] = cal.mean_at_k(correct_QG, k, valid_QG) if k <= n_min else None
  out["pass@k"] = {
    str(k): cal.pass_at_k(correct_QG, k, valid_QG) if k <= n_min else None for k in config.pass_ks
  }
  out["maj@k"] = {
    str(k): cal.maj_at_k(keys_QG, correct_QG, k, valid_QG) if k <= n_min else None
    for k in config.maj_ks
  }
  out.update(
    {
      "auc_mean": auc_m,
      "auc_n_used": auc_n,
      "pooled_auc": cal.pooled_auc(s_QG, correct_QG, valid_QG),
      "aurc": cal.aurc(s_QG, correct_QG, valid_QG),
      "ece": cal.ece(s_QG, correct_QG, valid_QG, config.ece_bins),
      "brier": cal.brier(s_QG, correct_QG, valid_QG),
      "auc_by_bucket": cal.auc_by_bucket(s_QG, correct_QG, valid_QG, config.buckets),
      "auc_per_question": auc_Q,
      "question_ids": [q[0].question_id for q in questions],
      "acc_per_question": (correct_QG & valid_QG).sum(1) / valid_QG.sum(1),
      "precision_coverage": {"coverage": coverage[keep], "precision": precision[keep]},
      "scaling": scaling.scaling_curves(prepared, config.scaling),
      "no_answer_rate": float(np.mean([r.answer is None for q in questions for r in q])),
      "mean_length": float(np.mean([r.length for q in questions for r in q])),
      "mean_s": float(s_QG[valid_QG].mean()),
      "grouping_timeouts": sum(q.n_unresolved for q in prepared),
    }
  )
  return out


def compute_results(
  records: Iterable[SampleRecord | Mapping[str, Any]],
  config: ResultsConfig = ResultsConfig(),
  run: str | None = None,
) -> dict[str, Any]:
  """All metrics of every benchmark in ``records`` (results.json layout).

  Records may be SampleRecord or samples.jsonl-style mappings; benchmarks and
  questions keep their order of first appearance, samples are ordered by
  ``sample_index``.
  """
  grouped: dict[str, dict[str, dict[int, SampleRecord]]] = {}
  for i, rec in enumerate(records):
    if not isinstance(rec, SampleRecord):
      rec = parse_sample(rec, f"record {i}")
    per_q = grouped.setdefault(rec.benchmark, {}).setdefault(rec.question_id, {})
    if rec.sample_index in per_q:
      raise ValueError(
        f"record {i}: duplicate sample_index {rec.sample_index} "
        f"for {rec.benchmark}/{rec.question_id}"
      )
    per_q[rec.sample_index] = rec
  if not grouped:
    raise ValueError("compute_results: no records")
  with grouping_lib.AnswerGrouper(config.grouping, config.grouping_limits) as grouper:
    benchmarks = {
      name: _clean(
        _benchmark_results([[q[j] for j in sorted(q)] for q in qs.values()], config, grouper)
      )
      for name, qs in grouped.items()
    }
  for name, res in benchmarks.items():
    if res["grouping_timeouts"]:
      log.warning(
        "%s: %d answer pairs counted as different answers unchecked (check past "
        "%.0f s, or past the %.0f s grouping budget of a question)",
        name,
        res["grouping_timeouts"],
        config.grouping_limits.pair_timeout_s,
        config.grouping_limits.budget_s,
      )
  return {"format": FORMAT, "version": VERSION, "run": run, "benchmarks": benchmarks}


def write_results(results: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> str:
  """Writes ``out_dir/results.json`` (strict JSON; local or gs://) and returns its path."""
  path = fs.join(out_dir, "results.json")
  fs.write_text(path, json.dumps(_clean(results), indent=1, allow_nan=False))
  return path


def load_results(result_dir: str | os.PathLike[str]) -> dict[str, Any]:
  """Reads ``result_dir/results.json`` (or the file itself) and checks it."""
  path = os.fspath(result_dir)
  if fs.is_dir(path):
    path = fs.join(path, "results.json")
  try:
    res = json.loads(fs.read_text(path))
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON ({e})") from None
  if not isinstance(res, dict) or res.get("format") != FORMAT:
    raise ValueError(f"{path}: not a {FORMAT} file")
  if res.get("version") != VERSION:
    raise ValueError(f"{path}: version {res.get('version')}, expected {VERSION}")
  if not isinstance(res.get("benchmarks"), dict):
    raise ValueError(f"{path}: no 'benchmarks' object")
  for name in res["benchmarks"]:
    inputs.check_benchmark_name(name, path)
  return res
