"""The cued task (capo_jax/demo/cued.py): its sets, its cues, its checker, its run file."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest

from capo_jax.demo import cued, tasks
from capo_jax.demo.char_tokenizer import PIECES

CFG = cued.CuedConfig(num_sft=300, sft_val=40, num_rl=500, num_heldout=120, seed=3)
PROMPT = re.compile(r"(\d(?:[-+*]\d){1,2})=\?(-?\d+)")


def _brute(expr: str) -> tuple[int, int]:
  """(precedence value via Python's own parser, left-to-right value by a loop)."""
  toks = re.findall(r"\d|[-+*]", expr)
  ltr = int(toks[0])
  for op, v in zip(toks[1::2], toks[2::2]):
    ltr = ltr + int(v) if op == "+" else ltr - int(v) if op == "-" else ltr * int(v)
  return eval(expr), ltr  # noqa: S307  (digits and + - * only: the regex above)


def _check_cue(ex) -> None:
  m = PROMPT.fullmatch(ex.problem)
  assert m, ex.problem
  answer, ltr = _brute(m.group(1))
  cue = int(m.group(2))
  assert (ex.answer, ex.meta["cue"], ex.meta["ltr"]) == (str(answer), str(cue), ltr)
  kind = ex.meta["cue_kind"]
  assert ex.meta["trap"] == (kind != "right") == (cue != answer)
  if kind in ("ltr", "near"):  # a decoy: left to right whenever that differs
    assert (kind == "ltr") == (ltr != answer)
    assert cue == ltr if ltr != answer else 1 <= abs(cue - answer) <= 3


def test_rl_and_heldout_cues_follow_the_decoy_rule_and_the_trap_shares():
  rl, heldout = cued.make_splits(CFG)
  assert len(rl) == 500 and len(heldout) == 120
  for ex in rl + heldout:
    _check_cue(ex)
    assert ex.meta["cue_kind"] != "other"
  assert sum(ex.meta["trap"] for ex in rl) == 100  # exactly 20%
  assert sum(ex.meta["trap"] for ex in heldout) == 60  # exactly half
  # Left-to-right decoys appear (a+-b*c only) and every one of them is taken.
  assert any(ex.meta["cue_kind"] == "ltr" for ex in heldout)
  assert cued.make_splits(CFG) == (rl, heldout)  # deterministic in the seed


def test_sft_data_mixes_cues_and_keeps_its_questions_apart():
  sft = cued.sft_examples(CFG)
  val, train = sft[: CFG.sft_val], sft[CFG.sft_val :]
  assert len(train) == CFG.num_sft * CFG.sft_cues
  for ex in sft:
    _check_cue(ex)
    assert ex.meta["solution"] == ex.answer  # the target is always the answer
  kinds = collections.Counter(ex.meta["cue_kind"] for ex in train)
  n = len(train)
  # Right with p 0.25; wrong cues half decoys, half other questions' answers (4 sd).
  assert abs(kinds["right"] / n - 0.25) < 4 * np.sqrt(0.25 * 0.75 / n)
  assert abs((kinds["ltr"] + kinds["near"]) / n - 0.375) < 4 * np.sqrt(0.375 * 0.625 / n)
  answers = {ex.answer for ex in train}
  assert all(ex.meta["cue"] in answers for ex in train if ex.meta["cue_kind"] == "other")
  # A question's cues sit together; validation questions have one cue and appear nowhere else.
  expr = [PROMPT.fullmatch(ex.problem).group(1) for ex in train]
  assert all(len(set(expr[i : i + CFG.sft_cues])) == 1 for i in range(0, n, CFG.sft_cues))
  sets = {
    "val": {PROMPT.fullmatch(ex.problem).group(1) for ex in val},
    "sft": set(expr),
    **{
      k: {PROMPT.fullmatch(e.problem).group(1) for e in v}
      for k, v in zip(("rl", "heldout"), cued.make_splits(CFG))
    },
  }
  assert len(sets["val"]) == CFG.sft_val
  names = list(sets)
  for i, a in enumerate(names):
    for b in names[i + 1 :]:
      assert not sets[a] & sets[b], (a, b)


def test_the_checker_is_an_exact_integer_match():
  assert cued.is_correct("7", "7") is True
  assert cued.is_correct("-12", "-12") is True
  assert cued.is_correct("007", "7") is True  # the same integer
  for wrong in ("8", "-7", " 7", "7\n", "\\boxed{7}", "", "7-", "7=?7", "+7"):
    assert cued.is_correct(wrong, "7") is False, wrong
  assert [cued.answer_of(c) for c in ("-3", "03", "3\n", "")] == ["-3", "3", "", ""]


def test_tokenizer_appends_the_cue_mark_and_keeps_the_other_ids():
  tok = cued.tokenizer()
  assert tok.pieces[: len(PIECES)] == PIECES and tok.vocab_size == len(PIECES) + 1
  ex = cued.make_splits(CFG)[1][0]
  assert tok.decode(tok.encode_prompt(ex.problem)) == ex.problem
  assert tasks.tokenizer(tasks.config_of({"kind": "cued"})).pieces == tok.pieces


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="rl_traps"):
    cued.CuedConfig(rl_traps=1.5)
  with pytest.raises(ValueError, match="distinct expressions"):
    cued.CuedConfig(num_rl=9000)
  with pytest.raises(ValueError, match="demo.task.kind"):
    tasks.config_of({"kind": "cue"})


def test_run_file_names_the_checker_and_fits_the_task():
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel
  from configs import cued as run_file  # pylint: disable=import-outside-toplevel

  for arg in (None, "shrink"):
    c = run_file.get_config(arg)
    assert c.reward.correct == cued.CHECKER
    spec = demo_run.spec_of(c)
    demo = demo_run.Demo.of(spec)
    assert isinstance(demo.task, cued.CuedConfig)
    assert demo.sft.eval_questions == demo.task.sft_val
    rl, heldout = tasks.splits(demo.task)
    tok = tasks.tokenizer(demo.task)
    assert max(len(tok.encode_prompt(e.problem)) for e in rl + heldout) <= c.rollout.max_prompt_len
    assert max(len(tok.encode(e.answer)) + 1 for e in rl + heldout) <= c.rollout.max_new_tokens
  c = run_file.get_config()
  assert (c.optim.lr, c.train.num_steps, c.eval.every_steps) == (5e-4, 150, 25)
  assert (c.rollout.num_prompts, c.rollout.num_samples) == (32, 8)
  c.demo.sft.eval_questions = 64
  with pytest.raises(ValueError, match="sft_val"):
    demo_run.Demo.of(demo_run.spec_of(c))


def test_heldout_evaluation_grades_with_the_examples_checker(monkeypatch):
  from capo_jax.demo import policy_eval  # pylint: disable=import-outside-toplevel
  from capo_jax.eval import evaluate  # pylint: disable=import-outside-toplevel

  seen = {}

  def fake_evaluate(policy, examples, eval_cfg, rng, benchmark, grader):
    seen["grader"] = grader
    raise StopIteration  # the grader is all this test needs

  monkeypatch.setattr(evaluate, "evaluate_policy", fake_evaluate)
  heldout = cued.make_splits(CFG)[1][:2]
  with pytest.raises(StopIteration):
    policy_eval.evaluate_policy(None, heldout, policy_eval.DemoSampling(max_new_tokens=4))
  # The bare-integer checker, not the boxed-answer grader.
  rewards, health = seen["grader"].score(["7", "\\boxed{7}", "8"], ["7", "7", "7"])
  assert list(rewards) == [1.0, 0.0, 0.0] and rewards.dtype == np.float32
  assert (health.total, health.correct) == (3, 1)


def test_in_process_grader_is_the_checker():
  completions = ["7", "-3", "07", " 7", "\\boxed{7}", "", "12"]
  golds = ["7", "-3", "7", "7", "7", "7", "21"]
  grader = cued.Grader()
  rewards, _ = grader.score(completions, golds)
  assert list(rewards) == [float(cued.is_correct(c, g)) for c, g in zip(completions, golds)]
  grader.score(["1"], ["1"])
  assert (grader.cumulative.total, grader.cumulative.correct) == (8, 4)
  with pytest.raises(ValueError, match="gold"):
    grader.score(["1"], [])
  assert isinstance(tasks.grader(cued.make_splits(CFG)[1][:1]), cued.Grader)
  assert tasks.grader([]) is None  # the arithmetic task: the math grader, as before


def test_the_arithmetic_task_reads_as_before_through_tasks():
  from capo_jax.demo import task as task_lib  # pylint: disable=import-outside-toplevel

  cfg = tasks.config_of({"num_train": 300, "num_heldout": 20, "min_operands": 3})
  assert cfg == task_lib.TaskConfig(num_train=300, num_heldout=20, min_operands=3)
  assert tasks.splits(cfg) == task_lib.make_splits(cfg)
  assert tasks.sft_examples(cfg) == task_lib.make_splits(cfg)[0]
  assert tasks.tokenizer(cfg).pieces == PIECES
  ex = tasks.splits(cfg)[1][:2]
  assert not tasks.is_cued(ex) and tasks.is_cued(cued.make_splits(CFG)[1][:1])
  assert tasks.answers(ex, ["x \\boxed{12}", "12"]) == ["12", ""]
