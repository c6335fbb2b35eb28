"""Every attention implementation against the reference, with padding and packed segments."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, qwen2
from models.config import Qwen2Config

B, T, N, K, H = 2, 130, 4, 2, 16


def _segments() -> np.ndarray:
  """Row 0: left padding then one sequence; row 1: three packed sequences and tail padding."""
  seg = np.zeros((B, T), np.int32)
  seg[0, 37:] = 1
  seg[1, :50], seg[1, 50:51], seg[1, 51:115] = 1, 2, 3
  return seg


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, T, N, H)) * 2, jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, T, K, H)) * 2, jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  return q, k, v, jnp.asarray(_segments()), w


def _brute_force(q, k, v, seg):
  """A loop over rows, heads and queries in float64 NumPy."""
  q, k, v, seg = (np.asarray(x, np.float64) for x in (q, k, v, seg))
  out = np.zeros(q.shape)
  for b in range(B):
    for n in range(N):
      for t in range(T):
        keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
        s = np.array([q[b, t, n] @ k[b, j, n // (N // K)] for j in keys]) / np.sqrt(H)
        p = np.exp(s - s.max())
        out[b, t, n] = (p / p.sum()) @ v[b, keys, n // (N // K)]
  return out


IMPLS = {
  "xla": attention.xla,
  "flash": functools.partial(attention.flash, block=32),  # 5 blocks of 32 (T padded to 160)
  "splash": functools.partial(attention.splash, block=128, interpret=True),  # 2 blocks
}


def _objective(fn, q, k, v, seg, w):
  return (fn(q, k, v, seg) * w).sum()


def test_reference_matches_brute_force(inputs):
  q, k, v, seg, _ = inputs
  got = attention.reference(q, k, v, attention.segment_mask(seg))
  np.testing.assert_allclose(np.asarray(got), _brute_force(q, k, v, seg), atol=1e-5)


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_implementation_matches_reference(inputs, name):
  q, k, v, seg, w = inputs
  ref = lambda q, k, v, seg: attention.reference(q, k, v, attention.segment_mask(seg))
  want = jax.jit(ref)(q, k, v, seg)
  got = jax.jit(IMPLS[name])(q, k, v, seg)
  # Every position, padding included: padding is a segment of its own on every path.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  grad = lambda fn: jax.jit(jax.grad(functools.partial(_objective, fn), argnums=(0, 1, 2)))
  for g_got, g_want, what in zip(
    grad(IMPLS[name])(q, k, v, seg, w), grad(ref)(q, k, v, seg, w), "qkv"
  ):
    scale = float(jnp.abs(g_want).max())
    np.testing.assert_allclose(
      np.asarray(g_got) / scale, np.asarray(g_want) / scale, atol=1e-5, err_msg=f"d{what}"
    )


@pytest.mark.slow  # 10-21 s on 2 cores; .ci/run runs it
def test_model_forward_with_each_attention():
  """The whole model's hidden states with packed segments agree across implementations."""
  cfg = Qwen2Config.tiny(vocab_size=64, num_layers=2, attention_block=32)
  params = jax.jit(qwen2.init_params, static_argnums=0)(cfg, jax.random.key(0))
  seg = jnp.asarray(_segments())
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (B, T)), jnp.int32)
  run = jax.jit(qwen2.hidden_states, static_argnums=1)
  want = run(params, cfg.replace(attention="reference"), tokens, seg > 0, None, seg)
  for impl in ("xla", "flash"):
    got = run(params, cfg.replace(attention=impl), tokens, seg > 0, None, seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, err_msg=impl)


def test_auto_and_bad_names():
  assert attention.resolve("auto", 512, 512) == (
    "splash" if jax.default_backend() == "tpu" else "reference"
  )
  assert attention.resolve("auto", 513, 512) in ("splash", "flash")
  with pytest.raises(ValueError, match="attention"):
    attention.resolve("cudnn", 8)
  with pytest.raises(ValueError, match="attention='fast'"):
    Qwen2Config.tiny(attention="fast")


def test_flash_backward_holds_no_full_score_matrix():
  """XLA's own buffer accounting of the compiled gradient: the blocked attention's
  temporaries stay far below one float32 [N, T, T] score matrix; the reference's do not."""
  T_long, W = 2048, 256
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  args = (
    shape(1, T_long, 2, 16),
    shape(1, T_long, 1, 16),
    shape(1, T_long, 1, 16),
    jax.ShapeDtypeStruct((1, T_long), jnp.int32),
  )
  scores_bytes = 2 * T_long * T_long * 4

  def temp_bytes(fn):
    f = jax.jit(jax.grad(lambda q, k, v, s: fn(q, k, v, s).sum(), argnums=(0, 1, 2)))
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

  assert temp_bytes(functools.partial(attention.flash, block=W)) < scores_bytes / 8
  ref = lambda q, k, v, s: attention.reference(q, k, v, attention.segment_mask(s))
  assert temp_bytes(ref) >= scores_bytes
