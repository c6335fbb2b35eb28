"""Tests of the evaluation CLI and API (capo_jax.eval.evaluate), on a tiny random HF model."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eval_files
import hf_utils
from capo_jax.data import answers, rewards
from capo_jax.eval import calibration as cal
from capo_jax.eval import cli as eval_cli
from capo_jax.eval import evaluate, report
from capo_jax.runtime import policy_io
from capo_jax.runtime.checkpoint import Checkpointer
from capo_jax.sampling import sampler as sampling
from models import hf_weights

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
  eval_cli.main(
    [
      f"--policy={path}",
      f"--benchmarks={eval_files.bench_file(tmp_path)}",
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
  rows = eval_files.read_samples(out / "samples.jsonl")
  assert len(rows) == 3 * G
  assert [(r["question_id"], r["sample_index"]) for r in rows] == [
    (q, g) for q, _, _ in eval_files.QUESTIONS[:3] for g in range(G)
  ]

  # Reference: every sampled row re-scored by the transformers model.
  tok = hf_utils.make_tokenizer()
  problem_of = {p: i for i, p, _ in eval_files.QUESTIONS}
  gold_of = {i: a for i, _, a in eval_files.QUESTIONS}
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
  _, s_QG, correct_QG = eval_files.arrays(rows, "tiny")
  assert 0 < correct_QG.sum() < correct_QG.size, "fake grader gave one class only"
  assert bench["mean@4"] == pytest.approx(cal.mean_at_k(correct_QG, G))
  assert bench["mean@4"] == pytest.approx(correct_QG.mean())
  assert bench["mean@16"] is None  # fewer samples than 16
  auc, n_used = cal.auc_mean(s_QG, correct_QG)
  ref_auc, ref_n = eval_files.sklearn_auc_mean(s_QG, correct_QG)
  assert bench["auc_n_used"] == n_used == ref_n and ref_n > 0
  assert bench["auc_mean"] == pytest.approx(auc) and auc == pytest.approx(ref_auc)
  assert bench["scaling"]["n"] == [1, 2, 4]
  assert res["config"]["num_samples"] == G and res["config"]["limit"] == 3
  eval_files.check_plots(out, "tiny")


def test_evaluate_policy_uses_the_reward_grader(policy, tmp_path):
  _, path = policy
  pol = policy_io.load_policy(path, dtype=jnp.float32)
  from capo_jax.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel

  tokenizer = load_tokenizer(pol.tokenizer_dir)
  exs = evaluate.load_benchmarks([str(eval_files.bench_file(tmp_path))])["tiny"][:2]
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
  assert all(r.answer == answers.extract_answer(r.completion)[0] for r in recs)


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
  dup = eval_files.write_jsonl(
    tmp_path / "dup.jsonl", [{"id": "a", "problem": "x", "answer": "1"}] * 2
  )
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
