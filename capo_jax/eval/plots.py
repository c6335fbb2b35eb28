"""Evaluation plots written as PNG files (matplotlib, Agg backend).

Each function takes plain arrays / dicts and an output path, draws one
figure, writes it and returns the path. Curves of several runs or methods are
overlaid on the same axes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # headless: evaluation runs on machines without display
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position

_LINESTYLES = ("-", "--", ":", "-.")
METHOD_LABELS = {
  "pc": "PC",
  "rpc": "RPC",
  "majority": "majority vote",
  "weighted": "weighted vote",
  "best_of_n": "best-of-N",
}


def _save(fig: plt.Figure, path: str | os.PathLike[str]) -> str:
  out = os.fspath(path)
  parent = os.path.dirname(out)
  if parent:
    os.makedirs(parent, exist_ok=True)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def plot_precision_coverage(
  curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
  path: str | os.PathLike[str],
  title: str = "precision-coverage",
) -> str:
  """One precision-against-coverage line per run or method.

  Args:
    curves: ``{label: (coverage, precision)}``, e.g. from
      ``capo_jax.eval.calibration.precision_coverage``.
    path: output PNG.
    title: axes title (e.g. the benchmark).
  """
  if not curves:
    raise ValueError("plot_precision_coverage: no curves given")
  fig, ax = plt.subplots(figsize=(5.0, 4.0))
  for label, (coverage, precision) in curves.items():
    cov, prec = np.asarray(coverage, float), np.asarray(precision, float)
    if cov.shape != prec.shape:
      raise ValueError(f"curve {label!r}: coverage {cov.shape} and precision {prec.shape} differ")
    ax.step(cov, prec, where="post", label=label)
  ax.set(
    xlabel="coverage (fraction answered)",
    ylabel="precision",
    xlim=(0.0, 1.0),
    ylim=(0.0, 1.02),
    title=title,
  )
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, path)


def plot_scaling(
  curves: Mapping[str, Mapping[str, Sequence[float]]],
  ns: Sequence[int],
  path: str | os.PathLike[str],
  title: str = "accuracy vs N",
) -> str:
  """Accuracy against the number of samples N, per run and method.

  Args:
    curves: ``{run: {method: [accuracy per N]}}``; a method's colour is the
      same in every run, runs differ by line style.
    ns: the N values (x axis, log2 scale).
    path: output PNG.
    title: axes title.
  """
  if not curves:
    raise ValueError("plot_scaling: no curves given")
  fig, ax = plt.subplots(figsize=(5.5, 4.0))
  colors: dict[str, str] = {}
  palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for r, (run, methods) in enumerate(curves.items()):
    for method, acc in methods.items():
      if len(acc) != len(ns):
        raise ValueError(f"{run}/{method}: {len(acc)} accuracies for {len(ns)} values of N")
      color = colors.setdefault(method, palette[len(colors) % len(palette)])
      name = METHOD_LABELS.get(method, method)
      ax.plot(
        ns,
        acc,
        marker="o",
        color=color,
        linestyle=_LINESTYLES[r % len(_LINESTYLES)],
        label=name if len(curves) == 1 else f"{run}: {name}",
      )
  ax.set_xscale("log", base=2)
  ax.set_xticks(list(ns), [str(n) for n in ns])
  ax.set(xlabel="N (samples)", ylabel="accuracy", title=title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  return _save(fig, path)


def plot_auc_histogram(
  aucs: Mapping[str, Sequence[float]],
  path: str | os.PathLike[str],
  bins: int = 20,
  title: str = "per-question AUC",
) -> str:
  """Overlaid histograms of per-question AUC (NaNs, i.e. skipped, dropped)."""
  if not aucs:
    raise ValueError("plot_auc_histogram: no AUC arrays given")
  fig, ax = plt.subplots(figsize=(5.0, 4.0))
  edges = np.linspace(0.0, 1.0, bins + 1)
  for label, values in aucs.items():
    vals = np.asarray(values, dtype=float)
    vals = vals[~np.isnan(vals)]
    ax.hist(
      vals,
      bins=edges.tolist(),
      alpha=0.45,
      label=f"{label} (n={vals.size}, mean={np.mean(vals):.3f})" if vals.size else f"{label} (n=0)",
    )
  ax.set(xlabel="AUC of s within a question", ylabel="questions", title=title)
  ax.legend(fontsize=8)
  return _save(fig, path)
