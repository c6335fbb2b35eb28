"""Sequence packing for the log-prob passes and the train step.

A rollout row is a left-padded prompt [P] and a right-padded completion [C]:
with long-tailed completion lengths most of the [B, P + C] grid is padding.
Packing lays each sequence's real tokens (prompt ++ completion) end to end in
rows of ``pack_len`` tokens (first-fit decreasing), with

  segment_ids_YT  1, 2, ... per sequence within a row, 0 on the row's tail
                  padding: attention stays within a sequence (``models.attention``);
  positions_YT    RoPE positions restarting at 0 for each sequence;
  targets_YT      the completion token each position predicts (the hidden state
                  of column t predicts token t + 1), with ``target_mask_YT``.

Per-token outputs come back to the [B, C] layout through ``index_BC``, the
packed position (row * T + column) that predicts completion token c of
sequence b: ``unpack`` is a gather, exact, and the losses then run on the
sequences as they were (so every aggregation's denominators are the original
sequences' and tokens', not the rows').

The train step's packed batch (``PackedTrainBatch``) groups rows into
micro-batches of ``pack_rows`` rows; each micro-batch carries its own
sequences in the [B, C] layout (B slots, empty ones all-zero). Shapes are
bucketed (micro-batches and sequence slots to powers of two) to bound
recompiles; the step loops over the micro-batches that hold tokens only.

Letters: Y packed rows, T row length (a row is a model batch row), M
micro-batches; B, C, J as in the RL code (sequences, completion columns, top-k).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from capo_jax.rl import losses
from capo_jax.rl import train_step as ts
from capo_jax.rl.logprobs import packed_token_logprobs
from capo_jax.types import Array
from models.config import Qwen2Config
from models.qwen2 import Params


@dataclasses.dataclass(frozen=True)
class FullRows:
  """A plan's rows [Y, T] with per-position targets (host arrays; see module doc).

  ``topk_ids_YTJ``: ids whose log-probs to return at each position (SimKO: the
  old policy's top-K of the token predicted there), or None.
  """
  tokens_YT: np.ndarray
  segment_ids_YT: np.ndarray
  positions_YT: np.ndarray
  targets_YT: np.ndarray
  target_mask_YT: np.ndarray
  topk_ids_YTJ: np.ndarray | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedRows:
  """What the model sees: rows [Y, T] and Z compact targets (a leading M axis in
  ``PackedTrainBatch``). Only the Z positions that predict a completion token
  (``target_pos_Z``, flat into Y * T; padding slots masked) are unembedded, so
  the vocabulary projection's FLOPs follow the completion tokens."""
  tokens_YT: Array
  segment_ids_YT: Array
  positions_YT: Array
  target_pos_Z: Array
  targets_Z: Array
  target_mask_Z: Array
  topk_ids_ZJ: Array | None = None


def bucket(n: int) -> int:
  """n rounded up to 4, 5, 6 or 7 x 2^k (at most 25% padding, few distinct shapes)."""
  n, k = max(int(n), 8), 0
  while n > 7 << k:
    k += 1
  return next(m << k for m in (4, 5, 6, 7) if n <= m << k)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each sequence went (host arrays): its row, first column, and ``index_BC``
  (flat into the full Y * T layout)."""
  rows: FullRows
  row_B: np.ndarray
  start_B: np.ndarray
  index_BC: np.ndarray

  def group(self, r0: int, r1: int, Z: int = 0) -> tuple[PackedRows, np.ndarray]:
    """Rows [r0, r1) as the model's ``PackedRows`` (Z target slots, 0: bucketed), and
    each sequence's ``index_BC`` into those slots (meaningful for the group's sequences)."""
    f, T = self.rows, self.rows.tokens_YT.shape[1]
    rows = slice(r0, r1)
    tm = f.target_mask_YT[rows].reshape(-1)
    pos_z = np.flatnonzero(tm)
    Z = Z or bucket(len(pos_z))
    pad = lambda x: np.pad(x, [(0, Z - len(pos_z))] + [(0, 0)] * (x.ndim - 1))
    topk = None if f.topk_ids_YTJ is None else pad(
        f.topk_ids_YTJ[rows].reshape(-1, f.topk_ids_YTJ.shape[-1])[pos_z])
    packed = PackedRows(f.tokens_YT[rows], f.segment_ids_YT[rows], f.positions_YT[rows],
                        pad(pos_z).astype(np.int32), pad(f.targets_YT[rows].reshape(-1)[pos_z]),
                        pad(np.ones(len(pos_z), np.int32)), topk)
    rank = np.cumsum(tm) - 1  # slot of each flat position of the group
    local = np.clip(self.index_BC - r0 * T, 0, len(tm) - 1)
    return packed, rank[local].astype(np.int32)


def _lengths(prompt_mask_BP: np.ndarray, completion_mask_BC: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
  """Real prompt / completion lengths; the masks must be left- / right-aligned."""
  pm, cm = np.asarray(prompt_mask_BP) > 0, np.asarray(completion_mask_BC) > 0
  p_B, c_B = pm.sum(1), cm.sum(1)
  P, C = pm.shape[1], cm.shape[1]
  if (pm != (np.arange(P)[None] >= P - p_B[:, None])).any():
    raise ValueError("packing: prompt_mask_BP must be left-padded (real tokens at the end)")
  if (cm != (np.arange(C)[None] < c_B[:, None])).any():
    raise ValueError("packing: completion_mask_BC must be right-padded (real tokens first)")
  if (p_B < 1).any():
    raise ValueError(f"packing: sequence {int(np.argmin(p_B))} has an empty prompt (its first "
                     "completion token is predicted from the last prompt token)")
  return p_B, c_B


def first_fit(lengths_B: np.ndarray, row_len: int) -> tuple[np.ndarray, np.ndarray]:
  """First-fit decreasing: (row, start column) of each sequence; rows in order of opening."""
  lengths_B = np.asarray(lengths_B)
  too_long = np.flatnonzero(lengths_B > row_len)
  if too_long.size:
    b = int(too_long[0])
    raise ValueError(f"packing: sequence {b} has {int(lengths_B[b])} tokens (prompt + "
                     f"completion), longer than a packed row of {row_len} tokens "
                     "(config.train.pack_len)")
  row_B = np.zeros(len(lengths_B), np.int64)
  start_B = np.zeros(len(lengths_B), np.int64)
  used: list[int] = []
  for b in np.argsort(-lengths_B, kind="stable"):
    n = int(lengths_B[b])
    r = next((i for i, u in enumerate(used) if u + n <= row_len), len(used))
    if r == len(used):
      used.append(0)
    row_B[b], start_B[b] = r, used[r]
    used[r] += n
  return row_B, start_B


def plan(prompt_tokens_BP: np.ndarray, prompt_mask_BP: np.ndarray,
         completion_tokens_BC: np.ndarray, completion_mask_BC: np.ndarray, row_len: int,
         topk_ids_BCJ: np.ndarray | None = None) -> Plan:
  """Packs the B sequences into rows of ``row_len`` tokens (host NumPy)."""
  p_B, c_B = _lengths(prompt_mask_BP, completion_mask_BC)
  row_B, start_B = first_fit(p_B + c_B, row_len)
  Y, T = int(row_B.max()) + 1 if len(row_B) else 0, row_len
  P, C = prompt_mask_BP.shape[1], completion_mask_BC.shape[1]
  tokens, seg, pos, targets, tmask = (np.zeros((Y, T), np.int32) for _ in range(5))
  topk = None if topk_ids_BCJ is None else np.zeros((Y, T, topk_ids_BCJ.shape[-1]), np.int32)
  index_BC = np.zeros((len(p_B), C), np.int32)
  seg_count = np.zeros(Y, np.int32)
  for b in np.lexsort((start_B, row_B)):  # row by row, left to right: segments 1, 2, ...
    r, s, p, c = int(row_B[b]), int(start_B[b]), int(p_B[b]), int(c_B[b])
    seg_count[r] += 1
    tokens[r, s:s + p] = prompt_tokens_BP[b, P - p:]
    tokens[r, s + p:s + p + c] = completion_tokens_BC[b, :c]
    seg[r, s:s + p + c] = seg_count[r]
    pos[r, s:s + p + c] = np.arange(p + c)
    # Column s + p - 1 + j predicts completion token j.
    cols = s + p - 1 + np.arange(c)
    targets[r, cols] = completion_tokens_BC[b, :c]
    tmask[r, cols] = 1
    index_BC[b, :c] = r * T + cols
    if topk is not None:
      topk[r, cols] = topk_ids_BCJ[b, :c]
  return Plan(FullRows(tokens, seg, pos, targets, tmask, topk), row_B, start_B, index_BC)


def unpack(x_Z: Array, index_BC: Array, mask_BC: Array) -> Array:
  """Per-slot values [Z, ...] -> [B, C, ...], 0 on completion padding."""
  xp = np if isinstance(x_Z, np.ndarray) else jnp
  out = x_Z[index_BC]
  m = (mask_BC > 0).reshape(mask_BC.shape + (1,) * (out.ndim - 2))
  return xp.where(m, out, xp.zeros((), out.dtype))


def pad_rows(rows: FullRows, num_rows: int) -> FullRows:
  """Appends all-padding rows (segment 0, no targets) up to ``num_rows``."""
  return jax.tree.map(lambda x: np.pad(x, [(0, num_rows - x.shape[0])] + [(0, 0)] *
                                       (x.ndim - 1)), rows)


jax.tree_util.register_dataclass(FullRows)  # for pad_rows' tree.map


def _pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


# --------------------------------------------------------------------------
# The train step's packed batch.
# --------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedTrainBatch:
  """One update's sequences packed into M micro-batches of Y rows.

  rows: PackedRows [M, Y, T] (``topk_ids_YTJ``: SimKO's old top-K ids);
  index_MBC: per micro-batch, ``index_BC`` into its own Y * T positions;
  seqs: the ``TrainBatch`` of each micro-batch's sequences, [M, B, ...]
    (empty slots: zero masks, so they weigh nothing).
  """
  rows: PackedRows
  index_MBC: Array
  seqs: Any


def pack_train_batch(batch: Any, row_len: int, rows_per_microbatch: int) -> PackedTrainBatch:
  """A host ``TrainBatch`` -> its ``PackedTrainBatch`` (host arrays)."""
  pl = plan(batch.prompt_tokens_BP, batch.prompt_mask_BP, batch.completion_tokens_BC,
            batch.completion_mask_BC, row_len, batch.old_topk_ids_BCJ)
  Y = rows_per_microbatch
  num_rows = pl.rows.tokens_YT.shape[0]
  M = _pow2(-(-num_rows // Y))
  pl = dataclasses.replace(pl, rows=pad_rows(pl.rows, M * Y))
  tm_M = pl.rows.target_mask_YT.reshape(M, -1).sum(-1)
  groups = [pl.group(m * Y, (m + 1) * Y, bucket(tm_M.max())) for m in range(M)]
  rows = jax.tree.map(lambda *xs: np.stack(xs), *[g[0] for g in groups])
  mb_B = pl.row_B // Y
  members = [np.flatnonzero(mb_B == m) for m in range(M)]
  # Slots: a multiple of Y (so whatever shards the rows shards the slots), bucketed.
  slots = Y * _pow2(-(-max(len(x) for x in members) // Y))
  take_MB = np.full((M, slots), -1)
  for m, bs in enumerate(members):
    take_MB[m, :len(bs)] = bs
  valid_MB = take_MB >= 0

  def regroup(x: np.ndarray | None) -> np.ndarray | None:
    if x is None:
      return None
    x = np.asarray(x)[np.maximum(take_MB, 0)]
    return np.where(valid_MB.reshape(valid_MB.shape + (1,) * (x.ndim - 2)), x, 0).astype(
        x.dtype)

  seqs = jax.tree.map(regroup, batch)
  slot_BC = np.stack([groups[m][1][b] for b, m in enumerate(mb_B)]) if len(mb_B) else \
      pl.index_BC
  index_MBC = np.where(valid_MB[..., None], slot_BC[np.maximum(take_MB, 0)], 0).astype(np.int32)
  return PackedTrainBatch(rows=rows, index_MBC=index_MBC, seqs=seqs)


def microbatch_loss(params: Params, rows: PackedRows, index_BC: Array, seqs: Any,
                    model_cfg: Qwen2Config, tcfg: ts.TrainConfig
                    ) -> tuple[Array, dict[str, Array]]:
  """``train_step.microbatch_loss`` of one packed micro-batch."""
  simko = tcfg.loss_kind == "simko"
  ts.check_simko_inputs(seqs, tcfg)
  if not simko:
    rows = dataclasses.replace(rows, topk_ids_ZJ=None)
  lp = packed_token_logprobs(params, model_cfg, rows,
                             chunk_size=tcfg.logprob_chunk_size)
  mask_BC = seqs.completion_mask_BC
  lp = {k.replace("_Z", "_BC"): unpack(v, index_BC, mask_BC) for k, v in lp.items()}
  return losses.policy_loss(tcfg.loss_kind, ts.policy_batch(lp, seqs, tcfg), tcfg.loss)


def loss_and_grads(params: Params, batch: PackedTrainBatch, model_cfg: Qwen2Config,
                   tcfg: ts.TrainConfig, microbatch_sharding: Any = None
                   ) -> tuple[Array, dict[str, Array], Params]:
  """``train_step.loss_and_grads`` over the packed micro-batches that hold tokens.

  Micro-batch m's loss is weighted by its share of the aggregation's
  denominator over the original sequences, so the sum is the full-batch loss.
  """
  del microbatch_sharding  # the batch arrives sharded over its rows / slots
  grad_fn = jax.value_and_grad(
      lambda p, mb: microbatch_loss(p, *mb, model_cfg, tcfg), has_aux=True)
  den_MB = ts.denominator_B(batch.seqs.completion_mask_BC, tcfg.loss.agg)
  w_M = den_MB.sum(-1) / jnp.maximum(den_MB.sum(), 1.0)
  # Micro-batches fill in order: the ones past the last real row are skipped.
  n = (batch.rows.segment_ids_YT > 0).any(axis=(1, 2)).sum()
  mb_at = lambda m: jax.tree.map(lambda x: x[m], (batch.rows, batch.index_MBC, batch.seqs))

  def body(m, carry):
    g_acc, loss_acc, aux_acc = carry
    (loss, aux), g = grad_fn(params, mb_at(m))
    w = w_M[m]
    g_acc = jax.tree.map(lambda a, b: a + w * b, g_acc, g)
    aux_acc = {k: ts.combine_aux(k, aux_acc[k], v, w) for k, v in aux.items()}
    return g_acc, loss_acc + w * loss, aux_acc

  aux_shape = jax.eval_shape(grad_fn, params, mb_at(0))[0][1]
  init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
          ts.init_aux(aux_shape))
  grads, loss, aux = jax.lax.fori_loop(0, n, body, init)
  return loss, aux, grads


# --------------------------------------------------------------------------
# The old / reference log-prob passes.
# --------------------------------------------------------------------------


def make_logprob_fn(model_cfg: Qwen2Config, mesh: jax.sharding.Mesh, rules: Any,
                    rows_per_call: int, *, chunk_size: int = 0, top_k: int = 0):
  """Jitted ``fn(params, rows: PackedRows [Y, T]) -> packed_token_logprobs dict``."""
  from capo_jax.runtime import mesh as mesh_lib
  p_sh = mesh_lib.param_shardings(model_cfg, mesh, rules)
  r_sh = mesh_lib.batch_sharding(mesh, rules, rows_per_call, name="packed rows")

  def fn(params: Params, rows: PackedRows) -> dict[str, Array]:
    return packed_token_logprobs(params, model_cfg, rows,
                                 chunk_size=chunk_size, top_k=top_k)

  return jax.jit(fn, in_shardings=(p_sh, r_sh), out_shardings=r_sh)


def host_logprobs(jitted: Any, params: Params, inputs: tuple[np.ndarray, ...], row_len: int,
                  rows_per_call: int, keys: tuple[str, ...], put: Any = None
                  ) -> dict[str, np.ndarray]:
  """Packs ``inputs`` (prompt, prompt mask, completion, completion mask), runs ``jitted``
  (``make_logprob_fn``) over ``rows_per_call`` rows at a time and unpacks ``keys``
  (``logp_BC``, ``topk_ids_BCJ``, ...) to host [B, C] arrays.

  ``put`` places a host tree on the devices (default: as is). Every call is
  dispatched before the first is read back.
  """
  from capo_jax.runtime.host import to_host
  pl = plan(*inputs, row_len)
  Y = rows_per_call
  n = -(-pl.rows.tokens_YT.shape[0] // Y)
  pl = dataclasses.replace(pl, rows=pad_rows(pl.rows, n * Y))
  put = put or (lambda x: x)
  groups = [pl.group(i * Y, (i + 1) * Y) for i in range(n)]
  outs = [jitted(params, put(g[0])) for g in groups]
  call_B = pl.row_B // Y
  slot_BC = np.stack([groups[i][1][b] for b, i in enumerate(call_B)])
  mask_BC = inputs[3]
  result = {}
  for k in keys:
    per_call = [to_host(o[k.replace("_BC", "_Z")]) for o in outs]
    got = np.stack([per_call[i][slot_BC[b]] for b, i in enumerate(call_B)])
    m = (mask_BC > 0).reshape(mask_BC.shape + (1,) * (got.ndim - 2))
    result[k] = np.where(m, got, np.zeros((), got.dtype))
  return result
