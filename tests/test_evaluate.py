"""Tests of the evaluation CLI and API (capo_jax.eval.evaluate), on a tiny random HF model."""

from __future__ import annotations

import json
import pathlib
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

import hf_utils
from capo_jax.data import rewards
from capo_jax.eval import calibration as cal
from capo_jax.eval import evaluate, grouping, report
from capo_jax.runtime import policy_io
from capo_jax.runtime.checkpoint import Checkpointer
from capo_jax.sampling import sampler as sampling
from models import hf_weights
from models.config import Qwen2Config

# Prompts of these questions fall in one sampler length bucket: one compile.
QUESTIONS = [
  ("q0", "What is 1 + 2?", "3"),
  ("q1", "Solve 2x + 3 = 11 for x.", "4"),
  ("q2", "Compute 7 times 6.", "42"),
  ("q3", "Find the value of 48 / 2.", "24"),
]
G, C = 4, 8  # samples per question, max new tokens


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, pathlib.Path]:
  """(transformers model, HF dir holding it and the tiny tokenizer)."""
  import torch  # pylint: disable=import-outside-toplevel

  path = tmp_path_factory.mktemp("policy")
  model, _ = hf_utils.make_hf_model(None, vocab_size=400)
  with torch.no_grad():  # <|im_end|> (id 2) gets likely: completions of varied lengths
    model.model.embed_tokens.weight[2] += 0.5
  model.save_pretrained(path)
  hf_utils.make_tokenizer().save_pretrained(path)
  return model, path


def _write_jsonl(path: pathlib.Path, rows: list[dict[str, Any]]) -> pathlib.Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return path


def _bench_file(tmp_path: pathlib.Path) -> pathlib.Path:
  return _write_jsonl(
    tmp_path / "tiny.jsonl", [{"id": i, "problem": p, "answer": a} for i, p, a in QUESTIONS]
  )


def _read_samples(path: pathlib.Path) -> list[dict[str, Any]]:
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _arrays(rows: list[dict[str, Any]], bench: str) -> tuple[list[str], np.ndarray, np.ndarray]:
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


def _sklearn_auc_mean(s_QG: np.ndarray, correct_QG: np.ndarray) -> tuple[float, int]:
  aucs = [roc_auc_score(c, s) for s, c in zip(s_QG, correct_QG) if 0 < c.sum() < c.size]
  return (float(np.mean(aucs)) if aucs else float("nan")), len(aucs)


def _check_plots(out: pathlib.Path, bench: str) -> None:
  for kind in ("precision_coverage", "scaling", "auc_hist"):
    png = out / f"{bench}_{kind}.png"
    assert png.is_file() and png.stat().st_size > 2000, png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _parity(text: str, gold: str) -> bool:
  return (len(text) + int(gold)) % 2 == 0


class _ParityGrader:
  """Fake grader: correct iff len(completion) + gold is even (gold mix-ups show)."""

  def score(self, texts: list[str], golds: list[str]) -> tuple[np.ndarray, None]:
    assert len(texts) == len(golds)
    return np.array([_parity(t, g) for t, g in zip(texts, golds)], np.float32), None


# A seed whose 12 samples the parity grader splits into both classes (the
# metric checks below need correct and wrong samples); any seed may serve.
SEED = 1


def test_cli_samples_and_metrics(policy, tmp_path, monkeypatch):
  model, path = policy
  calls = []
  real_generate = sampling.generate

  def spy(params, cfg, tokens, mask, rng, *args, **kw):
    out = real_generate(params, cfg, tokens, mask, rng, *args, **kw)
    calls.append((np.asarray(tokens), np.asarray(mask), jax.tree.map(np.asarray, out)))
    return out

  monkeypatch.setattr(sampling, "generate", spy)
  monkeypatch.setattr(rewards, "default_grader", _ParityGrader)
  out = tmp_path / "out"
  # 3 questions, 2 per batch: the second batch is padded with a repeated question.
  evaluate.main(
    [
      f"--policy={path}",
      f"--benchmarks={_bench_file(tmp_path)}",
      "--limit=3",
      f"--num_samples={G}",
      f"--max_new_tokens={C}",
      "--batch_size=2",
      "--dtype=float32",
      "--no_progress",
      f"--out={out}",
      f"--seed={SEED}",
    ]
  )
  assert len(calls) == 2
  rows = _read_samples(out / "samples.jsonl")
  assert len(rows) == 3 * G
  assert [(r["question_id"], r["sample_index"]) for r in rows] == [
    (q, g) for q, _, _ in QUESTIONS[:3] for g in range(G)
  ]

  # Reference: every sampled row re-scored by the transformers model.
  tok = hf_utils.make_tokenizer()
  problem_of = {p: i for i, p, _ in QUESTIONS}
  gold_of = {i: a for i, _, a in QUESTIONS}
  ref: dict[tuple[str, int], tuple[float, int, str]] = {}
  for tokens_QP, mask_QP, samples in calls:
    for q in range(tokens_QP.shape[0]):
      prompt = tokens_QP[q][mask_QP[q] > 0]
      text = tok.decode(prompt.tolist())
      qid = next(i for p, i in problem_of.items() if p in text)
      if (qid, 0) in ref:  # the padding repeat of a question
        continue
      for g in range(G):
        b = q * G + g
        n = int(samples.mask_BC[b].sum())
        comp = samples.tokens_BC[b, :n]
        seq = np.concatenate([prompt, comp])[None]
        logp = jax.nn.log_softmax(hf_utils.hf_logits(model, seq)[0], axis=-1)
        lp = [float(logp[len(prompt) - 1 + t, comp[t]]) for t in range(n)]
        body = comp[:-1] if comp[-1] in (0, 2) else comp  # stop ids: <|endoftext|>, <|im_end|>
        ref[qid, g] = (float(np.mean(lp)), n, tok.decode(body.tolist(), skip_special_tokens=True))
  assert len(ref) == 3 * G
  assert len({n for _, n, _ in ref.values()}) > 1, "every completion has the same length"
  for r in rows:
    s, n, text = ref[r["question_id"], r["sample_index"]]
    assert r["s"] == pytest.approx(s, abs=2e-4)
    assert r["length"] == n and r["completion"] == text
    assert r["correct"] == _parity(text, gold_of[r["question_id"]])

  # results.json against direct metric calls and independent references.
  res = report.load_results(out)
  bench = res["benchmarks"]["tiny"]
  _, s_QG, correct_QG = _arrays(rows, "tiny")
  assert 0 < correct_QG.sum() < correct_QG.size, "fake grader gave one class only"
  assert bench["mean@4"] == pytest.approx(cal.mean_at_k(correct_QG, G))
  assert bench["mean@4"] == pytest.approx(correct_QG.mean())
  assert bench["mean@16"] is None  # fewer samples than 16
  auc, n_used = cal.auc_mean(s_QG, correct_QG)
  ref_auc, ref_n = _sklearn_auc_mean(s_QG, correct_QG)
  assert bench["auc_n_used"] == n_used == ref_n and ref_n > 0
  assert bench["auc_mean"] == pytest.approx(auc) and auc == pytest.approx(ref_auc)
  assert bench["scaling"]["n"] == [1, 2, 4]
  assert res["config"]["num_samples"] == G and res["config"]["limit"] == 3
  _check_plots(out, "tiny")


def test_evaluate_policy_uses_the_reward_grader(policy, tmp_path):
  _, path = policy
  pol = policy_io.load_policy(path, dtype=jnp.float32)
  from capo_jax.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel

  tokenizer = load_tokenizer(pol.tokenizer_dir)
  exs = evaluate.load_benchmarks([str(_bench_file(tmp_path))])["tiny"][:2]
  cfg = evaluate.EvalConfig(num_samples=G, max_new_tokens=C, batch_size=2, progress=False)
  # Same batch shape as the CLI test (compiled once); "b" lists the questions reversed.
  recs = evaluate.evaluate_policy(
    evaluate.EvalPolicy(pol.params, pol.cfg, tokenizer),
    {"a": exs, "b": exs[::-1]},
    cfg,
    jax.random.key(1),
  )
  assert [(r.benchmark, r.question_id) for r in recs[::G]] == [
    ("a", "q0"),
    ("a", "q1"),
    ("b", "q1"),
    ("b", "q0"),
  ]
  golds = [e.answer for e in exs + exs[::-1] for _ in range(G)]
  want, _ = rewards.score_serial([r.completion for r in recs], golds)
  assert [r.correct for r in recs] == (want > 0).tolist()
  assert all(r.answer == rewards.extract_answer(r.completion)[0] for r in recs)


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
    samples = _write_jsonl(tmp_path / f"s{seed}.jsonl", _crafted_samples(seed))
    out = tmp_path / f"run{seed}"
    evaluate.main(["--from-samples", str(samples), f"--out={out}", "--no_progress"])
    runs.append(out)
    rows = _read_samples(samples)
    res = report.load_results(out)
    assert not (out / "samples.jsonl").exists()
    for bench in ("alpha", "beta"):
      got = res["benchmarks"][bench]
      qids, s_QG, correct_QG = _arrays(rows, bench)
      assert got["n_questions"] == len(qids) == 6
      for k in (8, 16):
        assert got[f"mean@{k}"] == pytest.approx(cal.mean_at_k(correct_QG, k))
        assert got[f"mean@{k}"] == pytest.approx(correct_QG[:, :k].mean())
      auc, n_used = cal.auc_mean(s_QG, correct_QG)
      ref_auc, ref_n = _sklearn_auc_mean(s_QG, correct_QG)
      assert got["auc_mean"] == pytest.approx(auc) == pytest.approx(ref_auc)
      assert got["auc_n_used"] == n_used == ref_n and ref_n > 0
      flat_c, flat_s = correct_QG.ravel(), s_QG.ravel()
      assert got["pooled_auc"] == pytest.approx(roc_auc_score(flat_c, flat_s))
      answers = [[r["answer"] for r in rows if r["question_id"] == q] for q in qids]
      maj = np.mean([_majority(a, c.tolist()) for a, c in zip(answers, correct_QG)])
      assert got["maj@k"]["16"] == pytest.approx(maj)
      assert got["scaling"]["n"] == [1, 2, 4, 8, 16]
      _check_plots(out, bench)
  md_path = evaluate.main(["--compare", str(runs[0]), str(runs[1]), f"--out={tmp_path / 'cmp'}"])
  md = pathlib.Path(md_path).read_text(encoding="utf-8")
  for run in runs:
    acc = report.load_results(run)["benchmarks"]["beta"]["mean@16"]
    assert f"{100 * acc:.1f}" in md
  assert "| alpha |" in md and "| beta |" in md


def test_load_policy_prefers_export_then_checkpoint(policy, tmp_path):
  _, path = policy
  cfg, hf_params = hf_weights.load_pretrained(path)
  workdir = tmp_path / "work"
  shifted = jax.tree.map(lambda x: x + 1.0, hf_params)
  state = {
    "step": jnp.array(7),
    "params": shifted,
    "opt_state": {"mu": jax.tree.map(jnp.zeros_like, shifted)},
  }
  ckpt = Checkpointer(str(workdir), every_steps=1)
  ckpt.save(7, state, {"hf_config": cfg.to_hf()}, force=True)
  ckpt.close()
  got = policy_io.load_policy(workdir, dtype=jnp.float32)
  assert got.cfg == cfg and "step 7" in got.source and got.tokenizer_dir is None
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(shifted)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The HF export wins over the checkpoint.
  hf_weights.save_pretrained(cfg, hf_params, workdir / "export_hf")
  got = policy_io.load_policy(workdir, base_model=str(path), dtype=jnp.float32)
  assert got.source.endswith("export_hf") and got.tokenizer_dir == str(path)
  np.testing.assert_array_equal(np.asarray(got.params["embed"]), np.asarray(hf_params["embed"]))


def test_bad_inputs_raise_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="neither a HF model directory"):
    policy_io.load_policy(tmp_path)
  ckpt = Checkpointer(str(tmp_path / "w"), every_steps=1)
  ckpt.save(1, {"params": {"embed": jnp.zeros((2, 2))}}, {}, force=True)
  ckpt.close()
  with pytest.raises(ValueError, match="base_model"):
    policy_io.load_policy(tmp_path / "w")
  dup = _write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "problem": "x", "answer": "1"}] * 2)
  exs = evaluate.load_benchmarks([str(dup)])["dup"]
  with pytest.raises(ValueError, match="'a' appears more than once"):
    evaluate.evaluate_policy(
      evaluate.EvalPolicy({}, None, None),
      exs,
      evaluate.EvalConfig(),
      jax.random.key(0),
      grader=_ParityGrader(),
    )
  with pytest.raises(ValueError, match="given twice"):
    evaluate.load_benchmarks([str(dup), str(dup)])
  with pytest.raises(ValueError, match="num_samples"):
    evaluate.EvalConfig(num_samples=0)


def test_load_benchmarks_by_name_with_limit(shared_data):
  got = evaluate.load_benchmarks(["aime24", "amc23"], str(shared_data), limit=2)
  for name in ("aime24", "amc23"):
    lines = (shared_data / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()[:2]
    assert [e.id for e in got[name]] == [json.loads(x)["id"] for x in lines]


# --- input errors name the file; names from data stay out of paths ---------------


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
  argv = [f"--policy={policy}", f"--benchmarks={_bench_file(tmp_path)}", f"--out={tmp_path / 'o'}"]
  with pytest.raises(evaluate.InputError) as err:
    evaluate.main(argv)
  assert str(policy / "config.json") in str(err.value) and message in str(err.value)


def test_policy_workdir_with_a_bad_export_config_and_the_cli_message(tmp_path, capsys):
  workdir = tmp_path / "work"
  (workdir / "export_hf").mkdir(parents=True)
  (workdir / "config.json").write_text(json.dumps({"config": {}}), encoding="utf-8")  # a run's
  (workdir / "export_hf" / "config.json").write_text("{not json", encoding="utf-8")
  argv = [f"--policy={workdir}", f"--benchmarks={_bench_file(tmp_path)}", f"--out={tmp_path / 'o'}"]
  with pytest.raises(SystemExit) as done:  # the command line: a message, no traceback
    evaluate.cli(argv)
  text = str(done.value.code)
  assert text.startswith("python -m capo_jax.eval: error: --policy: ")
  assert f"{workdir / 'export_hf' / 'config.json'} is not valid JSON" in text


def test_from_samples_errors_name_the_file_and_line(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n", encoding="utf-8")
  with pytest.raises(evaluate.InputError, match=f"{empty}: no samples"):
    evaluate.main(["--from-samples", str(empty), f"--out={tmp_path / 'o1'}"])
  rows = _crafted_samples(0)[:3]
  rows[1]["s"] = "high"
  bad = _write_jsonl(tmp_path / "bad.jsonl", rows)
  with pytest.raises(evaluate.InputError, match=f"{bad}:2: field 's' must be"):
    evaluate.main(["--from-samples", str(bad), f"--out={tmp_path / 'o2'}"])
  bad.write_text(json.dumps(rows[0]) + "\n{oops\n", encoding="utf-8")
  with pytest.raises(evaluate.InputError, match=f"{bad}:2: invalid JSON"):
    evaluate.main(["--from-samples", str(bad), f"--out={tmp_path / 'o3'}"])


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "ABS", "a\\b"])
def test_benchmark_names_that_are_paths_are_rejected(tmp_path, name):
  name = str(tmp_path / "abs" / "x") if name == "ABS" else name
  root = tmp_path / "root"
  (root / "in").mkdir(parents=True)
  rows = _crafted_samples(0)[:32]
  for r in rows[16:]:
    r["benchmark"] = name
  samples = _write_jsonl(root / "in" / "samples.jsonl", rows)
  before, before_tmp = _files_under(tmp_path), set(pathlib.Path("/tmp").glob("x_*.png"))
  with pytest.raises(evaluate.InputError, match=f"{samples}:17: field 'benchmark'"):
    evaluate.main(["--from-samples", str(samples), f"--out={root / 'out'}"])
  assert _files_under(tmp_path) == before
  assert set(pathlib.Path("/tmp").glob("x_*.png")) == before_tmp  # the name "/tmp/x"
  # A results.json naming such a benchmark is refused by --compare, before any output.
  run = root / "run"
  run.mkdir()
  res = {"format": report.FORMAT, "version": report.VERSION, "run": "r", "benchmarks": {name: {}}}
  (run / "results.json").write_text(json.dumps(res), encoding="utf-8")
  before = _files_under(tmp_path)
  with pytest.raises(evaluate.InputError, match=f"{run / 'results.json'}: benchmark name"):
    evaluate.main(["--compare", str(run), f"--out={root / 'cmp'}"])
  assert _files_under(tmp_path) == before
  with pytest.raises(ValueError, match="plot_benchmark: benchmark name"):
    report.plot_benchmark(name, {}, str(root / "out"))


def test_grouping_budget_flag_and_the_timeout_count(tmp_path, monkeypatch, capsys):
  # Every pair the math grader's cheap path leaves undecided hangs in the pool.
  hang = grouping.PairCheck(lambda a, b: (3600.0,), slow="time:sleep")
  monkeypatch.setattr(grouping, "REWARDS_CHECK", hang)
  rows = [r for r in _crafted_samples(0) if r["question_id"] == "alpha-0"]
  samples = _write_jsonl(tmp_path / "s.jsonl", rows)
  n_answers = len({r["answer"] for r in rows} - {None})
  assert n_answers >= 2
  out = tmp_path / "out"
  evaluate.main(
    ["--from-samples", str(samples), f"--out={out}", "--grouping_budget_s=1", "--no_plots"]
  )
  got = report.load_results(out)["benchmarks"]["alpha"]["grouping_timeouts"]
  assert got == n_answers * (n_answers - 1) // 2  # every answer its own class
  assert f"alpha: {got} answer pairs timed out in grouping" in capsys.readouterr().out
