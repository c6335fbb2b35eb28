"""The model card (README.md) and prompt.json of every HF export (issue 31, item 7)."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest
import yaml

import rl_driver
from capo_jax.data import prompts
from capo_jax.eval import evaluate, report
from capo_jax.eval.report import SampleRecord
from capo_jax.run import model_card
from capo_jax.run import spec as spec_lib
from capo_jax.runtime import run_record
from configs import common


def _records(bench: str, correct_QG: np.ndarray, s_QG: np.ndarray) -> list[SampleRecord]:
  return [
    SampleRecord(
      benchmark=bench,
      question_id=str(q),
      sample_index=g,
      completion="x",
      answer=str(int(correct_QG[q, g])),
      correct=bool(correct_QG[q, g]),
      s=float(s_QG[q, g]),
      length=3,
    )
    for q in range(correct_QG.shape[0])
    for g in range(correct_QG.shape[1])
  ]


def _auc_mean_brute_force(correct_QG: np.ndarray, s_QG: np.ndarray) -> float:
  """Mean over questions with both outcomes of P(s_right > s_wrong) (ties 1/2), by loops."""
  aucs = []
  for c, s in zip(correct_QG, s_QG):
    pairs = [(a, b) for a in s[c] for b in s[~c]]
    if pairs:
      aucs.append(np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs]))
  return float(np.mean(aucs))


def _tables(card: str) -> list[dict[str, list[str]]]:
  """Each evaluation table of the card: {benchmark: [cells after the name]}."""
  body = card.split("## Evaluation", 1)[1]
  tables = []
  for block in re.split(r"\n\s*\n", body):
    rows = [r.strip("|").split("|") for r in block.splitlines() if r.startswith("| ")]
    if rows and rows[0][0].strip() == "benchmark":
      tables.append({r[0].strip(): [c.strip() for c in r[1:]] for r in rows[1:]})
  return tables


def _check_table(table: dict[str, list[str]], results: dict) -> None:
  """The card's row of each benchmark is the recorded results.json, to 4 decimals."""
  assert set(table) == set(results["benchmarks"])
  for bench, r in results["benchmarks"].items():
    k = r["samples_per_question"][0]
    n, samples, acc, auc, aurc = table[bench]
    assert (int(n), int(samples)) == (r["n_questions"], k)
    for cell, value in ((acc, r[f"mean@{k}"]), (auc, r["auc_mean"]), (aurc, r["aurc"])):
      assert cell == ("n/a" if value is None else f"{value:.4f}")


@pytest.fixture
def workdir(tmp_path):
  """A workdir with evaluations at steps 0 and 4 of two benchmarks, and its config.json."""
  rng = np.random.default_rng(0)
  evals = {}
  for step in (0, 4):
    recs = []
    for bench, (Q, G) in (("val", (6, 4)), ("aime24", (5, 4))):
      correct = rng.random((Q, G)) < (0.3 + 0.1 * step)
      s = -rng.random((Q, G)) - 0.5 * ~correct * (step > 0)
      evals[(step, bench)] = (correct, s)
      recs += _records(bench, correct, s)
    res = report.compute_results(recs, evaluate.results_config(4), run=f"step {step}")
    report.write_results(res, str(tmp_path / "eval" / f"step_{step:06d}"))
  c = common.shrink(common.get_base_config())
  c.model.hf_path = "Qwen/Qwen2.5-Math-1.5B"  # a hub id: the card links it as base_model
  c.train.num_steps = 8
  spec = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True)
  run_record.record(spec.raw, str(tmp_path), resuming=False)
  return tmp_path, spec, evals


def test_card_holds_the_run_and_the_latest_evaluation(workdir):
  path, spec, evals = workdir
  prompt = prompts.PromptFormat(template="Q: {question}", enable_thinking="off")
  card = model_card.model_card(spec, str(path), 6, prompt)
  front = yaml.safe_load(card.split("---\n")[1])
  assert front["base_model"] == "Qwen/Qwen2.5-Math-1.5B"
  assert front["library_name"] == "transformers" and "capo" in front["tags"]
  recorded = json.loads((path / "config.json").read_text())["config"]
  digest = hashlib.sha256(
    json.dumps(recorded, sort_keys=True, separators=(",", ":")).encode()
  ).hexdigest()
  assert f"sha256 `{digest}`" in card
  assert "| steps | 6 of 8 RL steps" in card and "algo.name=capo" in card
  assert "- user: `Q: {question}`" in card and '{"enable_thinking": false}' in card
  latest, base = _tables(card)  # step 4 (the latest at or before 6), then step 0
  assert "At step 4 (`eval/step_000004/results.json`)" in card
  _check_table(latest, report.load_results(str(path / "eval" / "step_000004")))
  _check_table(base, report.load_results(str(path / "eval" / "step_000000")))
  for bench in ("val", "aime24"):  # the recorded numbers are the metrics, by brute force
    correct, s = evals[(4, bench)]
    assert float(latest[bench][2]) == pytest.approx(correct.mean(), abs=5e-5)
    assert float(latest[bench][3]) == pytest.approx(_auc_mean_brute_force(correct, s), abs=5e-5)


def test_card_before_any_later_evaluation_and_without_any(workdir, tmp_path_factory):
  path, spec, _ = workdir
  card = model_card.model_card(spec, str(path), 3, None)
  [only] = _tables(card)  # step 0 is the latest at step 3; no second table
  _check_table(only, report.load_results(str(path / "eval" / "step_000000")))
  assert "## Prompt" not in card
  empty = tmp_path_factory.mktemp("no_eval")
  card = model_card.model_card(spec, str(empty), 3, None)
  assert not _tables(card) and "No evaluation during training reached this step" in card
  files = model_card.export_files(spec, str(empty), 3, rl_driver.HashGrader())  # no prompt
  assert set(files) == {"README.md"}


@pytest.mark.slow  # a 2-step run with evaluations and two exports (~1-2 min on 2 cores)
def test_every_export_of_a_run_carries_its_card_and_prompt(tmp_path):
  assets = rl_driver.write_assets(tmp_path)
  c = rl_driver.tiny_config(assets["tok"], assets["data"], 2)
  c.data.eval = ()  # the validation split only
  c.eval.every_steps, c.checkpoint.export_hf_every = 1, 1
  c.prompt.template = "Question: {question}"
  workdir = tmp_path / "run"
  rl_driver.train(c, str(workdir), grader=rl_driver.HashGrader())
  for export, step in ((workdir / "exports" / "step_000001", 1), (workdir / "export_hf", 2)):
    card = (export / "README.md").read_text()
    latest, base = _tables(card)
    _check_table(latest, report.load_results(str(workdir / "eval" / f"step_{step:06d}")))
    _check_table(base, report.load_results(str(workdir / "eval" / "step_000000")))
    assert f"| steps | {step} of 2 RL steps" in card
    prompt = json.loads((export / "prompt.json").read_text())
    assert prompts.PromptFormat.from_json(prompt) == prompts.PromptFormat(
      template="Question: {question}"
    )
    assert (export / "config.json").is_file()
