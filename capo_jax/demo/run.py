"""The embedded demo: warm start (cached), then RL, then a before/after report.

``run(config, workdir)`` is what ``python -m capo_jax.main
--config=configs/demo.py --workdir=DIR`` does; ``run_rl`` is the piece the
GRPO-vs-CAPO benchmark calls once per (algorithm, seed) on a shared warm
start.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import ml_collections
import numpy as np

from capo_jax.data import rewards
from capo_jax.demo import compare
from capo_jax.demo import task as task_lib
from capo_jax.demo import warm_start
from capo_jax.eval import calibration
from capo_jax.rl import loop as rl_loop

log = logging.getLogger(__name__)

REPORT_KEYS = ("accuracy", "auc_mean", "pooled_auc", "auc_mostly_wrong", "entropy",
               "mean_length")


def task_config(c: ml_collections.ConfigDict) -> task_lib.TaskConfig:
  return task_lib.TaskConfig(**c.demo.task.to_dict())


def sft_config(c: ml_collections.ConfigDict) -> warm_start.SFTConfig:
  return warm_start.SFTConfig(**c.demo.sft.to_dict())


def get_warm_start(c: ml_collections.ConfigDict, workdir: str) -> warm_start.WarmStart:
  tokenizer_probe = warm_start.CharTokenizer()
  model_cfg = warm_start.default_model_config(tokenizer_probe, **c.demo.model.to_dict())
  return warm_start.get_or_train(workdir, task_config(c), model_cfg, sft_config(c))


def rule_share(completions: list[str], examples: list[Any], correct_QG: np.ndarray) -> float:
  """Of the wrong samples on questions where the wrong rule (``task.py``) changes the
  answer, the fraction whose boxed answer is the rule's: how much the policy still
  follows it. NaN when there are none."""
  Q, G = correct_QG.shape
  hits = total = 0
  for q, ex in enumerate(examples):
    rule = ex.meta.get("rule_answer")
    if rule is None or rule == ex.answer:
      continue
    for g in range(G):
      if not correct_QG[q, g]:
        total += 1
        hits += f"\\boxed{{{rule}}}" in completions[q * G + g]
  return hits / total if total else float("nan")


def heldout_metrics(ws: warm_start.WarmStart, params: Any, examples: list[Any],
                    num_samples: int, seed: int, save_to: str | None = None
                    ) -> dict[str, float]:
  """Held-out accuracy and calibration of ``params`` (``docs/algorithms.md``, "Evaluation
  metrics"), also on the questions the policy mostly gets wrong.

  ``save_to``: an ``.npz`` path for the per-sample scores and verdicts (``s_QG``,
  ``correct_QG``, ``lengths_QG``), which the paired comparisons read.
  """
  ev = warm_start.evaluate_policy(params, ws.cfg, ws.tokenizer, examples, num_samples,
                                  jax.random.key(seed))
  s_QG, correct_QG = ev["s"], ev["correct"]
  if save_to:
    os.makedirs(os.path.dirname(save_to), exist_ok=True)
    tmp = save_to + ".tmp.npz"
    np.savez_compressed(tmp, s_QG=s_QG, correct_QG=correct_QG, lengths_QG=ev["lengths"])
    os.replace(tmp, save_to)
  buckets = calibration.auc_by_bucket(s_QG, correct_QG)
  # Questions the policy mostly gets wrong (<= 1/4 right): in the demo's runs GRPO's
  # loss of calibration showed there, hidden in AUC-mean by the mostly-right questions.
  low = next(iter(buckets.values()))
  return {"accuracy": ev["accuracy"], "auc_mean": ev["auc_mean"],
          "auc_questions": float(ev["auc_n_used"]),
          "pooled_auc": calibration.pooled_auc(s_QG, correct_QG),
          "auc_mostly_wrong": low["auc_mean"], "mostly_wrong_questions": float(low["n"]),
          "entropy": ev["entropy"], "mean_length": ev["mean_length"],
          "aurc": calibration.aurc(s_QG, correct_QG),
          "rule_share": rule_share(ev["completions"], examples, correct_QG)}


def run_rl(c: ml_collections.ConfigDict, workdir: str, ws: warm_start.WarmStart,
           *, run_name: str | None = None, initial_eval: dict[str, float] | None = None
           ) -> list[dict[str, float]]:
  """RL from the warm start with held-out evals; returns them (step 0 = the warm start).

  ``initial_eval``: the warm start's held-out metrics, when already known (every
  run of a comparison shares them: same params, same evaluation seed).
  """
  train, heldout = task_lib.make_splits(task_config(c))
  heldout = heldout[:c.demo.eval_questions]
  if c.rollout.max_new_tokens == 0:
    c.rollout.max_new_tokens = warm_start.completion_budget(ws.tokenizer, train + heldout)
  run_dir = os.path.join(workdir, run_name or f"{c.algo.name}_seed{c.seed}")
  evals: list[dict[str, float]] = []

  def eval_fn(step: int, params: Any) -> dict[str, float]:
    if step == 0 and initial_eval is not None:
      m = dict(initial_eval)
    else:
      m = heldout_metrics(ws, params, heldout, c.demo.eval_samples, c.demo.eval_seed,
                          save_to=os.path.join(run_dir, "heldout", f"step_{step:06d}.npz"))
    evals.append({"step": step, **m})
    return m

  grader = None
  if c.demo.reward_flip > 0:  # the noisy-verifier variant: training rewards only
    grader = compare.NoisyGrader(rewards.default_grader(), c.demo.reward_flip, seed=c.seed)
  rl_loop.train(c, run_dir, policy=rl_loop.Policy(ws.cfg, ws.params), tokenizer=ws.tokenizer,
                train_examples=train, eval_fn=eval_fn, grader=grader)
  if not evals:  # resumed a finished run: read its evals back
    evals = _evals_from_metrics(os.path.join(run_dir, "metrics.jsonl"))
  with open(os.path.join(run_dir, "evals.json"), "w", encoding="utf-8") as f:
    json.dump(evals, f, indent=1)
  return evals


def _evals_from_metrics(path: str) -> list[dict[str, float]]:
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      # MetricsWriter stores NaN / inf as strings ("nan": AUC with no mixed group).
      ev = {k[5:]: float(v) if isinstance(v, str) else v
            for k, v in row.items() if k.startswith("eval/")}
      if ev:
        out.append({"step": row["step"], **ev})
  return out


def _fmt(v: Any) -> str:
  return "nan" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.3f}"


def report(evals: list[dict[str, float]]) -> str:
  """A before / after table of the held-out metrics."""
  first, last = evals[0], evals[-1]
  lines = [f"{'held-out metric':<20} {'warm start':>11} {'step ' + str(last['step']):>11}"]
  for k in REPORT_KEYS:
    lines.append(f"{k:<20} {_fmt(first.get(k)):>11} {_fmt(last.get(k)):>11}")
  return "\n".join(lines)


def run(c: ml_collections.ConfigDict, workdir: str) -> list[dict[str, float]]:
  """The README's main command: warm start if not cached, then CAPO, then the report."""
  ws = get_warm_start(c, workdir)
  info = ws.info
  print(f"warm start: {'trained' if info.get('trained') else 'loaded from cache'} "
        f"({info.get('steps')} SFT steps, {info.get('wall_s', 0):.0f} s) -> {info.get('path')}")
  evals = run_rl(c, workdir, ws)
  print(f"\n{c.algo.name} on the synthetic task, {c.demo.eval_questions} held-out questions "
        f"x {c.demo.eval_samples} samples:")
  print(report(evals))
  return evals

