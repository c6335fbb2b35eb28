"""Splash's per-row block tables (``models/splash_blocks.py``): the blocks it skips
against a brute-force count, and the kernel with them against the reference attention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, splash_blocks

T, N, K, H, BLOCK = 512, 4, 2, 16, 128


def _packed_rows() -> np.ndarray:
  """Two packed rows (ids rise along a row, tail padding 0): one with a one-token
  sequence and a sequence spanning three blocks, one with a whole block of padding."""
  seg = np.zeros((2, T), np.int32)
  seg[0, :200], seg[0, 200:201], seg[0, 201:460], seg[0, 460:500] = 1, 2, 3, 4
  seg[1, :90], seg[1, 90:300], seg[1, 300:380] = 1, 2, 3
  return seg


def _kernel():

  return attention._splash_kernel(N, T, BLOCK, interpret=True)  # noqa: SLF001


def _pairs(info, dkv: bool) -> set[tuple[int, int]]:
  """The (query block, key block) pairs a table computes, read back through data_next."""
  mask = np.asarray(info.block_mask)[0]
  nxt = np.asarray(info.data_next)[0]
  out = set()
  for a, b in zip(*np.nonzero(mask)):
    out.add((int(nxt[a, b]), int(b)) if dkv else (int(a), int(nxt[a, b])))
  return out


def _brute_pairs(seg_T: np.ndarray) -> set[tuple[int, int]]:
  """Causal block pairs holding at least one (query, key) of the same segment, s <= t."""
  X = T // BLOCK
  out = set()
  for x in range(X):
    for y in range(x + 1):
      for t in range(x * BLOCK, (x + 1) * BLOCK):
        keys = seg_T[y * BLOCK : min((y + 1) * BLOCK, t + 1)]
        if (keys == seg_T[t]).any():
          out.add((x, y))
          break
  return out


@pytest.mark.parametrize("row", [0, 1])
def test_tables_skip_exactly_the_blocks_of_other_sequences(row):
  seg_T = _packed_rows()[row]
  kernel = splash_blocks.per_row(_kernel(), jnp.asarray(seg_T), jnp.asarray(seg_T))
  want = _brute_pairs(seg_T)
  causal = {(x, y) for x in range(T // BLOCK) for y in range(x + 1)}
  assert want < causal  # the rows are built so that some causal pairs are skipped
  assert _pairs(kernel.fwd_mask_info, False) == want
  assert _pairs(kernel.dq_mask_info, False) == want
  assert _pairs(kernel.dkv_mask_info, True) == want


def _reference(q, k, v, seg):
  return attention.reference(q, k, v, attention.segment_mask(seg))


def test_values_and_gradients_match_reference():
  rng = np.random.default_rng(0)
  q, k, v = (
    jnp.asarray(rng.normal(size=(2, T, n, H)) * s, jnp.float32) for n, s in ((N, 2), (K, 2), (K, 1))
  )
  w = jnp.asarray(rng.normal(size=(2, T, N, H)), jnp.float32)
  seg = jnp.asarray(_packed_rows())
  splash = functools.partial(attention.splash, block=BLOCK, interpret=True)
  np.testing.assert_allclose(
    np.asarray(jax.jit(splash)(q, k, v, seg)),
    np.asarray(jax.jit(_reference)(q, k, v, seg)),
    atol=1e-5,
    rtol=1e-5,
  )
  grad = lambda fn: jax.jit(jax.grad(lambda *a: (fn(*a, seg) * w).sum(), argnums=(0, 1, 2)))
  for got, want, what in zip(grad(splash)(q, k, v), grad(_reference)(q, k, v), "qkv"):
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(
      np.asarray(got) / scale, np.asarray(want) / scale, atol=1e-5, err_msg=f"d{what}"
    )


def test_length_model_share_counts_the_kernels_pairs():
  """``step_estimate.splash_pair_share`` (NumPy, what the cost model scales splash's
  FLOPs by) against the brute-force count of the pairs the kernel computes."""
  from tools import step_estimate

  rng = np.random.default_rng(3)
  rows = []
  for _ in range(6):
    lengths, left = [], T - int(rng.integers(0, 60))
    while left > 0:
      n = min(int(rng.integers(1, 260)), left)
      lengths.append(n)
      left -= n
    rows.append(lengths)
  met = 0
  for lengths in rows:
    seg = np.zeros(T, np.int32)
    seg[: sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    met += len(_brute_pairs(seg))
  X = T // BLOCK
  want = met / (len(rows) * X * (X + 1) // 2)
  assert want < 1.0
  assert step_estimate.splash_pair_share(rows, T, BLOCK) == pytest.approx(want)
