"""The train step's batch: model rows, and the loss's per-sequence arrays, in micro-batches.

One update's sequences reach the model as rows of ``T`` tokens (``ModelRows``):
each row holds one or more whole sequences (prompt ++ completion) with

  segment_ids_YT  1, 2, ... per sequence within a row, 0 on the row's padding:
                  attention stays within a sequence (``models.attention``);
  positions_YT    RoPE positions restarting at 0 for each sequence;
  target_col_YZ   each row's Z target slots: the columns of the row that predict
                  a completion token, ``targets_YZ`` those tokens (padding slots
                  masked by ``target_mask_YZ``): only they are unembedded.
                  Targets stay with their row, so whatever shards the rows
                  shards the hidden states gathered at them and their logits.

Packing (``capo_jax.rl.packing``) decides how many sequences share a row; one
sequence per row is the unpacked batch. The loss runs on the sequences as they
were (``Sequences``, [B, C]): ``unpack`` gathers each completion token's
value from its slot, so every aggregation's denominators are the sequences'
and tokens', never the rows'.

A target slot is addressed flat, ``row * Z + slot`` (``index_BC``).

``TrainBatch`` stacks M micro-batches: rows [M, Y, T], targets [M, Y, Z] and each
micro-batch's own sequences [M, B, ...] (empty slots all-zero, weighing nothing).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from capo_jax.types import Array, HostOrDeviceArray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelRows:
  """What the model sees: rows [Y, T] and Z target slots a row (see module doc).

  ``topk_ids_YZJ``: ids whose log-probs to return at each target (SimKO: the old
  policy's top-K of the token predicted there), or None.
  """

  tokens_YT: HostOrDeviceArray
  segment_ids_YT: HostOrDeviceArray
  positions_YT: HostOrDeviceArray
  target_col_YZ: HostOrDeviceArray
  targets_YZ: HostOrDeviceArray
  target_mask_YZ: HostOrDeviceArray
  topk_ids_YZJ: HostOrDeviceArray | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sequences:
  """The loss's per-sequence inputs [B, ...] (B = Q * G rows, grouped by question).

  Optional fields may be None: ref_logp_BC (needed when LossConfig.beta > 0; the
  KL is logged whenever it is given); correct_B, old_topk_ids_BCJ and
  old_topk_logp_BCJ (SimKO: the old policy's top-K ids at each position and
  their old log-probs; the current policy's log-probs of those ids give the
  ratios rho(v_k)); is_weight_BC (the sampler / trainer mismatch correction's
  detached per-token weight, ``capo_jax.rl.mismatch``; None: 1).
  """

  completion_mask_BC: Array
  old_logp_BC: Array
  adv_B: Array
  ref_logp_BC: Array | None = None
  correct_B: Array | None = None
  old_topk_ids_BCJ: Array | None = None
  old_topk_logp_BCJ: Array | None = None
  is_weight_BC: Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
  """One optimizer update: M micro-batches of model rows and their sequences.

  rows: ``ModelRows`` [M, Y, T] / [M, Y, Z];
  index_MBC: per micro-batch, each completion token's flat slot among its Y * Z targets;
  seqs: ``Sequences`` [M, B, ...] of each micro-batch's sequences.
  """

  rows: ModelRows
  index_MBC: HostOrDeviceArray
  seqs: Sequences


def unpack(x_YZ: Array, index_BC: Array, mask_BC: Array) -> Array:
  """Per-slot values [Y, Z, ...] -> [B, C, ...], 0 on completion padding (exact: a gather)."""
  xp = np if isinstance(x_YZ, np.ndarray) else jnp
  out = x_YZ.reshape((-1,) + x_YZ.shape[2:])[index_BC]
  m = (mask_BC > 0).reshape(mask_BC.shape + (1,) * (out.ndim - 2))
  return xp.where(m, out, xp.zeros((), out.dtype))
