"""Shared types and the axis legend of array names in capo_jax.

Axis legend of the RL code (suffixes of array names, e.g. ``adv_QG``,
``logp_BC``); each letter names one axis:
  Q  questions (prompts) in a batch
  G  samples (responses) per question
  B  rows of a batch; in RL batches B = Q * G, grouped by question
  P  prompt length (left-padded)
  C  completion length (right-padded)
  T  full sequence length (P + C)
  V  vocabulary
  M  micro-batches of one update (gradient accumulation)
The model's axes (heads, kv heads, head dim, layers, cache slots, ...) are
listed at the top of ``models/qwen2.py``.
"""

from __future__ import annotations

from typing import Any

import jax

PyTree = Any
Array = jax.Array
# A policy's parameters: the nested dict of arrays ``models.qwen2`` builds.
Params = dict[str, Any]
