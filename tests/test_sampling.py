"""The jitted sampler against transformers and teacher forcing.

References: transformers ``generate(do_sample=False)`` on a left-padded batch
(greedy tokens and stopping), ``models.qwen2.forward`` over prompt + completion
(log-probs), a no-stop greedy run (where each row must stop), and the traces of
the jitted functions (compilations per length bucket); the strategies' own
distributions are tests/test_strategies.py's. The 8-device sharding check runs
in a subprocess, since XLA_FLAGS must be set before jax is imported.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_utils
from capo_jax.sampling import engine, strategies
from capo_jax.sampling import sampler as sampling
from models import hf_weights, qwen2

REPO = pathlib.Path(__file__).resolve().parent.parent
PAD = 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A random transformers Qwen2 (vocab 256) and the same weights as our params."""
  model, path = hf_utils.make_hf_model(tmp_path_factory.mktemp("hf"), seed=0)
  cfg, params = hf_weights.load_pretrained(path)
  return model, cfg, params


def _prompts(vocab: int) -> tuple[np.ndarray, np.ndarray]:
  return hf_utils.left_padded_batch(np.random.default_rng(0), [5, 11, 8], vocab, low=3)


def _hf_greedy(model, tokens, mask, max_new: int, stop: list[int] | None) -> np.ndarray:
  import torch  # pylint: disable=g-import-not-at-top

  with torch.no_grad():
    out = model.generate(
      input_ids=torch.as_tensor(tokens, dtype=torch.long),
      attention_mask=torch.as_tensor(mask, dtype=torch.long),
      max_new_tokens=max_new,
      do_sample=False,
      eos_token_id=stop,
      pad_token_id=PAD,
    )
  return out[:, tokens.shape[1] :].numpy()


def test_greedy_matches_transformers_and_stops(tiny):
  model, cfg, params = tiny
  tokens, mask = _prompts(cfg.vocab_size)
  free = _hf_greedy(model, tokens, mask, 12, None)
  # Stop ids the rows meet at different steps (and one row maybe never).
  stops = sorted({int(free[0, 3]), int(free[1, 6])})
  expected = _hf_greedy(model, tokens, mask, 12, stops)
  ours = sampling.generate(
    params,
    cfg,
    tokens,
    mask,
    jax.random.key(0),
    sampling.SamplingSpec(
      num_samples=1, max_new_tokens=12, strategy=strategies.Greedy(), stop_ids=stops, pad_id=PAD
    ),
  )
  np.testing.assert_array_equal(
    np.asarray(
      sampling.generate(
        params,
        cfg,
        tokens,
        mask,
        jax.random.key(0),
        sampling.SamplingSpec(
          num_samples=1, max_new_tokens=12, strategy=strategies.Greedy(), pad_id=PAD
        ),
      ).tokens_BC
    ),
    free,
  )
  # The engine with 2 slots for 3 rows (a refill mid-run) gives the same tokens.
  two = sampling.generate(
    params,
    cfg,
    tokens,
    mask,
    jax.random.key(0),
    sampling.SamplingSpec(
      num_samples=1,
      max_new_tokens=12,
      strategy=strategies.Greedy(),
      stop_ids=stops,
      pad_id=PAD,
      max_active_rows=2,
    ),
  )
  np.testing.assert_array_equal(np.asarray(two.tokens_BC), np.asarray(ours.tokens_BC))
  np.testing.assert_array_equal(np.asarray(two.mask_BC), np.asarray(ours.mask_BC))
  for b in range(tokens.shape[0]):
    hits = np.flatnonzero(np.isin(free[b], stops))
    n = int(hits[0]) + 1 if hits.size else 12
    np.testing.assert_array_equal(np.asarray(ours.tokens_BC[b, :n]), expected[b, :n])
    np.testing.assert_array_equal(np.asarray(ours.mask_BC[b]), (np.arange(12) < n).astype(int))
    assert int(ours.lengths_B[b]) == n
    assert bool(ours.truncated_B[b]) == (hits.size == 0)
    assert (np.asarray(ours.tokens_BC[b, n:]) == PAD).all()
    assert (np.asarray(ours.logprobs_BC[b, n:]) == 0).all()
  assert int(ours.lengths_B[0]) <= 4 and int(ours.lengths_B[1]) <= 7  # the stops took effect
  # A stop on the very last allowed token is a stop, not a truncation.
  n0 = int(ours.lengths_B[0])
  short = sampling.generate(
    params,
    cfg,
    tokens,
    mask,
    jax.random.key(0),
    sampling.SamplingSpec(
      num_samples=1, max_new_tokens=n0, strategy=strategies.Greedy(), stop_ids=stops, pad_id=PAD
    ),
  )
  stopped = np.isin(free[:, :n0], stops).any(1)
  np.testing.assert_array_equal(np.asarray(short.truncated_B), ~stopped)
  assert stopped[0] and int(short.lengths_B[0]) == n0
  np.testing.assert_array_equal(np.asarray(short.tokens_BC), np.asarray(ours.tokens_BC[:, :n0]))


def _teacher_forced(params, cfg, tokens, mask, out, G: int) -> tuple[np.ndarray, np.ndarray]:
  """Log-probs of the sampled tokens under ``qwen2.forward`` over prompt + completion."""
  seq = np.concatenate([np.repeat(tokens, G, 0), np.asarray(out.tokens_BC)], axis=1)
  seq_mask = np.concatenate([np.repeat(mask, G, 0), np.asarray(out.mask_BC)], axis=1)
  logits = np.asarray(qwen2.forward(params, cfg, jnp.asarray(seq), jnp.asarray(seq_mask)))
  P = tokens.shape[1]
  logp = jax.nn.log_softmax(logits[:, P - 1 : -1], axis=-1)
  ref = np.take_along_axis(np.asarray(logp), seq[:, P:, None], axis=-1)[..., 0]
  return ref, np.asarray(out.mask_BC).astype(bool)


def test_logprobs_equal_teacher_forcing(tiny):
  _, cfg, params = tiny
  tokens, mask = _prompts(cfg.vocab_size)
  G, C = 2, 10
  out = sampling.generate(
    params,
    cfg,
    tokens,
    mask,
    jax.random.key(3),
    sampling.SamplingSpec(
      num_samples=G,
      max_new_tokens=C,
      strategy=strategies.TopK(temperature=0.7, k=20),
      stop_ids=[5, 17],
    ),
  )
  ref, m = _teacher_forced(params, cfg, tokens, mask, out, G)
  assert m.sum() > G * 3 * 3
  np.testing.assert_allclose(np.asarray(out.logprobs_BC)[m], ref[m], atol=1e-4)
  # Rows of one prompt share the prefill yet draw their own tokens.
  rows = np.asarray(out.tokens_BC)
  assert all((rows[2 * q] != rows[2 * q + 1]).any() for q in range(3))


@pytest.mark.slow  # 15-27 s on 2 cores; .ci/run runs it
def test_bfloat16_sampler_logprobs(tiny):
  # The TPU / GPU setting: bfloat16 weights, activations and cache. Reference:
  # the bfloat16 teacher-forced forward (same dtype, other matmul shapes, so
  # a bfloat16-sized tolerance); the float32 forward bounds the dtype's drift.
  _, cfg32, params32 = tiny
  cfg = cfg32.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
  tokens, mask = _prompts(cfg.vocab_size)
  G = 2
  out = sampling.generate(
    params,
    cfg,
    tokens,
    mask,
    jax.random.key(5),
    sampling.SamplingSpec(
      num_samples=G, max_new_tokens=12, strategy=strategies.Temperature(1.0), stop_ids=[5, 17]
    ),
  )
  assert out.logprobs_BC.dtype == jnp.float32
  ref16, m = _teacher_forced(params, cfg, tokens, mask, out, G)
  ref32, _ = _teacher_forced(params32, cfg32, tokens, mask, out, G)
  got = np.asarray(out.logprobs_BC)[m]
  assert m.sum() > G * 3 * 3
  np.testing.assert_allclose(got, ref16[m], atol=0.05)
  np.testing.assert_allclose(got, ref32[m], atol=0.15)


def test_same_rng_same_samples(tiny):
  _, cfg, params = tiny
  tokens, mask = _prompts(cfg.vocab_size)
  run = lambda key: np.asarray(
    sampling.generate(
      params,
      cfg,
      tokens,
      mask,
      jax.random.key(key),
      sampling.SamplingSpec(
        num_samples=2,
        max_new_tokens=10,
        strategy=strategies.TopK(temperature=0.7, k=20),
        stop_ids=[5, 17],
      ),
    ).tokens_BC
  )
  np.testing.assert_array_equal(run(3), run(3))
  assert (run(3) != run(4)).any()


@pytest.mark.slow  # 15-27 s on 2 cores; .ci/run runs it
def test_length_buckets_bound_compilations(tiny):
  _, cfg, params = tiny
  rng = np.random.default_rng(4)
  for f in (engine.prefill, engine.decode_loop):
    f.clear_cache()
  before = dict(engine.TRACE_COUNTS)
  # Prompt lengths in buckets 16, 16, 16, 32, 32; max_new_tokens (and stop sets)
  # vary within the 16 bucket: two shapes, so two traces of each function.
  for P, C, stops in [(4, 9, [5]), (9, 16, [5, 17]), (16, 11, []), (17, 9, [5]), (30, 14, [9])]:
    tokens, mask = hf_utils.left_padded_batch(rng, [P, P - 2, 3], cfg.vocab_size)
    out = sampling.generate(
      params,
      cfg,
      tokens,
      mask,
      jax.random.key(P),
      sampling.SamplingSpec(
        num_samples=2,
        max_new_tokens=C,
        strategy=strategies.TopK(temperature=0.7, k=20),
        stop_ids=stops,
      ),
    )
    assert out.tokens_BC.shape == (6, C)
  new = {k: engine.TRACE_COUNTS[k] - before.get(k, 0) for k in ("prefill", "decode")}
  assert new == {"prefill": 2, "decode": 2}, new


def test_bad_input_is_named(tiny):
  _, cfg, params = tiny
  gen = lambda t, m, **kw: sampling.generate(
    params, cfg, t, m, jax.random.key(0), sampling.SamplingSpec(1, 4, **kw)
  )
  with pytest.raises(ValueError, match="left-padded"):
    gen(np.ones((1, 4), int), np.array([[1, 1, 0, 0]]))
  with pytest.raises(ValueError, match="stop_ids"):
    gen(np.ones((1, 4), int), np.ones((1, 4), int), stop_ids=[cfg.vocab_size])
  with pytest.raises(ValueError, match="temperature"):
    strategies.make_strategy(temperature=-1.0)
  with pytest.raises(ValueError, match="TopP.p"):
    strategies.TopP(p=0.0)
  with pytest.raises(ValueError, match="max_active_rows"):
    sampling.SamplingSpec(num_samples=1, max_new_tokens=4, max_active_rows=0)
  with pytest.raises(ValueError, match="must be >= 1"):
    sampling.SamplingSpec(num_samples=0, max_new_tokens=4)


_SHARDED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import dataclasses
    import jax, numpy as np
    from capo_jax.runtime import mesh as capo_mesh
    from capo_jax.sampling import sampler as sampling
    from capo_jax.sampling import strategies
    from models import qwen2
    from models.config import Qwen2Config
    from models.sharding import Layout
    cfg = Qwen2Config.tiny(tie_word_embeddings=False)
    params = qwen2.init_params(cfg, jax.random.key(0))
    # Weights of std 0.15 (not 0.02) so greedy does not just repeat the last token.
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x if "norm" in jax.tree_util.keystr(p) else 7.5 * x, params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 256, (4, 9)); mask = np.ones((4, 9), int); mask[1, :4] = 0
    spec = sampling.SamplingSpec(num_samples=2, max_new_tokens=12, strategy=strategies.Greedy())
    # Stop ids taken from an unstopped run (row 0 at step 2, row 4 at step 6), so rows end
    # at different lengths whatever the random weights.
    free = np.asarray(sampling.generate(params, cfg, tokens, mask, jax.random.key(1),
                                        spec).tokens_BC)
    spec = dataclasses.replace(spec, stop_ids=sorted({int(free[0, 2]), int(free[4, 6])}))
    one = sampling.generate(params, cfg, tokens, mask, jax.random.key(1), spec)
    # The sampler's mesh: 4 row shards x a tensor group of 2 (one kv head a chip).
    mesh = capo_mesh.sampling_mesh(capo_mesh.make_mesh({"data": -1}), cfg, 2)
    layout = Layout.of(mesh, capo_mesh.SAMPLING_RULES)
    eight = sampling.generate(params, cfg, tokens, mask, jax.random.key(1), spec, layout=layout)
    assert len(jax.devices()) == 8
    assert eight.tokens_BC.sharding.spec[0] in ("data", ("data", "fsdp")), eight.tokens_BC.sharding
    np.testing.assert_array_equal(np.asarray(one.tokens_BC), np.asarray(eight.tokens_BC))
    np.testing.assert_array_equal(np.asarray(one.mask_BC), np.asarray(eight.mask_BC))
    np.testing.assert_allclose(np.asarray(one.logprobs_BC), np.asarray(eight.logprobs_BC),
                               atol=1e-5)
    assert len(set(np.asarray(one.lengths_B).tolist())) > 1, one.lengths_B  # the stops took effect
    print("OK")
""")


@pytest.mark.slow  # 15-27 s on 2 cores; .ci/run runs it
def test_sharded_greedy_equals_one_device():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  proc = subprocess.run(
    [sys.executable, "-c", _SHARDED], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
