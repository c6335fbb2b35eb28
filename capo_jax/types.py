"""Shared RL types and the axis legend used in names across capo_jax.

Axis legend (suffixes of array names, e.g. ``adv_QG``, ``logprobs_BC``):
  Q  questions (prompts) in a batch
  G  samples (responses) per question
  B  rows of a batch; in RL batches B = Q * G, grouped by question
  P  prompt length (left-padded)
  C  completion length (right-padded)
  T  full sequence length (P + C)
  V  vocabulary
Model axes (D, N, K, H, F, L, S) are listed at the top of ``models/qwen2.py``.
"""

from __future__ import annotations

from typing import Any

import jax

PyTree = Any
Array = jax.Array
