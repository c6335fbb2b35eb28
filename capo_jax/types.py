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
  J  top-k candidate tokens (SimKO's top-K log-probs, ``topk_logp_BCJ``)
Confidence-based scaling (``capo_jax.eval.scaling``) adds E sets of responses,
U responses in a set and A answer classes. The model's axes (D, F, H, K kv
heads, N query heads, R query heads per kv head, L layers, S cache slots) are
listed at the top of ``models/qwen2.py``; no letter means two axes.
"""

from __future__ import annotations

from typing import Any

import jax

from models.qwen2 import Params  # noqa: F401  (re-exported: the one definition, the model's tree)

PyTree = Any
Array = jax.Array
