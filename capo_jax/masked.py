"""Masked means: the one definition the RL code and the evaluator share.

``masked_mean`` serves the losses, the advantages and the confidence score
``s = mean_logprob`` of a completion (the trainer's and the evaluator's alike),
so this module sits below ``capo_jax.rl`` and ``capo_jax.eval``.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

# NumPy in, NumPy out; jax in, jax out.
Array = TypeVar("Array", jax.Array, np.ndarray)


def masked_mean(x: Array, mask: Array, axis: int | None = None) -> Array:
  """Mean of ``x`` over the entries where ``mask > 0`` (along ``axis``; None: all).

  0 where nothing is selected; entries outside the mask never enter the
  arithmetic, so inf / NaN there (padding) do not leak. NumPy in, NumPy out
  (host arrays stay on the host); otherwise jax.numpy (traceable).
  """
  xp = np if isinstance(x, np.ndarray) and isinstance(mask, np.ndarray) else jnp
  m = mask > 0
  return xp.where(m, x, 0).sum(axis) / xp.maximum(m.sum(axis), 1)


def mean_logprob(logp_BC: Array, mask_BC: Array) -> Array:
  """The confidence score s of each completion: its mean token log-prob (= -log PPL).

  ``s = (1/|o|) sum_t log pi(o_t | q, o_<t)`` over the completion's tokens,
  the stop token included (``docs/algorithms.md``, "Advantages").
  """
  return masked_mean(logp_BC, mask_BC, axis=-1)
