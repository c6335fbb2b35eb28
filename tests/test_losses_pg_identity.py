"""The policy-gradient identity end to end on the tiny Qwen2: at theta = theta_old,
grad L = -(1/B) sum_i A_i grad s_i, with s_i computed straight from the model's forward.
The losses against NumPy references and closed forms: tests/test_losses.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capo_jax.rl import losses
from capo_jax.rl.losses import LossConfig, PolicyBatch


@pytest.mark.slow  # 10-21 s on 2 cores; .ci/run runs it
def test_policy_gradient_identity_on_tiny_qwen2() -> None:
  """At theta = theta_old, grad L = -(1/B) sum_i A_i grad s_i (seq-mean-token-mean).

  s_i is the mean completion-token log-prob, computed here straight from
  `models.qwen2.forward`. The same holds for GSPO; for token-mean the weight
  of row i is |o_i| / (total tokens) instead of 1/B.
  """
  from capo_jax.rl import advantages
  from models import qwen2
  from models.config import Qwen2Config

  cfg = Qwen2Config.tiny(num_layers=1, vocab_size=64)
  params = qwen2.init_params(cfg, jax.random.key(0))
  q, g, p_len, c_len = 2, 4, 5, 7
  b = q * g
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, p_len + c_len)), jnp.int32)
  p_lens, c_lens = rng.integers(2, p_len + 1, b), rng.integers(1, c_len + 1, b)
  prompt_mask = np.arange(p_len)[None, :] >= (p_len - p_lens)[:, None]  # left-padded
  comp_mask = np.arange(c_len)[None, :] < c_lens[:, None]  # right-padded
  mask_BT = jnp.asarray(np.concatenate([prompt_mask, comp_mask], 1), jnp.int32)
  mask_BC = jnp.asarray(comp_mask, jnp.float32)

  def token_logp(prm):
    logits = qwen2.forward(prm, cfg, tokens, mask_BT)[:, p_len - 1 : -1]  # predicts completion
    logp_BCV = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_BCV, tokens[:, p_len:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_BCV) * logp_BCV, axis=-1)
    return logp, ent

  def mean_logp(prm):
    logp, _ = token_logp(prm)
    return (logp * mask_BC).sum(-1) / mask_BC.sum(-1)

  old_logp, ent = jax.lax.stop_gradient(token_logp(params))
  rewards = np.array([[1, 0, 1, 0], [0, 1, 1, 1]], np.float32)
  adv_QG = advantages.capo(
    rewards, mean_logp(params).reshape(q, g), np.ones((q, g), bool), tau=0.05
  )
  adv_B = jnp.asarray(adv_QG).reshape(b)
  assert np.abs(np.asarray(adv_B)).min() > 0

  def loss(prm, kind, agg):
    logp, _ = token_logp(prm)
    batch = PolicyBatch(
      logp_BC=logp, old_logp_BC=old_logp, mask_BC=mask_BC, adv_B=adv_B, entropy_BC=ent
    )
    return losses.policy_loss(kind, batch, LossConfig(agg=agg))[0]

  lens = np.asarray(mask_BC.sum(-1))
  row_w = {"seq-mean-token-mean": np.full(b, 1.0 / b), "token-mean": lens / lens.sum()}
  cases = (
    (losses.Ppo(), "seq-mean-token-mean"),
    (losses.Gspo(), "seq-mean-token-mean"),
    (losses.Ppo(), "token-mean"),
  )

  @jax.jit
  def all_grads(prm):  # one compilation for every case keeps the test fast
    out = []
    for kind, agg in cases:
      w = jnp.asarray(row_w[agg], jnp.float32)
      want = jax.grad(lambda x: -jnp.sum(w * adv_B * mean_logp(x)))(prm)
      out.append((want, jax.grad(loss)(prm, kind, agg)))
    return out

  for (kind, agg), (want, got) in zip(cases, all_grads(params)):
    flat_got = dict(jax.tree_util.tree_leaves_with_path(got))
    scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree_util.tree_leaves(want))
    assert scale > 0
    for path, gw in jax.tree_util.tree_leaves_with_path(want):
      np.testing.assert_allclose(
        np.asarray(flat_got[path]),
        np.asarray(gw),
        rtol=1e-4,
        atol=1e-6 * scale,
        err_msg=f"{kind}/{agg} {jax.tree_util.keystr(path)}",
      )
