"""The noise mask's thresholds from the reference's perplexities on this task.

The mask (SPEC.md, "Noise masking") drops a correct sample whose reference
perplexity is above ``high`` (a lucky guess) and a wrong one whose reference
perplexity is below ``low`` (a near miss the verifier may have judged harshly).
The paper's 2.5 and 1.05 are in the units of a 1.5B model's chains of thought on
competition maths; a tiny model's one-line-per-step arithmetic has its own
perplexity scale, where those values may mask nothing or half the batch. So the
demo can set them from the reference itself: ``low`` = the ``q_wrong`` quantile of
the perplexities of the reference's wrong samples, ``high`` = the ``q_right``
quantile of its correct ones, on a fixed sample of training questions. With
(0.1, 0.9) the mask removes about 10% of each kind on the warm start (less where
perplexities tie at the threshold: the comparisons are strict, as the mask's).

The labels are the true grader's: the thresholds describe the reference on the
task, so the variants under flips and under false negatives share them.

Letters: Q questions, G samples per question.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from capo_jax.data.datasets import Example
from capo_jax.demo import policy_eval, warm_start
from capo_jax.eval import evaluate


def quantile_thresholds(
  ppl_QG: Any, correct_QG: Any, q_wrong: float, q_right: float
) -> tuple[float, float]:
  """(low, high): the ``q_wrong`` quantile of the wrong samples' reference perplexity and
  the ``q_right`` quantile of the correct samples' (numpy's linear interpolation).

  A kind the sample lacks gets a threshold that masks none of it (low 0, high inf:
  perplexities are >= 1), e.g. a smoke run's untrained warm start, never right.
  """
  if not (0.0 < q_wrong < 1.0 and 0.0 < q_right < 1.0):
    raise ValueError(f"quantile_thresholds: quantiles ({q_wrong}, {q_right}) must be in (0, 1)")
  ppl, correct = np.asarray(ppl_QG, np.float64).ravel(), np.asarray(correct_QG, bool).ravel()
  if ppl.shape != correct.shape:
    raise ValueError(f"quantile_thresholds: {ppl.size} perplexities, {correct.size} labels")
  low = float(np.quantile(ppl[~correct], q_wrong)) if (~correct).any() else 0.0
  high = float(np.quantile(ppl[correct], q_right)) if correct.any() else float("inf")
  return low, high


def masked_fractions(ppl_QG: Any, correct_QG: Any, low: float, high: float) -> dict[str, float]:
  """The fractions the mask at (low, high) removes: of the wrong samples (``wrong``, ppl
  below ``low``) and of the correct ones (``right``, ppl above ``high``); NaN for a kind
  the sample lacks."""
  ppl, correct = np.asarray(ppl_QG, np.float64).ravel(), np.asarray(correct_QG, bool).ravel()
  frac = lambda hit, sel: float(hit[sel].mean()) if sel.any() else float("nan")  # noqa: E731
  return {"wrong": frac(ppl < low, ~correct), "right": frac(ppl > high, correct)}


def calibrate(
  ws: Any,
  examples: list[Example],
  *,
  num_samples: int,
  seed: int,
  quantiles: tuple[float, float],
  paper: tuple[float, float],
  path: str,
) -> dict[str, Any]:
  """Mask thresholds at ``quantiles`` = (q_wrong, q_right) from the warm start's samples of
  ``examples`` (the warm start is the reference), cached at ``path`` (JSON).

  Returns ``{"low", "high", "key", "samples", "masked": {...}, "paper_masked": {...}}``:
  the thresholds, what the cache is valid for, the sample size, and the fractions the
  mask removes on this sample at these thresholds and at the paper's ``paper`` =
  (low, high). The per-sample arrays go beside it (``<path>.npz``: ``ref_ppl_QG``,
  ``correct_QG``).
  """
  key = {
    "warm_start": warm_start.cache_id(ws),
    "quantiles": list(quantiles),
    "questions": len(examples),
    "samples": num_samples,
    "seed": seed,
  }
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      cached = json.load(f)
    if warm_start.same_cache_key(cached.get("key", {}), key):
      return cached
  ev = policy_eval.evaluate_policy(
    evaluate.EvalPolicy(ws.params, ws.cfg, ws.tokenizer),
    examples,
    policy_eval.DemoSampling(num_samples=num_samples),
    jax.random.key(seed),
  )
  # s is the mean token log-prob of the sample (EOS included), as the trainer's: ppl = e^-s.
  ppl_QG, correct_QG = np.exp(-ev["s"]), ev["correct"]
  low, high = quantile_thresholds(ppl_QG, correct_QG, *quantiles)
  out = {
    "low": low,
    "high": high,
    "key": key,
    "samples": int(correct_QG.size),
    "accuracy": float(correct_QG.mean()),
    "masked": masked_fractions(ppl_QG, correct_QG, low, high),
    "paper_masked": masked_fractions(ppl_QG, correct_QG, *paper),
  }
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"  # runs in parallel processes may calibrate at once
  np.savez_compressed(tmp + ".npz", ref_ppl_QG=ppl_QG, correct_QG=correct_QG)
  os.replace(tmp + ".npz", path + ".npz")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  os.replace(tmp, path)
  return out
