"""Runs side by side: markdown tables of results.json metrics, the overlaid plots, and
``comparison.md`` (``python -m capo_jax.eval --compare``).

Results are read with ``capo_jax.eval.report.load_results``; the paired tests between
two runs come from ``capo_jax.eval.paired``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from capo_jax.eval import inputs, paired, scaling
from capo_jax.eval.report import load_results
from capo_jax.runtime import fs

# The paper's calibration metrics lead: AUC-mean, then AURC. ECE and Brier of exp(s) stay
# out of every table (results.json keeps them; ``ECE_NOTE`` says why).
MAIN_COLUMNS = (("acc", "mean@16"), ("AUC", "auc_mean"), ("AURC", "aurc"))
EXTRA_COLUMNS = (("pooled AUC", "pooled_auc"), ("PC@16", "scaling/pc/-1"), ("maj@16", "maj@k/16"))
ECE_NOTE = (
  "ECE and Brier (results.json: `ece`, `brier`) score exp(s), the geometric-mean "
  "token probability, as if it were P(correct). For a long chain of thought it is "
  "~0.9-1.0 for every sample, so ECE is close to 1 - accuracy and says little about "
  "ranking; they are not the paper's metrics. AUC-mean and AURC are."
)


def _lookup(bench: Mapping[str, Any], key: str) -> float | None:
  """Value at a '/'-separated path ('maj@k/16', 'scaling/pc/-1'), or None."""
  node: Any = bench
  for part in key.split("/"):
    if isinstance(node, Mapping):
      node = node.get(part)
    elif isinstance(node, list):
      try:
        node = node[int(part)]
      except (ValueError, IndexError):
        return None
    else:
      return None
  return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _fmt(x: float | None, percent: bool) -> str:
  if x is None:
    return "-"
  return f"{100 * x:.1f}" if percent else f"{x:.3f}"


def comparison_table(
  runs: Mapping[str, Mapping[str, Any]],
  columns: Sequence[tuple[str, str]] = MAIN_COLUMNS,
  average: bool = True,
) -> str:
  """Markdown table: rows = benchmarks (+ average), columns = runs x metrics.

  Args:
    runs: ``{run name: results}`` (results.json contents).
    columns: ``(header, key)`` per metric; keys are paths into a benchmark's
      results (see ``_lookup``). Keys naming an accuracy (``mean@``,
      ``pass@``, ``maj@``, ``PC@``-style scaling entries) print as percent.
    average: add an "average" row (mean over the benchmarks a run has).
  """
  if not runs:
    raise ValueError("comparison_table: no runs")
  names: list[str] = []
  for res in runs.values():
    names += [b for b in res["benchmarks"] if b not in names]
  header = ["benchmark"] + [f"{run} {h}" for run in runs for h, _ in columns]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" + "---:|" * (len(header) - 1)]
  percent = [key.startswith(("mean@", "pass@", "maj@", "scaling/")) for _, key in columns]
  table = {
    b: [
      _lookup(res["benchmarks"][b], key) if b in res["benchmarks"] else None
      for res in runs.values()
      for _, key in columns
    ]
    for b in names
  }
  if average:
    cols = list(zip(*table.values()))
    table["average"] = [
      float(np.mean([v for v in col if v is not None])) if any(v is not None for v in col) else None
      for col in cols
    ]
  for b, vals in table.items():
    cells = [_fmt(v, percent[i % len(columns)]) for i, v in enumerate(vals)]
    lines.append("| " + " | ".join([b] + cells) + " |")
  return "\n".join(lines) + "\n"


def plot_benchmark(
  bench: str, have: Mapping[str, Mapping[str, Any]], out_dir: str | os.PathLike[str]
) -> list[str]:
  """Overlaid precision-coverage, accuracy-vs-N and AUC-histogram PNGs."""
  from capo_jax.eval import plots  # pylint: disable=import-outside-toplevel

  inputs.check_benchmark_name(bench, "plot_benchmark")
  out = lambda kind: os.path.join(out_dir, f"{bench}_{kind}.png")  # noqa: E731
  nan = lambda xs: [np.nan if x is None else x for x in xs]  # noqa: E731
  pc = {
    r: (v["precision_coverage"]["coverage"], v["precision_coverage"]["precision"])
    for r, v in have.items()
  }
  ns = next(iter(have.values()))["scaling"]["n"]
  curves = {
    r: {m: nan(v["scaling"][m]) for m in scaling.METHODS if m in v["scaling"]}
    for r, v in have.items()
    if v["scaling"]["n"] == ns
  }
  aucs = {r: nan(v["auc_per_question"]) for r, v in have.items()}
  return [
    plots.plot_precision_coverage(pc, out("precision_coverage"), bench),
    plots.plot_scaling(curves, ns, out("scaling"), bench),
    plots.plot_auc_histogram(aucs, out("auc_hist"), title=bench),
  ]


def compare(
  result_dirs: Sequence[str | os.PathLike[str]],
  out_dir: str | os.PathLike[str],
  names: Sequence[str] | None = None,
) -> str:
  """Writes ``out_dir/comparison.md`` and overlaid plots; returns the md path.

  Runs are named by ``names``, else results.json's "run", else the dir name.
  """
  runs: dict[str, dict[str, Any]] = {}
  for i, d in enumerate(result_dirs):
    res = load_results(d)
    name = (
      (names[i] if names else None)
      or res.get("run")
      or os.path.basename(os.path.normpath(os.fspath(d)))
    )
    runs[name if name not in runs else f"{name}#{i}"] = res
  with fs.output_dir(out_dir) as local:
    return fs.join(out_dir, _write_comparison(runs, local))


def _at_k(
  runs: Mapping[str, Mapping[str, Any]], methods: Sequence[str], ks: Sequence[int]
) -> dict[str, dict[str, Any]]:
  """The subset-averaged scaling accuracies at ``ks`` as 'scaling/<method>@<k>' keys
  (looked up by N, so runs evaluated at different N still line up)."""
  out: dict[str, dict[str, Any]] = {}
  for run, res in runs.items():
    benches = {}
    for b, v in res["benchmarks"].items():
      sc = v.get("scaling", {})
      pos = {n: i for i, n in enumerate(sc.get("n", []))}
      benches[b] = {
        "scaling": {f"{m}@{k}": sc[m][pos[k]] for m in methods for k in ks if k in pos and m in sc}
      }
    out[run] = {"benchmarks": benches}
  return out


def _subset_section(
  runs: Mapping[str, Mapping[str, Any]], ks: Sequence[int] = (4, 8, 16)
) -> list[str]:
  subsets = {
    v["scaling"].get("n_subsets")
    for res in runs.values()
    for v in res["benchmarks"].values()
    if "scaling" in v
  }
  at_k = _at_k(runs, ("pc", "majority"), ks)
  return [
    "## PC@k and maj@k over subsets",
    "",
    f"Accuracy (%) of perplexity consistency and of majority vote on k of a question's "
    f"samples, averaged over {' / '.join(str(n) for n in sorted(subsets))} random "
    "subsets of size k per question (all of them when there are fewer; the full set "
    "when k is its sample count), then over questions; from results.json's "
    "`scaling` curves.",
    "",
    comparison_table(at_k, [(f"PC@{k}", f"scaling/pc@{k}") for k in ks]),
    comparison_table(at_k, [(f"maj@{k}", f"scaling/majority@{k}") for k in ks]),
  ]


def _write_comparison(runs: Mapping[str, Mapping[str, Any]], out_dir: str) -> str:
  """comparison.md and its plots in the local ``out_dir``; returns the md's name."""
  md = [
    "# Evaluation comparison",
    "",
    "acc = mean@16 (%), AUC = AUC-mean of s over questions, AURC = area under the "
    "risk-coverage curve (lower is better).",
    "",
    ECE_NOTE,
    "",
    comparison_table(runs),
    *paired.paired_section(runs),
    "## Calibration and scaling",
    "",
    comparison_table(runs, EXTRA_COLUMNS),
    *_subset_section(runs),
    "## Plots",
    "",
  ]
  benchmarks = {b for res in runs.values() for b in res["benchmarks"]}
  for b in sorted(benchmarks):
    have = {r: res["benchmarks"][b] for r, res in runs.items() if b in res["benchmarks"]}
    files = plot_benchmark(b, have, out_dir)
    md += [f"### {b}", ""] + [f"![{b}]({os.path.basename(f)})" for f in files] + [""]
  with open(os.path.join(out_dir, "comparison.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(md))
  return "comparison.md"
