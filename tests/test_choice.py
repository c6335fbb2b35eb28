"""The draw inside the vocabulary shards (``capo_jax.sampling.choice``) against references.

On 8 fake CPU devices (a sampling mesh of data 2 x a tensor group of 4, so the
vocabulary is split 4 ways), the child process draws from vocab-split logits and
compares with references computed in NumPy from the same logits and uniforms:

* greedy: the first index of the maximum, ties across shards included (bit for bit);
* temperature: a float64 inverse CDF over softmax(logits / T): on every row u lies in
  the drawn token's interval of the running sum within 1e-5 (float32 rounding), and
  the token is the reference's wherever no boundary lies that close to u; the
  shards' padded block tails (V / t = 250, not a multiple of 128) never drawn, also
  for u just below 1;
* log-probs: a float64 log_softmax of the raw logits, within 1e-5;
* token frequencies over 40,000 draws of one row against softmax(logits / T);
* top-k keeps whole rows (the exchange), and a vocabulary the group does not divide too.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import fake_devices

V, B, T = 1000, 96, 4  # vocabulary, rows, the group's vocabulary shards


def _child() -> None:
  import types  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  from capo_jax.runtime import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from capo_jax.sampling import choice, strategies  # pylint: disable=import-outside-toplevel
  from models.sharding import Layout  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == 8
  cfg = types.SimpleNamespace(num_kv_heads=2, num_attention_heads=4)
  mesh = mesh_lib.sampling_mesh(mesh_lib.make_mesh({"data": -1}), cfg, tensor=T)
  layout = Layout.of(mesh, mesh_lib.SAMPLING_RULES)
  assert layout.shards("vocab") == T, mesh.shape
  rng = np.random.default_rng(0)
  x_VB = (rng.normal(size=(V, B)) * 3.0).astype(np.float32)
  x_VB[[10, 400, 990], 0] = x_VB[:, 0].max() + 1.0  # a tie across shards (0, 1 and 3)
  u_B = rng.uniform(size=B).astype(np.float32)
  u_B[:4] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5, 1e-7]
  out: dict = {}

  def draw(strategy, x, u):
    put = jax.device_put(x, layout.sharding(("vocab", "batch")))
    f = jax.jit(lambda x, u: choice.choose(strategy, x, u, layout))
    tok, lp = f(put, u)
    return np.asarray(tok).tolist(), np.asarray(lp).tolist()

  cases = {
    "greedy": strategies.Greedy(),
    "t1": strategies.Temperature(1.0),
    "t07": strategies.Temperature(0.7),
    "topk": strategies.TopK(temperature=1.0, k=5),
  }
  for name, st in cases.items():
    out[name] = draw(st, x_VB, u_B)
    out[name + "_shards"] = choice.vocab_shards(st, layout, V)
  out["odd_vocab_shards"] = choice.vocab_shards(cases["t1"], layout, V + 2)
  # One row's distribution, 40,000 draws (V = 300: 75 a shard, one padded block each).
  logits = np.random.default_rng(1).normal(0, 2.0, 300).astype(np.float32)
  n = 40_000
  x_many = np.broadcast_to(logits[:, None], (300, n)).copy()
  u_many = np.random.default_rng(2).uniform(size=n).astype(np.float32)
  out["freq_logits"] = logits.tolist()
  out["freq_tokens"] = draw(cases["t07"], x_many, u_many)[0]
  out["x"], out["u"] = x_VB.tolist(), u_B.tolist()
  print("RESULTS " + json.dumps(out))


@pytest.fixture(scope="module")
def results() -> dict:
  return fake_devices.child_results(__file__)


def _log_softmax(x_BV: np.ndarray) -> np.ndarray:
  z = x_BV - x_BV.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_greedy_is_the_first_maximum(results: dict) -> None:
  x_BV = np.asarray(results["x"], np.float64).T
  tokens, lps = results["greedy"]
  assert results["greedy_shards"] == T
  np.testing.assert_array_equal(tokens, x_BV.argmax(-1))
  assert tokens[0] == 10  # the tie's first index, in shard 0
  rows = np.arange(B)
  np.testing.assert_allclose(lps, _log_softmax(x_BV)[rows, tokens], atol=1e-5)


@pytest.mark.parametrize("name, temp", [("t1", 1.0), ("t07", 0.7)])
def test_temperature_draw_is_the_inverse_cdf(results: dict, name: str, temp: float) -> None:
  x_BV = np.asarray(results["x"], np.float64).T
  u = np.asarray(results["u"], np.float64)
  tokens, lps = np.asarray(results[name][0]), results[name][1]
  assert results[name + "_shards"] == T
  assert ((tokens >= 0) & (tokens < V)).all(), tokens
  p_BV = np.exp(_log_softmax(x_BV / temp))
  cum_BV = np.cumsum(p_BV, -1)
  want = np.array([np.searchsorted(cum_BV[b], u[b], side="right") for b in range(B)])
  want = np.minimum(want, V - 1)
  # Every row: u lies in its token's interval of the running sum, up to float32 rounding.
  rows = np.arange(B)
  lo_B = np.where(tokens > 0, cum_BV[rows, np.maximum(tokens - 1, 0)], 0.0)
  assert ((lo_B - 1e-5 <= u) & (u <= cum_BV[rows, tokens] + 1e-5)).all()
  # And the very token wherever no boundary lies within that rounding.
  clear = np.abs(cum_BV - u[:, None]).min(-1) > 1e-5
  assert clear.sum() >= 0.75 * B, clear.sum()
  np.testing.assert_array_equal(tokens[clear], want[clear])
  np.testing.assert_allclose(lps, _log_softmax(x_BV)[rows, tokens], atol=1e-5)


def test_temperature_frequencies_match_the_distribution(results: dict) -> None:
  logits = np.asarray(results["freq_logits"], np.float64)
  p = np.exp(_log_softmax(logits[None] / 0.7))[0]
  freq = np.bincount(results["freq_tokens"], minlength=300) / len(results["freq_tokens"])
  assert freq.shape == (300,)  # no token past the vocabulary (a shard's padding)
  bound = 4.5 * np.sqrt(p * (1 - p) / len(results["freq_tokens"])) + 1e-4
  assert (np.abs(freq - p) <= bound).all(), np.abs(freq - p).max()


def test_top_k_and_an_undivided_vocabulary_keep_whole_rows(results: dict) -> None:
  assert results["topk_shards"] == 1 and results["odd_vocab_shards"] == 1
  x_BV = np.asarray(results["x"], np.float64).T
  tokens = np.asarray(results["topk"][0])
  top5 = np.argsort(-x_BV, -1)[:, :5]
  assert all(tokens[b] in top5[b] for b in range(B))


if __name__ == "__main__":
  _child()
