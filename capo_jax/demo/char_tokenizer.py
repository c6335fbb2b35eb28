"""A character-level tokenizer for the synthetic arithmetic task.

Every character of the task is one token, except ``\\boxed{`` which is one
piece: it is pure boilerplate, and as seven tokens it would dilute the mean
token log-prob (the confidence score) with near-certain tokens. Special
tokens: ``<pad>`` (0), ``<eos>`` (the stop token) and ``<bos>`` (put before
every prompt so the first real character has a context). The prompt is the
question itself (no chat template).
"""

from __future__ import annotations

from collections.abc import Sequence

from capo_jax.data.tokenizer import PromptCodec

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
BOXED = "\\boxed{"
PIECES: tuple[str, ...] = (PAD, EOS, BOS, *"0123456789", "+", "-", "*", "=", "\n", BOXED, "}")


class CharTokenizer(PromptCodec):
  """Implements ``capo_jax.data.tokenizer.Tokenizer`` over ``PIECES``."""

  def __init__(self, pieces: Sequence[str] = PIECES) -> None:
    if len(set(pieces)) != len(pieces):
      raise ValueError(f"CharTokenizer: duplicate pieces in {pieces!r}")
    for special in (PAD, EOS, BOS):
      if special not in pieces:
        raise ValueError(f"CharTokenizer: missing special piece {special!r}")
    self.pieces = tuple(pieces)
    self._ids = {p: i for i, p in enumerate(self.pieces)}
    self._special_ids = frozenset(self._ids[p] for p in (PAD, EOS, BOS))
    # Longest match first, so "\boxed{" wins over any one-character prefix.
    self._text_pieces = sorted(
      (p for p in self.pieces if p not in (PAD, EOS, BOS)), key=len, reverse=True
    )

  @property
  def vocab_size(self) -> int:
    return len(self.pieces)

  @property
  def pad_id(self) -> int:
    return self._ids[PAD]

  @property
  def eos_id(self) -> int:
    return self._ids[EOS]

  @property
  def bos_id(self) -> int:
    return self._ids[BOS]

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``; raises on a character outside the vocabulary."""
    ids, i = [], 0
    while i < len(text):
      for piece in self._text_pieces:
        if text.startswith(piece, i):
          ids.append(self._ids[piece])
          i += len(piece)
          break
      else:
        raise ValueError(
          f"CharTokenizer.encode: character {text[i]!r} at position {i} of "
          f"{text!r} is not in the vocabulary"
        )
    return ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    """Text of ``ids``; special tokens are dropped unless ``skip_special`` is False."""
    out = []
    for t in ids:
      t = int(t)
      if not 0 <= t < self.vocab_size:
        raise ValueError(f"CharTokenizer.decode: id {t} outside [0, {self.vocab_size})")
      if skip_special and t in self._special_ids:
        continue
      out.append(self.pieces[t])
    return "".join(out)

  def render_prompt(self, question: str) -> str:
    """The demo's prompt is the question itself."""
    return question

  def encode_prompt(self, question: str) -> list[int]:
    return [self.bos_id] + self.encode(self.render_prompt(question))
