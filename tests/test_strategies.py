"""The token strategies draw from exactly the distributions they name.

References: a brute-force running sum (the inverse-CDF draw), a float64
log_softmax (the log-prob a strategy returns), and softmax(logits/T) with its
top-k / top-p restrictions computed in NumPy (token frequencies, directly and
through ``generate``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capo_jax.sampling import sampler as sampling
from capo_jax.sampling import strategies
from models import qwen2
from models.config import Qwen2Config


def test_inverse_cdf_is_exact_and_skips_zero_weights():
  # Integer weights and u on a 1/1024 grid keep every float32 sum exact, so the
  # draw must equal the brute-force first index whose running sum exceeds u*total.
  rng = np.random.default_rng(0)
  w = rng.integers(0, 4, 300).astype(np.float32)
  w[:130] = 0  # the whole first block and more carry no weight
  u = np.arange(1024, dtype=np.float32) / 1024  # includes u = 0
  got = np.asarray(
    strategies.inverse_cdf(jnp.broadcast_to(jnp.asarray(w), (1024, 300)), jnp.asarray(u))
  )
  want = np.searchsorted(np.cumsum(w), u * w.sum(), side="right")
  np.testing.assert_array_equal(got, want)
  assert (w[got] > 0).all()


@pytest.mark.parametrize(
  "strategy",
  [
    strategies.Greedy(),
    strategies.Temperature(1.0),
    strategies.Temperature(0.6),
    strategies.TopK(temperature=1.0, k=5),
    strategies.TopP(temperature=1.2, p=0.5, k=30),
  ],
)
def test_choose_returns_the_untempered_logprob(strategy):
  # Vocab-major logits (the decode loop's layout); V = 300 spans a partial block.
  logits_VB = jax.random.normal(jax.random.key(0), (300, 16)) * 3.0
  u_B = jax.random.uniform(jax.random.key(1), (16,))
  tokens_B, logprobs_B = jax.jit(strategy.choose)(logits_VB, u_B)
  x_BV = np.asarray(logits_VB, np.float64).T
  ref_BV = x_BV - x_BV.max(-1, keepdims=True)
  ref_BV -= np.log(np.exp(ref_BV).sum(-1, keepdims=True))  # log_softmax in float64
  rows = np.arange(16)
  np.testing.assert_allclose(np.asarray(logprobs_B), ref_BV[rows, np.asarray(tokens_B)], atol=1e-5)
  if isinstance(strategy, strategies.Greedy):
    np.testing.assert_array_equal(np.asarray(tokens_B), ref_BV.argmax(-1))


def _freq_bound(p: np.ndarray, n: int) -> np.ndarray:
  """4.5 binomial standard deviations (+1/n): fails a wrong distribution, not noise."""
  return 4.5 * np.sqrt(p * (1 - p) / n) + 1.0 / n


def _draw(strategy, logits_V: np.ndarray, n: int, seed: int) -> np.ndarray:
  logits = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, logits_V.size))
  keys = jax.random.split(jax.random.key(seed), n)
  counts = np.bincount(
    np.asarray(jax.jit(strategy.next_token)(logits, keys)), minlength=logits_V.size
  )
  return counts / n


def _softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max())
  return e / e.sum()


@pytest.mark.parametrize(
  "strategy",
  [
    strategies.Temperature(0.7),
    strategies.TopK(temperature=1.3, k=7),
    strategies.TopP(temperature=1.0, p=0.6),
    strategies.TopP(temperature=0.8, p=0.9, k=40),
  ],
)
def test_token_frequencies_match_the_distribution(strategy):
  # V = 300 is not a multiple of the 128-token block of the inverse-CDF draw.
  logits = np.random.default_rng(1).normal(0, 2.0, 300)
  n = 40_000
  freq = _draw(strategy, logits, n, seed=2)
  p = _softmax(logits / strategy.temperature)
  order = np.argsort(-p)
  keep = np.zeros(300, bool)
  if isinstance(strategy, strategies.TopK) or getattr(strategy, "k", 0):
    keep[order[: strategy.k]] = True
  else:
    keep[:] = True
  p = np.where(keep, p, 0) / p[keep].sum()
  if isinstance(strategy, strategies.TopP):
    order = np.argsort(-p)
    above = np.cumsum(p[order]) - p[order]
    nucleus = np.zeros(300, bool)
    nucleus[order[above < strategy.p]] = True
    p = np.where(nucleus, p, 0) / p[nucleus].sum()
  assert (freq[p == 0] == 0).all(), "an excluded token was emitted"
  assert (np.abs(freq - p) <= _freq_bound(p, n)).all(), np.abs(freq - p).max()


@pytest.mark.slow  # 15-27 s on 2 cores; .ci/run runs it
def test_first_token_frequencies_through_generate():
  cfg = Qwen2Config.tiny(vocab_size=12)
  params = qwen2.init_params(cfg, jax.random.key(5))
  params["embed"] = params["embed"] * 3.0  # spread the logits
  tokens, mask = np.array([[0, 0, 4, 7, 1]]), np.array([[0, 0, 1, 1, 1]])
  logits = np.asarray(qwen2.forward(params, cfg, jnp.asarray(tokens), jnp.asarray(mask)))[0, -1]
  p = _softmax(logits / 1.5)
  assert p.max() < 0.6 and (p > 0.02).sum() >= 4
  n, rounds = 2000, 4
  counts = np.zeros(12)
  for r in range(rounds):
    out = sampling.generate(
      params,
      cfg,
      tokens,
      mask,
      jax.random.key(r),
      sampling.SamplingSpec(num_samples=n, max_new_tokens=1, strategy=strategies.Temperature(1.5)),
    )
    counts += np.bincount(np.asarray(out.tokens_BC[:, 0]), minlength=12)
  freq = counts / (n * rounds)
  assert (np.abs(freq - p) <= _freq_bound(p, n * rounds)).all(), np.abs(freq - p).max()
