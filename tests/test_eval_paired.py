"""The paired ΔAUC and subset-averaged PC@k / maj@k of ``python -m capo_jax.eval --compare``
(issue 32, item 8): matching by question id against brute-force loops, the bootstrap
interval's behaviour, and comparison.md end to end from synthetic samples."""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections import Counter

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from capo_jax.demo import compare as demo_compare
from capo_jax.eval import cli as eval_cli
from capo_jax.eval import comparison, paired, report
from capo_jax.eval import scaling as sc
from capo_jax.eval.report import SampleRecord


def _bench(ids, aucs):
  return {"question_ids": list(ids), "auc_per_question": list(aucs)}


def _brute_pairs(a: dict, b: dict) -> list[float]:
  """AUC_b - AUC_a over ids in both with both AUCs set, in a's order, by a loop."""
  out = []
  for q, va in a.items():
    if q in b and va is not None and b[q] is not None:
      out.append(b[q] - va)
  return out


def _brute_bootstrap(d_by_stratum, n_boot: int, seed: int) -> tuple[float, float]:
  """Percentile interval of the pooled mean, questions redrawn within each stratum."""
  rng = np.random.default_rng(seed + 1000)  # not the library's stream
  est = []
  for _ in range(n_boot):
    draws = [np.asarray(d)[rng.integers(0, len(d), len(d))] for d in d_by_stratum if len(d)]
    est.append(np.concatenate(draws).mean())
  return tuple(np.quantile(est, [0.025, 0.975]))


def _tables(md: str, section: str) -> list[dict[str, dict[str, str]]]:
  """The markdown tables of a '## section': {first cell: {column header: cell}} each."""
  body = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", md, re.M | re.S).group(1)
  tables: list[dict[str, dict[str, str]]] = []
  head: list[str] = []
  for line in body.splitlines() + [""]:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if not line.startswith("|"):
      head = []
    elif not head:
      head = cells
      tables.append({})
    elif not line.startswith("|---"):
      tables[-1][cells[0]] = dict(zip(head, cells))
  return tables


def _rows(md: str, section: str) -> dict[tuple[str, str], list[str]]:
  """Paired table rows by (benchmark, run): the cells after those two."""
  rows = {}
  for table in _tables(md, section):
    for row in table.values():
      cells = list(row.values())
      rows[(cells[0], cells[1])] = cells[2:]
  return rows


# Run A and run B of two benchmarks: B lists the questions in another order, lacks "a5",
# has "a6" that A lacks, and "a2" is all-right (no AUC) in A.
A = {
  "aime": dict(a1=0.70, a2=None, a3=0.50, a4=0.90, a5=0.60),
  "math": dict(m1=0.55, m2=0.80, m3=None, m4=0.65),
}
B = {
  "aime": dict(a4=0.75, a3=0.80, a1=0.60, a6=0.40, a2=0.90),
  "math": dict(m4=0.95, m2=0.70, m1=0.30, m3=0.50),
}


def _results(runs):
  return {
    name: {"benchmarks": {b: _bench(q.keys(), q.values()) for b, q in r.items()}}
    for name, r in runs.items()
  }


def test_matching_and_table_equal_brute_force_loops():
  m = paired.match_questions(
    list(B["aime"]), list(B["aime"].values()), list(A["aime"]), list(A["aime"].values())
  )
  want = _brute_pairs(A["aime"], B["aime"])
  assert sorted(m.d_Q.tolist()) == pytest.approx(sorted(want)) and len(want) == 3
  assert (m.not_mixed, m.only_a, m.only_b) == (1, 1, 1)  # a2 / a6 only in B / a5 only in A
  rows = _rows(
    "## Paired ΔAUC\n" + paired.paired_table(_results({"A": A, "B": B}), n_boot=4000), "Paired ΔAUC"
  )
  strata = [_brute_pairs(A[b], B[b]) for b in ("aime", "math")]
  for label, ds, not_mixed, only in (
    ("aime", strata[0], 1, "1 / 1"),
    ("math", strata[1], 1, "0 / 0"),
    ("pooled", strata[0] + strata[1], 2, "1 / 1"),
  ):
    delta, interval, pairs, nm, only_cells = rows[(label, "B")]
    assert float(delta) == pytest.approx(np.mean(ds), abs=5e-4)
    assert (int(pairs), int(nm), only_cells) == (len(ds), not_mixed, only)
    lo, hi = (float(x) for x in interval.strip("[]").split(","))
    ref_lo, ref_hi = _brute_bootstrap(strata if label == "pooled" else [ds], 4000, 0)
    assert lo == pytest.approx(ref_lo, abs=0.02) and hi == pytest.approx(ref_hi, abs=0.02)
    assert lo <= float(delta) <= hi


def test_pooled_interval_resamples_within_benchmarks():
  # Two benchmarks whose differences sit at -1 and +1: drawn within each, the pooled mean
  # keeps their shares; drawn over all pairs it would move with the share drawn.
  d = [np.full(10, -1.0) + 0.01 * np.arange(10), np.full(30, 1.0)]
  out = paired.delta_interval(d, n_boot=2000)
  assert out["pairs"] == 40 and out["delta"] == pytest.approx(np.concatenate(d).mean())
  assert out["hi"] - out["lo"] < 0.01


def test_interval_contains_the_estimate_and_shrinks_with_more_questions():
  rng = np.random.default_rng(0)
  widths = []
  for n in (12, 48, 400):
    z = rng.normal(size=n)
    d = 0.05 + 0.1 * (z - z.mean()) / z.std()  # sd exactly 0.1: widths differ by n alone
    out = paired.delta_interval([d])
    assert out["delta"] == pytest.approx(d.mean()) and out["pairs"] == n
    assert out["lo"] < out["delta"] < out["hi"]
    widths.append(out["hi"] - out["lo"])
    # The percentile interval of a mean has width ~ 2 * 1.96 * sd / sqrt(n).
    assert widths[-1] == pytest.approx(2 * 1.96 * d.std() / math.sqrt(n), rel=0.2)
  assert widths[0] > widths[1] > widths[2] and widths[0] > 4 * widths[2]


def test_identical_runs_give_zero_with_a_zero_width_interval():
  table = paired.paired_table(_results({"A": A, "A again": A}))
  for label in ("aime", "math", "pooled"):
    delta, interval, *_ = _rows("## x\n" + table, "x")[(label, "A again")]
    assert delta == "+0.000" and interval == "[+0.000, +0.000]"
  out = paired.delta_interval([np.zeros(7), np.zeros(3)])
  assert (out["delta"], out["lo"], out["hi"], out["pairs"]) == (0.0, 0.0, 0.0, 10)


def test_no_pairs_and_one_run():
  out = paired.delta_interval([np.array([]), []])
  assert out["pairs"] == 0 and math.isnan(out["delta"]) and math.isnan(out["lo"])
  assert paired.paired_table(_results({"A": A})) == "One run: nothing to pair.\n"
  with pytest.raises(ValueError, match="duplicate question ids"):
    paired.match_questions(["q", "q"], [0.5, 0.6], ["q"], [0.5])


def test_demo_compare_reexports_the_eval_bootstrap():
  assert demo_compare.paired_delta_auc is paired.paired_delta_auc


# ---------------------------------------------------------------- end to end


def _run_records(rng, ids, rates, shift: float) -> list[SampleRecord]:
  """16 samples per question; right answers are '7', wrong ones '1'-'3'."""
  recs = []
  for qid, rate in zip(ids, rates):
    for g in range(16):
      ok = bool(rng.uniform() < rate)
      s = np.log(rng.uniform(0.5, 1.0)) + (shift if ok else 0.0)
      ans = "7" if ok else str(rng.integers(1, 4))
      recs.append(
        SampleRecord(
          benchmark="aime" if qid[0] == "a" else "math",
          question_id=qid,
          sample_index=g,
          completion=f"{ans} {g}",
          answer=ans,
          correct=ok,
          s=float(min(s, 0.0)),
          length=5,
        )
      )
  return recs


def test_compare_end_to_end_against_an_independent_computation(tmp_path):
  rng = np.random.default_rng(3)
  ids = [f"a{i}" for i in range(6)] + [f"m{i}" for i in range(10)]
  rates = rng.uniform(0.2, 0.8, len(ids))
  rates[1] = 1.0  # all right in both runs: no AUC, not paired
  runs = {
    "base": _run_records(rng, ids, rates, 0.0),
    # The other run: questions in reverse order, without a3 and m0.
    "tuned": _run_records(
      rng,
      [q for q in ids[::-1] if q not in ("a3", "m0")],
      [r for q, r in zip(ids[::-1], rates[::-1]) if q not in ("a3", "m0")],
      -0.05,
    ),
  }
  config = report.ResultsConfig(
    grouping="exact",
    scaling=sc.ScalingConfig(ns=(1, 4, 8, 16), methods=("pc", "majority"), n_subsets=8),
  )
  dirs = []
  for name, recs in runs.items():
    report.write_results(report.compute_results(recs, config, run=name), tmp_path / name)
    dirs.append(str(tmp_path / name))
  md = pathlib.Path(eval_cli.main(["--compare", *dirs, f"--out={tmp_path / 'cmp'}"])).read_text(
    encoding="utf-8"
  )

  def aucs(recs, bench):
    by_q: dict[str, list[SampleRecord]] = {}
    for r in recs:
      if r.benchmark == bench:
        by_q.setdefault(r.question_id, []).append(r)
    return {
      q: (
        roc_auc_score([r.correct for r in rs], [r.s for r in rs])
        if 0 < sum(r.correct for r in rs) < len(rs)
        else None
      )
      for q, rs in by_q.items()
    }, by_q

  rows, strata = _rows(md, "Paired ΔAUC"), []
  for bench in ("aime", "math"):
    auc_base, _ = aucs(runs["base"], bench)
    auc_tuned, _ = aucs(runs["tuned"], bench)
    ds = _brute_pairs(auc_base, auc_tuned)
    strata.append(ds)
    delta, _, pairs, not_mixed, only = rows[(bench, "tuned")]
    assert float(delta) == pytest.approx(np.mean(ds), abs=5e-4)
    assert int(pairs) == len(ds) and only == "1 / 0"
    assert int(not_mixed) == sum(
      q in auc_tuned and None in (a, auc_tuned[q]) for q, a in auc_base.items()
    )
  delta, interval, pairs, _, only = rows[("pooled", "tuned")]
  assert float(delta) == pytest.approx(np.mean(strata[0] + strata[1]), abs=5e-4)
  assert int(pairs) == len(strata[0] + strata[1]) and only == "2 / 0"
  lo, hi = (float(x) for x in interval.strip("[]").split(","))
  ref_lo, ref_hi = _brute_bootstrap(strata, 2000, 0)
  assert lo == pytest.approx(ref_lo, abs=0.02) and hi == pytest.approx(ref_hi, abs=0.02)

  # k = 16 uses every sample (one subset): a plain vote and PC by hand; k = 4 and 8 are
  # the results.json curves at those N.
  pc_table, maj_table = _tables(md, "PC@k and maj@k over subsets")
  for name, recs in runs.items():
    res = report.load_results(tmp_path / name)
    for bench in ("aime", "math"):
      _, by_q = aucs(recs, bench)
      vote, pc = [], []
      for rs in by_q.values():
        counts = Counter(r.answer for r in rs)
        mass = Counter()
        for r in rs:
          mass[r.answer] += math.exp(r.s)  # completions are distinct: each counts
        vote.append(np.mean([a == "7" for a, n in counts.items() if n == max(counts.values())]))
        pc.append(float(max(mass, key=mass.get) == "7"))
      curves = res["benchmarks"][bench]["scaling"]
      for table, method, hand in ((pc_table, "pc", pc), (maj_table, "majority", vote)):
        head = "PC" if method == "pc" else "maj"
        assert table[bench][f"{name} {head}@16"] == f"{100 * np.mean(hand):.1f}"
        for k in (4, 8):
          want = curves[method][curves["n"].index(k)]
          assert table[bench][f"{name} {head}@{k}"] == f"{100 * want:.1f}"
  assert "averaged over 8 random subsets" in md


def test_old_results_without_question_ids_say_so(tmp_path):
  rng = np.random.default_rng(0)
  recs = _run_records(rng, ["a0", "a1", "a2"], [0.5, 0.5, 0.5], 0.0)
  config = report.ResultsConfig(grouping="exact", scaling=sc.ScalingConfig(ns=(1, 4), n_subsets=4))
  res = report.compute_results(recs, config, run="new")
  assert res["benchmarks"]["aime"]["question_ids"] == ["a0", "a1", "a2"]
  assert res["benchmarks"]["aime"]["acc_per_question"] == pytest.approx(
    [np.mean([r.correct for r in recs if r.question_id == q]) for q in ("a0", "a1", "a2")]
  )
  report.write_results(res, tmp_path / "new")
  old = json.loads(json.dumps(res))
  for key in ("question_ids", "acc_per_question"):
    del old["benchmarks"]["aime"][key]
  old["run"] = "old"
  report.write_results(old, tmp_path / "old")
  assert "question_ids" not in report.load_results(tmp_path / "old")["benchmarks"]["aime"]
  md = pathlib.Path(
    comparison.compare([tmp_path / "old", tmp_path / "new"], tmp_path / "cmp")
  ).read_text(encoding="utf-8")
  assert f"| aime | new | {paired.MISSING} |" in md


def test_t_interval_against_scipy_and_the_fallback_table(monkeypatch):
  from scipy import stats  # pylint: disable=import-outside-toplevel

  m = np.array([0.03, -0.01, 0.02, 0.05])
  got = paired.t_interval(m)
  half = stats.t.ppf(0.975, 3) * np.std(m, ddof=1) / 2
  assert (got["t_lo"], got["t_hi"], got["clusters"]) == (
    pytest.approx(m.mean() - half),
    pytest.approx(m.mean() + half),
    4,
  )
  assert [round(float(stats.t.ppf(0.975, df)), 3) for df in range(1, 10)] == list(paired._T975)
  monkeypatch.setitem(__import__("sys").modules, "scipy", None)  # as if not installed
  assert paired.t_interval(m)["t_lo"] == pytest.approx(m.mean() - half, abs=1e-4)
  with pytest.raises(ValueError, match="t_interval"):
    paired.t_interval(m, level=0.9)
  assert np.isnan(paired.t_interval([0.1])["t_lo"])


def test_paired_delta_auc_gives_a_t_interval_over_seeds_below_ten():
  from scipy import stats  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(4)
  b = rng.random((3, 50))
  a = b + np.array([[0.01], [0.04], [-0.02]]) + rng.normal(0, 0.01, b.shape)
  a[0, :7] = np.nan
  got = paired.paired_delta_auc(a, b, n_boot=200)
  seed_means = [np.nanmean(a[i] - b[i]) for i in range(3)]  # brute force per seed
  half = stats.t.ppf(0.975, 2) * np.std(seed_means, ddof=1) / np.sqrt(3)
  assert got["t_lo"] == pytest.approx(np.mean(seed_means) - half)
  assert got["t_hi"] == pytest.approx(np.mean(seed_means) + half)
  assert "t_lo" not in paired.paired_delta_auc(rng.random((10, 5)), rng.random((10, 5)), n_boot=50)


def test_t_pvalue_is_scipys_one_sample_test_and_inverts_the_interval():
  from scipy import stats  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  for _ in range(200):
    m = rng.normal(0.01, 0.02, size=rng.integers(2, 8))
    p = paired.t_pvalue(m)
    assert p == pytest.approx(stats.ttest_1samp(m, 0.0).pvalue, rel=1e-9)
    iv = paired.t_interval(m)
    assert (p < 0.05) == (iv["t_lo"] > 0 or iv["t_hi"] < 0)
  assert np.isnan(paired.t_pvalue([0.1, np.nan]))


def test_holm_by_hand_and_by_its_definition():
  # alpha 0.05, m 4: 0.005 < 0.0125 holds, 0.01 < 0.0167 holds, 0.03 >= 0.025 stops.
  got = paired.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
  assert got == {"a": True, "b": False, "c": False, "d": True}
  assert paired.holm({"x": float("nan"), "y": 0.001}) == {"x": False, "y": True}
  rng = np.random.default_rng(1)
  for _ in range(300):
    p = {str(i): float(v) for i, v in enumerate(rng.uniform(0, 0.06, size=rng.integers(1, 9)))}
    ranked = sorted(p, key=p.get)
    m = len(ranked)
    # Definition: the i-th smallest holds iff every j <= i has p_(j) < alpha / (m - j).
    want = {
      n: all(p[ranked[j]] < 0.05 / (m - j) for j in range(i + 1)) for i, n in enumerate(ranked)
    }
    assert paired.holm(p) == want
