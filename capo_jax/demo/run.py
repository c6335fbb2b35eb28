"""The embedded demo: warm start (cached), then RL, then a before/after report.

``run(config, workdir)`` is what ``python -m capo_jax.main
--config=configs/cued.py --workdir=DIR`` (``make demo``) and ``--config=configs/demo.py``
(the arithmetic task) do; ``run_rl`` is the piece the
studies (``studies/``) call once per (algorithm, seed) on a shared warm
start. The printed tables and curves are ``capo_jax.demo.report``'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from capo_jax.data import rewards
from capo_jax.demo import compare, cued, policy_eval, report, tasks, warm_start
from capo_jax.demo import mask as mask_lib
from capo_jax.eval import calibration, evaluate, traps
from capo_jax.run import loop
from capo_jax.run.spec import RunSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Demo:
  """The config's ``demo`` section (``configs/demo.py`` documents each field)."""

  task: tasks.AnyTask
  model: dict[str, Any]
  sft: warm_start.SFTConfig
  eval_questions: int
  eval_samples: int
  eval_seed: int
  methods: str
  reward_flip: float
  false_negative: str = ""
  false_negative_rate: float = 0.5
  mask_quantiles: tuple[float, ...] = ()
  mask_questions: int = 512
  mask_seed: int = 99

  def __post_init__(self) -> None:
    if self.false_negative not in compare.FALSE_NEGATIVE_FORMS:
      raise ValueError(
        f"config.demo.false_negative={self.false_negative!r}: expected one of "
        f"{compare.FALSE_NEGATIVE_FORMS}"
      )
    if len(self.mask_quantiles) not in (0, 2) or not all(
      0.0 < q < 1.0 for q in self.mask_quantiles
    ):
      raise ValueError(
        f"config.demo.mask_quantiles={self.mask_quantiles!r}: expected () (the "
        "paper's thresholds, algo.mask_low / mask_high) or (q_wrong, q_right) "
        "in (0, 1)"
      )
    # The cued task lists its validation questions first (capo_jax/demo/cued.py).
    if isinstance(self.task, cued.CuedConfig) and self.sft.eval_questions != self.task.sft_val:
      raise ValueError(
        f"config.demo.sft.eval_questions={self.sft.eval_questions} must equal "
        f"config.demo.task.sft_val={self.task.sft_val} on the cued task"
      )

  @classmethod
  def of(cls, spec: RunSpec) -> Demo:
    d = dict(spec.extra["demo"])
    return cls(
      **{
        **d,
        "task": tasks.config_of(d["task"]),
        "sft": warm_start.SFTConfig(**d["sft"]),
        "model": dict(d["model"]),
        "mask_quantiles": tuple(d.get("mask_quantiles", ())),
      }
    )


def spec_of(config: ml_collections.ConfigDict) -> RunSpec:
  """The demo's run spec: ``rollout.max_new_tokens`` = 0 resolved to the task's longest
  written solution plus slack (``policy_eval.completion_budget``), the policy given."""
  c = ml_collections.ConfigDict(config.to_dict())
  if c.rollout.max_new_tokens == 0:
    task = tasks.config_of(c.demo.task.to_dict())
    train, heldout = tasks.splits(task)
    heldout = heldout[: c.demo.eval_questions]
    c.rollout.max_new_tokens = policy_eval.completion_budget(tasks.tokenizer(task), train + heldout)
  return RunSpec.from_config(c, policy_given=True)


def get_warm_start(spec: RunSpec, workdir: str) -> warm_start.WarmStart:
  demo = Demo.of(spec)
  model_cfg = warm_start.default_model_config(tasks.tokenizer(demo.task), **demo.model)
  return warm_start.get_or_train(workdir, demo.task, model_cfg, demo.sft)


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


def _completion_ids(completions: list[str], shape: tuple[int, int]) -> np.ndarray:
  """[Q, G] ids, equal within a question for identical completions (PC counts each once)."""
  Q, G = shape
  out = np.zeros(shape, np.int64)
  for q in range(Q):
    ids: dict[str, int] = {}
    out[q] = [ids.setdefault(t, len(ids)) for t in completions[q * G : (q + 1) * G]]
  return out


def heldout_metrics(
  ws: warm_start.WarmStart,
  params: Any,
  examples: list[Any],
  num_samples: int,
  seed: int,
  save_to: str | None = None,
) -> dict[str, float]:
  """Held-out accuracy and calibration of ``params`` (``docs/algorithms.md``, "Evaluation
  metrics"), also on the questions the policy mostly gets wrong.

  On the cued task (``capo_jax/demo/cued.py``) it adds the trap metrics
  (``cued.trap_metrics``).

  ``save_to``: an ``.npz`` path for the per-sample scores and verdicts (``s_QG``,
  ``correct_QG``, ``lengths_QG``, ``answers_QG``: the answer (``tasks.answers``), "" for none, and
  ``completion_QG``: equal ids within a question mark identical completions, which
  the voting methods read), which the paired comparisons read.
  """
  ev = policy_eval.evaluate_policy(
    evaluate.EvalPolicy(params, ws.cfg, ws.tokenizer),
    examples,
    policy_eval.DemoSampling(num_samples=num_samples),
    jax.random.key(seed),
  )
  s_QG, correct_QG = ev["s"], ev["correct"]
  answers_QG = np.array(tasks.answers(examples, ev["completions"]), dtype=str).reshape(s_QG.shape)
  if save_to:
    os.makedirs(os.path.dirname(save_to), exist_ok=True)
    tmp = f"{save_to}.{os.getpid()}.tmp.npz"  # parallel processes may write it at once
    np.savez_compressed(
      tmp,
      s_QG=s_QG,
      correct_QG=correct_QG,
      lengths_QG=ev["lengths"],
      answers_QG=answers_QG,
      completion_QG=_completion_ids(ev["completions"], s_QG.shape),
    )
    os.replace(tmp, save_to)
  buckets = calibration.auc_by_bucket(s_QG, correct_QG)
  # Questions the policy mostly gets wrong (<= 1/4 right): in the demo's runs GRPO's
  # loss of calibration showed there, hidden in AUC-mean by the mostly-right questions.
  low = next(iter(buckets.values()))
  return {
    "accuracy": ev["accuracy"],
    "auc_mean": ev["auc_mean"],
    "auc_questions": float(ev["auc_n_used"]),
    "pooled_auc": calibration.pooled_auc(s_QG, correct_QG),
    "auc_mostly_wrong": low["auc_mean"],
    "mostly_wrong_questions": float(low["n"]),
    "entropy": ev["entropy"],
    "mean_length": ev["mean_length"],
    "aurc": calibration.aurc(s_QG, correct_QG),
    "rule_share": rule_share(ev["completions"], examples, correct_QG),
    "confidently_wrong": traps.confidently_wrong(s_QG, correct_QG),
    **(
      cued.trap_metrics(examples, answers_QG, s_QG, correct_QG) if tasks.is_cued(examples) else {}
    ),
  }


def run_rl(
  spec: RunSpec,
  workdir: str,
  ws: warm_start.WarmStart,
  *,
  run_name: str | None = None,
  initial_eval: dict[str, float] | None = None,
  on_eval: Callable[[int, Any, str], None] | None = None,
) -> list[dict[str, float]]:
  """RL from the warm start with held-out evals; returns them (step 0 = the warm start).

  ``initial_eval``: the warm start's held-out metrics, when already known (every
  run of a comparison shares them: same params, same evaluation seed).
  ``on_eval(step, params, run_dir)``: called after each held-out evaluation (the
  study's extra evaluations, e.g. more samples at the last step).
  """
  demo = Demo.of(spec)
  train, heldout = tasks.splits(demo.task)
  heldout = heldout[: demo.eval_questions]
  run_dir = os.path.join(workdir, run_name or f"{spec.algo.name}_seed{spec.seed}")
  evals: list[dict[str, float]] = []

  def eval_fn(step: int, params: Any) -> dict[str, float]:
    if step == 0 and initial_eval is not None:
      m = dict(initial_eval)
    else:
      m = heldout_metrics(
        ws,
        params,
        heldout,
        demo.eval_samples,
        demo.eval_seed,
        save_to=os.path.join(run_dir, "heldout", f"step_{step:06d}.npz"),
      )
    evals.append({"step": step, **m})
    if on_eval is not None:
      on_eval(step, params, run_dir)
    return m

  if demo.mask_quantiles and spec.uses_noise_mask:
    spec = spec.with_overrides(mask_thresholds(spec, workdir, ws), policy_given=True)
  # The faulty-verifier variants grade the training rewards only (eval_fn: the true grader).
  grader = compare.training_grader(
    tasks.grader(train) or rewards.default_grader(),
    reward_flip=demo.reward_flip,
    false_negative=demo.false_negative,
    false_negative_rate=demo.false_negative_rate,
    seed=spec.seed,
  )
  if grader is None:  # the cued task's checker in process; else reward.correct's grader
    grader = tasks.grader(train)
  loop.train(
    spec,
    run_dir,
    policy=loop.Policy(ws.cfg, ws.params),
    tokenizer=ws.tokenizer,
    train_examples=train,
    eval_fn=eval_fn,
    grader=grader,
  )
  # A resumed run evaluated, in this process, only the steps after its checkpoint (none
  # when it had finished); the metrics file holds every evaluation the run made.
  by_step = {e["step"]: e for e in _evals_from_metrics(os.path.join(run_dir, "metrics.jsonl"))}
  by_step.update({e["step"]: e for e in evals})
  evals = [by_step[s] for s in sorted(by_step)]
  with open(os.path.join(run_dir, "evals.json"), "w", encoding="utf-8") as f:
    json.dump(evals, f, indent=1)
  return evals


def mask_thresholds(spec: RunSpec, workdir: str, ws: warm_start.WarmStart) -> dict[str, float]:
  """``algo.mask_low`` / ``mask_high`` at ``demo.mask_quantiles`` of the warm start's
  reference perplexities (``capo_jax/demo/mask.py``) on ``demo.mask_questions`` training
  questions x ``rollout.num_samples``; computed once per warm start, cached in
  ``workdir`` and logged. The run's config then records the values it used."""
  demo = Demo.of(spec)
  q_wrong, q_right = demo.mask_quantiles
  train = tasks.splits(demo.task)[0][: demo.mask_questions]
  res = mask_lib.calibrate(
    ws,
    train,
    num_samples=spec.rollout.num_samples,
    seed=demo.mask_seed,
    quantiles=(q_wrong, q_right),
    paper=(spec.algo.mask_low, spec.algo.mask_high),
    path=os.path.join(workdir, f"mask_thresholds_q{q_wrong:g}_{q_right:g}.json"),
  )
  msg = (
    f"mask thresholds at quantiles ({q_wrong:g}, {q_right:g}) of the warm start's "
    f"reference perplexity ({res['samples']} samples): low {res['low']:.4f}, high "
    f"{res['high']:.4f}, masking {res['masked']['wrong']:.3f} of its wrong and "
    f"{res['masked']['right']:.3f} of its correct samples (the paper's "
    f"{spec.algo.mask_low:g} / {spec.algo.mask_high:g}: {res['paper_masked']['wrong']:.3f}"
    f" / {res['paper_masked']['right']:.3f})"
  )
  log.info(msg)
  print(msg, flush=True)
  return {"algo.mask_low": res["low"], "algo.mask_high": res["high"]}


def _evals_from_metrics(path: str) -> list[dict[str, float]]:
  """The held-out evaluations in a run's ``metrics.jsonl``, in the order written (a
  step evaluated again after a resume appears twice); [] without the file."""
  out: list[dict[str, float]] = []
  if not os.path.exists(path):
    return out
  with open(path, encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      # MetricsWriter stores NaN / inf as strings ("nan": AUC with no mixed group).
      ev = {
        k[5:]: float(v) if isinstance(v, str) else v
        for k, v in row.items()
        if k.startswith("eval/")
      }
      if ev:
        out.append({"step": row["step"], **ev})
  return out


def method_spec(spec: RunSpec, method: str) -> RunSpec:
  """``spec`` with the overrides of ``compare.VARIANTS[method]`` (e.g. "grpo", "capo")."""
  if method not in compare.VARIANTS:
    raise ValueError(
      f"config.demo.methods: unknown method {method!r}; known: {', '.join(compare.VARIANTS)}"
    )
  return spec.with_overrides(compare.VARIANTS[method], policy_given=True)


def warm_start_eval(spec: RunSpec, workdir: str, ws: warm_start.WarmStart) -> dict[str, float]:
  """The warm start's held-out metrics, shared by every run from it; cached in the
  workdir (``warm_start_eval.json`` and the per-sample ``warm_start_heldout.npz``)."""
  path = os.path.join(workdir, "warm_start_eval.json")
  demo = Demo.of(spec)
  key = {
    "warm_start": warm_start.cache_id(ws),
    "questions": demo.eval_questions,
    "samples": demo.eval_samples,
    "seed": demo.eval_seed,
  }
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      cached = json.load(f)
    if "key" not in cached or warm_start.same_cache_key(cached["key"], key):
      return {k: v for k, v in cached.items() if k != "key"}
  heldout = tasks.splits(demo.task)[1][: demo.eval_questions]
  m = heldout_metrics(
    ws,
    ws.params,
    heldout,
    demo.eval_samples,
    demo.eval_seed,
    save_to=os.path.join(workdir, "warm_start_heldout.npz"),
  )
  tmp = f"{path}.{os.getpid()}.tmp"  # runs in parallel processes may evaluate at once
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({**m, "key": key}, f)
  os.replace(tmp, path)
  return m


def run(spec: RunSpec, workdir: str) -> dict[str, list[dict[str, float]]]:
  """The README's main command: the warm start (cached), then each of
  ``demo.methods`` from it (GRPO and CAPO by default), then the side-by-side report
  and ``<workdir>/demo_curves.png``; on the cued testbed (``configs/cued.py``, what
  ``make demo`` runs) the study's premise M, P1 and P2 of this run beside the recorded
  study's (``report.cued_checks_text``). Returns each method's evaluations."""
  demo = Demo.of(spec)
  ws = get_warm_start(spec, workdir)
  info = ws.info
  print(
    f"warm start: {'trained' if info.get('trained') else 'loaded from cache'} "
    f"({info.get('steps')} SFT steps, {info.get('wall_s', 0):.0f} s) -> {info.get('path')}"
  )
  initial = warm_start_eval(spec, workdir, ws)
  methods = [m.strip() for m in demo.methods.split(",") if m.strip()]
  runs = {}
  for method in methods:
    print(f"=== {method}", flush=True)
    runs[method] = run_rl(
      method_spec(spec, method), workdir, ws, run_name=method, initial_eval=initial
    )
  cmp = report.compare_runs(workdir, runs)
  is_cued = isinstance(demo.task, cued.CuedConfig)
  checks = is_cued and {"grpo", "capo"} <= set(runs)
  recorded = report.recorded_cued() if checks else {}
  png = report.plot_curves(
    runs,
    os.path.join(workdir, "demo_curves.png"),
    report.CUED_CURVES if is_cued else report.DEMO_CURVES,
    report.premise_marks(runs["grpo"], recorded) if checks else None,
  )
  print(
    f"\n{', '.join(methods)} from one warm start, {demo.eval_questions} held-out "
    f"questions x {demo.eval_samples} samples (evaluation seed {demo.eval_seed}):"
  )
  print(report.side_by_side(runs, cmp))
  print(f"curves: {png}")
  print(
    "\nThis run is one warm start and one RL seed: an illustration, not evidence "
    "(docs/demo.md says how much warm starts differ)."
  )
  if not is_cued:
    print("\n" + report.recorded_study())
  elif checks:
    print("\n" + report.cued_checks_text(report.cued_estimates(runs, recorded), recorded))
  return runs
