"""PC / RPC / majority / weighted vote / best-of-N against hand-worked cases and brute force;
compute_results on a synthetic samples.jsonl; plots and comparison files."""

from __future__ import annotations

import itertools
import json
import math
import sys
import types

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

import capo_jax.data
from capo_jax.eval import calibration as cal
from capo_jax.eval import comparison, plots, report
from capo_jax.eval import scaling as sc

EXACT = sc.resolve_same_answer("exact")


def _question(answers, completions, p, correct, same=EXACT):
  return sc.prepare_question(answers, completions, np.log(p), correct, same)


def _select_accuracy(question, method, config=sc.ScalingConfig()):
  """Expected accuracy of ``method`` using all of the question's samples."""
  idx = np.arange(len(question.group_G))[None]
  keep = sc.rpc_keep_mask(question.s_G[None], None, config.weibull) if method == "rpc" else None
  return float(sc.subset_accuracy(question, idx, method, keep, config.tie_rtol)[0])


def _naive_select(method, answers, completions, p, correct, keep=None):
  """Dictionary-based reference of one selection over one set of samples."""
  members: dict[str, list[bool]] = {}
  for a, c in zip(answers, correct):
    if a is not None:
      members.setdefault(a, []).append(bool(c))
  group_acc = {a: np.mean(cs) for a, cs in members.items()}
  idx = [i for i, a in enumerate(answers) if a is not None and (keep is None or keep[i])]
  if not idx:
    return 0.0
  if method == "best_of_n":
    best = max(p[i] for i in idx)
    return float(np.mean([correct[i] for i in idx if p[i] == best]))
  score: dict[str, float] = {}
  seen: set[str] = set()
  for i in idx:
    if method in ("pc", "rpc"):
      if completions[i] in seen:
        continue
      seen.add(completions[i])
    score[answers[i]] = score.get(answers[i], 0.0) + (1.0 if method == "majority" else p[i])
  best = max(score.values())
  tied = [a for a, v in score.items() if math.isclose(v, best, rel_tol=1e-9)]
  return float(np.mean([group_acc[a] for a in tied]))


def test_pc_hand_case_duplicates_once_and_ties_split():
  # A: distinct completions c1 (0.5; its duplicate is not counted) + c4 (0.25)
  # = 0.75, tied with B = 0.75 -> half right. The None sample abstains.
  q = _question(
    ["A", "A", "B", "A", None],
    ["c1", "c1", "c3", "c4", "c5"],
    [0.5, 0.5, 0.75, 0.25, 0.99],
    [1, 1, 0, 1, 0],
  )
  assert _select_accuracy(q, "pc") == pytest.approx(0.5)
  assert _select_accuracy(q, "majority") == 1.0  # A has 3 votes
  assert _select_accuracy(q, "best_of_n") == 0.0  # B has the top answered p


def test_weighted_vote_counts_repeated_completions_and_pc_reduces_to_best_of_n():
  # A: c1 twice (0.4 + 0.4) = 0.8 beats B's 0.6 in the weighted vote; PC counts c1 once
  # (0.4 < 0.6) and picks B, as best-of-N does: with every answer written one way, PC
  # is best-of-N over the distinct answers.
  q = _question(["A", "A", "B"], ["c1", "c1", "c2"], [0.4, 0.4, 0.6], [1, 1, 0])
  assert _select_accuracy(q, "weighted") == 1.0
  assert _select_accuracy(q, "pc") == 0.0
  assert _select_accuracy(q, "best_of_n") == 0.0
  assert _select_accuracy(q, "majority") == 1.0


def test_pc_groups_equivalent_answers_with_callable():
  canon = {"1/2": 0.5, "0.5": 0.5, "2": 2.0}
  same = lambda a, b: canon[a] == canon[b]  # noqa: E731
  q = _question(["1/2", "2", "0.5"], ["x", "y", "z"], [0.4, 0.6, 0.3], [1, 0, 1], same)
  assert list(q.group_G) == [0, 1, 0]
  assert _select_accuracy(q, "pc") == 1.0  # 0.7 for 1/2 = 0.5 beats 0.6
  q_exact = _question(["1/2", "2", "0.5"], ["x", "y", "z"], [0.4, 0.6, 0.3], [1, 0, 1])
  assert _select_accuracy(q_exact, "pc") == 0.0


def test_best_of_n_and_majority_split_ties():
  q = _question(["a", "b", "c", "d"], ["1", "2", "3", "4"], [0.5, 0.5, 0.25, 0.5], [1, 0, 0, 0])
  assert _select_accuracy(q, "best_of_n") == pytest.approx(1 / 3)
  assert _select_accuracy(q, "majority") == pytest.approx(1 / 4)


def _bimodal(seed: int):
  rng = np.random.default_rng(seed)
  low, high = rng.uniform(0.3, 0.4, 12), rng.uniform(0.88, 0.95, 4)
  return np.concatenate([low, high])


def test_rpc_drops_low_mode_and_changes_the_pick():
  for seed in range(5):
    p = _bimodal(seed)
    keep = sc.rpc_keep_mask(np.log(p)[None])[0]
    assert not keep[:12].any() and keep[12:].all()
    answers = ["W"] * 12 + ["R"] * 4
    q = _question(answers, [f"c{i}" for i in range(16)], p, [0] * 12 + [1] * 4)
    assert _select_accuracy(q, "pc") == 0.0  # 12 x ~0.35 outweighs 4 x ~0.9
    assert _select_accuracy(q, "rpc") == 1.0


def test_rpc_keeps_everything_without_two_groups():
  s = np.log(np.array([[0.5, 0.5, 0.5, 0.5], [0.9, 0.9, 0.9, 0.9]]))
  assert sc.rpc_keep_mask(s).all()
  assert sc.rpc_keep_mask(np.log([[0.7]])).all()


def test_fit_weibull_matches_scipy_mle():
  stats = pytest.importorskip("scipy.stats")
  p = stats.weibull_min.rvs(6.0, scale=0.7, size=300, random_state=0)
  shape, scale = sc.fit_weibull(p)
  ref_shape, _, ref_scale = stats.weibull_min.fit(p, floc=0)
  assert shape == pytest.approx(ref_shape, rel=1e-3)
  assert scale == pytest.approx(ref_scale, rel=1e-3)


def test_mixture_recovers_two_separated_components():
  rng = np.random.default_rng(0)
  low = 0.3 * rng.weibull(8.0, 600)
  high = 0.9 * rng.weibull(40.0, 900)
  mix = sc.fit_weibull_mixture(
    np.log(np.concatenate([low, high]))[None], config=sc.WeibullFitConfig(n_iter=500)
  )
  assert mix.fitted_E[0]
  np.testing.assert_allclose(mix.weight_E2[0], [0.4, 0.6], atol=0.03)
  np.testing.assert_allclose(mix.scale_E2[0], [0.3, 0.9], rtol=0.03)
  np.testing.assert_allclose(mix.shape_E2[0], [8.0, 40.0], rtol=0.15)


UNBOUNDED = sc.WeibullFitConfig(weight_min=0.0)


@pytest.mark.parametrize("low_outlier", [True, False])
def test_rpc_weight_bound_on_a_single_outlier(low_outlier):
  # 15 tight p values and one outlier: unbounded, one component shrinks onto the outlier
  # with its 1/16 share of the mass; bounded, that component's weight is lifted to 0.2.
  cluster, outlier = (
    (np.linspace(0.88, 0.92, 15), 0.3) if low_outlier else (np.linspace(0.30, 0.34, 15), 0.95)
  )
  s = np.log(np.r_[cluster, outlier])[None]
  small = 0 if low_outlier else 1  # the outlier's component (0: the lower mean)
  free = sc.fit_weibull_mixture(s, config=UNBOUNDED)
  assert free.weight_E2[0, small] == pytest.approx(1 / 16)
  bounded = sc.fit_weibull_mixture(s)
  assert bounded.weight_E2[0, small] == pytest.approx(0.2)
  keep = sc.rpc_keep_mask(s)[0]
  if low_outlier:  # only the outlier is below the mean p (0.8625): it alone can go
    assert list(keep) == [True] * 15 + [False]
  else:  # all 15 are below the mean p (0.36) and ~0 under the spike at 0.95
    assert list(keep) == [False] * 15 + [True]


def test_rpc_weight_bound_changes_the_pruning():
  stats = pytest.importorskip("scipy.stats")
  optimize = pytest.importorskip("scipy.optimize")
  p = np.array([0.48, 0.2, 0.85, 0.54, 0.3, 0.56, 0.37, 0.53])  # mean 0.479
  s = np.log(p)[None]
  free = sc.fit_weibull_mixture(s, config=UNBOUNDED)
  assert free.weight_E2[0, 0] < 0.1  # the low component fades: nothing is pruned
  assert sc.rpc_keep_mask(s, config=UNBOUNDED)[0].all()
  mix = sc.fit_weibull_mixture(s)
  w, k, lam = mix.weight_E2[0], mix.shape_E2[0], mix.scale_E2[0]
  assert w[0] == pytest.approx(0.2)

  def nll(x):
    dens = x[0] * stats.weibull_min.pdf(p, x[1], scale=x[2]) + (1 - x[0]) * stats.weibull_min.pdf(
      p, x[3], scale=x[4]
    )
    return -np.log(dens).sum()

  # The bounded EM fit is a constrained optimum: the official code's optimizer (L-BFGS-B,
  # w in [0.2, 0.8]) started there finds nothing better.
  x0 = [w[0], k[0], lam[0], k[1], lam[1]]
  better = optimize.minimize(nll, x0, bounds=[(0.2, 0.8)] + [(0.01, None)] * 4)
  assert nll(x0) - better.fun < 1e-5
  # RPC's rule with scipy's densities: the two lowest p, both below the mean, go.
  low = w[0] * stats.weibull_min.pdf(p, k[0], scale=lam[0])
  high = w[1] * stats.weibull_min.pdf(p, k[1], scale=lam[1])
  expect = ~((p < p.mean()) & (low > high))
  assert list(expect) == [p_i not in (0.2, 0.3) for p_i in p]
  np.testing.assert_array_equal(sc.rpc_keep_mask(s)[0], expect)


def test_weibull_config_rejects_a_weight_bound_past_one_half():
  with pytest.raises(ValueError, match="weight_min"):
    sc.WeibullFitConfig(weight_min=0.6)


def _random_questions(seed: int, n_q: int, g: int):
  rng = np.random.default_rng(seed)
  raw = []
  for _ in range(n_q):
    answers = [None if rng.uniform() < 0.1 else str(rng.integers(0, 3)) for _ in range(g)]
    completions = [f"{a}-{rng.integers(0, 2)}" for a in answers]  # duplicates
    by_completion: dict[str, float] = {}  # identical completions, same p
    p = np.array([by_completion.setdefault(c, rng.uniform(0.2, 1.0)) for c in completions])
    correct = [a == "0" for a in answers]
    raw.append((answers, completions, p, correct))
  return raw


def test_scaling_curves_match_brute_force_over_all_subsets():
  g, ns = 6, (1, 2, 3, 6)
  raw = _random_questions(1, 12, g)
  questions = [_question(*r) for r in raw]
  config = sc.ScalingConfig(ns=ns, n_subsets=20)  # 20 = C(6, 3): exact
  curves = sc.scaling_curves(questions, config)
  assert curves["n"] == list(ns) and curves["n_questions"] == [12] * 4
  for j, n in enumerate(ns):
    expect = {m: [] for m in sc.METHODS}
    for answers, completions, p, correct in raw:
      per = {m: [] for m in sc.METHODS}
      for sub in itertools.combinations(range(g), n):
        sub = list(sub)
        args = (
          [answers[i] for i in sub],
          [completions[i] for i in sub],
          p[sub],
          [correct[i] for i in sub],
        )
        keep = sc.rpc_keep_mask(np.log(p[sub])[None])[0]
        for m in sc.METHODS:
          # group correctness is over the whole question: pass it via members
          per[m].append(
            _naive_with_question(m, args, (answers, correct), keep if m == "rpc" else None)
          )
      for m in sc.METHODS:
        expect[m].append(np.mean(per[m]))
    for m in sc.METHODS:
      assert curves[m][j] == pytest.approx(np.mean(expect[m]), abs=1e-12), (m, n)


def _naive_with_question(method, args, whole, keep):
  answers, completions, p, correct = args
  all_answers, all_correct = whole
  # Group correctness over the question; with a consistent grader it equals
  # the sample's own flag, which the synthetic data guarantees.
  assert all((a == "0") == c for a, c in zip(all_answers, all_correct) if a is not None)
  return _naive_select(method, answers, completions, p, correct, keep)


def test_random_subsets_are_seeded_and_unbiased():
  raw = _random_questions(2, 20, 16)
  questions = [_question(*r) for r in raw]
  config = sc.ScalingConfig(ns=(4,), n_subsets=64, methods=("pc", "majority"))
  a = sc.scaling_curves(questions, config)
  assert a == sc.scaling_curves(questions, config)
  exact = sc.scaling_curves(
    questions, sc.ScalingConfig(ns=(4,), n_subsets=math.comb(16, 4), methods=("pc", "majority"))
  )
  for m in ("pc", "majority"):
    assert a[m][0] == pytest.approx(exact[m][0], abs=0.04)


def test_scaling_skips_questions_with_too_few_samples():
  raw = _random_questions(3, 3, 4)
  short = _question(*[x[:2] for x in raw[0]])
  curves = sc.scaling_curves(
    [_question(*r) for r in raw] + [short], sc.ScalingConfig(ns=(1, 2, 4, 8))
  )
  assert curves["n_questions"] == [4, 4, 3, 0]
  assert math.isnan(curves["pc"][3])


def test_default_grouping_uses_rewards_lazily(monkeypatch):
  """ "rewards" grades answer a, boxed, against b with capo_jax.data.rewards.is_correct."""
  calls = []
  fake = types.ModuleType("capo_jax.data.rewards")
  fake.is_correct = lambda completion, gold: (
    calls.append((completion, gold)) or completion == "\\boxed{" + gold + "}"
  )
  monkeypatch.setitem(sys.modules, "capo_jax.data.rewards", fake)
  monkeypatch.setattr(capo_jax.data, "rewards", fake, raising=False)
  same = sc.resolve_same_answer()
  assert same("7", "7") and not same("7", "8")
  assert calls == [("\\boxed{7}", "7"), ("\\boxed{7}", "8")]


def test_rewards_grouping_treats_equal_values_as_one_answer():
  pytest.importorskip("capo_jax.data.rewards")
  same = sc.resolve_same_answer("rewards")
  # Decided by the grader's fast path (plain numbers), so no worker pool.
  assert same("\\frac{1}{2}", "0.5") and same("007", "7") and not same("3", "4")
  assert list(sc.group_answers(["0.5", "\\frac{1}{2}", "3", None], same)) == [0, 0, 1, -1]


def _synthetic_rows(seed: int):
  rng = np.random.default_rng(seed)
  rows = []
  for bench, n_q in (("aime25", 6), ("math500", 9)):
    for q in range(n_q):
      rate = [0.0, 1.0, rng.uniform()][q % 3]  # all-wrong / all-right / mixed
      for i in range(16):
        ok = bool(rng.uniform() < rate)
        ans = "42" if ok else str(rng.integers(0, 5))
        ans = None if (not ok and rng.uniform() < 0.2) else ans
        rows.append(
          {
            "benchmark": bench,
            "question_id": f"{bench}-{q}",
            "sample_index": 15 - i,
            "completion": f"... {ans} {i % 3}",
            "answer": ans,
            "correct": ok,
            "length": int(rng.integers(5, 50)),
            "s": float(np.log(rng.uniform(0.6, 1.0) if ok else rng.uniform(0.2, 0.9))),
          }
        )
  return rows


def test_compute_results_on_samples_file_and_plots(tmp_path):
  rows = _synthetic_rows(0)
  path = tmp_path / "samples.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  config = report.ResultsConfig(
    grouping="exact", scaling=sc.ScalingConfig(n_subsets=16)
  )  # N=1 exact
  results = report.compute_results(report.load_samples(path), config, run="toy")
  assert list(results["benchmarks"]) == ["aime25", "math500"]
  for bench, res in results["benchmarks"].items():
    mine = sorted(
      (r for r in rows if r["benchmark"] == bench),
      key=lambda r: (r["question_id"], r["sample_index"]),
    )
    by_q: dict[str, list[dict]] = {}
    for r in mine:
      by_q.setdefault(r["question_id"], []).append(r)
    qs = list(by_q.values())
    c = np.array([[r["correct"] for r in q] for q in qs])
    s = np.array([[r["s"] for r in q] for q in qs])
    assert res["mean@16"] == pytest.approx(c.mean())
    assert res["mean@8"] == pytest.approx(c[:, :8].mean())
    aucs = [roc_auc_score(ci, si) for ci, si in zip(c, s) if 0 < ci.sum() < 16]
    assert res["auc_n_used"] == len(aucs)
    assert res["auc_mean"] == pytest.approx(np.mean(aucs))
    assert res["pooled_auc"] == pytest.approx(roc_auc_score(c.ravel(), s.ravel()))
    assert res["pass@k"]["1"] == pytest.approx(c.mean())
    assert res["scaling"]["best_of_n"][0] == pytest.approx(c.mean())
    pc16 = np.mean(
      [
        _naive_select(
          "pc",
          [r["answer"] for r in q],
          [r["completion"] for r in q],
          np.exp([r["s"] for r in q]),
          [r["correct"] for r in q],
        )
        for q in qs
      ]
    )
    assert res["scaling"]["pc"][-1] == pytest.approx(pc16)
    assert res["auc_per_question"].count(None) == len(qs) - len(aucs)
  run_a = report.write_results(results, tmp_path / "run_a")
  json.loads(open(run_a, encoding="utf-8").read())  # strict JSON, no NaN
  results["run"] = "toy2"
  report.write_results(results, tmp_path / "run_b")
  md = comparison.compare([tmp_path / "run_a", tmp_path / "run_b"], tmp_path / "cmp")
  text = open(md, encoding="utf-8").read()
  assert "| benchmark | toy acc | toy AUC | toy AURC | toy2 acc | toy2 AUC | toy2 AURC |" in text
  for bench in ("aime25", "math500"):
    for kind in ("precision_coverage", "scaling", "auc_hist"):
      png = tmp_path / "cmp" / f"{bench}_{kind}.png"
      assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
      assert f"({png.name})" in text


def test_plot_functions_write_png(tmp_path):
  cov, prec, _ = cal.precision_coverage([-0.1, -0.5, -0.2, -0.9], [1, 0, 1, 0])
  files = [
    plots.plot_precision_coverage({"a": (cov, prec), "b": (cov, prec[::-1])}, tmp_path / "pc.png"),
    plots.plot_scaling(
      {"run": {"pc": [0.1, 0.2, 0.3], "majority": [0.1, 0.15, 0.2]}},
      [1, 2, 4],
      tmp_path / "sub" / "scaling.png",
    ),
    plots.plot_auc_histogram({"a": [0.5, 0.7, np.nan], "b": []}, tmp_path / "h.png"),
  ]
  for f in files:
    with open(f, "rb") as fh:
      assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="3 accuracies for 2 values"):
    plots.plot_scaling({"r": {"pc": [0.1, 0.2, 0.3]}}, [1, 2], tmp_path / "x.png")
