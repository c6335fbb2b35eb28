"""Dynamic sampling (DAPO's group filter): train on groups whose rewards differ.

A group whose G samples are all right or all wrong carries no signal for the
group-relative estimators: GRPO's, Dr.GRPO's and CAPO's advantages are exactly
zero there (every pairwise term of CAPO compares a right with a wrong sample,
and there are none). Without the filter such groups still cost a full rollout,
their log-prob passes and their share of the train step.

With ``rollout.dynamic_sampling``, ``Drawer.draw_groups`` samples and grades the
step's Q prompts, and while fewer than Q of all the groups drawn so far are
*mixed*, draws the next Q prompts from the data stream, at most
``rollout.dynamic_max_draws`` batches of Q per step (the bound on extra
prompts: (max_draws - 1) * Q). The step then trains on the first Q mixed
groups in draw order; when the bound is hit first, the earliest degenerate
groups fill the batch (zero advantage; the step keeps its static shape).
Everything drawn is consumed from the stream, so the data position in a
checkpoint covers the extra draws and a resumed run continues exactly.

This module holds the host-side choice; ``drawing.Drawer.draw_groups`` does the drawing.
"""

from __future__ import annotations

import numpy as np


def mixed_groups(rewards_QG: np.ndarray) -> np.ndarray:
  """bool[Q]: the groups with at least one right and one wrong sample."""
  correct_QG = np.asarray(rewards_QG) > 0.5
  # numpy types any(1) as scalar-or-array; with axis=1 of a [Q, G] array it is an array.
  return np.asarray(correct_QG.any(1) & ~correct_QG.all(1))


def select_groups(rewards_QG: np.ndarray, num_groups: int) -> tuple[np.ndarray, int]:
  """The groups a step trains on, out of the Q drawn so far (rows in draw order).

  Returns (idx_Q, num_mixed): ``num_groups`` row indices in increasing order
  (the first ``num_groups`` mixed groups; if there are fewer, all of them plus
  the earliest degenerate ones) and how many of them are mixed.
  """
  n = rewards_QG.shape[0]
  if n < num_groups:
    raise ValueError(
      f"select_groups: {n} groups drawn, fewer than the {num_groups} a step trains on"
    )
  mixed_Q = mixed_groups(rewards_QG)
  chosen = np.flatnonzero(mixed_Q)[:num_groups]
  fill = np.flatnonzero(~mixed_Q)[: num_groups - chosen.size]
  return np.sort(np.concatenate([chosen, fill])).astype(np.int64), int(chosen.size)


def needs_more(rewards_QG: np.ndarray, num_groups: int, draws: int, max_draws: int) -> bool:
  """Whether to draw another batch: fewer than ``num_groups`` mixed and draws left."""
  return draws < max_draws and int(mixed_groups(rewards_QG).sum()) < num_groups
