"""A completion's final answer: the last ``\\boxed{...}`` or ``\\fbox{...}``, nested braces kept.

Fallbacks, used only when the completion has no box: the last "final answer is X", "the answer
is X" or "answer: X" (X: the first ``$...$`` after it, else the rest of the sentence) in the
last 2,000 characters. `capo_jax.data.rewards` grades what this finds.
"""

from __future__ import annotations

import re

_FALLBACK_TAIL = 2000

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_BRACE_RE = re.compile(r"\\[{}]|[{}]")
_FALLBACK_RE = re.compile(r"(?:final answer|\banswer)\s*(?:is\b|:)\s*:?", re.IGNORECASE)
_INLINE_MATH_RE = re.compile(r"^[^$\n]{0,20}\$([^$]+)\$")


def _read_group(text: str, start: int) -> str | None:
  """Content of the brace group opening at or after `start`; None if unclosed or absent."""
  i = start
  while i < len(text) and text[i].isspace():
    i += 1
  if i >= len(text):
    return None
  if text[i] != "{":  # `\boxed 5`: one token
    m = re.match(r"[^\s$]+", text[i:])
    return m.group(0) if m else None
  depth = 0
  for m in _BRACE_RE.finditer(text, i):
    tok = m.group(0)
    if tok == "{":
      depth += 1
    elif tok == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1 : m.start()]
  return None


def _fallback_answer(text: str) -> str | None:
  tail = text[-_FALLBACK_TAIL:]
  matches = list(_FALLBACK_RE.finditer(tail))
  if not matches:
    return None
  rest = tail[matches[-1].end() :].replace("**", "")
  m = _INLINE_MATH_RE.match(rest)
  if m:
    return m.group(1).strip()
  line = rest.strip().split("\n", 1)[0]
  line = re.split(r"\.\s|\.$", line, maxsplit=1)[0]
  return line.strip().strip("$").strip() or None


def extract_answer(completion: str) -> tuple[str | None, bool]:
  """Returns (answer, has_box): the last box's content, else a fallback phrase's answer.

  A last box that is never closed (a truncated completion) or empty gives (None, True).
  """
  last = None
  for last in _BOX_RE.finditer(completion):
    pass
  if last is not None:
    content = _read_group(completion, last.end())
    if content is None or not content.strip():
      return None, True
    return content.strip(), True
  return _fallback_answer(completion), False


def extract_boxed(text: str) -> str | None:
  """Content of the last ``\\boxed{}`` / ``\\fbox{}`` (nested braces kept), or None."""
  answer, has_box = extract_answer(text)
  return answer if has_box else None
