"""A step's one upload: what the device programs read of the host's arrays (``Uploader``).

The rollout's arrays live on the host until its groups are chosen (the tokens,
to decode and grade them; the rewards, from the graders). ``Uploader.to_devices``
then places, once a step, everything the device programs read of them: the
updates' model rows, planned once (``microbatches.plan_step``) and sent in one
transfer (``logprob_pass.upload``), which the log-prob passes and the train
batches both read; the groups' rewards and labels, replicated on every device;
the per-row labels (SimKO) and kept rows (``mismatch.MismatchSpec.mask_truncated``)
in the [B] arrays' sharding. Past it nothing of the step crosses to the devices.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from capo_jax.rl import microbatches
from capo_jax.rl.drawing import Graded
from capo_jax.rl.logprob_pass import UpdateRows, upload
from capo_jax.runtime.host import put_global
from capo_jax.types import Array


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """How an update's sequences become a ``TrainBatch`` (the run's packing settings).

  Attributes:
    rows: the micro-batches' rows (``microbatches.RowLayout``).
    sharding: the train batch's sharding ([M, rows or slots, ...] on axis 1).
    prompts: questions per update (the PPO mini-batch).
  """

  rows: microbatches.RowLayout
  sharding: jax.sharding.Sharding
  prompts: int


@dataclasses.dataclass(frozen=True)
class Uploaded:
  """One step's arrays on the devices (``Uploader.to_devices``).

  Attributes:
    updates: each update's micro-batch rows.
    reward_QG: the scalar reward (the labels themselves without reward plug-ins).
    correct_QG: bool, the binary labels.
    labels_QG: the labels as floats where the reward differs from them (plug-ins), else None.
    correct_B: each row's label (SimKO), else None.
    keep_B: the rows that did not hit ``max_new_tokens`` (``mask_truncated``), else None.
  """

  updates: list[UpdateRows]
  reward_QG: Array
  correct_QG: Array
  labels_QG: Array | None = None
  correct_B: Array | None = None
  keep_B: Array | None = None


@dataclasses.dataclass(frozen=True)
class Uploader:
  """The step's packing plan and its host -> device transfers, configured once.

  Attributes:
    batches: the updates' micro-batches (rows, sharding, questions per update).
    per_group: where the [Q, G] arrays go (replicated: small, read whole).
    per_row: where the [B] arrays go (the log-prob pass's index sharding).
    row_labels: upload each row's label (SimKO reads them).
    keep_rows: upload the rows that were not truncated (``mask_truncated``).
  """

  batches: BatchLayout
  per_group: jax.sharding.Sharding
  per_row: jax.sharding.Sharding
  row_labels: bool = False
  keep_rows: bool = False

  def to_devices(self, sel: Graded) -> Uploaded:
    """The chosen groups' rows, planned into the updates' micro-batches, and their rewards,
    labels and row flags, on the devices."""
    G = sel.rewards_QG.shape[1]
    prompt_BP, pmask_BP = sel.prompts_BP()
    plans = microbatches.plan_step(
      prompt_BP, pmask_BP, sel.comp_BC, sel.cmask_BC, self.batches.rows, self.batches.prompts * G
    )
    # The updates' rows first, in one transfer: the passes and the updates read them.
    updates = upload(plans, self.batches.sharding)
    correct_QG = sel.rewards_QG > 0.5
    labels_dev, correct_dev = put_global((sel.rewards_QG, correct_QG), self.per_group)
    reward_dev, labels = labels_dev, None
    if sel.reward_QG is not None:  # plug-ins: reward != labels
      reward_dev, labels = put_global(sel.reward_QG, self.per_group), labels_dev
    correct_B = put_global(correct_QG.reshape(-1), self.per_row) if self.row_labels else None
    kept_B = ~np.asarray(sel.truncated_B, bool)
    keep_B = put_global(kept_B, self.per_row) if self.keep_rows else None
    return Uploaded(updates, reward_dev, correct_dev, labels, correct_B, keep_B)
