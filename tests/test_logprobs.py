"""Chunked per-token log-probs against a log_softmax of the full forward's logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capo_jax.rl.logprobs import token_logprobs
from models import qwen2
from models.config import Qwen2Config

CFG = Qwen2Config.tiny(vocab_size=128, num_layers=2)
B, P, C, K = 3, 5, 7, 3
_forward = jax.jit(qwen2.forward, static_argnums=1)


@pytest.fixture(scope="module")
def setup():
  params = qwen2.init_params(CFG, jax.random.key(0))
  # Larger logits than the 0.02 init so top-k and argmax are well separated.
  params = jax.tree.map(lambda p: p * 8.0 if p.ndim >= 2 else p, params)
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, CFG.vocab_size, (B, P)).astype(np.int32)
  prompt_mask = np.ones((B, P), np.int32)
  prompt_mask[0, :2] = 0  # left padding
  prompt_mask[2, :4] = 0
  completion = rng.integers(0, CFG.vocab_size, (B, C)).astype(np.int32)
  completion_mask = np.ones((B, C), np.int32)
  completion_mask[1, 3:] = 0  # right padding
  completion_mask[2, 6:] = 0
  # Make every row's first completion token its argmax, so is_argmax has True cases.
  logits = _forward(
    params,
    CFG,
    np.concatenate([prompt, completion], 1),
    np.concatenate([prompt_mask, completion_mask], 1),
  )
  completion[:, 0] = np.asarray(logits[:, P - 1].argmax(-1))
  inputs = tuple(jnp.asarray(x) for x in (prompt, prompt_mask, completion, completion_mask))
  return params, inputs


def _reference(params, inputs):
  """log_softmax of qwen2.forward on the whole sequence, in float64 numpy."""
  prompt, prompt_mask, completion, completion_mask = inputs
  tokens = jnp.concatenate([prompt, completion], 1)
  mask = jnp.concatenate([prompt_mask, completion_mask], 1)
  logits = np.asarray(_forward(params, CFG, tokens, mask), np.float64)
  logp_BTV = (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  # Completion token c is predicted at column P - 1 + c.
  logp_BCV = logp_BTV[:, P - 1 : P - 1 + C]
  comp = np.asarray(completion)
  logp = np.take_along_axis(logp_BCV, comp[..., None], -1)[..., 0]
  entropy = -(np.exp(logp_BCV) * logp_BCV).sum(-1)
  ids = np.argsort(-logp_BCV, -1)[..., :K]
  return logp, entropy, np.take_along_axis(logp_BCV, ids, -1), ids, logp_BCV.argmax(-1) == comp


def _run(params, inputs, **kw):
  f = jax.jit(lambda p, *x: token_logprobs(p, CFG, *x, **kw))
  return {k: np.asarray(v) for k, v in f(params, *inputs).items()}


def test_unchunked_and_chunked_match_forward(setup):
  params, inputs = setup
  logp, entropy, topk, ids, is_max = _reference(params, inputs)
  mask = np.asarray(inputs[3]) > 0
  full = _run(params, inputs, top_k=K)
  # chunk 3 does not divide C = 7: exercises the padded last chunk.
  chunked = _run(params, inputs, chunk_size=3, topk_ids_BCJ=jnp.asarray(ids, jnp.int32))
  for out in (full, chunked):
    np.testing.assert_allclose(out["logp_BC"][mask], logp[mask], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(out["entropy_BC"][mask], entropy[mask], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(out["topk_logp_BCJ"][mask], topk[mask], atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(out["topk_ids_BCJ"][mask], ids[mask])
    np.testing.assert_array_equal(out["is_argmax_BC"][mask], is_max[mask])
    assert not out["is_argmax_BC"][~mask].any()
    for key in ("logp_BC", "entropy_BC", "topk_logp_BCJ"):
      assert (out[key][~mask] == 0).all(), key
  assert is_max[:, 0].all() and not is_max[mask].all()  # both cases occur


@pytest.mark.slow  # 15-27 s on 2 cores; .ci/run runs it
def test_gradients_chunked_equal_unchunked_and_forward(setup):
  params, inputs = setup
  rng = np.random.default_rng(1)
  w_BC = jnp.asarray(rng.normal(size=(B, C)), jnp.float32)
  w_BCJ = jnp.asarray(rng.normal(size=(B, C, K)), jnp.float32)
  ids = jnp.asarray(_reference(params, inputs)[3], jnp.int32)

  def objective(p, chunk):
    out = token_logprobs(p, CFG, *inputs, chunk_size=chunk, topk_ids_BCJ=ids)
    return (out["logp_BC"] * w_BC).sum() + (out["topk_logp_BCJ"] * w_BCJ).sum()

  def reference(p):
    prompt, prompt_mask, completion, completion_mask = inputs
    logits = qwen2.forward(
      p,
      CFG,
      jnp.concatenate([prompt, completion], 1),
      jnp.concatenate([prompt_mask, completion_mask], 1),
    )
    logp_BCV = jax.nn.log_softmax(logits[:, P - 1 : P - 1 + C], -1)
    m = completion_mask > 0
    logp = jnp.take_along_axis(logp_BCV, completion[..., None], -1)[..., 0]
    topk = jnp.take_along_axis(logp_BCV, ids, -1)
    return (jnp.where(m, logp, 0) * w_BC).sum() + (jnp.where(m[..., None], topk, 0) * w_BCJ).sum()

  g_full = jax.jit(jax.grad(functools.partial(objective, chunk=0)))(params)
  g_chunk = jax.jit(jax.grad(functools.partial(objective, chunk=2)))(params)
  g_ref = jax.jit(jax.grad(reference))(params)

  def check(path, ref, *others):
    scale = float(jnp.abs(ref).max()) + 1e-8
    for got in others:
      np.testing.assert_allclose(
        np.asarray(got) / scale,
        np.asarray(ref) / scale,
        atol=1e-5,
        err_msg=jax.tree_util.keystr(path),
      )

  jax.tree_util.tree_map_with_path(check, g_ref, g_full, g_chunk)


def test_bfloat16_compute_is_close(setup):
  params, inputs = setup
  logp = _reference(params, inputs)[0]
  mask = np.asarray(inputs[3]) > 0
  cfg16 = CFG.replace(compute_dtype="bfloat16", remat=True)
  out = jax.jit(lambda p, *x: token_logprobs(p, cfg16, *x, chunk_size=4))(params, *inputs)
  got = np.asarray(out["logp_BC"])
  assert got.dtype == np.float32
  # bfloat16 matmul inputs: a few percent of |logp| (~5 here), not more.
  np.testing.assert_allclose(got[mask], logp[mask], atol=0.15 + 0.03 * np.abs(logp[mask]).max())


def test_bad_shapes_name_the_field(setup):
  params, (prompt, prompt_mask, completion, completion_mask) = setup
  with pytest.raises(ValueError, match="completion_mask_BC"):
    token_logprobs(params, CFG, prompt, prompt_mask, completion, completion_mask[:, :-1])
  with pytest.raises(ValueError, match="prompt_mask_BP"):
    token_logprobs(params, CFG, prompt, prompt_mask[:2], completion, completion_mask)
  with pytest.raises(ValueError, match="topk_ids_BCJ"):
    token_logprobs(
      params,
      CFG,
      prompt,
      prompt_mask,
      completion,
      completion_mask,
      topk_ids_BCJ=jnp.zeros((B, C), jnp.int32),
    )
