"""The mask study's pieces: the false-negative verifier and the quantile mask thresholds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from capo_jax.data import rewards
from capo_jax.demo import compare
from capo_jax.demo import mask as mask_lib
from capo_jax.demo import run as demo_run
from capo_jax.demo.char_tokenizer import CharTokenizer


class _SerialGrader:
  """The project's real scoring function, in this process."""

  def score(self, completions, golds):
    return rewards.score_serial(completions, golds)


def _batch(n_each: int = 400) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
  """Hand-built completions of four kinds, n_each of each: correct negative, correct
  non-negative, wrong negative, wrong non-negative; with their kind masks."""
  texts, golds, kind = [], [], []
  for i in range(n_each):
    v = i % 50 + 1
    texts += [
      f"3-{v + 3}\n\\boxed{{-{v}}}",
      f"{v}+0\n\\boxed{{{v}}}",
      f"1-9\n\\boxed{{-{v}}}",
      f"9-1\n\\boxed{{{v}}}",
    ]
    golds += [f"-{v}", str(v), str(v), f"-{v}"]
    kind += [0, 1, 2, 3]
  kind_B = np.array(kind)
  return texts, golds, kind_B == 0, np.isin(kind_B, (0, 1))


def test_false_negative_grader_rejects_only_correct_negative_answers_at_the_rate():
  texts, golds, target_B, correct_B = _batch()
  true_B, health = _SerialGrader().score(texts, golds)
  np.testing.assert_array_equal(true_B > 0.5, correct_B)  # the hand-built verdicts hold
  fn = compare.FalseNegativeGrader(_SerialGrader(), "negative", rate=0.5, seed=3)
  got_B, got_health = fn.score(texts, golds)
  changed_B = got_B != true_B
  assert not changed_B[~target_B].any()  # wrong answers and positive correct ones: untouched
  assert (got_B[changed_B] == 0).all()  # only ever a rejection
  n = int(target_B.sum())
  assert abs(changed_B[target_B].mean() - 0.5) < 4 * np.sqrt(0.25 / n)
  assert got_health.correct == health.correct  # the health counts the true verdicts
  np.testing.assert_array_equal(fn.score(texts, golds)[0], got_B)  # deterministic
  all_B, _ = compare.FalseNegativeGrader(_SerialGrader(), "negative", rate=1.0).score(texts, golds)
  np.testing.assert_array_equal(all_B > 0.5, correct_B & ~target_B)
  # "-0" is the parser's fault too (the sign), though it equals the gold 0.
  assert compare.false_negative_form("0-0\n\\boxed{-0}", "negative")
  assert not compare.false_negative_form("no box -3", "negative")
  with pytest.raises(ValueError, match="form"):
    compare.FalseNegativeGrader(_SerialGrader(), "decimal")


def test_training_grader_composes_and_names_the_bad_field():
  g = _SerialGrader()
  assert compare.training_grader(g) is None
  fn = compare.training_grader(g, false_negative="negative", seed=1)
  assert isinstance(fn, compare.FalseNegativeGrader) and fn.grader is g
  both = compare.training_grader(g, reward_flip=0.1, false_negative="negative")
  assert isinstance(both, compare.NoisyGrader)
  assert isinstance(both.grader, compare.FalseNegativeGrader)
  with pytest.raises(ValueError, match="config.demo.false_negative"):
    compare.training_grader(g, false_negative="decimal")


def test_evaluation_never_sees_the_faulty_verifier(monkeypatch, tmp_path):
  """run_rl hands the faulty verifier to the training loop; its held-out evaluation of
  always-correct answers (a third of them negative) still scores 100%."""
  from capo_jax.eval import evaluate  # pylint: disable=import-outside-toplevel
  from capo_jax.eval.report import SampleRecord  # pylint: disable=import-outside-toplevel
  from configs import demo  # pylint: disable=import-outside-toplevel

  seen = {}

  def fake_evaluate(policy, examples, eval_cfg, rng, benchmark, grader=None):
    del policy, rng
    seen["eval_grader"] = grader
    texts = [f"\\boxed{{{ex.answer}}}" for ex in examples for _ in range(eval_cfg.num_samples)]
    golds = [ex.answer for ex in examples for _ in range(eval_cfg.num_samples)]
    verdicts = (grader or _SerialGrader()).score(texts, golds)[0]
    return [
      SampleRecord(benchmark, "q", 0, t, g, bool(v > 0.5), -0.1, 5)
      for t, g, v in zip(texts, golds, verdicts)
    ]

  def fake_train(spec, run_dir, *, policy, tokenizer, train_examples, eval_fn, grader):
    del spec, policy, tokenizer
    seen["grader"] = grader
    seen["train_rewards"] = grader.score(
      [f"\\boxed{{{ex.answer}}}" for ex in train_examples], [ex.answer for ex in train_examples]
    )[0]
    tmp_path.joinpath(run_dir).mkdir(parents=True, exist_ok=True)
    eval_fn(1, None)

  monkeypatch.setattr(demo_run.loop, "train", fake_train)
  monkeypatch.setattr(evaluate, "evaluate_policy", fake_evaluate)
  monkeypatch.setattr(demo_run.rewards, "default_grader", _SerialGrader)
  c = demo.get_config("shrink")
  c.demo.false_negative, c.demo.false_negative_rate = "negative", 1.0
  spec = demo_run.method_spec(demo_run.spec_of(c), "grpo")

  class _WS:
    cfg = params = None
    tokenizer = CharTokenizer()

  evals = demo_run.run_rl(spec, str(tmp_path), _WS(), run_name="r")
  assert isinstance(seen["grader"], compare.FalseNegativeGrader)
  assert 0.1 < 1 - seen["train_rewards"].mean() < 0.6  # training: the negatives rejected
  assert seen["eval_grader"] is None  # evaluation: the benchmark's own (true) checker
  assert evals[0]["step"] == 1 and evals[0]["accuracy"] == 1.0


def test_unknown_false_negative_or_quantiles_name_the_field():
  from configs import demo  # pylint: disable=import-outside-toplevel

  for field, value, match in (
    ("false_negative", "decimal", "config.demo.false_negative"),
    ("mask_quantiles", (0.1,), "config.demo.mask_quantiles"),
    ("mask_quantiles", (0.1, 1.0), "config.demo.mask_quantiles"),
  ):
    c = demo.get_config("shrink")
    c.demo[field] = value
    with pytest.raises(ValueError, match=match):
      demo_run.Demo.of(demo_run.spec_of(c))


def test_quantile_thresholds_match_numpy_and_mask_the_stated_fraction():
  rng = np.random.default_rng(0)
  ppl_QG = 1.0 + rng.exponential(0.2, size=(50, 8))
  correct_QG = rng.random((50, 8)) < 0.4
  low, high = mask_lib.quantile_thresholds(ppl_QG, correct_QG, 0.1, 0.9)
  assert low == pytest.approx(np.quantile(ppl_QG[~correct_QG], 0.1))
  assert high == pytest.approx(np.quantile(ppl_QG[correct_QG], 0.9))
  frac = mask_lib.masked_fractions(ppl_QG, correct_QG, low, high)
  # Brute force: continuous values, so the strict comparisons remove ~10% of each kind.
  n_wrong, n_right = int((~correct_QG).sum()), int(correct_QG.sum())
  assert frac["wrong"] == sum(p < low for p in ppl_QG[~correct_QG]) / n_wrong
  assert frac["right"] == sum(p > high for p in ppl_QG[correct_QG]) / n_right
  assert abs(frac["wrong"] - 0.1) <= 1 / n_wrong + 1e-12
  assert abs(frac["right"] - 0.1) <= 1 / n_right + 1e-12
  # A hand-built case: wrong 1.0..1.9, right 2.0..2.9.
  ppl = np.arange(10, 30) / 10
  correct = ppl >= 2.0
  low, high = mask_lib.quantile_thresholds(ppl, correct, 0.2, 0.7)
  assert (low, high) == pytest.approx((1.18, 2.63))
  assert mask_lib.masked_fractions(ppl, correct, low, high) == {"wrong": 0.2, "right": 0.3}
  # A kind the sample lacks: nothing of it is masked.
  assert mask_lib.quantile_thresholds(ppl, np.zeros_like(correct), 0.1, 0.9)[1] == np.inf
  assert mask_lib.quantile_thresholds(ppl, np.ones_like(correct), 0.1, 0.9)[0] == 0.0


def test_study_variants_cover_the_design():
  v = compare.VARIANTS
  for noise in ("noise", "fneg"):
    assert v[f"grpo_{noise}"]["algo.mask"] == "off"
    assert v[f"capo_{noise}"]["algo.mask"] == "on"
    assert "demo.mask_quantiles" not in v[f"capo_{noise}"]
    assert v[f"capo_qmask_{noise}"]["demo.mask_quantiles"] == (0.1, 0.9)
    assert v[f"capo_nomask_{noise}"]["algo.mask"] == "off"
  for name, over in v.items():
    assert ("demo.false_negative" in over) == name.endswith("_fneg")
    assert ("demo.reward_flip" in over) == name.endswith("_noise")


def test_verdict_is_the_pre_registered_rule():
  from studies.mask.report import verdict  # pylint: disable=import-outside-toplevel

  def paired(lo, hi, per_seed):
    return {
      "selected": {"delta": (lo + hi) / 2, "lo": lo, "hi": hi, "pairs": 9},
      "per_seed": [{"d_accuracy": a, "d_entropy": e} for a, e in per_seed],
    }

  grows_and_stalls = [(0.02, -0.1)] * 3  # mask minus no mask: more accurate, lower entropy
  assert verdict(paired(0.01, 0.05, grows_and_stalls), 3) == {
    "calibration": "helps",
    "paper_claim": "reproduced",
  }
  assert verdict(paired(-0.05, -0.01, [(-0.01, 0.1)] * 3), 3) == {
    "calibration": "hurts",
    "paper_claim": "contradicted",
  }
  assert verdict(paired(-0.01, 0.02, grows_and_stalls[:2] + [(-0.01, -0.1)]), 3) == {
    "calibration": "inconclusive",
    "paper_claim": "mixed",
  }
  assert verdict(paired(float("nan"), float("nan"), []), 3)["paper_claim"] == "-"
  # One seed of three: the same readings, labelled partial, never the verdict itself.
  assert verdict(paired(0.01, 0.05, grows_and_stalls[:1]), 3) == {
    "calibration": "helps (1 of 3 seeds)",
    "paper_claim": "reproduced (1 of 3 seeds)",
  }


def test_warm_start_eval_cache_survives_a_moved_root(monkeypatch, tmp_path):
  """A study root copied elsewhere (another machine, a bucket) keeps its warm start's
  held-out evaluation: the cache is keyed on the settings hash, not the absolute path,
  and a key written with the old absolute path still serves."""
  from configs import demo  # pylint: disable=import-outside-toplevel

  spec = demo_run.spec_of(demo.get_config("shrink"))
  d = demo_run.Demo.of(spec)
  old_key = {
    "warm_start": "/elsewhere/ws0/warm_start/abc123",
    "questions": d.eval_questions,
    "samples": d.eval_samples,
    "seed": d.eval_seed,
  }
  (tmp_path / "warm_start_eval.json").write_text(json.dumps({"accuracy": 0.25, "key": old_key}))

  class _WS:
    params = None
    info = {"path": str(tmp_path / "warm_start" / "abc123")}

  def must_not_run(*a, **k):
    raise AssertionError("recomputed a cached evaluation")

  monkeypatch.setattr(demo_run, "heldout_metrics", must_not_run)
  assert demo_run.warm_start_eval(spec, str(tmp_path), _WS()) == {"accuracy": 0.25}
  # Another warm start (other settings hash) is not served by it.
  _WS.info = {"path": str(tmp_path / "warm_start" / "def456")}
  with pytest.raises(AssertionError, match="recomputed"):
    demo_run.warm_start_eval(spec, str(tmp_path), _WS())


def test_tau_grid_is_relative_to_the_spread_and_its_verdict_the_rule():
  from studies.tau import design, report  # pylint: disable=import-outside-toplevel

  scales = {
    v: compare.VARIANTS[v]["algo.adaptive_tau"] for v in design.variant_names() if v != "grpo"
  }
  assert scales == pytest.approx({"capo_rtau0.4": 2 / 3, "capo_rtau0.6": 1.0, "capo_rtau1": 5 / 3})
  assert all(compare.VARIANTS[v]["algo.mask"] == "on" for v in scales)

  def d(lo, hi):
    return {"delta": (lo + hi) / 2, "lo": lo, "hi": hi}

  verdict = report.verdict
  assert verdict([d(-0.01, 0.05), d(0.01, 0.03), d(-0.02, 0.04)]) == "robust to tau"
  assert verdict([d(-0.05, 0.01), d(0.01, 0.03), d(-0.02, 0.04)]) == "not robust"  # signs
  assert (
    verdict([d(-0.01, 0.05), d(0.01, 0.03), d(-0.05, -0.01) | {"delta": 0.001}]) == "not robust"
  )  # an interval wholly below 0 against a positive estimate
  assert verdict([d(0.0, 0.1), d(0.0, 0.1)]) == "-"  # not all three


def test_ws0_study_names_rows_and_heldout(tmp_path):
  """The runner the mask and tau studies share: run names, the training rows of a resumed
  run, and a run's held-out AUC on the selected questions against scikit-learn."""
  from sklearn.metrics import roc_auc_score  # pylint: disable=import-outside-toplevel

  from studies import ws0  # pylint: disable=import-outside-toplevel
  from studies.mask import run as mask_run  # pylint: disable=import-outside-toplevel
  from studies.tau import run as tau_run  # pylint: disable=import-outside-toplevel

  for s in (mask_run.STUDY, tau_run.STUDY):
    assert [s.parse_name(n) for n in s.run_names()][0][0] in s.variants()
  assert tau_run.STUDY.parse_name("ws0/tau/capo_rtau1_seed1") == ("capo_rtau1", 1)
  for bad in ("ws0/mask/capo_rtau1_seed1", "ws1/tau/grpo_seed0", "ws0/tau/grpo_seedx"):
    with pytest.raises(SystemExit, match="--runs"):
      tau_run.STUDY.parse_name(bad)

  # A run resumed after step 2: its steps 2-3 were written twice; the last row wins.
  rows = [
    {"step": 1, "entropy": 1.0},
    {"step": 2, "entropy": 2.0},
    {"step": 3, "entropy": 3.0},
    {"step": 2, "eval/accuracy": 0.5},
    {"step": 2, "entropy": 2.5},
    {"step": 3, "entropy": 3.5},
  ]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  got = ws0.train_rows(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["entropy"]) for r in got] == [(1, 1.0), (2, 2.5), (3, 3.5)]

  rng = np.random.default_rng(0)
  s_QG, c_QG = rng.normal(size=(6, 8)), rng.random((6, 8)) < 0.5
  c_QG[0], c_QG[1, :3] = False, True  # question 0: no correct sample, AUC undefined
  (tmp_path / "heldout").mkdir()
  np.savez(tmp_path / "heldout" / "step_000150.npz", s_QG=s_QG, correct_QG=c_QG)
  keep_Q = np.array([True, True, False, True, False, True])
  h = ws0.heldout_at(tmp_path, 150, keep_Q)
  want = [roc_auc_score(c, s) if 0 < c.sum() < c.size else np.nan for s, c in zip(s_QG, c_QG)]
  np.testing.assert_allclose(h["auc_Q"], want)
  np.testing.assert_allclose(h["auc_sel_Q"], np.array(want)[keep_Q])
  assert h["accuracy_sel"] == pytest.approx(c_QG[keep_Q].mean())
  assert h["auc_mean_sel"] == pytest.approx(np.nanmean(np.array(want)[keep_Q]))


def test_mean_curve_averages_seeds_up_to_the_shortest_run():
  """The studies' plotted curves: the mean over seeds at each step, NaN where no seed logged
  a value, cut at the shortest run; nothing for a value no run logged."""
  from studies import ws0  # pylint: disable=import-outside-toplevel

  a = {"train": [{"step": 1, "x": 1.0}, {"step": 2, "x": None}, {"step": 3, "x": 5.0}]}
  b = {"train": [{"step": 1, "x": 3.0}, {"step": 2, "x": None}]}  # stopped after step 2
  steps, mean = ws0.mean_curve([a, b], "train", "x")
  assert steps == [1, 2]
  np.testing.assert_array_equal(mean, [2.0, np.nan])
  assert ws0.mean_curve([a, b], "train", "masked_frac_wrong") is None
  assert ws0.mean_curve([], "train", "x") is None
