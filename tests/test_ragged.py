"""The ragged decode-attention kernel (Pallas, interpreted on CPU) against the reference.

Reference: ``decode.attend_full`` (the softmax over every column) under the
mask ``start <= s < end`` per slot. Slots of one token, of the whole cache, a
left-padded prompt's range, ranges across block edges and an idle slot; grouped
queries (K kv heads of R query heads each); a cache whose length is not a
multiple of the block (the last copy moves back). And the kernel never uses a
block outside a slot's own range: those are NaN here, and the result stays
finite and equal. The engine's use of it (same samples as the blocked XLA
attention) is in tests/test_engine.py; its TPU lowering in test_aot_tpu.py.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from capo_jax.sampling import decode, ragged

W, K, R, H = 7, 2, 3, 16


def qkv(S: int, dtype=jnp.float32, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = lambda *s: jnp.asarray(rng.normal(size=s), dtype)
  return x(W, K, R, H), x(W, K, H, S), x(W, K, S, H)


def slot_layout(k_WKHS, v_WKSH):
  """The kernel's [W, S, K*H] keys and values."""
  W, K, H, S = k_WKHS.shape
  return k_WKHS.transpose(0, 3, 1, 2).reshape(W, S, K * H), v_WKSH.transpose(0, 2, 1, 3).reshape(
    W, S, K * H
  )


def ragged_attend(q, k, v, start_W, end_W, **kw):
  return ragged.attend(q, *slot_layout(k, v), start_W, end_W, **kw)


def reference(q, k, v, start_W, end_W) -> np.ndarray:
  S = k.shape[-1]
  cols = np.arange(S)
  mask_WS = (cols >= np.asarray(start_W)[:, None]) & (cols < np.asarray(end_W)[:, None])
  return np.asarray(decode.attend_full(q, k, v, jnp.asarray(mask_WS)), np.float32)


# (start, end) per slot over S = 40 columns, blocks of 16: one token at column 0,
# at the last column, in the middle; the whole cache; a prompt from 13 on whose
# completion crosses two block edges; a range inside one block; an idle slot.
RANGES_40 = [(0, 1), (39, 40), (20, 21), (0, 40), (13, 35), (17, 30), (25, 25)]


# (S, block, align): blocks from the block edges (align a multiple of the block, or
# 128 > block: gcd = block), and blocks laid from a slot's first column rounded down
# to 4 or 8, the last one moved back at the cache's end.
@pytest.mark.parametrize(
  "S, block, align", [(40, 16, 128), (48, 16, 16), (40, 64, 128), (40, 16, 4), (48, 32, 8)]
)
def test_ragged_equals_reference_attention(S, block, align):
  q, k, v = qkv(S)
  ranges = [(min(a, S - 1), min(b, S)) if b > a else (a, b) for a, b in RANGES_40]
  ranges[3] = (0, S)  # the whole cache
  start_W, end_W = (jnp.asarray(x, jnp.int32) for x in zip(*ranges))
  got = np.asarray(ragged_attend(q, k, v, start_W, end_W, block=block, align=align))
  want = reference(q, k, v, start_W, end_W)
  live = np.asarray(end_W > start_W)
  np.testing.assert_allclose(got[live], want[live], atol=2e-6, rtol=2e-6)
  np.testing.assert_array_equal(got[~live], 0.0)  # an idle slot reads nothing


def own_blocks(start: int, end: int, block: int, unit: int, S: int) -> set[int]:
  """The columns a slot copies, by hand: blocks of ``block`` columns laid from ``start``
  rounded down to ``unit``, as many as reach ``end``, the last cut to the ``unit``s that
  reach it; one past the cache's end moved back to end at S."""
  if end <= start:
    return set()
  cols, b0 = set(), start - start % unit
  while b0 < end:
    size = min(block, -(-(end - b0) // unit) * unit)
    s0 = min(b0, S - size)
    cols |= set(range(s0, s0 + size))
    b0 += block
  return cols


# (block, align, interpret): blocks from the block edges (gcd(128, 16) = 16); laid from
# a slot's first column rounded down to 8, the last cut to 8-column tiles; and that on
# the TPU interpreter (DMAs as on the chip, scratch NaN until written).
@pytest.mark.parametrize(
  "block, align, tpu", [(16, 128, False), (16, 8, False), (16, 8, True)], ids=str
)
def test_ragged_never_reads_other_blocks(block, align, tpu):
  """Columns outside what a slot copies are NaN: results unchanged. With blocks laid
  from 8-column edges, the padding before a slot's first 8-column edge (its block edge
  when laid from 0) is NaN too, and the columns past a cut last block's end; the rows
  of the buffer a cut copy leaves are stale (NaN on the TPU interpreter)."""
  S = 64
  q, k, v = qkv(S, seed=1)
  start_W = jnp.asarray([0, 16, 5, 40, 63, 29, 30], jnp.int32)
  end_W = jnp.asarray([3, 32, 40, 64, 64, 64, 30], jnp.int32)
  unit = np.gcd(block, align)
  own_WS = np.zeros((W, S), bool)
  for w, (a, b) in enumerate(zip(np.asarray(start_W), np.asarray(end_W))):
    own_WS[w, sorted(own_blocks(int(a), int(b), block, int(unit), S))] = True
  if unit < block:  # slot 5 (29 .. 64) from column 24: 16 .. 23, its block edge's, unread
    assert not own_WS[5, 16:24].any() and own_WS[5, 24:].all()
    assert not own_WS[0, 8:].any()  # slot 0 (0 .. 3): one 8-column tile, not 16 columns
  k_bad = jnp.where(jnp.asarray(own_WS)[:, None, None, :], k, jnp.nan)
  v_bad = jnp.where(jnp.asarray(own_WS)[:, None, :, None], v, jnp.nan)
  interpret = pltpu.InterpretParams() if tpu else True
  got = np.asarray(
    ragged_attend(q, k_bad, v_bad, start_W, end_W, block=block, align=align, interpret=interpret)
  )
  assert np.isfinite(got).all()
  live = np.asarray(end_W > start_W)
  want = reference(q, k, v, start_W, end_W)
  np.testing.assert_allclose(got[live], want[live], atol=2e-6, rtol=2e-6)


def test_ragged_bfloat16_and_many_query_heads():
  """The model's dtype, and R = 7 query heads per kv head (padded to 8 inside)."""
  S, block = 96, 32
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(size=(3, 4, 7, 32)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(3, 4, 32, S)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(3, 4, S, 32)), jnp.bfloat16)
  start_W, end_W = jnp.asarray([0, 50, 95]), jnp.asarray([96, 70, 96])
  got = ragged_attend(q, k, v, start_W, end_W, block=block)
  assert got.dtype == jnp.bfloat16 and got.shape == q.shape
  want = reference(q, k, v, start_W, end_W)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


def test_resolve_picks_by_platform():
  assert decode.resolve("auto") == ("ragged" if jax.default_backend() == "tpu" else "blocks")
  assert decode.resolve("ragged") == "ragged"
  with pytest.raises(ValueError, match="decode attention 'paged'"):
    decode.resolve("paged")


@pytest.mark.tpu_aot
@pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed; run from tools/.venv-tpu (tools/setup_aot_tpu.sh)",
)
def test_ragged_decode_loop_compiles_for_tpu_without_cache_copies():
  """A decode-like loop (each step writes one column per slot, then attends) compiled
  for a v5e-8 from this CPU host, over 4 slot shards x 2 kv-head shards: the kernel
  lowers through Mosaic in a shard_map, nothing is gathered, and the compiler keeps the
  carried cache in the kernel's layout (with [W, K, H, S] keys it copied every layer's
  cache every step)."""
  from capo_jax.run import tpu_topology  # pylint: disable=import-outside-toplevel
  from capo_jax.runtime import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from models.sharding import Layout  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator("v5e-8")
  tpu_topology.set_tpu_env(acc)
  mesh = mesh_lib.make_mesh(
    {"data": 1, "fsdp": 4, "tensor": 2, "tensor_q": 1}, devices=tpu_topology.topology_devices(acc)
  )
  layout = Layout.of(mesh, mesh_lib.SAMPLING_RULES)
  Wn, Kn, Rn, Hn, S = 32, 2, 6, 128, 3328  # 1.5B's heads, a 3,072-token completion
  heads = layout.sharding(("batch", "kv_heads", None, None), (Wn, Kn, Rn, Hn))
  cache = jax.sharding.NamedSharding(mesh, ragged.cache_spec(layout, Wn, Kn))
  rows = layout.sharding(("batch",), (Wn,))
  sds = lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh)

  def loop(q, k, v, start_W, col_W):
    def body(i, carry):
      k, v, acc = carry
      new_WX = jnp.broadcast_to(q[:, :, 0].reshape(Wn, Kn * Hn), (Wn, Kn * Hn))
      k = k.at[jnp.arange(Wn), col_W + i].set(new_WX)
      v = v.at[jnp.arange(Wn), col_W + i].set(new_WX)
      out = ragged.attend(q, k, v, start_W, col_W + i + 1, layout=layout)
      return k, v, acc + out.astype(jnp.float32)

    return jax.lax.fori_loop(0, 4, body, (k, v, jnp.zeros(q.shape, jnp.float32)))[2]

  args = (
    sds((Wn, Kn, Rn, Hn), jnp.bfloat16, heads),
    sds((Wn, S, Kn * Hn), jnp.bfloat16, cache),
    sds((Wn, S, Kn * Hn), jnp.bfloat16, cache),
    sds((Wn,), jnp.int32, rows),
    sds((Wn,), jnp.int32, rows),
  )
  text = jax.jit(loop).lower(*args).compile().as_text()
  assert text.count("tpu_custom_call") == 1
  assert "all-gather" not in text and "all-to-all" not in text
  local = f"bf16[{Wn // 4},{S},{Kn * Hn // 2}]"  # one device's keys or values
  copies = [l for l in text.splitlines() if local in l and " copy(" in l]
  assert not copies, copies[:2]
