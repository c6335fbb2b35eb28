"""Tests of the evaluator's command line (capo_jax.eval.cli): --from-samples, --compare and
the input errors it names."""

from __future__ import annotations

import json
import pathlib
from collections import Counter
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

import eval_files
from capo_jax.eval import calibration as cal
from capo_jax.eval import cli as eval_cli
from capo_jax.eval import comparison, grouping, report
from capo_jax.eval.inputs import InputError
from models.config import Qwen2Config


def _crafted_samples(seed: int) -> list[dict[str, Any]]:
  """Two benchmarks, 6 questions x 16 samples; answers are numbers, gold "1"."""
  rng = np.random.default_rng(seed)
  rows = []
  for bench in ("alpha", "beta"):
    for q in range(6):
      p_right = q / 5
      for g in range(16):
        ans = "1" if rng.random() < p_right else str(rng.integers(2, 4))
        ans = None if rng.random() < 0.1 else ans
        rows.append(
          {
            "benchmark": bench,
            "question_id": f"{bench}-{q}",
            "sample_index": g,
            "completion": f"work {rng.integers(3)} \\boxed{{{ans}}}",
            "answer": ans,
            "correct": ans == "1",
            "s": -float(rng.gamma(2.0, 0.2)) - 0.3 * (ans == "1"),
            "length": int(rng.integers(1, 100)),
          }
        )
  return rows


def _majority(answers: list[str | None], correct: list[bool]) -> float:
  counts = Counter(a for a in answers if a is not None)
  if not counts:
    return 0.0
  top = max(counts.values())
  tied = [a for a, n in counts.items() if n == top]
  return float(np.mean([correct[answers.index(a)] for a in tied]))


def test_from_samples_and_compare(tmp_path):
  runs = []
  for seed in (0, 1):
    samples = eval_files.write_jsonl(tmp_path / f"s{seed}.jsonl", _crafted_samples(seed))
    out = tmp_path / f"run{seed}"
    eval_cli.main(["--from-samples", str(samples), f"--out={out}", "--no_progress"])
    runs.append(out)
    rows = eval_files.read_samples(samples)
    res = report.load_results(out)
    assert not (out / "samples.jsonl").exists()
    for bench in ("alpha", "beta"):
      got = res["benchmarks"][bench]
      qids, s_QG, correct_QG = eval_files.arrays(rows, bench)
      assert got["n_questions"] == len(qids) == 6
      for k in (8, 16):
        assert got[f"mean@{k}"] == pytest.approx(cal.mean_at_k(correct_QG, k))
        assert got[f"mean@{k}"] == pytest.approx(correct_QG[:, :k].mean())
      auc, n_used = cal.auc_mean(s_QG, correct_QG)
      ref_auc, ref_n = eval_files.sklearn_auc_mean(s_QG, correct_QG)
      assert got["auc_mean"] == pytest.approx(auc) == pytest.approx(ref_auc)
      assert got["auc_n_used"] == n_used == ref_n and ref_n > 0
      flat_c, flat_s = correct_QG.ravel(), s_QG.ravel()
      assert got["pooled_auc"] == pytest.approx(roc_auc_score(flat_c, flat_s))
      answers = [[r["answer"] for r in rows if r["question_id"] == q] for q in qids]
      maj = np.mean([_majority(a, c.tolist()) for a, c in zip(answers, correct_QG)])
      assert got["maj@k"]["16"] == pytest.approx(maj)
      assert got["scaling"]["n"] == [1, 2, 4, 8, 16]
      eval_files.check_plots(out, bench)
  md_path = eval_cli.main(["--compare", str(runs[0]), str(runs[1]), f"--out={tmp_path / 'cmp'}"])
  md = pathlib.Path(md_path).read_text(encoding="utf-8")
  for run in runs:
    acc = report.load_results(run)["benchmarks"]["beta"]["mean@16"]
    assert f"{100 * acc:.1f}" in md
  assert "| alpha |" in md and "| beta |" in md


def _files_under(root: pathlib.Path) -> set[pathlib.Path]:
  return {p for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
  "broken, message",
  [
    (lambda c: c.pop("hidden_size"), "has no field 'hidden_size'"),
    (lambda c: c.update(vocab_size="big"), "field 'vocab_size' must be a positive integer"),
    (lambda c: c.pop("rope_theta") and c.pop("rope_parameters"), "rope_theta"),
  ],
)
def test_policy_with_a_bad_config_json_names_file_and_field(tmp_path, broken, message):
  cfg = Qwen2Config.tiny().to_hf()
  broken(cfg)
  policy = tmp_path / "policy"
  policy.mkdir()
  (policy / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
  argv = [
    f"--policy={policy}",
    f"--benchmarks={eval_files.bench_file(tmp_path)}",
    f"--out={tmp_path / 'o'}",
  ]
  with pytest.raises(InputError) as err:
    eval_cli.main(argv)
  assert str(policy / "config.json") in str(err.value) and message in str(err.value)


def test_policy_workdir_with_a_bad_export_config_and_the_cli_message(tmp_path, capsys):
  workdir = tmp_path / "work"
  (workdir / "export_hf").mkdir(parents=True)
  (workdir / "config.json").write_text(json.dumps({"config": {}}), encoding="utf-8")  # a run's
  (workdir / "export_hf" / "config.json").write_text("{not json", encoding="utf-8")
  argv = [
    f"--policy={workdir}",
    f"--benchmarks={eval_files.bench_file(tmp_path)}",
    f"--out={tmp_path / 'o'}",
  ]
  with pytest.raises(SystemExit) as done:  # the command line: a message, no traceback
    eval_cli.cli(argv)
  text = str(done.value.code)
  assert text.startswith("python -m capo_jax.eval: error: --policy: ")
  assert f"{workdir / 'export_hf' / 'config.json'} is not valid JSON" in text


def test_from_samples_errors_name_the_file_and_line(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n", encoding="utf-8")
  with pytest.raises(InputError, match=f"{empty}: no samples"):
    eval_cli.main(["--from-samples", str(empty), f"--out={tmp_path / 'o1'}"])
  rows = _crafted_samples(0)[:3]
  rows[1]["s"] = "high"
  bad = eval_files.write_jsonl(tmp_path / "bad.jsonl", rows)
  with pytest.raises(InputError, match=f"{bad}:2: field 's' must be"):
    eval_cli.main(["--from-samples", str(bad), f"--out={tmp_path / 'o2'}"])
  bad.write_text(json.dumps(rows[0]) + "\n{oops\n", encoding="utf-8")
  with pytest.raises(InputError, match=f"{bad}:2: invalid JSON"):
    eval_cli.main(["--from-samples", str(bad), f"--out={tmp_path / 'o3'}"])


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "ABS", "a\\b"])
def test_benchmark_names_that_are_paths_are_rejected(tmp_path, name):
  name = str(tmp_path / "abs" / "x") if name == "ABS" else name
  root = tmp_path / "root"
  (root / "in").mkdir(parents=True)
  rows = _crafted_samples(0)[:32]
  for r in rows[16:]:
    r["benchmark"] = name
  samples = eval_files.write_jsonl(root / "in" / "samples.jsonl", rows)
  before, before_tmp = _files_under(tmp_path), set(pathlib.Path("/tmp").glob("x_*.png"))
  with pytest.raises(InputError, match=f"{samples}:17: field 'benchmark'"):
    eval_cli.main(["--from-samples", str(samples), f"--out={root / 'out'}"])
  assert _files_under(tmp_path) == before
  assert set(pathlib.Path("/tmp").glob("x_*.png")) == before_tmp  # the name "/tmp/x"
  # A results.json naming such a benchmark is refused by --compare, before any output.
  run = root / "run"
  run.mkdir()
  res = {"format": report.FORMAT, "version": report.VERSION, "run": "r", "benchmarks": {name: {}}}
  (run / "results.json").write_text(json.dumps(res), encoding="utf-8")
  before = _files_under(tmp_path)
  with pytest.raises(InputError, match=f"{run / 'results.json'}: benchmark name"):
    eval_cli.main(["--compare", str(run), f"--out={root / 'cmp'}"])
  assert _files_under(tmp_path) == before
  with pytest.raises(ValueError, match="plot_benchmark: benchmark name"):
    comparison.plot_benchmark(name, {}, str(root / "out"))


def test_grouping_budget_flag_and_the_timeout_count(tmp_path, monkeypatch, capsys):
  # Every pair the math grader's cheap path leaves undecided hangs in the pool.
  hang = grouping.PairCheck(lambda a, b: (3600.0,), slow="time:sleep")
  monkeypatch.setattr(grouping, "REWARDS_CHECK", hang)
  rows = [r for r in _crafted_samples(0) if r["question_id"] == "alpha-0"]
  samples = eval_files.write_jsonl(tmp_path / "s.jsonl", rows)
  n_answers = len({r["answer"] for r in rows} - {None})
  assert n_answers >= 2
  out = tmp_path / "out"
  eval_cli.main(
    ["--from-samples", str(samples), f"--out={out}", "--grouping_budget_s=1", "--no_plots"]
  )
  got = report.load_results(out)["benchmarks"]["alpha"]["grouping_timeouts"]
  assert got == n_answers * (n_answers - 1) // 2  # every answer its own class
  assert f"alpha: {got} answer pairs timed out in grouping" in capsys.readouterr().out
