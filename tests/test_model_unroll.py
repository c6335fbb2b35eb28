"""``Qwen2Config.layer_unroll``: the unrolled layer scan computes what the rolled one does.

Forward hidden states, the cached prefill / decode and the gradient of a packed-row
loss are compared between ``layer_unroll`` 1 (the rolled scan), 2 and ``num_layers``,
and against an independent reference: the layers applied one by one in a Python loop
(``qwen2.layer``) with the reference attention under the segment mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, qwen2
from models.config import Qwen2Config
from models.decoder import rms_norm, rope_tables
from models.kv_cache import init_cache

L = 3
CFG = Qwen2Config.tiny(
  vocab_size=37,
  hidden_size=32,
  intermediate_size=64,
  num_layers=L,
  num_heads=4,
  num_kv_heads=2,
  rope_theta=1e4,
  tie_word_embeddings=True,
  max_position_embeddings=64,
)


def _packed_rows(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """tokens, positions, segment ids [4, 12] of rows holding 1-3 sequences and padding."""
  rng = np.random.default_rng(seed)
  seg = np.array(
    [[1] * 5 + [2] * 4 + [3] * 2 + [0], [1] * 12, [1] * 7 + [0] * 5, [1] * 3 + [2] * 9], np.int32
  )
  pos = np.zeros_like(seg)
  for y in range(seg.shape[0]):
    for s in set(seg[y].tolist()) - {0}:
      cols = np.flatnonzero(seg[y] == s)
      pos[y, cols] = np.arange(len(cols))
  tokens = rng.integers(1, CFG.vocab_size, seg.shape).astype(np.int32)
  return jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)


def _loop_hidden(params, cfg, tokens, positions, seg):
  """The layers one by one (no scan), reference attention under the segment mask."""
  x = params["embed"][tokens]
  rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
  mask = attention.segment_mask(seg)
  for l in range(cfg.num_layers):
    layer_params = jax.tree.map(lambda p, l=l: p[l], params["layers"])
    x, _ = qwen2.layer(
      cfg, x, layer_params, rope, lambda q, k, v: (attention.reference(q, k, v, mask), None)
    )
  return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def _loss(params, cfg, tokens, positions, seg, w):
  h = qwen2.hidden_states(params, cfg, tokens, seg > 0, positions, seg)
  return jnp.sum(jnp.tanh(h) * w)


# Unrolled in part and whole: the whole unroll is the slower compile, run with the slow checks.
@pytest.mark.parametrize("unroll", [2, pytest.param(L, marks=pytest.mark.slow)])
def test_unrolled_forward_and_gradient_equal_the_scan(unroll):
  params = qwen2.init_params(CFG, jax.random.key(0))
  tokens, pos, seg = _packed_rows()
  w = jax.random.normal(jax.random.key(1), tokens.shape + (CFG.hidden_size,))
  rolled, unrolled = CFG, CFG.replace(layer_unroll=unroll)
  hid = jax.jit(qwen2.hidden_states, static_argnums=1)
  h_scan = hid(params, rolled, tokens, seg > 0, pos, seg)
  h_unroll = hid(params, unrolled, tokens, seg > 0, pos, seg)
  h_loop = jax.jit(_loop_hidden, static_argnums=1)(params, CFG, tokens, pos, seg)
  real = np.asarray(seg > 0)
  np.testing.assert_allclose(np.asarray(h_unroll)[real], np.asarray(h_loop)[real], atol=2e-6)
  np.testing.assert_allclose(np.asarray(h_unroll), np.asarray(h_scan), rtol=0, atol=2e-6)
  grad = jax.jit(jax.grad(_loss), static_argnums=1)
  g_scan, g_unroll = (
    grad(params, rolled, tokens, pos, seg, w),
    grad(params, unrolled, tokens, pos, seg, w),
  )
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(g_scan), jax.tree_util.tree_leaves(g_unroll)
  ):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, path
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max(), err_msg=str(path))


def test_unrolled_cached_prefill_and_decode_equal_the_scan():
  params = qwen2.init_params(CFG, jax.random.key(2))
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (2, 6)), jnp.int32)
  mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32)
  step = jax.jit(qwen2.forward_with_cache, static_argnums=1)
  outs = []
  for cfg in (CFG, CFG.replace(layer_unroll=L)):
    cache = init_cache(cfg, 2, 10)
    logits, cache = step(params, cfg, tokens, mask, cache)
    nxt = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
    logits2, cache = step(params, cfg, nxt, jnp.ones_like(nxt), cache)
    outs.append((logits, logits2, cache.k_LBSKH))
  for a, b in zip(*outs):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2e-6)


def test_layer_unroll_is_checked():
  with pytest.raises(ValueError, match="layer_unroll"):
    CFG.replace(layer_unroll=0)
  with pytest.raises(ValueError, match="layer_unroll"):
    CFG.replace(layer_unroll=L + 1)


def _cols(seg: jax.Array, Z: int = 5, seed: int = 4) -> jax.Array:
  """Z target columns a row: some real columns of each row, the rest 0 (padding slots)."""
  rng = np.random.default_rng(seed)
  cols = np.zeros((seg.shape[0], Z), np.int32)
  for y, row in enumerate(np.asarray(seg)):
    real = np.flatnonzero(row > 0)
    pick = np.sort(rng.choice(real, min(Z - 1, len(real)), replace=False))
    cols[y, : len(pick)] = pick
  return jnp.asarray(cols)


# The only layer trimmed is the edge case; the real model trims the last of several.
@pytest.mark.parametrize("num_layers", [pytest.param(1, marks=pytest.mark.slow), L])
def test_trimmed_last_layer_equals_the_full_forward_at_the_columns(num_layers):
  cfg = CFG.replace(num_layers=num_layers, layer_unroll=num_layers)
  params = qwen2.init_params(cfg, jax.random.key(5))
  tokens, pos, seg = _packed_rows(6)
  cols = _cols(seg)
  at = jax.jit(qwen2.hidden_states_at, static_argnums=1)
  h_full = at(params, cfg, tokens, pos, seg, cols)  # the full forward, gathered
  h_trim = at(params, cfg.replace(trim_last_layer=True), tokens, pos, seg, cols)
  h_loop = jax.jit(_loop_hidden, static_argnums=1)(params, cfg, tokens, pos, seg)
  ref = np.take_along_axis(np.asarray(h_loop), np.asarray(cols)[..., None], axis=1)
  np.testing.assert_allclose(np.asarray(h_trim), ref, rtol=0, atol=2e-6)
  np.testing.assert_allclose(np.asarray(h_trim), np.asarray(h_full), rtol=0, atol=2e-6)

  w = jax.random.normal(jax.random.key(7), cols.shape + (cfg.hidden_size,))

  def loss(p, c):
    return jnp.sum(jnp.tanh(qwen2.hidden_states_at(p, c, tokens, pos, seg, cols)) * w)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  g_full, g_trim = grad(params, cfg), grad(params, cfg.replace(trim_last_layer=True))
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(g_full), jax.tree_util.tree_leaves(g_trim)
  ):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max(), err_msg=str(path))
