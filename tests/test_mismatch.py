"""Sampler / trainer mismatch: metrics against NumPy, every IS correction at every level
and ``mask_truncated`` against hand-computed losses (the train step, the config checks and
a run: tests/test_mismatch_run.py).

The hand cases (``_HAND``): row 0 has four tokens with rho = 0.25, 1, 3, 27 (sequence
rho = 0.25 * 1 * 3 * 27 = 20.25, geometric rho = 20.25^(1/4) = sqrt(4.5) ~ 2.12), row 1
two tokens with rho = 0.4, 1.5 (sequence rho = 0.6, geometric sqrt(0.6) ~ 0.775) and two
padding slots holding rho = 100; advantages A = (2, -1); C = 2 (MIS keeps [0.5, 2], or
rho <= 2 one-sided), IcePop's band [0.5, 5]. At theta = theta_old the PPO ratio is 1 and
nothing clips, so each kept token's objective is A * w.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capo_jax.rl import losses, mismatch
from capo_jax.rl.batch import Sequences
from capo_jax.rl.losses import LossConfig, PolicyBatch

RHO_BC = np.array([[0.25, 1.0, 3.0, 27.0], [0.4, 1.5, 100.0, 100.0]])
MASK_BC = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32)
ADV_B = np.array([2.0, -1.0], np.float32)
PPO = losses.Ppo()  # the clipped surrogate the corrected weights enter
SEQ1, GEO1 = 0.6, math.sqrt(0.6)  # row 1's sequence (product) and geometric rho
ONE_SIDED = "/one-sided"  # a _HAND key suffix: the MIS correction with mis_two_sided=False

# correction -> (w, keep) by hand (cap 2, band [0.5, 5]).
_HAND = {
  "none": ([[1, 1, 1, 1], [1, 1, 0, 0]], MASK_BC),
  "tis_token": ([[0.25, 1, 2, 2], [0.4, 1.5, 0, 0]], MASK_BC),
  "tis_seq": ([[2, 2, 2, 2], [SEQ1, SEQ1, 0, 0]], MASK_BC),  # row 0 (20.25) capped at 2
  "tis_geo": ([[2, 2, 2, 2], [GEO1, GEO1, 0, 0]], MASK_BC),  # row 0 (2.12) capped at 2
  # two-sided: 0.25 and 0.4 fall below 1/C = 0.5, 3 and 27 above C.
  "mis_token": ([[0, 1, 0, 0], [0, 1.5, 0, 0]], [[0, 1, 0, 0], [0, 1, 0, 0]]),
  "mis_token" + ONE_SIDED: ([[0.25, 1, 0, 0], [0.4, 1.5, 0, 0]], [[1, 1, 0, 0], [1, 1, 0, 0]]),
  "mis_seq": ([[0, 0, 0, 0], [SEQ1, SEQ1, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 0]]),
  "mis_seq" + ONE_SIDED: ([[0, 0, 0, 0], [SEQ1, SEQ1, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 0]]),
  "mis_geo": ([[0, 0, 0, 0], [GEO1, GEO1, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 0]]),
  "icepop": ([[0, 1, 3, 0], [0, 1.5, 0, 0]], [[0, 1, 1, 0], [0, 1, 0, 0]]),
}
# correction -> loss by hand: seq-mean-token-mean averages each kept row's token mean
# over the kept rows; token-mean sums over the kept tokens and divides by their count.
_LOSS = {
  "none": {"seq-mean-token-mean": -(2 * 1 - 1 * 1) / 2, "token-mean": -(2 * 4 - 1 * 2) / 6},
  "tis_token": {
    "seq-mean-token-mean": -(2 * 5.25 / 4 - 1 * 1.9 / 2) / 2,
    "token-mean": -(2 * 5.25 - 1 * 1.9) / 6,
  },
  "tis_seq": {
    "seq-mean-token-mean": -(2 * 2 - SEQ1) / 2,
    "token-mean": -(2 * 2 * 4 - 2 * SEQ1) / 6,
  },
  "tis_geo": {
    "seq-mean-token-mean": -(2 * 2 - GEO1) / 2,
    "token-mean": -(2 * 2 * 4 - 2 * GEO1) / 6,
  },
  # one kept token per row: 1 in row 0 (A 2), 1.5 in row 1 (A -1).
  "mis_token": {"seq-mean-token-mean": -(2 * 1 - 1.5) / 2, "token-mean": -(2 * 1 - 1.5) / 2},
  "mis_token" + ONE_SIDED: {
    "seq-mean-token-mean": -(2 * 1.25 / 2 - 1.9 / 2) / 2,
    "token-mean": -(2 * 1.25 - 1.9) / 4,
  },
  "mis_seq": {
    "seq-mean-token-mean": -(-SEQ1) / 1,  # row 0 rejected: one row left
    "token-mean": -(-2 * SEQ1) / 2,
    "seq-mean-token-sum-norm": -(-2 * SEQ1) / (4 * 1),
  },
  "mis_geo": {
    "seq-mean-token-mean": -(-GEO1) / 1,
    "token-mean": -(-2 * GEO1) / 2,
    "seq-mean-token-sum-norm": -(-2 * GEO1) / (4 * 1),
  },
  "icepop": {
    "seq-mean-token-mean": -(2 * 4 / 2 - 1.5 / 1) / 2,
    "token-mean": -(2 * 4 - 1.5) / 3,
    # Dr.GRPO: the constant normaliser max_len = 4 stays; only rows leave it.
    "seq-mean-token-sum-norm": -(2 * 4 - 1.5) / (4 * 2),
  },
}


def _hand_logps() -> tuple[jax.Array, jax.Array]:
  sampler = np.full(RHO_BC.shape, -1.0)
  return jnp.asarray(sampler + np.log(RHO_BC), jnp.float32), jnp.asarray(sampler, jnp.float32)


def _spec(correction: str, **kw) -> mismatch.MismatchSpec:
  """``correction`` may carry the ``ONE_SIDED`` suffix of the hand tables."""
  name, one_sided, _ = correction.partition(ONE_SIDED)
  return mismatch.MismatchSpec(
    correction=name, cap=2.0, low=0.5, high=5.0, mis_two_sided=not one_sided, **kw
  )


def test_the_hand_table_covers_every_correction():
  assert {k.partition(ONE_SIDED)[0] for k in _HAND} == set(mismatch.CORRECTIONS)


@pytest.mark.parametrize("correction", list(_HAND))
def test_weights_and_rejections_match_the_hand_table(correction):
  old, sampler = _hand_logps()
  w, keep = mismatch.is_weights(old, sampler, jnp.asarray(MASK_BC), _spec(correction))
  want_w, want_keep = _HAND[correction]
  np.testing.assert_allclose(np.asarray(w), np.asarray(want_w, np.float32), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(keep), np.asarray(want_keep, bool))


def _weights(
  lr_BC: np.ndarray, mask_BC: np.ndarray, correction: str, **kw
) -> tuple[np.ndarray, np.ndarray]:
  """is_weights on token log-ratios ``lr_BC`` (sampler log-prob -1 on every slot)."""
  sampler = np.full(lr_BC.shape, -1.0, np.float32)
  old = jnp.asarray(sampler + lr_BC.astype(np.float32))
  w, keep = mismatch.is_weights(
    old, jnp.asarray(sampler), jnp.asarray(mask_BC), _spec(correction, **kw)
  )
  return np.asarray(w), np.asarray(keep)


def test_a_3000_token_response_binds_the_sequence_cap_not_the_geometric_one():
  """Row 0: 3,000 tokens with log rho_t = 5e-4 (the demo's measured scale): sequence
  rho = e^1.5 ~ 4.48 > C = 2, geometric rho = e^0.0005 ~ 1.0005. Row 1: 3,000 tokens with
  log rho_t = 0.05: the product e^150 overflows float32, the capped weight must not.
  Row 2: 3,000 tokens with log rho_t = -0.05: the product e^-150 < 1/C."""
  C = 3000
  lr = np.array([[5e-4] * C, [0.05] * C, [-0.05] * C])
  mask = np.ones(lr.shape, np.int32)
  assert 150 > math.log(np.finfo(np.float32).max)  # ~88.7: why the product stays in log space
  w, keep = _weights(lr, mask, "tis_seq")
  np.testing.assert_allclose(w[0], 2.0, rtol=1e-6)  # min(4.48, 2)
  np.testing.assert_allclose(w[1], 2.0, rtol=1e-6)  # min(e^150, 2)
  np.testing.assert_allclose(w[2], 0.0, atol=1e-30)  # e^-150 is below float32's range
  assert keep.all()
  w, keep = _weights(lr, mask, "tis_geo")
  np.testing.assert_allclose(w[0], math.exp(5e-4), rtol=1e-5)  # 1.0005: the cap never binds
  np.testing.assert_allclose(w[1:], np.exp(lr[1:]), rtol=1e-4)  # e^0.05, e^-0.05
  w, keep = _weights(lr, mask, "mis_seq")  # two-sided: 4.48 and e^150 > 2, e^-150 < 1/2
  assert not keep.any() and not w.any()
  w, keep = _weights(lr, mask, "mis_seq" + ONE_SIDED)  # only row 2 (below C) is kept
  np.testing.assert_array_equal(keep, [[False] * C, [False] * C, [True] * C])
  w, keep = _weights(lr, mask, "mis_geo")  # geometric: all three rows within [1/2, 2]
  assert keep.all()
  np.testing.assert_allclose(w, np.exp(lr), rtol=1e-4)


def test_two_sided_mis_rejects_a_sequence_below_one_over_c_and_one_sided_keeps_it():
  """rho_t = 0.5, 0.5, 1.5: sequence rho = 0.375 < 1/C = 0.5; geometric 0.375^(1/3)
  ~ 0.721 lies inside [0.5, 2]. Row 1 (rho_t = 1.2, 1.5: 1.8) is kept either way."""
  lr = np.log(np.array([[0.5, 0.5, 1.5], [1.2, 1.5, 1.0]]))
  mask = np.array([[1, 1, 1], [1, 1, 0]], np.int32)
  w, keep = _weights(lr, mask, "mis_seq")
  np.testing.assert_array_equal(keep, [[0, 0, 0], [1, 1, 0]])
  np.testing.assert_allclose(w, [[0, 0, 0], [1.8, 1.8, 0]], rtol=1e-5)
  w, keep = _weights(lr, mask, "mis_seq" + ONE_SIDED)
  np.testing.assert_array_equal(keep, mask.astype(bool))
  np.testing.assert_allclose(w, [[0.375] * 3, [1.8, 1.8, 0]], rtol=1e-5)
  w, keep = _weights(lr, mask, "mis_geo")
  np.testing.assert_array_equal(keep, mask.astype(bool))
  np.testing.assert_allclose(w[0], 0.375 ** (1 / 3), rtol=1e-5)


@pytest.mark.parametrize("correction", ["tis_seq", "tis_geo", "mis_seq", "mis_geo"])
def test_padding_does_not_enter_the_sequence_sums(correction):
  """Random rows of 1..40 real tokens, padding slots holding log rho = 30 (rho ~ 1e13):
  each row's weight equals a plain loop over its real tokens. The rows' biases put
  sequence rho = 0.61, 2.67, 0.34, 0.04, 66, 2.14 and geometric rho = 0.99, 2.67, 0.94,
  0.34, 1.16, 1.10: each level has rows inside and outside [1/C, C]."""
  rng = np.random.default_rng(3)
  B, C = 6, 40
  lens = np.array([40, 1, 17, 3, 29, 8])
  bias_B = np.array([0.0, 0.9, -0.05, -0.9, 0.02, 0.1])
  mask = (np.arange(C)[None] < lens[:, None]).astype(np.int32)
  lr = np.where(mask > 0, rng.normal(bias_B[:, None], 0.3, (B, C)), 30.0)
  w, keep = _weights(lr, mask, correction)
  for b in range(B):
    total = 0.0
    for t in range(lens[b]):
      total += lr[b, t]
    log_rho = total if correction.endswith("seq") else total / lens[b]
    rho = math.exp(log_rho)
    kept = correction.startswith("tis") or 0.5 <= rho <= 2.0
    want = (min(rho, 2.0) if correction.startswith("tis") else rho) if kept else 0.0
    assert keep[b, : lens[b]].all() == kept and not keep[b, lens[b] :].any(), b
    np.testing.assert_allclose(w[b, : lens[b]], want, rtol=1e-4, atol=1e-12)
    assert not w[b, lens[b] :].any()


def _corrected_batch(
  correction: str, mask_truncated: bool = False, truncated=(False, False)
) -> PolicyBatch:
  """The hand case through the rollout's ``MismatchSpec.correct``, as the loss sees it."""
  old, sampler = _hand_logps()
  seqs = Sequences(
    completion_mask_BC=jnp.asarray(MASK_BC), old_logp_BC=old, adv_B=jnp.asarray(ADV_B)
  )
  seqs, metrics = _spec(correction, mask_truncated=mask_truncated).correct(
    seqs, sampler, jnp.asarray(~np.asarray(truncated))
  )
  assert "mismatch/abs_log_ratio" in metrics
  return PolicyBatch(
    logp_BC=old,
    old_logp_BC=old,
    mask_BC=seqs.completion_mask_BC,
    adv_B=seqs.adv_B,
    is_weight_BC=seqs.is_weight_BC,
  )


@pytest.mark.parametrize("correction,agg", [(c, a) for c in _LOSS for a in _LOSS[c]])
def test_corrected_loss_matches_hand_computation(correction, agg):
  batch = _corrected_batch(correction)
  loss, aux = losses.policy_loss(PPO, batch, LossConfig(agg=agg, max_len=4))
  assert float(loss) == pytest.approx(_LOSS[correction][agg], rel=1e-5)
  assert float(aux["clip_frac"]) == 0.0


def test_rejected_tokens_leave_the_gradient_and_the_weight_is_detached():
  """IcePop, seq-mean-token-mean: d loss / d logp_t = -(1/rows)(1/kept in row) A w_t on
  kept tokens (ratio 1), 0 on rejected ones; no gradient reaches w."""
  batch = _corrected_batch("icepop")
  cfg = LossConfig()
  grad = jax.grad(lambda lp: losses.policy_loss(PPO, batch._replace(logp_BC=lp), cfg)[0])(
    batch.logp_BC
  )
  want = [
    [0, -(1 / 2) * (1 / 2) * 2 * 1, -(1 / 2) * (1 / 2) * 2 * 3, 0],
    [0, -(1 / 2) * (1 / 1) * -1 * 1.5, 0, 0],
  ]
  np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-7)
  g_w = jax.grad(lambda w: losses.policy_loss(PPO, batch._replace(is_weight_BC=w), cfg)[0])(
    batch.is_weight_BC
  )
  assert not np.asarray(g_w).any()


@pytest.mark.parametrize(
  "agg,want",
  [
    # Row 0 (A = 2, four tokens) truncated: only row 1 (A = -1, two tokens) is left.
    ("seq-mean-token-mean", -(-1.0) / 1),
    ("token-mean", -(-1.0 * 2) / 2),
  ],
)
def test_mask_truncated_drops_the_row_from_numerator_and_denominator(agg, want):
  batch = _corrected_batch("none", mask_truncated=True, truncated=(True, False))
  assert float(losses.policy_loss(PPO, batch, LossConfig(agg=agg))[0]) == pytest.approx(want)
  # Without the flag, the same batch is the "none" row of the table.
  plain = _corrected_batch("none", mask_truncated=False, truncated=(True, False))
  assert float(losses.policy_loss(PPO, plain, LossConfig(agg=agg))[0]) == pytest.approx(
    _LOSS["none"][agg]
  )


def test_mask_truncated_three_rows_by_hand():
  """Rows: truncated (A 2, 4 tokens), kept (A -1, 2 tokens), kept (A 0.5, 3 tokens);
  the ratio is 1 on every token."""
  mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], np.int32)
  logp = jnp.full(mask.shape, -1.0)
  seqs = Sequences(
    completion_mask_BC=jnp.asarray(mask), old_logp_BC=logp, adv_B=jnp.asarray([2.0, -1.0, 0.5])
  )
  seqs, metrics = mismatch.MismatchSpec(measure=False, mask_truncated=True).correct(
    seqs, logp, jnp.asarray([False, True, True])
  )
  assert jax.device_get(metrics) == {"mismatch/loss_token_frac": pytest.approx(5 / 9)}
  batch = PolicyBatch(logp, logp, seqs.completion_mask_BC, seqs.adv_B)
  for agg, want in (
    ("seq-mean-token-mean", -(-1.0 + 0.5) / 2),
    ("token-mean", -(-1.0 * 2 + 0.5 * 3) / 5),
  ):
    assert float(losses.policy_loss(PPO, batch, LossConfig(agg=agg))[0]) == pytest.approx(want)


def test_metrics_match_numpy():
  rng = np.random.default_rng(0)
  B, C = 5, 11
  sampler = np.log(rng.uniform(0.05, 1.0, (B, C)))
  old = sampler + 0.3 * rng.standard_normal((B, C))
  lens = np.array([11, 3, 0, 7, 1])
  mask = np.arange(C)[None] < lens[:, None]
  got = jax.jit(mismatch.mismatch_metrics)(
    jnp.asarray(old, jnp.float32), jnp.asarray(sampler, jnp.float32), jnp.asarray(mask, jnp.int32)
  )
  lr = []  # token by token, real tokens only
  for b in range(B):
    for t in range(lens[b]):
      lr.append(old[b, t] - sampler[b, t])
  lr = np.array(lr)
  rho = np.exp(lr)
  want = {
    "abs_log_ratio": np.abs(lr).mean(),
    "k3_kl": (rho - 1 - lr).mean(),
    "ratio_p01": np.quantile(rho, 0.01),
    "ratio_p50": np.quantile(rho, 0.5),
    "ratio_p99": np.quantile(rho, 0.99),
    "ratio_min": rho.min(),
    "ratio_max": rho.max(),
    "seq_abs_log_ratio": np.mean(
      [abs(np.mean(old[b, : lens[b]] - sampler[b, : lens[b]])) for b in range(B) if lens[b]]
    ),
    "seq_abs_sum_log_ratio": np.mean(
      [abs(np.sum(old[b, : lens[b]] - sampler[b, : lens[b]])) for b in range(B) if lens[b]]
    ),
  }
  assert set(got) == set(want)
  for k, v in want.items():
    assert float(got[k]) == pytest.approx(v, rel=1e-4), k
  assert float(got["k3_kl"]) > 0
