"""Packing: how an update's sequences are laid into model rows (host NumPy).

A rollout row is a left-padded prompt [P] and a right-padded completion [C]:
with long-tailed completion lengths most of the [B, P + C] grid is padding.
Packing lays each sequence's real tokens (prompt ++ completion) end to end in
rows of ``pack_len`` tokens (first-fit decreasing); unpacked, each sequence has
a row of its own. Either way the result is the same batch type
(``capo_jax.rl.batch``): the model's rows with segment ids, positions and
compact targets, and ``index_BC``, the packed position (row * T + column) that
predicts completion token c of sequence b.

``capo_jax.rl.microbatches`` groups an update's rows into micro-batches. Target slots
are bucketed (``bucket``) to bound recompiles.

Letters: Y model rows, T row length, Z target slots; B sequences, C, J as in the RL code.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from capo_jax.rl.batch import ModelRows
from models import shared_prefix


@dataclasses.dataclass(frozen=True)
class FullRows:
  """A plan's rows [Y, T] and its N targets (host arrays; see module doc).

  Target n is token ``target_tok_N[n]``, predicted at column ``target_col_N[n]`` of row
  ``target_row_N[n]``; a column may predict several (a shared prompt's last token
  predicts each of its completions' first). ``branch_ids_YT``: 0 on a prompt and on
  padding, 1, 2, ... on the completions that share the prompt before them (each
  completion's own when nothing is shared). ``topk_ids_NJ``: ids whose log-probs to
  return at each target (SimKO: the old policy's top-K of the token predicted there), or
  None.
  """

  tokens_YT: np.ndarray
  segment_ids_YT: np.ndarray
  positions_YT: np.ndarray
  branch_ids_YT: np.ndarray
  target_row_N: np.ndarray
  target_col_N: np.ndarray
  target_tok_N: np.ndarray
  topk_ids_NJ: np.ndarray | None = None


def bucket(n: int) -> int:
  """n rounded up to 4, 5, 6 or 7 x 2^k (at most 25% padding, few distinct shapes)."""
  n, k = max(int(n), 8), 0
  while n > 7 << k:
    k += 1
  return next(m << k for m in (4, 5, 6, 7) if n <= m << k)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each sequence went (host arrays): its row and its chunk's first column, and
  ``index_BC``, the target (into ``rows``' N) of each completion token. ``shared``: its
  prompts are shared (the model needs ``branch_ids``)."""

  rows: FullRows
  row_B: np.ndarray
  start_B: np.ndarray
  index_BC: np.ndarray
  shared: bool = False

  def group(self, r0: int, r1: int, Z: int = 0) -> tuple[ModelRows, np.ndarray]:
    """Rows [r0, r1) as the model's ``ModelRows`` with Z target slots a row (0: bucketed
    to the group's fullest row), and each sequence's ``index_BC`` into the group's
    flat ``row * Z + slot`` targets (meaningful for the group's sequences)."""
    f, Y = self.rows, r1 - r0
    n_N = np.flatnonzero((f.target_row_N >= r0) & (f.target_row_N < r1))
    row_N = f.target_row_N[n_N] - r0
    n_N = n_N[np.lexsort((f.target_col_N[n_N], row_N))]  # by row, then column
    row_N = f.target_row_N[n_N] - r0
    count_Y = np.bincount(row_N, minlength=Y)
    Z = Z or bucket(count_Y.max(initial=0))
    slot_N = np.arange(len(n_N)) - np.repeat(np.cumsum(count_Y) - count_Y, count_Y)

    def slots(values_N: np.ndarray) -> np.ndarray:
      out = np.zeros((Y, Z) + values_N.shape[1:], np.int32)
      out[row_N, slot_N] = values_N
      return out

    topk = None if f.topk_ids_NJ is None else slots(f.topk_ids_NJ[n_N])
    rows = slice(r0, r1)
    packed = ModelRows(
      f.tokens_YT[rows],
      f.segment_ids_YT[rows],
      f.positions_YT[rows],
      slots(f.target_col_N[n_N]),
      slots(f.target_tok_N[n_N]),
      slots(np.ones(len(n_N), np.int32)),
      topk,
    )
    if self.shared:  # the model reads the tree from the segment ids (models.shared_prefix)
      ids = shared_prefix.tree_ids(f.segment_ids_YT[rows], f.branch_ids_YT[rows])
      packed = dataclasses.replace(packed, segment_ids_YT=np.asarray(ids))
    flat_N = np.zeros(len(f.target_row_N), np.int64)
    flat_N[n_N] = row_N * Z + slot_N
    return packed, flat_N[self.index_BC].astype(np.int32)


def _lengths(
  prompt_mask_BP: np.ndarray, completion_mask_BC: np.ndarray
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
    raise ValueError(
      f"packing: sequence {int(np.argmin(p_B))} has an empty prompt (its first "
      "completion token is predicted from the last prompt token)"
    )
  return p_B, c_B


def first_fit(
  lengths_B: np.ndarray, row_len: int, alone: bool = False
) -> tuple[np.ndarray, np.ndarray]:
  """First-fit decreasing: (row, start column) of each sequence; rows in order of opening.

  ``alone``: no packing, sequence b at the start of row b (the same length checks)."""
  lengths_B = np.asarray(lengths_B)
  too_long = np.flatnonzero(lengths_B > row_len)
  if too_long.size:
    b = int(too_long[0])
    raise ValueError(
      f"packing: sequence {b} has {int(lengths_B[b])} tokens (prompt + "
      f"completion), longer than a packed row of {row_len} tokens "
      "(config.train.pack_len)"
    )
  row_B = np.zeros(len(lengths_B), np.int64)
  start_B = np.zeros(len(lengths_B), np.int64)
  if alone:
    return np.arange(len(lengths_B)), start_B
  used: list[int] = []
  for b in np.argsort(-lengths_B, kind="stable"):
    n = int(lengths_B[b])
    r = next((i for i, u in enumerate(used) if u + n <= row_len), len(used))
    if r == len(used):
      used.append(0)
    row_B[b], start_B[b] = r, used[r]
    used[r] += n
  return row_B, start_B


def _chunks(
  p_B: np.ndarray, c_B: np.ndarray, row_len: int, group_B: np.ndarray, prompt_cap: int = 0
) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
  """Shared prompts: the chunks (a group's prompt once, then some of its completions)
  and each chunk's row and first column. Completions are placed group by group, longest
  first: into a row that already holds their group's prompt, else the first row with
  room for the prompt too (and at most ``prompt_cap`` prompt tokens, 0: any), else a new
  row. A row's chunks are laid in the order they opened."""
  too_long = np.flatnonzero(p_B + c_B > row_len)
  if too_long.size:
    b = int(too_long[0])
    raise ValueError(
      f"packing: sequence {b} has {int(p_B[b] + c_B[b])} tokens (prompt + completion), "
      f"longer than a packed row of {row_len} tokens (config.train.pack_len)"
    )
  big = np.flatnonzero(p_B > prompt_cap) if prompt_cap else np.array([], np.int64)
  if big.size:
    b = int(big[0])
    raise ValueError(
      f"packing: prompt {b} has {int(p_B[b])} tokens, more than the {prompt_cap} a row's "
      "shared prompts may hold (config.model.shared_prompt_cols)"
    )
  used: list[int] = []  # tokens a row
  held: list[int] = []  # prompt tokens a row
  where: list[dict[int, int]] = []  # a row's chunks: group -> index into chunks
  chunks: list[list[int]] = []
  row_K: list[int] = []
  for g in dict.fromkeys(np.asarray(group_B).tolist()):  # groups in order of appearance
    members = np.flatnonzero(group_B == g)
    for b in members[np.argsort(-c_B[members], kind="stable")]:
      c, p = int(c_B[b]), int(p_B[b])
      r = next((i for i in range(len(used)) if g in where[i] and used[i] + c <= row_len), -1)
      if r < 0:
        fits = lambda i: (
          used[i] + p + c <= row_len and (not prompt_cap or held[i] + p <= prompt_cap)
        )  # noqa: E731,B023
        r = next((i for i in range(len(used)) if fits(i)), len(used))
        if r == len(used):
          used.append(0)
          held.append(0)
          where.append({})
        where[r][g] = len(chunks)
        chunks.append([])
        row_K.append(r)
        used[r] += p
        held[r] += p
      chunks[where[r][g]].append(int(b))
      used[r] += c
  # Each row's chunks from column 0, in the order they opened.
  start_K = np.zeros(len(chunks), np.int64)
  fill = [0] * len(used)
  for k, ch in enumerate(chunks):
    r = row_K[k]
    start_K[k] = fill[r]
    fill[r] += int(p_B[ch[0]] + c_B[ch].sum())
  return chunks, np.asarray(row_K, np.int64), start_K


def _check_shared_prompts(
  prompt_tokens_BP: np.ndarray, p_B: np.ndarray, group_B: np.ndarray
) -> None:
  P = prompt_tokens_BP.shape[1]
  first: dict[int, int] = {}
  for b, g in enumerate(np.asarray(group_B).tolist()):
    a = first.setdefault(g, b)
    same = (
      p_B[a] == p_B[b]
      and (prompt_tokens_BP[a, P - p_B[a] :] == prompt_tokens_BP[b, P - p_B[b] :]).all()
    )
    if not same:
      raise ValueError(
        f"packing: sequences {a} and {b} share group {g} (group_B) but not their prompt"
      )


def plan(
  prompt_tokens_BP: np.ndarray,
  prompt_mask_BP: np.ndarray,
  completion_tokens_BC: np.ndarray,
  completion_mask_BC: np.ndarray,
  row_len: int,
  topk_ids_BCJ: np.ndarray | None = None,
  pack: bool = True,
  group_B: np.ndarray | None = None,
  prompt_cap: int = 0,
) -> Plan:
  """Lays the B sequences into rows of ``row_len`` tokens (host NumPy): packed first-fit
  decreasing, or (``pack=False``) sequence b alone in row b. ``group_B``: the sequences
  of a group share their prompt, laid once a chunk (``_chunks``; packed only), at most
  ``prompt_cap`` prompt tokens a row (0: any)."""
  p_B, c_B = _lengths(prompt_mask_BP, completion_mask_BC)
  if group_B is not None:
    if not pack:
      raise ValueError("packing: shared prompts (group_B) need packed rows (pack=True)")
    _check_shared_prompts(prompt_tokens_BP, p_B, group_B)
  if group_B is None:
    chunks = [[b] for b in range(len(p_B))]
    row_K, start_K = first_fit(p_B + c_B, row_len, alone=not pack)
  else:
    chunks, row_K, start_K = _chunks(p_B, c_B, row_len, np.asarray(group_B), prompt_cap)
  len_K = np.array([p_B[ch[0]] + c_B[ch].sum() for ch in chunks], np.int64)
  Y, T = int(row_K.max()) + 1 if len(row_K) else 0, row_len
  P, C = prompt_mask_BP.shape[1], completion_mask_BC.shape[1]
  tokens, seg, pos, branch = (np.zeros((Y, T), np.int32) for _ in range(4))
  row_B, start_B = np.zeros(len(p_B), np.int64), np.zeros(len(p_B), np.int64)
  index_BC = np.zeros((len(p_B), C), np.int64)
  t_row: list[int] = []
  t_col: list[int] = []
  t_tok: list[int] = []
  t_topk: list[np.ndarray] = []
  seg_count = np.zeros(Y, np.int32)
  for k in np.lexsort((start_K, row_K)):  # row by row, left to right: segments 1, 2, ...
    r, s, ch = int(row_K[k]), int(start_K[k]), chunks[k]
    p = int(p_B[ch[0]])
    seg_count[r] += 1
    tokens[r, s : s + p] = prompt_tokens_BP[ch[0], P - p :]
    seg[r, s : s + len_K[k]] = seg_count[r]
    pos[r, s : s + p] = np.arange(p)
    col = s + p
    for i, b in enumerate(ch):
      c = int(c_B[b])
      tokens[r, col : col + c] = completion_tokens_BC[b, :c]
      pos[r, col : col + c] = p + np.arange(c)
      branch[r, col : col + c] = i + 1
      # Token 0 is predicted at the prompt's last column, token j at the completion's j - 1.
      cols = np.concatenate([[s + p - 1], col + np.arange(c - 1)])[:c]
      index_BC[b, :c] = len(t_row) + np.arange(c)
      t_row += [r] * c
      t_col += cols.tolist()
      t_tok += completion_tokens_BC[b, :c].tolist()
      if topk_ids_BCJ is not None:
        t_topk.append(topk_ids_BCJ[b, :c])
      row_B[b], start_B[b] = r, s
      col += c
  topk = None
  if topk_ids_BCJ is not None:
    J = topk_ids_BCJ.shape[-1]
    topk = np.concatenate(t_topk).astype(np.int32) if t_topk else np.zeros((0, J), np.int32)
  rows = FullRows(
    tokens,
    seg,
    pos,
    branch,
    np.asarray(t_row, np.int64),
    np.asarray(t_col, np.int64),
    np.asarray(t_tok, np.int32),
    topk,
  )
  return Plan(rows, row_B, start_B, index_BC, shared=group_B is not None)


def pad_rows(rows: FullRows, num_rows: int) -> FullRows:
  """Appends all-padding rows (segment 0, no targets) up to ``num_rows``."""
  pad = lambda x: np.pad(x, [(0, num_rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
  return dataclasses.replace(
    rows,
    tokens_YT=pad(rows.tokens_YT),
    segment_ids_YT=pad(rows.segment_ids_YT),
    positions_YT=pad(rows.positions_YT),
    branch_ids_YT=pad(rows.branch_ids_YT),
  )
