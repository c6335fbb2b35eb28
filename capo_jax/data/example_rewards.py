"""Example reward plug-ins for ``reward.fns`` (docs/rewards.md).

A reward function takes one question's completions and their examples (the same
example repeated, one per completion) and returns one float per completion. It runs
in the plug-in workers (``capo_jax.data.reward_fns``): plain Python over strings.

    --config.reward.fns='("correct", "capo_jax.data.example_rewards:boxed_format")' \
    --config.reward.weights='(1.0, 0.1)'
"""

from __future__ import annotations

from collections.abc import Sequence

from capo_jax.data.answers import extract_answer
from capo_jax.data.rows import Example

MAX_CHARS = 2000


def boxed_format(completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
  """1.0 when the completion's final answer is a closed, non-empty ``\\boxed{}``, else 0.0."""
  del examples
  out = []
  for c in completions:
    answer, has_box = extract_answer(c)
    out.append(1.0 if has_box and answer else 0.0)
  return out


def length_penalty(completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
  """-(characters / MAX_CHARS), floored at -1: of two equally right answers, the shorter wins."""
  del examples
  return [-min(len(c) / MAX_CHARS, 1.0) for c in completions]
