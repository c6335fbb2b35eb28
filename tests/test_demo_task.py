"""The CPU demo's synthetic task, char tokenizer and warm start (SFT + cache)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capo_jax.data import rewards
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.demo import policy_eval, task, warm_start
from capo_jax.demo.char_tokenizer import CharTokenizer
from capo_jax.eval import evaluate
from models import qwen2

_MIXED = task.TaskConfig(min_operands=2, max_operands=6, num_train=3000, num_heldout=500, seed=3)


def _num_ops(expr: str) -> int:
  """Binary operators in an expression; a leading minus is a sign, not an operator."""
  return len(re.findall(r"[+\-*]", expr[1:] if expr.startswith("-") else expr))


# --- task --------------------------------------------------------------------


def test_hand_computed_solutions():
  ex = task.make_example([3, 4, 2, 5], ["+", "*", "-"], "a")
  assert ex.problem == "3+4*2-5="
  assert ex.answer == "6"
  assert ex.meta["solution"] == "3+8-5\n11-5\n6\n\\boxed{6}"
  ex = task.make_example([2, 9, 3, 1], ["-", "*", "+"], "b")
  assert ex.meta["solution"] == "2-27+1\n-25+1\n-24\n\\boxed{-24}"
  ex = task.make_example([2, 3, 4], ["*", "*"], "c")
  assert ex.meta["solution"] == "6*4\n24\n\\boxed{24}"


def test_chain_of_thought_steps_against_python_eval():
  train, heldout = task.make_splits(_MIXED)
  for ex in train[:1500] + heldout:
    question = ex.problem
    assert question.endswith("=")
    value = eval(question[:-1])  # noqa: S307 -- our own digits-and-operators strings
    assert ex.answer == str(value)
    *lines, boxed = ex.meta["solution"].split("\n")
    assert boxed == f"\\boxed{{{value}}}"
    prev = question[:-1]
    for line in lines:
      assert re.fullmatch(r"-?\d+([+\-*]\d+)*", line), line
      assert eval(line) == value, (question, line)  # noqa: S307
      # Exactly one binary operation reduced per line.
      assert _num_ops(line) == _num_ops(prev) - 1, (prev, line)
      prev = line
    assert lines[-1] == str(value)
    assert ex.meta["num_steps"] == len(ex.meta["operands"]) - 1 == len(lines)


def test_reduction_follows_precedence_order():
  # Multiplications go first (leftmost first), then + and - left to right: after
  # every line, the untouched suffix of the expression is the question's suffix.
  ex = task.make_example([1, 2, 3, 4, 5], ["-", "*", "+", "*"], "x")
  assert ex.meta["solution"].split("\n")[:-1] == ["1-6+4*5", "1-6+20", "-5+20", "15"]


def test_gold_solutions_are_correct_under_the_project_reward():
  _, heldout = task.make_splits(_MIXED)
  for ex in heldout[:200]:
    assert rewards.is_correct(ex.meta["solution"], ex.answer)
    assert not rewards.is_correct(ex.meta["solution"], str(int(ex.answer) + 1))


def test_splits_disjoint_distinct_and_deterministic():
  train, heldout = task.make_splits(_MIXED)
  q_train = [e.problem for e in train]
  q_held = [e.problem for e in heldout]
  assert len(set(q_train)) == len(q_train) == _MIXED.num_train
  assert len(set(q_held)) == len(q_held) == _MIXED.num_heldout
  assert not set(q_train) & set(q_held)
  again_train, again_held = task.make_splits(_MIXED)
  assert [e.problem for e in again_train] == q_train
  assert [e.problem for e in again_held] == q_held
  # The held-out split does not move when the training split grows.
  _, held_big = task.make_splits(dataclasses.replace(_MIXED, num_train=6000))
  assert [e.problem for e in held_big] == q_held
  _, held_other = task.make_splits(dataclasses.replace(_MIXED, seed=4))
  assert [e.problem for e in held_other] != q_held
  counts = {len(e.meta["operands"]) for e in train}
  assert counts == set(range(2, 7))


def test_task_config_validation():
  with pytest.raises(ValueError, match="operators"):
    task.TaskConfig(operators="+/")
  with pytest.raises(ValueError, match="min_operands"):
    task.TaskConfig(min_operands=1)
  with pytest.raises(ValueError, match="distinct"):
    task.TaskConfig(min_operands=2, max_operands=2, max_operand=2, num_train=20)
  small = task.TaskConfig(
    min_operands=2, max_operands=3, max_operand=2, operators="+", num_train=12, num_heldout=6
  )
  assert small.num_distinct_questions() == 3**2 + 3**3
  train, heldout = task.make_splits(small)
  assert len({e.problem for e in train + heldout}) == 18


# --- tokenizer ---------------------------------------------------------------


def test_char_tokenizer_round_trip_and_pieces():
  tok = CharTokenizer()
  train, _ = task.make_splits(_MIXED)
  for ex in train[:300]:
    for text in (ex.problem, ex.meta["solution"]):
      ids = tok.encode(text)
      assert tok.decode(ids) == text
  ids = tok.encode("\\boxed{-3}")
  assert len(ids) == 4  # "\boxed{" is one piece
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == "\\boxed{-3}"
  assert tok.decode([tok.eos_id], skip_special=False) == "<eos>"
  assert tok.stop_ids == (tok.eos_id,)
  assert len({tok.pad_id, tok.eos_id, tok.bos_id}) == 3
  with pytest.raises(ValueError, match=r"'x' at position 2"):
    tok.encode("1+x")
  with pytest.raises(ValueError, match="outside"):
    tok.decode([tok.vocab_size])


def test_encode_prompts_left_pads():
  tok = CharTokenizer()
  tokens, mask = tok.encode_prompts(["1+2=", "3*45-6="], max_len=9)
  assert tokens.dtype == np.int32 and mask.dtype == np.int32
  ids = lambda s: [tok.bos_id] + [tok.pieces.index(c) for c in s]
  p = tok.pad_id
  np.testing.assert_array_equal(tokens[0], [p] * 4 + ids("1+2="))
  np.testing.assert_array_equal(tokens[1], [p] * 1 + ids("3*45-6="))
  np.testing.assert_array_equal(mask, [[0] * 4 + [1] * 5, [0] + [1] * 8])
  tokens, _ = tok.encode_prompts(["1+2=", "3*45-6="])
  assert tokens.shape == (2, 8)
  with pytest.raises(ValueError, match="max_len=4"):
    tok.encode_prompts(["3*45-6="], max_len=4)
  assert isinstance(tok, Tokenizer)


def test_decode_completions_cuts_at_stop():
  tok = CharTokenizer()
  e = tok.eos_id
  rows = np.array(
    [tok.encode("12\n") + [e] + tok.encode("34"), tok.encode("\\boxed{7}") + [tok.pad_id] * 3]
  )
  assert tok.decode_completions(rows) == ["12\n", "\\boxed{7}"]


# --- warm start --------------------------------------------------------------

_REF_LEN = 64


@functools.partial(jax.jit, static_argnums=1)
def _ref_logp_TV(params, cfg, seq_1T):
  return jax.nn.log_softmax(qwen2.forward(params, cfg, seq_1T, jnp.ones_like(seq_1T))[0], -1)


def _reference_logps(params, cfg, prompt: list[int], ids: list[int]) -> list[float]:
  """log pi(ids | prompt) of one row with no left padding.

  The row is right-padded to a fixed length (causal attention: later tokens
  cannot change earlier logits), so one compilation serves every row.
  """
  seq = prompt + ids
  logp = np.asarray(_ref_logp_TV(params, cfg, jnp.asarray([seq + [0] * (_REF_LEN - len(seq))])))
  return [float(logp[len(prompt) + j - 1, t]) for j, t in enumerate(ids)]


@pytest.mark.slow  # 15-27 s on 2 cores; .ci/run runs it
def test_sft_loss_matches_per_row_reference():
  tok = CharTokenizer()
  cfg = warm_start.default_model_config(
    tok, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1
  )
  params = qwen2.init_params(cfg, jax.random.key(1))
  train, _ = task.make_splits(_MIXED)
  batch = train[:4]
  tokens, mask, loss_mask = warm_start.encode_sft(tok, batch)
  got = float(warm_start.sft_loss(params, cfg, tokens, mask, loss_mask))
  # Reference: each row unpadded, its own forward, NLL summed over the solution + EOS.
  logps = []
  for ex in batch:
    target = tok.encode(ex.meta["solution"]) + [tok.eos_id]
    logps += _reference_logps(params, cfg, tok.encode_prompt(ex.problem), target)
  assert len({len(ex.meta["solution"]) for ex in batch}) > 1  # rows of unequal length
  np.testing.assert_allclose(got, -np.mean(logps), rtol=1e-5)


def test_bad_warm_start_settings_raise(tmp_path):
  with pytest.raises(ValueError, match="target_low"):
    warm_start.SFTConfig(target_low=0.6, target_high=0.5)
  with pytest.raises(ValueError, match="batch_size"):
    warm_start.SFTConfig(batch_size=0)
  wrong_vocab = warm_start.default_model_config(CharTokenizer(), vocab_size=32)
  with pytest.raises(ValueError, match="vocab_size=32"):
    warm_start.get_or_train(str(tmp_path), model_cfg=wrong_vocab)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("demo"))
  task_cfg = task.TaskConfig(num_train=600, num_heldout=40)
  tok = CharTokenizer()
  model_cfg = warm_start.default_model_config(
    tok, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1
  )
  sft_cfg = warm_start.SFTConfig(
    max_steps=20,
    batch_size=16,
    lr=1e-2,
    warmup_steps=1,
    eval_every=20,
    eval_questions=8,
    eval_samples=2,
    early_stop=False,
  )
  first = warm_start.get_or_train(workdir, task_cfg, model_cfg, sft_cfg, progress=False)
  second = warm_start.get_or_train(workdir, task_cfg, model_cfg, sft_cfg, progress=False)
  return first, second, task_cfg


@pytest.mark.slow  # 15-27 s on 2 cores; .ci/run runs it
def test_sft_decreases_loss_and_cache_is_reused(tiny_run):
  first, second, _ = tiny_run
  assert first.info["trained"] and first.info["steps"] == 20
  assert first.info["final_loss"] < 0.85 * first.info["first_loss"]
  assert not second.info["trained"]
  assert second.info["path"] == first.info["path"]
  assert second.cfg == first.cfg
  jax.tree.map(np.testing.assert_array_equal, first.params, second.params)
  assert second.info["history"] == first.info["history"]


def test_evaluate_policy_scores_match_reference(tiny_run):
  first, _, task_cfg = tiny_run
  _, heldout = task.make_splits(task_cfg)
  # 16 questions in batches of 8 x 2 samples: the shapes of the SFT run's
  # validation evals, so the sampler is not compiled again.
  examples = heldout[:16]
  budget = first.info["max_new_tokens"]
  policy = evaluate.EvalPolicy(first.params, first.cfg, first.tokenizer)
  sampling = policy_eval.DemoSampling(num_samples=2, max_new_tokens=budget, batch_questions=8)
  ev = policy_eval.evaluate_policy(policy, examples, sampling, rng=jax.random.key(0))
  assert ev["s"].shape == ev["correct"].shape == ev["lengths"].shape == (16, 2)
  tok = first.tokenizer
  checked = 0
  for q, ex in enumerate(examples):
    for g in range(2):
      text = ev["completions"][q * 2 + g]
      assert ev["correct"][q, g] == rewards.is_correct(text, ex.answer)
      # s = mean log-prob of the completion tokens, EOS included, by a plain forward.
      # A row shorter than the budget ended with EOS; a special token mid-row is
      # missing from the text, so such rows cannot be rebuilt and are skipped.
      ids = tok.encode(text) + [tok.eos_id]
      if ev["lengths"][q, g] >= budget or len(ids) != ev["lengths"][q, g]:
        continue
      checked += 1
      ref = _reference_logps(first.params, first.cfg, tok.encode_prompt(ex.problem), ids)
      np.testing.assert_allclose(ev["s"][q, g], np.mean(ref), rtol=1e-4, atol=1e-5)
  assert checked >= 8
  assert ev["accuracy"] == pytest.approx(ev["correct"].mean())


def test_sft_loss_of_the_trimmed_last_layer_equals_the_full_one():
  """``trim_last_layer`` with as many slots as the most loss tokens a row: the loss and its
  gradient of the full forward (``qwen2.forward`` over every column)."""
  tok = CharTokenizer()
  cfg = warm_start.default_model_config(
    tok,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    layer_unroll=2,
    trim_last_layer=True,
  )
  params = qwen2.init_params(cfg, jax.random.key(3))
  train, _ = task.make_splits(_MIXED)
  tokens, mask, loss_mask = warm_start.encode_sft(tok, train[:6])
  slots = int(loss_mask.sum(1).max())
  assert slots < tokens.shape[1] - 1  # fewer slots than columns
  full = cfg.replace(trim_last_layer=False, layer_unroll=1)
  grad = jax.jit(jax.value_and_grad(warm_start.sft_loss), static_argnums=(1, 5))
  want, g_want = grad(params, full, tokens, mask, loss_mask, 0)
  got, g_got = grad(params, cfg, tokens, mask, loss_mask, slots)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_want), jax.tree.leaves(g_got)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * np.abs(a).max())
