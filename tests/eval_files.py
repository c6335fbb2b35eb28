"""Shared test helpers of the evaluator's tests: benchmark and samples files, and the
independent references (sklearn's AUC, the plots on disk) their metrics are held against."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score

# Prompts of these questions fall in one sampler length bucket: one compile.
QUESTIONS = [
  ("q0", "What is 1 + 2?", "3"),
  ("q1", "Solve 2x + 3 = 11 for x.", "4"),
  ("q2", "Compute 7 times 6.", "42"),
  ("q3", "Find the value of 48 / 2.", "24"),
]


def write_jsonl(path: pathlib.Path, rows: list[dict[str, Any]]) -> pathlib.Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return path


def bench_file(tmp_path: pathlib.Path) -> pathlib.Path:
  return write_jsonl(
    tmp_path / "tiny.jsonl", [{"id": i, "problem": p, "answer": a} for i, p, a in QUESTIONS]
  )


def read_samples(path: pathlib.Path) -> list[dict[str, Any]]:
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def arrays(rows: list[dict[str, Any]], bench: str) -> tuple[list[str], np.ndarray, np.ndarray]:
  """Question ids in file order, s_QG and correct_QG, built by hand from samples rows."""
  qids = list(dict.fromkeys(r["question_id"] for r in rows if r["benchmark"] == bench))
  by_q = {
    q: sorted(
      (r for r in rows if r["benchmark"] == bench and r["question_id"] == q),
      key=lambda r: r["sample_index"],
    )
    for q in qids
  }
  s = np.array([[r["s"] for r in by_q[q]] for q in qids])
  correct = np.array([[r["correct"] for r in by_q[q]] for q in qids])
  return qids, s, correct


def sklearn_auc_mean(s_QG: np.ndarray, correct_QG: np.ndarray) -> tuple[float, int]:
  aucs = [roc_auc_score(c, s) for s, c in zip(s_QG, correct_QG) if 0 < c.sum() < c.size]
  return (float(np.mean(aucs)) if aucs else float("nan")), len(aucs)


def check_plots(out: pathlib.Path, bench: str) -> None:
  for kind in ("precision_coverage", "scaling", "auc_hist"):
    png = out / f"{bench}_{kind}.png"
    assert png.is_file() and png.stat().st_size > 2000, png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
