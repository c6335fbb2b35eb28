"""Shared types and the one axis legend of array names.

Array names end in the letters of their axes (``adv_QG``, ``logp_BC``,
``k_LBSKH``), and einsum strings use the same letters in lower case. Each
letter names one axis, everywhere (capo_jax and models); ``models/decoder.py``
repeats the model's letters.

The model (``models``):
  B  batch rows
  T  query length: the tokens of one call (RL: the full sequence, P + C)
  S  key / value length: the columns of a KV cache (prompt + completion)
  D  model width (hidden size)
  N  query heads
  K  kv heads
  R  query heads per kv head (N = K * R)
  H  head dim (h: H / 2, RoPE's half)
  F  MLP width
  V  vocabulary
  L  layers
RL batches (``capo_jax.rl``, ``capo_jax.data``):
  Q  questions (prompts): of a batch, or drawn so far (dynamic sampling)
  G  samples (responses) per question
  B  rows of a batch: B = Q * G, grouped by question
  P  prompt length (left-padded)
  C  completion length (right-padded)
  M  micro-batches of one update (gradient accumulation)
  J  top-k candidate tokens (SimKO's top-K log-probs, ``topk_logp_BCJ``)
  Y  model rows of a train or log-prob batch (``capo_jax.rl.batch``: whole
     sequences laid end to end, packed or one per row, T long)
  Z  target slots of a model row: the row's positions that predict a completion token
Sampling (``capo_jax.sampling``):
  W  cache slots of the rollout engine (the rows decoded at once)
  X  blocks of a blocked axis, which keeps its own letter at the block's
     length: the sampler's vocabulary blocks ``[X, V, B]``, flash attention's
     query blocks ``[X, B, T, ...]``
Evaluation and comparisons (``capo_jax.eval``, ``capo_jax.demo``):
  E  sets of responses (subsets of a question's samples, or rows of a batch of sets)
  U  responses in a set
  A  answer classes of a question
  I  independent training runs (seeds)
  O  bootstrap replicates

Sizes that are not axes of any array name (a LoRA rank, a block's width)
are spelled out.
"""

from __future__ import annotations

import jax
import numpy as np

Array = jax.Array
# Containers the host fills with NumPy arrays and then uploads as they are.
HostOrDeviceArray = np.ndarray | jax.Array
