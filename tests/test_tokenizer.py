"""The tokenizer wrapper on a small offline Qwen2-style byte-level BPE tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

import hf_utils
from capo_jax.data import tokenizer as tk

# The Qwen2.5-Math chain-of-thought prompt (docs/algorithms.md), verbatim.
QWEN_MATH_PROMPT = (
  "<|im_start|>system\nPlease reason step by step, and put your final answer "
  "within \\boxed{}.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
  "<|im_start|>assistant\n"
)
QUESTIONS = ["What is 1 + 2?", "Let x be a real number such that 2x + 3 = 11. Find x.", "Hi"]


@pytest.fixture(scope="module", params=[True, False], ids=["chat_template", "no_template"])
def tok(request, tmp_path_factory) -> tk.HFTokenizer:
  path = hf_utils.make_tokenizer_dir(tmp_path_factory.mktemp("tok"), chat_template=request.param)
  t = tk.HFTokenizer.from_pretrained(path)
  assert t.use_chat_template == request.param
  return t


def test_render_prompt_is_the_spec_prompt(tok):
  for q in QUESTIONS:
    assert tok.render_prompt(q) == QWEN_MATH_PROMPT.replace("{question}", q)


def test_special_ids(tok):
  vocab = tok.hf.get_vocab()
  assert tok.stop_ids == (vocab["<|endoftext|>"], vocab["<|im_end|>"])
  assert tok.pad_id == vocab["<|endoftext|>"]
  assert tok.vocab_size == len(vocab)
  ids = tok.encode(tok.render_prompt("Hi"))
  assert ids[0] == vocab["<|im_start|>"] and ids.count(vocab["<|im_end|>"]) == 2


def test_encode_decode_roundtrip(tok):
  text = "Solve: 2x + 3 = 11, so x = 4 \u2014 caf\u00e9 \u221a2 \\boxed{4}"
  assert tok.decode(tok.encode(text)) == text


def test_encode_prompts_left_pads(tok):
  tokens, mask = tok.encode_prompts(QUESTIONS, max_len=96)
  assert tokens.shape == mask.shape == (3, 96) and tokens.dtype == mask.dtype == np.int32
  for b, q in enumerate(QUESTIONS):
    ids = tok.hf.encode(QWEN_MATH_PROMPT.replace("{question}", q), add_special_tokens=False)
    n = len(ids)
    assert tokens[b, -n:].tolist() == ids
    assert (tokens[b, :-n] == tok.pad_id).all()
    assert mask[b].tolist() == [0] * (96 - n) + [1] * n


def test_encode_prompts_width_rules_and_truncation(tok):
  lengths = [len(tok.encode(tok.render_prompt(q))) for q in QUESTIONS]
  longest = max(lengths)
  tokens, mask = tok.encode_prompts(QUESTIONS)
  assert tokens.shape[1] == longest and mask.sum(1).tolist() == lengths
  tokens, _ = tok.encode_prompts(QUESTIONS, pad_to_multiple=16)
  assert tokens.shape[1] == -(-longest // 16) * 16
  tokens, _ = tok.encode_prompts(QUESTIONS, max_len=longest + 3, pad_to_multiple=64)
  assert tokens.shape[1] == longest + 3
  with pytest.raises(ValueError, match=rf"prompt 1 has {longest} tokens, more than max_len=20"):
    tok.encode_prompts(QUESTIONS, max_len=20)
  tokens, mask = tok.encode_prompts(QUESTIONS, max_len=20, truncate=True)
  full = tok.encode(tok.render_prompt(QUESTIONS[1]))
  assert tokens[1].tolist() == full[-20:] and mask[1].all()


def test_decode_completions_cut_at_stop_tokens(tok):
  eos, im_end = tok.stop_ids
  answer = "The answer is \\boxed{3}."
  ids = tok.encode(answer)
  junk = tok.encode(" never shown")
  rows = [ids + [im_end] + junk, ids + [eos] + junk, ids + junk]
  width = max(map(len, rows)) + 2
  tokens = np.full((3, width), tok.pad_id, np.int32)
  mask = np.zeros((3, width), np.int32)
  for b, r in enumerate(rows):
    tokens[b, : len(r)] = r
    mask[b, : len(r)] = 1
  texts = tok.decode_completions(tokens, mask)
  assert texts == [answer, answer, answer + " never shown"]
  assert tok.completion_length(rows[0]) == len(ids) + 1
  assert tok.completion_length(rows[2]) == len(rows[2])


def test_left_pad_matches_a_loop():
  rng = np.random.default_rng(0)
  rows = [list(rng.integers(1, 50, n)) for n in (5, 0, 3, 7)]
  tokens, mask = tk.left_pad(rows, pad_id=0, max_len=9)
  for b, r in enumerate(rows):
    expect = [0] * (9 - len(r)) + list(r)
    assert tokens[b].tolist() == expect
    assert mask[b].tolist() == [0] * (9 - len(r)) + [1] * len(r)
  with pytest.raises(ValueError, match="pad_to_multiple=0"):
    tk.left_pad(rows, 0, pad_to_multiple=0)


def test_protocol_and_offline_errors(tok, tmp_path):
  assert isinstance(tok, tk.Tokenizer)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    tk.load_tokenizer(tmp_path / "absent")
  if not tok.use_chat_template:
    with pytest.raises(ValueError, match="no chat template"):
      tk.HFTokenizer(tok.hf, prompt=tk.PromptFormat(chat_template="on"))
