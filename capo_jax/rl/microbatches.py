"""Micro-batches: an update's packed rows in groups of ``Y`` rows (host NumPy).

``plan_update`` groups an update's rows (``capo_jax.rl.packing.plan``) into micro-batches
of ``Y`` rows, each with its own sequences (B slots, empty ones all-zero); ``plan_step``
plans each of a step's updates so, once: the log-prob passes run over the same rows
(``capo_jax.rl.logprob_pass``). Shapes are bucketed (micro-batches and sequence slots to
powers of two, target slots by ``packing.bucket``) to bound recompiles; the step loops
over the micro-batches that hold tokens only.

Letters: M micro-batches, Y model rows, T row length, Z target slots; B (sequences, a
micro-batch's sequence slots), C, J as in the RL code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from capo_jax.rl import packing
from capo_jax.rl.batch import ModelRows, Sequences, TrainBatch


def pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class MicroBatches:
  """An update's sequences laid into M micro-batches of Y rows (host arrays).

  rows: ``ModelRows`` [M, Y, T] / [M, Y, Z]; index_MBC: each slot's ``index_BC``
  into its micro-batch's flat Y * Z targets; take_MB: the sequence (row of the update's
  [B, ...] arrays) in each slot, -1 where empty; filled: how many micro-batches (the
  first ones) hold tokens.
  """

  rows: ModelRows
  index_MBC: np.ndarray
  take_MB: np.ndarray
  filled: int

  def batch(self, seqs: Sequences) -> TrainBatch:
    """The ``TrainBatch`` of an update's sequences ``seqs`` [B, ...] in this layout."""
    return TrainBatch(rows=self.rows, index_MBC=self.index_MBC, seqs=regroup(seqs, self.take_MB))


def regroup(tree: Any, take_MB: Any) -> Any:
  """[B, ...] leaves -> [M, B, ...]: sequence ``take_MB[m, b]`` in slot (m, b), 0 where -1.

  NumPy or jax arrays (traceable: the trainer runs it on the devices)."""
  xp = np if isinstance(take_MB, np.ndarray) else jnp
  valid_MB = take_MB >= 0
  idx_MB = xp.maximum(take_MB, 0)

  def one(x: Any) -> Any:
    xq = np if isinstance(x, np.ndarray) and xp is np else jnp
    x = x[idx_MB]
    m = valid_MB.reshape(valid_MB.shape + (1,) * (x.ndim - 2))
    return xq.where(m, x, xq.zeros((), x.dtype))

  return jax.tree.map(one, tree)


def scatter_topk(rows: ModelRows, index_MBC: Any, seqs_MB: Sequences) -> ModelRows:
  """The rows' ``topk_ids_YZJ`` [M, Y, Z, J]: each target's old top-K ids (SimKO), from the
  regrouped sequences' ``old_topk_ids_BCJ`` [M, B, C, J]."""
  ids_MBCJ = seqs_MB.old_topk_ids_BCJ
  if ids_MBCJ is None:
    raise ValueError(
      "microbatches.scatter_topk: Sequences.old_topk_ids_BCJ is None (SimKO's old pass)"
    )
  M, Y, Z = rows.targets_YZ.shape
  J = ids_MBCJ.shape[-1]
  xp = np if isinstance(ids_MBCJ, np.ndarray) else jnp
  # Padding columns point past the targets, where the scatter drops them.
  z_MBC = xp.where(seqs_MB.completion_mask_BC > 0, index_MBC, Y * Z)
  m_MBC = xp.broadcast_to(xp.arange(M)[:, None, None], z_MBC.shape)
  topk = (
    jnp.zeros((M, Y * Z, J), jnp.int32)
    .at[m_MBC, z_MBC]
    .set(ids_MBCJ.astype(jnp.int32), mode="drop")
  )
  return dataclasses.replace(rows, topk_ids_YZJ=topk.reshape(M, Y, Z, J))


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """How sequences become model rows: ``row_len`` tokens a row (0: the batch's prompt +
  completion width), ``rows`` rows a micro-batch or a call, several sequences a row
  when ``pack`` (else one)."""

  row_len: int
  rows: int
  pack: bool = True
  share: int = 0  # G: sequences b = q * G + g share prompt q (``plan``'s group_B); 0: none
  prompt_cap: int = 0  # shared prompts' tokens a row at most (the model's prompt keys)

  def width(self, prompt_BP: np.ndarray, completion_BC: np.ndarray) -> int:
    return self.row_len or prompt_BP.shape[1] + completion_BC.shape[1]


def plan_update(
  prompt_tokens_BP: np.ndarray,
  prompt_mask_BP: np.ndarray,
  completion_tokens_BC: np.ndarray,
  completion_mask_BC: np.ndarray,
  layout: RowLayout,
  topk_ids_BCJ: np.ndarray | None = None,
) -> MicroBatches:
  """Lays one update's sequences into micro-batches of ``layout.rows`` rows."""
  pl = packing.plan(
    prompt_tokens_BP,
    prompt_mask_BP,
    completion_tokens_BC,
    completion_mask_BC,
    layout.width(prompt_tokens_BP, completion_tokens_BC),
    topk_ids_BCJ,
    pack=layout.pack,
    group_B=np.arange(len(prompt_tokens_BP)) // layout.share if layout.share else None,
    prompt_cap=layout.prompt_cap,
  )
  Y = layout.rows
  filled = -(-pl.rows.tokens_YT.shape[0] // Y)
  M = pow2(filled)
  pl = dataclasses.replace(pl, rows=packing.pad_rows(pl.rows, M * Y))
  # One Z for the update (the micro-batches stack), from its fullest row.
  Z = packing.bucket(np.bincount(pl.rows.target_row_N, minlength=1).max(initial=0))
  groups = [pl.group(m * Y, (m + 1) * Y, Z) for m in range(M)]
  rows = jax.tree.map(lambda *xs: np.stack(xs), *[g[0] for g in groups])
  mb_B = pl.row_B // Y
  members = [np.flatnonzero(mb_B == m) for m in range(M)]
  # Slots: a multiple of Y (so whatever shards the rows shards the slots), bucketed.
  slots = Y * pow2(-(-max(len(x) for x in members) // Y))
  take_MB = np.full((M, slots), -1)
  for m, bs in enumerate(members):
    take_MB[m, : len(bs)] = bs
  slot_BC = np.stack([groups[m][1][b] for b, m in enumerate(mb_B)]) if len(mb_B) else pl.index_BC
  index_MBC = np.where((take_MB >= 0)[..., None], slot_BC[np.maximum(take_MB, 0)], 0).astype(
    np.int32
  )
  return MicroBatches(rows=rows, index_MBC=index_MBC, take_MB=take_MB, filled=filled)


def plan_step(
  prompt_tokens_BP: np.ndarray,
  prompt_mask_BP: np.ndarray,
  completion_tokens_BC: np.ndarray,
  completion_mask_BC: np.ndarray,
  layout: RowLayout,
  rows_per_update: int,
) -> list[MicroBatches]:
  """A step's consecutive updates of ``rows_per_update`` sequences, each laid into
  micro-batches (``plan_update``); ``take_MB`` indexes the step's [B, ...] arrays."""
  plans = []
  for start in range(0, prompt_tokens_BP.shape[0], rows_per_update):
    sl = slice(start, start + rows_per_update)
    # Slices of the step's [B, P] / [B, C]: every update's rows are as wide (unpacked too).
    mbs = plan_update(
      prompt_tokens_BP[sl],
      prompt_mask_BP[sl],
      completion_tokens_BC[sl],
      completion_mask_BC[sl],
      layout,
    )
    plans.append(
      dataclasses.replace(mbs, take_MB=np.where(mbs.take_MB >= 0, mbs.take_MB + start, -1))
    )
  return plans
