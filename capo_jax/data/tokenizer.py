"""Tokenizers: a small protocol, and a wrapper over local Hugging Face tokenizers.

The RL loop only needs the ``Tokenizer`` protocol: render a question as a
prompt, left-pad a batch of prompts to int32 arrays, and decode right-padded
completions up to the first stop token. ``HFTokenizer`` implements it for a
Qwen2.5(-Math) tokenizer directory (never the hub); the demo's character
tokenizer implements it too.

    tok = HFTokenizer.from_pretrained("/ckpt/Qwen2.5-Math-1.5B")
    tokens_BP, mask_BP = tok.encode_prompts(questions, max_len=512)
    texts = tok.decode_completions(completions_BC)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

# The paper's prompt is the default; config.prompt changes it (capo_jax/data/prompts.py).
from capo_jax.data.prompts import PROMPT_FORMAT, SYSTEM_PROMPT, PromptFormat  # noqa: F401

EOS_TOKEN = "<|endoftext|>"
IM_END_TOKEN = "<|im_end|>"


@runtime_checkable
class Tokenizer(Protocol):
  """What sampling, rewards and evaluation need from a tokenizer."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def stop_ids(self) -> tuple[int, ...]: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

  def render_prompt(self, question: str) -> str: ...

  def encode_prompts(
    self, questions: Sequence[str], max_len: int | None = None
  ) -> tuple[np.ndarray, np.ndarray]: ...

  def decode_completions(
    self, tokens_BC: np.ndarray, mask_BC: np.ndarray | None = None
  ) -> list[str]: ...


def left_pad(
  rows: Sequence[Sequence[int]],
  pad_id: int,
  max_len: int | None = None,
  pad_to_multiple: int | None = None,
  truncate: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
  """Right-aligns token rows into int32 ``(tokens_BP, mask_BP)``; mask 1 on real tokens.

  Width P: ``max_len`` when ``pad_to_multiple`` is None (one shape, one jit
  compile); else the longest row rounded up to ``pad_to_multiple``, capped at
  ``max_len``. A row longer than ``max_len`` raises ``ValueError`` unless
  ``truncate``, which keeps its last ``max_len`` tokens (the prompt loses its
  beginning, e.g. the system message, but keeps the question's end and the
  assistant header the model continues from).
  """
  if pad_to_multiple is not None and pad_to_multiple <= 0:
    raise ValueError(f"pad_to_multiple={pad_to_multiple} must be positive")
  if max_len is not None and max_len <= 0:
    raise ValueError(f"max_len={max_len} must be positive")
  lengths = [len(r) for r in rows]
  longest = max(lengths, default=0)
  if max_len is not None and longest > max_len:
    if not truncate:
      i = int(np.argmax(lengths))
      raise ValueError(
        f"prompt {i} has {longest} tokens, more than max_len={max_len} "
        "(raise max_len or pass truncate=True to drop tokens from the left)"
      )
    rows = [r[len(r) - max_len :] if len(r) > max_len else r for r in rows]
    longest = max_len
  if pad_to_multiple is None:
    P = longest if max_len is None else max_len
  else:
    P = -(-longest // pad_to_multiple) * pad_to_multiple
    if max_len is not None:
      P = min(P, max_len)
  tokens = np.full((len(rows), P), pad_id, np.int32)
  mask = np.zeros((len(rows), P), np.int32)
  for b, r in enumerate(rows):
    if len(r):
      tokens[b, P - len(r) :] = np.asarray(r, np.int32)
      mask[b, P - len(r) :] = 1
  return tokens, mask


def completion_length(ids: Sequence[int], stop_ids: Sequence[int]) -> int:
  """Tokens up to and including the first stop token (all of them when none)."""
  stops = set(int(s) for s in stop_ids)
  for i, t in enumerate(ids):
    if int(t) in stops:
      return i + 1
  return len(ids)


def decode_completions(
  tokenizer: PromptCodec, tokens_BC: np.ndarray, mask_BC: np.ndarray | None = None
) -> list[str]:
  """Texts of right-padded completions (real tokens where ``mask_BC`` is 1), each cut
  before its first stop token; shared by every ``Tokenizer`` implementation."""
  tokens_BC = np.asarray(tokens_BC)
  out = []
  for b in range(tokens_BC.shape[0]):
    row = tokens_BC[b] if mask_BC is None else tokens_BC[b][np.asarray(mask_BC[b]) > 0]
    n = completion_length(row, tokenizer.stop_ids)
    if n and int(row[n - 1]) in tokenizer.stop_ids:
      n -= 1
    out.append(tokenizer.decode(row[:n]))
  return out


class PromptCodec:
  """What every ``Tokenizer`` derives from ``encode_prompt`` / ``encode`` / ``decode``:
  batched left-padded prompts, completion lengths and completion texts."""

  @property
  def stop_ids(self) -> tuple[int, ...]:
    raise NotImplementedError

  @property
  def pad_id(self) -> int:
    raise NotImplementedError

  def encode_prompt(self, question: str) -> list[int]:
    raise NotImplementedError

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    raise NotImplementedError

  def encode_prompts(
    self,
    questions: Sequence[str],
    max_len: int | None = None,
    pad_to_multiple: int | None = None,
    truncate: bool = False,
  ) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded int32 ``(tokens_BP, mask_BP)`` of ``encode_prompt`` of each question.

    Width and overflow as in ``left_pad``: ``P = max_len`` when given (one
    shape, one jit compile), else the longest prompt; a longer prompt raises
    unless ``truncate``.
    """
    rows = [self.encode_prompt(q) for q in questions]
    try:
      return left_pad(rows, self.pad_id, max_len, pad_to_multiple, truncate)
    except ValueError as e:
      raise ValueError(f"encode_prompts: {e}") from e

  def completion_length(self, ids: Sequence[int]) -> int:
    """Tokens up to and including the first stop token (all of them when none)."""
    return completion_length(ids, self.stop_ids)

  def decode_completions(
    self, tokens_BC: np.ndarray, mask_BC: np.ndarray | None = None
  ) -> list[str]:
    """Texts of right-padded completions, cut before the first stop token."""
    return decode_completions(self, tokens_BC, mask_BC)


class HFTokenizer(PromptCodec):
  """A local Hugging Face tokenizer behind the ``Tokenizer`` protocol.

  ``stop_ids``: ``<|endoftext|>`` and ``<|im_end|>`` (those in the vocabulary)
  plus the tokenizer's eos token. ``pad_id``: its pad token, else
  ``<|endoftext|>``. ``vocab_size`` counts the tokenizer's tokens, added ones
  included; a model's embedding may be larger (Qwen2.5 pads it to 151936).
  """

  def __init__(
    self, hf_tokenizer: Any, prompt: PromptFormat = PromptFormat(), name: str = "tokenizer"
  ) -> None:
    self.hf = hf_tokenizer
    self.prompt = prompt
    self.use_chat_template = prompt.uses_template(hf_tokenizer, name)  # raises when it can't
    vocab = hf_tokenizer.get_vocab()
    stops = [vocab[t] for t in (EOS_TOKEN, IM_END_TOKEN) if t in vocab]
    if hf_tokenizer.eos_token_id is not None:
      stops.append(int(hf_tokenizer.eos_token_id))
    if not stops:
      raise ValueError(
        f"{name}: no stop token: neither {EOS_TOKEN!r}, {IM_END_TOKEN!r} nor an "
        "eos_token is defined"
      )
    self._stop_ids = tuple(dict.fromkeys(stops))
    pad = hf_tokenizer.pad_token_id
    self._pad_id = int(pad) if pad is not None else vocab.get(EOS_TOKEN, self._stop_ids[0])
    self._vocab_size = len(hf_tokenizer)

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, **kw: Any) -> HFTokenizer:
    """Loads ``AutoTokenizer`` from a local directory (``local_files_only``: no hub)."""
    import transformers  # pylint: disable=g-import-not-at-top  (heavy; only HF users pay)

    from capo_jax.runtime import model_files  # pylint: disable=import-outside-toplevel

    path = os.fspath(path)
    if not os.path.isdir(path):
      raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    # transformers' own error for a directory without tokenizer files asks for
    # sentencepiece or tiktoken; name the directory and the files instead.
    model_files.check_tokenizer_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return cls(hf, name=path, **kw)

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self._stop_ids

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``; special-token strings in it map to their ids, no BOS added."""
    return list(self.hf.encode(text, add_special_tokens=False))

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return self.hf.decode([int(t) for t in ids], skip_special_tokens=skip_special)

  def render_prompt(self, question: str) -> str:
    """The chat prompt of ``self.prompt`` (the paper's by default), through the chat
    template when ``use_chat_template``."""
    if self.use_chat_template:
      return self.hf.apply_chat_template(
        self.prompt.messages(question),
        tokenize=False,
        add_generation_prompt=True,
        **self.prompt.template_kwargs(),
      )
    return self.prompt.render_plain(question)

  def encode_prompt(self, question: str) -> list[int]:
    return self.encode(self.render_prompt(question))


def load_tokenizer(path: str | os.PathLike, **kw: Any) -> HFTokenizer:
  """``HFTokenizer.from_pretrained`` of a HF model directory, local or ``gs://``
  (copied to the local cache first: HF tokenizers read local files), or of a
  hub id ("Qwen/Qwen2.5-Math-1.5B", fetched by ``fs.model_dir``)."""
  from capo_jax.runtime import fs  # pylint: disable=import-outside-toplevel

  return HFTokenizer.from_pretrained(fs.model_dir(path), **kw)
