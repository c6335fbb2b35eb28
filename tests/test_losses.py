"""Policy losses against NumPy references and closed forms.

References: the clipped surrogate and its gradient written per token in NumPy,
KL estimators averaged exactly over small categorical distributions, SimKO's
gradient split derived by hand. The end-to-end identity grad L = -(1/B) sum_i A_i grad s_i
on the tiny Qwen2 model at theta = theta_old: tests/test_losses_pg_identity.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capo_jax.rl import losses
from capo_jax.rl.losses import LossConfig, PolicyBatch
from capo_jax.run import spec as spec_lib
from configs import common


def _batch(
  seed: int, b: int = 6, c: int = 9, k: int = 3, spread: float = 0.3, adv_scale: float = 1.0
) -> PolicyBatch:
  rng = np.random.default_rng(seed)
  old = np.log(rng.uniform(0.05, 0.95, (b, c))).astype(np.float32)
  logp = (old + spread * rng.standard_normal((b, c))).astype(np.float32)
  lens = rng.integers(1, c + 1, size=b)
  lens[0] = c
  mask = (np.arange(c)[None, :] < lens[:, None]).astype(np.float32)
  adv = (adv_scale * rng.standard_normal(b)).astype(np.float32)
  adv[1] = 0.0
  topk = np.log(rng.uniform(0.05, 0.6, (b, c, k))).astype(np.float32)
  old_topk = (topk + 0.1 * rng.standard_normal((b, c, k))).astype(np.float32)
  return PolicyBatch(
    logp_BC=jnp.asarray(logp),
    old_logp_BC=jnp.asarray(old),
    mask_BC=jnp.asarray(mask),
    adv_B=jnp.asarray(adv),
    entropy_BC=jnp.asarray(rng.uniform(0, 3, (b, c)), jnp.float32),
    ref_logp_BC=jnp.asarray(old + 0.2 * rng.standard_normal((b, c)), jnp.float32),
    topk_logp_BCJ=jnp.asarray(topk),
    old_topk_logp_BCJ=jnp.asarray(old_topk),
    is_argmax_BC=jnp.asarray(rng.random((b, c)) < 0.6),
    correct_B=jnp.asarray(np.arange(b) % 2 == 0),
  )


def _agg_weights(mask: np.ndarray, agg: str, max_len: int | None = None) -> np.ndarray:
  """d(aggregate)/d(x_bt), computed row by row."""
  w = np.zeros(mask.shape)
  rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
  for i in rows:
    for t in range(mask.shape[1]):
      if mask[i, t]:
        if agg == "seq-mean-token-mean":
          w[i, t] = 1.0 / (len(rows) * mask[i].sum())
        elif agg == "token-mean":
          w[i, t] = 1.0 / mask.sum()
        else:
          w[i, t] = 1.0 / (len(rows) * (max_len or mask.shape[1]))
  return w


def _ppo_reference(batch: PolicyBatch, cfg: LossConfig):
  """Loss, d loss / d logp and clip fractions, token by token in float64."""
  logp, old = np.asarray(batch.logp_BC, np.float64), np.asarray(batch.old_logp_BC, np.float64)
  mask, adv = np.asarray(batch.mask_BC), np.asarray(batch.adv_B, np.float64)
  w = _agg_weights(mask, cfg.agg, cfg.max_len)
  loss, grad, low, high = 0.0, np.zeros(logp.shape), 0, 0
  for i in range(logp.shape[0]):
    for t in range(logp.shape[1]):
      if not mask[i, t]:
        continue
      rho, a = np.exp(logp[i, t] - old[i, t]), adv[i]
      clipped = min(max(rho, 1 - cfg.eps_low), 1 + cfg.eps_high)
      loss -= w[i, t] * min(rho * a, clipped * a)
      is_low, is_high = rho < 1 - cfg.eps_low and a < 0, rho > 1 + cfg.eps_high and a > 0
      low, high = low + is_low, high + is_high
      if not (is_low or is_high):
        grad[i, t] = -w[i, t] * a * rho
  n = mask.sum()
  return loss, grad, low / n, high / n


@pytest.mark.parametrize("agg", losses.AGGS)
def test_ppo_loss_value_grad_and_aux_match_token_loop(agg: str) -> None:
  batch = _batch(seed=1, spread=0.4)
  cfg = LossConfig(agg=agg, max_len=12 if agg == "seq-mean-token-sum-norm" else None)
  loss, aux = losses.policy_loss(losses.Ppo(), batch, cfg)
  grad = jax.jit(
    jax.grad(lambda lp: losses.policy_loss(losses.Ppo(), batch._replace(logp_BC=lp), cfg)[0])
  )(batch.logp_BC)
  want_loss, want_grad, low, high = _ppo_reference(batch, cfg)
  assert 0 < low and 0 < high  # the case exercises both clip sides
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(aux["clip_frac_low"]), low, rtol=1e-6)
  np.testing.assert_allclose(float(aux["clip_frac_high"]), high, rtol=1e-6)
  m = np.asarray(batch.mask_BC) > 0
  rho = np.exp(np.asarray(batch.logp_BC) - np.asarray(batch.old_logp_BC))[m]
  np.testing.assert_allclose(
    [float(aux["ratio_mean"]), float(aux["ratio_min"]), float(aux["ratio_max"])],
    [rho.mean(), rho.min(), rho.max()],
    rtol=1e-5,
  )
  np.testing.assert_allclose(
    float(aux["entropy"]), np.asarray(batch.entropy_BC)[m].mean(), rtol=1e-5
  )
  assert float(aux["zero_adv_frac"]) == pytest.approx(1 / 6)


@pytest.mark.parametrize(
  "agg,want",
  [
    ("auto", "seq-mean-token-sum-norm"),
    ("seq-mean-token-mean", "seq-mean-token-mean"),
    ("token-mean", "token-mean"),
  ],
)
def test_dr_grpo_default_aggregation_is_its_own(agg: str, want: str) -> None:
  """Dr.GRPO's loss sums each response's tokens and divides by a constant, the rollout's
  max_new_tokens (Dr.GRPO's MAX_TOKENS), not by the response's length; an explicit
  loss.agg overrides it. At theta = theta_old (rho = 1) the loss is, by hand,
  -(1/rows) sum_i A_i |o_i| / max_new_tokens."""
  c = common.shrink(common.get_base_config())
  c.algo.name, c.loss.agg = "dr_grpo", agg
  cfg = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True).train_config().loss
  assert cfg.agg == want and cfg.max_len == c.rollout.max_new_tokens == 16
  lens, adv = np.array([3, 16, 5]), np.array([1.0, -0.5, 2.0], np.float32)
  mask = (np.arange(16)[None] < lens[:, None]).astype(np.float32)
  logp = jnp.full(mask.shape, -0.7, jnp.float32)
  loss, _ = losses.policy_loss(
    losses.Ppo(), PolicyBatch(logp, logp, jnp.asarray(mask), jnp.asarray(adv)), cfg
  )
  by_hand = {
    "seq-mean-token-sum-norm": -(3 * 1 - 16 * 0.5 + 5 * 2) / (16 * 3),
    "seq-mean-token-mean": -(1 - 0.5 + 2) / 3,
    "token-mean": -(3 * 1 - 16 * 0.5 + 5 * 2) / 24,
  }[want]
  assert float(loss) == pytest.approx(by_hand, rel=1e-6)


def test_padding_garbage_does_not_leak() -> None:
  batch = _batch(seed=2)
  pad = np.asarray(batch.mask_BC) == 0
  assert pad.any()
  dirty = batch._replace(
    logp_BC=jnp.where(pad, jnp.nan, batch.logp_BC),
    old_logp_BC=jnp.where(pad, -jnp.inf, batch.old_logp_BC),
    ref_logp_BC=jnp.where(pad, jnp.inf, batch.ref_logp_BC),
  )
  cfg = LossConfig(beta=0.1)
  for kind in (cls() for cls in losses.LOSSES.values()):
    f = lambda lp, b: losses.policy_loss(kind, b._replace(logp_BC=lp), cfg)[0]
    g_clean = jax.grad(f)(batch.logp_BC, batch)
    g_dirty = jax.grad(f)(dirty.logp_BC, dirty)
    assert np.isfinite(np.asarray(g_dirty)).all(), kind
    np.testing.assert_allclose(np.asarray(g_dirty), np.asarray(g_clean), rtol=1e-6)
    np.testing.assert_allclose(
      float(f(dirty.logp_BC, dirty)), float(f(batch.logp_BC, batch)), rtol=1e-6
    )


def _categorical(seed: int, v: int = 7):
  rng = np.random.default_rng(seed)
  theta = rng.standard_normal(v)
  logq = np.log(rng.dirichlet(np.ones(v)))
  return theta, logq


def test_kl_estimators_exact_expectations() -> None:
  """E_{x~p}[k1] = E_{x~p}[k3] = KL(p||q); E[k2] = sum_x p (log p/q)^2 / 2."""
  for seed in range(3):
    theta, logq = _categorical(seed)
    logp = theta - np.log(np.exp(theta).sum())
    p = np.exp(logp)
    kl = float(np.sum(p * (logp - logq)))
    expect = lambda est: float(
      np.sum(
        p * np.asarray(losses.kl_per_token(jnp.asarray(logp), jnp.asarray(logq), est), np.float64)
      )
    )
    np.testing.assert_allclose(expect("k1"), kl, rtol=1e-5)
    np.testing.assert_allclose(expect("k3"), kl, rtol=1e-5)
    np.testing.assert_allclose(expect("k2"), 0.5 * np.sum(p * (logp - logq) ** 2), rtol=1e-5)


def test_kl_estimators_expected_gradients() -> None:
  """With samples from p_theta held fixed (as the loss does), E[grad k] is known.

  k1: 0 (score function has mean 0); k2: grad KL(p||q); k3: grad KL(q||p).
  """
  theta, logq = _categorical(5)
  logq = jnp.asarray(logq)

  def expected(est: str):
    def f(th):
      logp = jax.nn.log_softmax(th)
      p = jax.lax.stop_gradient(jnp.exp(logp))
      return jnp.sum(p * losses.kl_per_token(logp, logq, est))

    return np.asarray(jax.grad(f)(jnp.asarray(theta)))

  fwd = lambda th: jnp.sum(jax.nn.softmax(th) * (jax.nn.log_softmax(th) - logq))
  rev = lambda th: jnp.sum(jnp.exp(logq) * (logq - jax.nn.log_softmax(th)))
  np.testing.assert_allclose(expected("k1"), 0.0, atol=1e-6)
  np.testing.assert_allclose(
    expected("k2"), np.asarray(jax.grad(fwd)(jnp.asarray(theta))), rtol=1e-4, atol=1e-6
  )
  np.testing.assert_allclose(
    expected("k3"), np.asarray(jax.grad(rev)(jnp.asarray(theta))), rtol=1e-4, atol=1e-6
  )


@pytest.mark.parametrize("est", losses.KL_ESTIMATORS)
def test_kl_term_in_policy_loss(est: str) -> None:
  batch = _batch(seed=3)
  base, _ = losses.policy_loss(losses.Ppo(), batch, LossConfig(kl_estimator=est))
  loss, aux = losses.policy_loss(losses.Ppo(), batch, LossConfig(beta=0.5, kl_estimator=est))
  m = np.asarray(batch.mask_BC) > 0
  r = np.asarray(batch.ref_logp_BC, np.float64) - np.asarray(batch.logp_BC, np.float64)
  k = {"k1": -r, "k2": 0.5 * r**2, "k3": np.exp(r) - r - 1}[est]
  kl = np.mean([k[i][m[i]].mean() for i in range(m.shape[0])])  # seq-mean-token-mean
  np.testing.assert_allclose(float(aux["kl"]), kl, rtol=1e-5)
  np.testing.assert_allclose(float(loss), float(base) + 0.5 * kl, rtol=1e-5)


def test_gspo_value_against_numpy() -> None:
  batch = _batch(seed=4, spread=2e-3)
  cfg = LossConfig()
  loss, aux = losses.policy_loss(losses.Gspo(), batch, cfg)
  m = np.asarray(batch.mask_BC) > 0
  d = np.asarray(batch.logp_BC, np.float64) - np.asarray(batch.old_logp_BC, np.float64)
  adv = np.asarray(batch.adv_B, np.float64)
  terms, clipped = [], 0
  for i in range(m.shape[0]):
    s = np.exp(d[i][m[i]].mean())
    c = np.clip(s, 1 - 3e-4, 1 + 4e-4)
    terms.append(-min(s * adv[i], c * adv[i]))
    clipped += ((s < 1 - 3e-4 and adv[i] < 0) or (s > 1 + 4e-4 and adv[i] > 0)) * m[i].sum()
  assert 0 < clipped < m.sum()
  np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-5)
  np.testing.assert_allclose(float(aux["clip_frac"]), clipped / m.sum(), rtol=1e-6)


def test_gspo_and_simko_reduce_to_grpo() -> None:
  """GSPO with a very wide clip at theta = theta_old, SimKO with alpha = 0, lambda = 1."""
  wide = LossConfig(eps_low=0.99, eps_high=1e6)
  wide_gspo = losses.Gspo(eps_low=0.99, eps_high=1e6)
  onpolicy = _batch(seed=6)
  onpolicy = onpolicy._replace(logp_BC=onpolicy.old_logp_BC)
  grad = lambda kind, b, cfg: np.asarray(
    jax.grad(lambda lp: losses.policy_loss(kind, b._replace(logp_BC=lp), cfg)[0])(b.logp_BC)
  )
  np.testing.assert_allclose(
    grad(wide_gspo, onpolicy, wide), grad(losses.Ppo(), onpolicy, wide), rtol=1e-5, atol=1e-8
  )
  np.testing.assert_allclose(
    float(losses.policy_loss(wide_gspo, onpolicy, wide)[0]),
    float(losses.policy_loss(losses.Ppo(), onpolicy, wide)[0]),
    rtol=1e-6,
  )
  off = _batch(seed=6, spread=0.4)
  plain = losses.Simko(alpha=0.0, lam=1.0)
  for cfg in (LossConfig(), LossConfig(agg="token-mean")):
    np.testing.assert_allclose(grad(plain, off, cfg), grad(losses.Ppo(), off, cfg), rtol=1e-6)
    np.testing.assert_allclose(
      float(losses.policy_loss(plain, off, cfg)[0]),
      float(losses.policy_loss(losses.Ppo(), off, cfg)[0]),
      rtol=1e-6,
    )


def test_forked_tokens_match_numpy_quantile() -> None:
  batch = _batch(seed=8, c=20)
  fork = np.asarray(losses.forked_tokens(batch.entropy_BC, batch.mask_BC, 0.8))
  ent, m = np.asarray(batch.entropy_BC), np.asarray(batch.mask_BC) > 0
  for i in range(m.shape[0]):
    thr = np.quantile(ent[i][m[i]], 0.8)
    np.testing.assert_array_equal(fork[i], m[i] & (ent[i] > thr))
  assert fork.sum() > 0


def test_simko_gradient_split_by_hand() -> None:
  """Unclipped tokens: d/dlogp = -(1 - a w) A' rho g, d/dtopk_k = -(a w / K) A' rho g.

  w = forked and correct, A' = A * lambda on forked argmax tokens of wrong
  responses, g = aggregation weight. The loss value equals PPO's.
  """
  batch = _batch(seed=9, c=12, spread=0.05)
  cfg = LossConfig(agg="token-mean")
  simko = losses.Simko(alpha=0.3, lam=1.5)
  f = lambda lp, tk: losses.policy_loss(simko, batch._replace(logp_BC=lp, topk_logp_BCJ=tk), cfg)[0]
  g_lp, g_tk = jax.jit(jax.grad(f, argnums=(0, 1)))(batch.logp_BC, batch.topk_logp_BCJ)
  m = np.asarray(batch.mask_BC) > 0
  ent = np.asarray(batch.entropy_BC)
  rho = np.exp(np.asarray(batch.logp_BC, np.float64) - np.asarray(batch.old_logp_BC, np.float64))
  assert (np.abs(rho[m] - 1) < 0.2).all()  # nothing clipped
  correct, argmax = np.asarray(batch.correct_B), np.asarray(batch.is_argmax_BC)
  want_lp, want_tk = np.zeros(rho.shape), np.zeros(rho.shape + (3,))
  for i in range(m.shape[0]):
    thr = np.quantile(ent[i][m[i]], 0.8)
    for t in range(m.shape[1]):
      if not m[i, t]:
        continue
      forked = ent[i, t] > thr
      a = float(batch.adv_B[i]) * (1.5 if forked and argmax[i, t] and not correct[i] else 1.0)
      alpha = 0.3 if forked and correct[i] else 0.0
      g = 1.0 / m.sum()
      want_lp[i, t] = -(1 - alpha) * a * rho[i, t] * g
      want_tk[i, t, :] = -(alpha / 3) * a * rho[i, t] * g
  assert np.abs(want_tk).max() > 0
  np.testing.assert_allclose(np.asarray(g_lp), want_lp, rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(np.asarray(g_tk), want_tk, rtol=1e-5, atol=1e-8)
  # SimKO changes the gradient of correct responses, not the loss value
  # (lambda does change the wrong ones' value, so compare with lambda = 1).
  no_boost = losses.Simko(alpha=0.3, lam=1.0)
  np.testing.assert_allclose(
    float(losses.policy_loss(no_boost, batch, cfg)[0]),
    float(losses.policy_loss(losses.Ppo(), batch, cfg)[0]),
    rtol=1e-6,
  )


def test_bad_inputs_raise_clear_errors() -> None:
  batch = _batch(seed=10)
  with pytest.raises(ValueError, match="agg='mean'"):
    LossConfig(agg="mean")
  with pytest.raises(ValueError, match="kl_estimator='k4'"):
    LossConfig(kl_estimator="k4")
  with pytest.raises(ValueError, match="eps_low"):
    LossConfig(eps_low=1.0)
  with pytest.raises(TypeError, match="loss must be a PolicyLoss.*got 'grpo'"):
    losses.policy_loss("grpo", batch)
  with pytest.raises(ValueError, match="needs PolicyBatch.ref_logp_BC"):
    losses.policy_loss(losses.Ppo(), batch._replace(ref_logp_BC=None), LossConfig(beta=0.1))
  with pytest.raises(ValueError, match="PolicyBatch.correct_B is required"):
    losses.policy_loss(losses.Simko(), batch._replace(correct_B=None))
  with pytest.raises(ValueError, match="Simko.k=4"):
    losses.policy_loss(losses.Simko(k=4), batch)
  with pytest.raises(ValueError, match=r"adv_B has shape \(5,\)"):
    losses.policy_loss(losses.Ppo(), batch._replace(adv_B=batch.adv_B[:5]))
  # Each loss checks its own fields, once, when it is built.
  for bad, needle in (
    (lambda: losses.Gspo(eps_low=1.0), "Gspo.eps_low=1.0 must be < 1"),
    (lambda: losses.Gspo(eps_high=-1.0), "Gspo.eps_high=-1.0 must be >= 0"),
    (lambda: losses.Simko(alpha=-0.1), "Simko.alpha=-0.1 must be >= 0"),
    (lambda: losses.Simko(k=0), "Simko.k=0 must be >= 1"),
    (lambda: losses.Simko(quantile=1.5), r"Simko.quantile=1.5 must lie"),
  ):
    with pytest.raises(ValueError, match=needle):
      bad()


def test_run_spec_builds_each_algorithms_loss_from_config_loss() -> None:
  """config.loss's per-loss fields (gspo_*, simko_*) reach the loss classes' own fields,
  the shared ones LossConfig; SimKO's K is also the old pass's top-K."""
  c = common.shrink(common.get_base_config())
  c.loss.eps_low, c.loss.eps_high, c.loss.beta = 0.1, 0.3, 0.01
  c.loss.gspo_eps_low, c.loss.gspo_eps_high = 1e-4, 2e-4
  c.loss.simko_alpha, c.loss.simko_k, c.loss.simko_lambda, c.loss.simko_quantile = 0.02, 4, 1.3, 0.7
  want = {
    "capo": losses.Ppo(),
    "grpo": losses.Ppo(),
    "dr_grpo": losses.Ppo(),
    "codapo": losses.Ppo(),
    "cde": losses.Ppo(),
    "gspo": losses.Gspo(eps_low=1e-4, eps_high=2e-4),
    "simko": losses.Simko(alpha=0.02, k=4, lam=1.3, quantile=0.7),
  }
  for name, loss in want.items():
    c.algo.name = name
    spec = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True)
    tcfg = spec.train_config()
    assert tcfg.policy_loss == loss and type(tcfg.policy_loss) is type(loss), name
    assert (tcfg.loss.eps_low, tcfg.loss.eps_high, tcfg.loss.beta) == (0.1, 0.3, 0.01)
    assert spec.simko_k == (4 if name == "simko" else 0)
  c.loss.simko_k = 0  # checked by the class even when unused, named by the config section
  with pytest.raises(spec_lib.ConfigError, match=r"config\.loss: Simko\.k=0 must be >= 1"):
    spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True)
