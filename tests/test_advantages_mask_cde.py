"""CAPO's noise mask, CoDaPO, CDE and the score transform against their equations
(docs/algorithms.md): hand-computed groups and NumPy references, as in test_advantages.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

import advantage_refs
from capo_jax.rl import advantages as adv
from capo_jax.rl import algorithms


def test_noise_mask_thresholds() -> None:
  r = np.array([[1, 1, 1, 0, 0, 0]], np.float32)
  ppl = np.array([[2.6, 2.5, 1.01, 1.04, 1.05, 3.0]], np.float32)
  want = np.array([[True, False, False, True, False, False]])
  np.testing.assert_array_equal(np.asarray(adv.noise_mask(r, ppl)), want)
  np.testing.assert_array_equal(
    np.asarray(adv.noise_mask(r, ppl, high=1.0, low=1.5)),
    np.array([[True, True, True, True, True, False]]),
  )
  np.testing.assert_allclose(np.asarray(adv.ref_ppl(np.log([[0.5, 1.0]]))), [[2.0, 1.0]], rtol=1e-6)


def test_capo_noise_mask_partner_and_drop_modes() -> None:
  r, s, v = advantage_refs.random_batch(seed=17, q=16, g=8, p_valid=1.0)
  mask = np.random.default_rng(2).random(r.shape) < 0.25
  # partner: masked rows keep their place in the pair sums, get 0 themselves.
  valid, receive = adv.split_masks(v, mask, mode="partner")
  got = np.asarray(adv.capo(r, s, valid, receive_QG=receive, tau=0.6))
  np.testing.assert_allclose(
    got, advantage_refs.capo_loop(r, s, v, v & ~mask, 0.6), rtol=1e-5, atol=1e-6
  )
  # drop: exactly CAPO on the group with the masked rows deleted.
  valid, receive = adv.split_masks(v, mask, mode="drop")
  got = np.asarray(adv.capo(r, s, valid, receive_QG=receive, tau=0.6))
  for q in range(r.shape[0]):
    keep = ~mask[q]
    sub = advantage_refs.capo_loop(
      r[q : q + 1, keep],
      s[q : q + 1, keep],
      np.ones((1, keep.sum()), bool),
      np.ones((1, keep.sum()), bool),
      0.6,
    )[0]
    np.testing.assert_allclose(got[q, keep], sub, rtol=1e-5, atol=1e-6)
    assert (got[q, ~keep] == 0).all()
  frac = adv.masked_fraction(mask, r, v)
  np.testing.assert_allclose(float(frac["masked_frac"]), mask.mean(), rtol=1e-6)
  np.testing.assert_allclose(float(frac["masked_frac_correct"]), mask[r == 1].mean(), rtol=1e-6)


@pytest.mark.parametrize("mode", adv.MASK_MODES)
def test_lone_correct_sample_masked_as_lucky_guess(mode: str) -> None:
  """One correct sample, masked (reference perplexity 3 > 2.5), and seven wrong ones.

  partner (the paper's A = m * A~, A~ over the whole group): the masked sample receives 0
  but stays the wrong samples' partner, so each wrong j still gets
  A_j = -sigmoid((s_j - s_0) / tau) / (G tau) with G = 8. drop: the group left is all
  wrong, hence degenerate: every advantage is 0."""
  tau = 0.6
  r = np.array([[1, 0, 0, 0, 0, 0, 0, 0]], np.float32)
  s = np.array([[-0.4, -0.9, -0.6, -0.5, -0.4, -0.3, -0.2, -0.1]], np.float32)
  ppl = np.array([[3.0, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8]], np.float32)
  mask = adv.noise_mask(r, ppl)
  np.testing.assert_array_equal(np.asarray(mask), [[True] + [False] * 7])
  valid, receive = adv.split_masks(np.ones_like(r, bool), mask, mode=mode)
  got = np.asarray(algorithms.Capo(tau=tau).advantages(adv.GroupBatch(r, s, valid, receive)))[0]
  if mode == "drop":
    assert (got == 0).all()
    return
  want = [0.0] + [-1 / (1 + math.exp(-(s[0, j] - s[0, 0]) / tau)) / (8 * tau) for j in range(1, 8)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  # Every wrong sample pushed down, the more confident ones (s rises with j) the more.
  assert got[0] == 0 and (got[1:] < 0).all() and (np.diff(got[1:]) < 0).all()


def test_codapo_hand_computed() -> None:
  r = np.array([[1, 0, 0, 0]], np.float32)
  s = np.array([[-0.2, -0.4, -0.6, -0.8]], np.float32)
  # acc = 1/4, d = 3/4, w = 1 - 4 (1/4)^2 = 3/4, c = exp(-0.5), unbiased std(R) =
  # sqrt((0.75^2 + 3 * 0.25^2) / 3) = 1/2.
  scale = math.exp(-0.5) * 0.75 + 0.1
  base = np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6)
  got = algorithms.Codapo().advantages(adv.GroupBatch(r, s, np.ones_like(r, bool)))
  np.testing.assert_allclose(np.asarray(got)[0], base * scale, rtol=1e-5)


def _grpo_norm(x: np.ndarray, ddof: int = 1) -> np.ndarray:
  """GRPO's normalisation of one group in NumPy: (x - mean) / (std + 1e-6)."""
  return (x - x.mean()) / (x.std(ddof=ddof) + 1e-6)


def test_cde_hand_computed_and_omega_schedule() -> None:
  r = np.array([[1, 0, 1]], np.float32)
  s = np.array([[-0.1, -0.5, -2.0]], np.float32)
  v = np.ones_like(r, bool)
  # rewards -> [1, -1, 1]; bonus min(1/3, -s) = [0.1, 1/3, 1/3].
  shaped = np.array([1.1, -1 + 1 / 3, 1 + 1 / 3])
  early = algorithms.Cde().advantages(adv.GroupBatch(r, s, v), step=4, total_steps=10)
  np.testing.assert_allclose(np.asarray(early)[0], _grpo_norm(shaped), rtol=1e-5)
  late = algorithms.Cde().advantages(adv.GroupBatch(r, s, v), step=5, total_steps=10)
  np.testing.assert_allclose(np.asarray(late)[0], _grpo_norm(np.array([1, -1, 1.0])), rtol=1e-5)
  # omega scales the first half's bonus.
  half = algorithms.Cde(omega=0.5).advantages(adv.GroupBatch(r, s, v))
  shaped = np.array([1.05, -1 + 1 / 6, 1 + 1 / 6])
  np.testing.assert_allclose(np.asarray(half)[0], _grpo_norm(shaped), rtol=1e-5)
  # alpha reaches the bonus: alpha = 0.1 -> bonus = 0.1 * (-s).
  got = algorithms.Cde(alpha=0.1).advantages(adv.GroupBatch(r, s, v))
  np.testing.assert_allclose(
    np.asarray(got)[0], _grpo_norm(np.array([1.01, -0.95, 1.2])), rtol=1e-5
  )
  pop = algorithms.Cde(alpha=0.1, std="population").advantages(adv.GroupBatch(r, s, v))
  np.testing.assert_allclose(
    np.asarray(pop)[0], _grpo_norm(np.array([1.01, -0.95, 1.2]), 0), rtol=1e-5
  )


def test_cde_all_correct_group_keeps_its_bonus() -> None:
  """All correct: r = 1 everywhere, so only the bonus min(1/3, -s) spreads the group, and
  the less confident (lower s, higher perplexity) samples go up. All wrong likewise.
  Degenerate only when the shaped rewards are all equal (every bonus capped at 1/3)."""
  s = np.array(
    [
      [-0.05, -0.3, -0.1, -0.2, -0.9],
      [-0.05, -0.3, -0.1, -0.2, -0.9],
      [-0.5, -0.4, -1.0, -2.0, -0.7],
    ],
    np.float32,
  )
  r = np.array([[1] * 5, [0] * 5, [1] * 5], np.float32)
  v = np.ones_like(r, bool)
  got = np.asarray(algorithms.Cde().advantages(adv.GroupBatch(r, s, v), total_steps=10))
  bonus = np.array([0.05, 0.3, 0.1, 0.2, 1 / 3])
  np.testing.assert_allclose(got[0], _grpo_norm(1 + bonus), rtol=1e-4)
  np.testing.assert_allclose(got[1], _grpo_norm(-1 + bonus), rtol=1e-4)
  for q in (0, 1):  # the order of the advantages is the reverse order of s
    np.testing.assert_array_equal(np.argsort(got[q]), np.argsort(-s[q]))
  assert (got[2] == 0).all()  # every bonus capped: all r~ equal
  late = np.asarray(algorithms.Cde().advantages(adv.GroupBatch(r, s, v), step=5, total_steps=10))
  assert (late == 0).all()  # omega = 0: r~ = r, uniform groups are degenerate


def test_cde_shaped_reward_against_numpy() -> None:
  """reward = c + shaping (an overlong penalty): r = 2c - 1 + shaping, so a penalty of
  -1 on a wrong sample gives r = -2, not 2 * (-1) - 1 = -3."""
  c = np.array([[1, 1, 0, 0, 1, 0]], np.float32)
  penalty = np.array([[0, -0.5, 0, -1, -0.25, 0]], np.float32)
  s = np.array([[-0.2, -0.6, -0.1, -0.05, -1.5, -0.4]], np.float32)
  v = np.ones_like(c, bool)
  batch = adv.GroupBatch(c + penalty, s, v, correct_QG=c)
  r = np.array([1, 0.5, -1, -2, 0.75, -1])  # by hand
  late = np.asarray(algorithms.Cde().advantages(batch, step=1, total_steps=2))[0]
  np.testing.assert_allclose(late, _grpo_norm(r), rtol=1e-5)
  # First half: bonus min(|r| / 3, -s) = [0.2, 1/6, 0.1, 0.05, 0.25, 1/3].
  bonus = np.array([0.2, 1 / 6, 0.1, 0.05, 0.25, 1 / 3])
  np.testing.assert_allclose(np.minimum(np.abs(r) / 3, -s[0]), bonus, rtol=1e-6)
  early = np.asarray(algorithms.Cde().advantages(batch, step=0, total_steps=2))[0]
  np.testing.assert_allclose(early, _grpo_norm(r + bonus), rtol=1e-5)


def test_score_transform_spread_and_adaptive_tau() -> None:
  s = np.array([[-0.1, -0.5, -0.9, -0.3], [-0.2, -0.4, -1.0, -2.0], [-1.0, -2.0, -3.0, -4.0]])
  r = np.array([[1, 0, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
  v = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], bool)
  np.testing.assert_allclose(np.asarray(adv.to_score(s, "neg_ppl")), -np.exp(-s), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(adv.to_score(s, "mean_logprob")), s.astype(np.float32))
  # Group 1 is degenerate: skipped. Group 2 uses its 3 valid rows.
  spread = (np.std(s[0]) + np.std(s[2, :3])) / 2
  np.testing.assert_allclose(float(adv.score_spread(s, r, v)), spread, rtol=1e-6)
  for score, conv in (("mean_logprob", lambda x: x), ("neg_ppl", lambda x: -np.exp(-x))):
    z = conv(s)
    tau = 0.5 * (np.std(z[0]) + np.std(z[2, :3])) / 2
    got = algorithms.Capo(score=score, adaptive_tau=0.5).advantages(adv.GroupBatch(r, s, v))
    np.testing.assert_allclose(
      np.asarray(got), advantage_refs.capo_loop(r, z, v, v, tau), rtol=2e-5, atol=1e-6
    )
  # No spread anywhere: adaptive tau falls back to the fixed tau.
  tau = adv.adaptive_tau_value(s[1:2], r[1:2], v[1:2], scale=0.5, fallback=0.6)
  assert float(tau) == pytest.approx(0.6)
