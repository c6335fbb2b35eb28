"""Policy losses: the PPO-style clipped surrogate, GSPO and SimKO, plus KL.

Inputs are per-token arrays over the completion (axis C), rows B = Q * G.
`policy_loss(kind, batch, cfg)` is the one entry point; `kind` is "ppo"
(used by grpo, dr_grpo, capo, codapo and cde), "gspo" or "simko". Every loss
returns `(loss, aux)` with aux a flat dict of scalars for logging.

Conventions (the equations: ``docs/algorithms.md``, "Policy losses"):
  * rho = exp(logp - old_logp); token objective
    `min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`; loss = -objective.
  * Aggregation over tokens (`LossConfig.agg`):
      "seq-mean-token-mean" (default): mean over rows that have at least one
        token of each row's token mean;
      "token-mean": mean over all completion tokens of the batch;
      "seq-mean-token-sum-norm" (Dr.GRPO's, and dr_grpo's default in a run): each
        row's token sum divided by the constant `max_len`, averaged over rows with
        tokens; a run sets `max_len` to rollout.max_new_tokens (Dr.GRPO's MAX_TOKENS),
        a bare LossConfig leaves it None (C, the padded completion length).
  * KL(pi_theta || pi_ref) per token from r = ref_logp - logp:
    k1 = -r, k2 = r^2 / 2, k3 = exp(r) - r - 1; aggregated like the loss and
    added with weight beta (0 by default, when ref_logp may be omitted).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from capo_jax.masked import masked_mean
from capo_jax.types import Array

AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
KINDS = ("ppo", "gspo", "simko")


class PolicyBatch(NamedTuple):
  """Per-token inputs of a policy loss (a pytree; optional fields may be None).

  Attributes:
    logp_BC: log-prob of the sampled token under the current policy (differentiable).
    old_logp_BC: same under the policy that sampled the batch.
    mask_BC: 1 on completion tokens (EOS included), 0 on padding.
    adv_B: per-sequence advantage.
    entropy_BC: per-token entropy of the current policy (logging, SimKO gating;
      treated as stop-gradient).
    ref_logp_BC: log-prob under the frozen reference (KL; needed when beta > 0).
    topk_logp_BCJ: SimKO: current log-probs of the K most likely tokens (differentiable).
    old_topk_logp_BCJ: SimKO: old-policy log-probs of those same tokens.
    is_argmax_BC: SimKO: the sampled token is the current argmax.
    correct_B: SimKO: the response is correct (reward 1).
    is_weight_BC: the mismatch correction's detached weight w >= 0 of each token's
      policy-gradient term (``capo_jax.rl.mismatch``); None: 1.
  """
  logp_BC: Array
  old_logp_BC: Array
  mask_BC: Array
  adv_B: Array
  entropy_BC: Array | None = None
  ref_logp_BC: Array | None = None
  topk_logp_BCJ: Array | None = None
  old_topk_logp_BCJ: Array | None = None
  is_argmax_BC: Array | None = None
  correct_B: Array | None = None
  is_weight_BC: Array | None = None


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Hyper-parameters of the policy losses; the defaults are the papers' (eps 0.2 for
  PPO; GSPO's 3e-4 / 4e-4; SimKO's alpha 0.01, K 3, lambda 1.1, 0.8 entropy quantile)."""
  eps_low: float = 0.2
  eps_high: float = 0.2
  agg: str = "seq-mean-token-mean"
  beta: float = 0.0
  kl_estimator: str = "k3"
  max_len: int | None = None  # seq-mean-token-sum-norm's constant; None: C
  gspo_eps_low: float = 3e-4
  gspo_eps_high: float = 4e-4
  simko_alpha: float = 0.01
  simko_k: int = 3
  simko_lambda: float = 1.1
  simko_quantile: float = 0.8

  def __post_init__(self) -> None:
    if self.agg not in AGGS:
      raise ValueError(f"LossConfig.agg={self.agg!r} is not one of {AGGS}")
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"LossConfig.kl_estimator={self.kl_estimator!r} is not one of "
                       f"{KL_ESTIMATORS}")
    for name in ("eps_low", "eps_high", "gspo_eps_low", "gspo_eps_high", "beta",
                 "simko_alpha"):
      if getattr(self, name) < 0:
        raise ValueError(f"LossConfig.{name}={getattr(self, name)} must be >= 0")
    if self.eps_low >= 1 or self.gspo_eps_low >= 1:
      raise ValueError("LossConfig.eps_low / gspo_eps_low must be < 1 (the ratio's lower "
                       f"clip bound 1 - eps must stay positive), got {self.eps_low}, "
                       f"{self.gspo_eps_low}")
    if self.max_len is not None and self.max_len <= 0:
      raise ValueError(f"LossConfig.max_len={self.max_len} must be positive")
    if self.simko_k < 1:
      raise ValueError(f"LossConfig.simko_k={self.simko_k} must be >= 1")
    if not 0.0 <= self.simko_quantile <= 1.0:
      raise ValueError("LossConfig.simko_quantile="
                       f"{self.simko_quantile} must lie in [0, 1]")


# --------------------------------------------------------------------------
# Building blocks.
# --------------------------------------------------------------------------


def aggregate(x_BC: Array, mask_BC: Array, agg: str, max_len: int | None = None) -> Array:
  """Reduces a per-token quantity to a scalar with aggregation mode `agg`."""
  m = mask_BC > 0
  rows = jnp.maximum(m.any(-1).sum(), 1)
  if agg == "seq-mean-token-mean":
    return masked_mean(x_BC, m, axis=-1).sum() / rows
  if agg == "token-mean":
    return masked_mean(x_BC, m)
  if agg == "seq-mean-token-sum-norm":
    norm = x_BC.shape[-1] if max_len is None else max_len
    return jnp.where(m, x_BC, 0.0).sum() / (norm * rows)  # padding may hold inf / NaN
  raise ValueError(f"aggregate: agg={agg!r} is not one of {AGGS}")


def kl_per_token(logp_BC: Array, ref_logp_BC: Array, estimator: str = "k3") -> Array:
  """Per-token estimate of KL(pi_theta || pi_ref) for tokens sampled from pi_theta."""
  r = ref_logp_BC - logp_BC
  if estimator == "k1":
    return -r
  if estimator == "k2":
    return 0.5 * r**2
  if estimator == "k3":
    return jnp.exp(r) - r - 1.0
  raise ValueError(f"kl_per_token: estimator={estimator!r} is not one of {KL_ESTIMATORS}")


def _clipped(ratio_BC: Array, adv_BC: Array, mask_BC: Array, eps_low: float,
             eps_high: float, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
  """The clipped surrogate loss (aggregated) and its clip statistics."""
  clipped_BC = jnp.clip(ratio_BC, 1.0 - eps_low, 1.0 + eps_high)
  obj_BC = jnp.minimum(ratio_BC * adv_BC, clipped_BC * adv_BC)
  loss = aggregate(-obj_BC, mask_BC, cfg.agg, cfg.max_len)
  r = jax.lax.stop_gradient(ratio_BC)
  m = mask_BC > 0
  # A token is "clipped" when the clipped branch wins and carries no gradient.
  low_BC = (r < 1.0 - eps_low) & (adv_BC < 0)
  high_BC = (r > 1.0 + eps_high) & (adv_BC > 0)
  big = jnp.finfo(r.dtype).max
  aux = {
      "clip_frac_low": masked_mean(low_BC.astype(r.dtype), mask_BC),
      "clip_frac_high": masked_mean(high_BC.astype(r.dtype), mask_BC),
      "clip_frac": masked_mean((low_BC | high_BC).astype(r.dtype), mask_BC),
      "ratio_mean": masked_mean(r, mask_BC),
      "ratio_min": jnp.where(m, r, big).min(),
      "ratio_max": jnp.where(m, r, -big).max(),
      "pg_loss": loss,
  }
  return loss, aux


def _common_aux(batch: PolicyBatch, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
  """KL penalty term and the logging shared by every kind."""
  mask = batch.mask_BC
  has_tokens_B = mask.sum(-1) > 0
  aux = {
      "zero_adv_frac": (has_tokens_B & (batch.adv_B == 0)).sum()
                       / jnp.maximum(has_tokens_B.sum(), 1),
      "token_frac": (mask > 0).mean(),
  }
  if batch.entropy_BC is not None:
    aux["entropy"] = masked_mean(jax.lax.stop_gradient(batch.entropy_BC), mask)
  penalty = jnp.zeros((), batch.logp_BC.dtype)
  if batch.ref_logp_BC is not None:
    kl_BC = kl_per_token(batch.logp_BC, batch.ref_logp_BC, cfg.kl_estimator)
    kl = aggregate(kl_BC, mask, cfg.agg, cfg.max_len)
    aux["kl"] = jax.lax.stop_gradient(kl)
    penalty = cfg.beta * kl
  elif cfg.beta > 0:
    raise ValueError(f"policy_loss: LossConfig.beta={cfg.beta} > 0 needs "
                     "PolicyBatch.ref_logp_BC, which is None")
  return penalty, aux


def _weighted(adv_BC: Array, batch: PolicyBatch) -> Array:
  """The advantage times the mismatch weight: w >= 0 is detached, so
  min(rho A w, clip(rho) A w) = w min(rho A, clip(rho) A), the clip statistics unchanged."""
  if batch.is_weight_BC is None:
    return adv_BC
  return adv_BC * jax.lax.stop_gradient(batch.is_weight_BC)


# --------------------------------------------------------------------------
# The three kinds.
# --------------------------------------------------------------------------


def ppo_loss(batch: PolicyBatch, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
  """Token-level clipped surrogate (GRPO, Dr.GRPO, CAPO, CoDaPO, CDE)."""
  ratio_BC = jnp.exp(batch.logp_BC - batch.old_logp_BC)
  adv_BC = _weighted(jnp.broadcast_to(batch.adv_B[:, None], ratio_BC.shape), batch)
  return _clipped(ratio_BC, adv_BC, batch.mask_BC, cfg.eps_low, cfg.eps_high, cfg)


def gspo_loss(batch: PolicyBatch, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
  """GSPO: one ratio per response, `exp(mean_t(logp - old_logp))`, clipped per response."""
  log_ratio_B = masked_mean(batch.logp_BC - batch.old_logp_BC, batch.mask_BC, axis=-1)
  ratio_BC = jnp.broadcast_to(jnp.exp(log_ratio_B)[:, None], batch.mask_BC.shape)
  adv_BC = _weighted(jnp.broadcast_to(batch.adv_B[:, None], ratio_BC.shape), batch)
  return _clipped(ratio_BC, adv_BC, batch.mask_BC, cfg.gspo_eps_low, cfg.gspo_eps_high, cfg)


def forked_tokens(entropy_BC: Array, mask_BC: Array, quantile: float) -> Array:
  """SimKO's gate: tokens whose entropy is above their response's `quantile`.

  The quantile is numpy's default ("linear") over the row's completion tokens.
  """
  m = mask_BC > 0
  ent_BC = jax.lax.stop_gradient(entropy_BC)
  q_B = jnp.nanquantile(jnp.where(m, ent_BC, jnp.nan), quantile, axis=-1)
  return m & (ent_BC > q_B[:, None])  # NaN threshold (empty row) -> False


def simko_loss(batch: PolicyBatch, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
  """SimKO: top-K lifted ratio on forked tokens of correct responses, lambda on the wrong ones.

  For a correct response and a forked token the ratio becomes
  `(1 - alpha) rho + (alpha / K) sum_k rho_k sg(rho / rho_k)`: its value is rho
  but part of the gradient goes to the K most likely candidates. For a wrong
  response, forked tokens whose sampled token is the argmax get their
  advantage multiplied by lambda. Then the usual clipped loss.
  """
  for field in ("entropy_BC", "topk_logp_BCJ", "old_topk_logp_BCJ", "is_argmax_BC",
                "correct_B"):
    if getattr(batch, field) is None:
      raise ValueError(f"simko loss: PolicyBatch.{field} is required, got None")
  k = batch.topk_logp_BCJ.shape[-1]
  if k != cfg.simko_k or batch.old_topk_logp_BCJ.shape != batch.topk_logp_BCJ.shape:
    raise ValueError(f"simko loss: topk_logp_BCJ {batch.topk_logp_BCJ.shape} and "
                     f"old_topk_logp_BCJ {batch.old_topk_logp_BCJ.shape} must end in "
                     f"LossConfig.simko_k={cfg.simko_k}")
  rho_BC = jnp.exp(batch.logp_BC - batch.old_logp_BC)
  rho_BCJ = jnp.exp(batch.topk_logp_BCJ - batch.old_topk_logp_BCJ)
  lifted_BC = (rho_BCJ * jax.lax.stop_gradient(rho_BC[..., None] / rho_BCJ)).mean(-1)
  fork_BC = forked_tokens(batch.entropy_BC, batch.mask_BC, cfg.simko_quantile)
  correct_B1 = batch.correct_B.astype(bool)[:, None]
  alpha_BC = jnp.where(fork_BC & correct_B1, cfg.simko_alpha, 0.0)
  ratio_BC = (1.0 - alpha_BC) * rho_BC + alpha_BC * lifted_BC
  boost_BC = fork_BC & ~correct_B1 & batch.is_argmax_BC.astype(bool)
  adv_BC = _weighted(batch.adv_B[:, None] * jnp.where(boost_BC, cfg.simko_lambda, 1.0), batch)
  loss, aux = _clipped(ratio_BC, adv_BC, batch.mask_BC, cfg.eps_low, cfg.eps_high, cfg)
  aux["forked_frac"] = masked_mean(fork_BC.astype(rho_BC.dtype), batch.mask_BC)
  aux["boosted_frac"] = masked_mean(boost_BC.astype(rho_BC.dtype), batch.mask_BC)
  return loss, aux


LOSSES = {"ppo": ppo_loss, "gspo": gspo_loss, "simko": simko_loss}


def _check_batch(batch: PolicyBatch) -> None:
  shape = batch.logp_BC.shape
  if len(shape) != 2:
    raise ValueError(f"policy_loss: logp_BC must be [B, C], got shape {shape}")
  for field in ("old_logp_BC", "mask_BC", "entropy_BC", "ref_logp_BC", "is_argmax_BC",
                "is_weight_BC"):
    x = getattr(batch, field)
    if x is not None and x.shape != shape:
      raise ValueError(f"policy_loss: {field} has shape {x.shape}, expected {shape}")
  for field in ("adv_B", "correct_B"):
    x = getattr(batch, field)
    if x is not None and x.shape != shape[:1]:
      raise ValueError(f"policy_loss: {field} has shape {x.shape}, expected {shape[:1]}")
  for field in ("topk_logp_BCJ", "old_topk_logp_BCJ"):
    x = getattr(batch, field)
    if x is not None and x.shape[:2] != shape:
      raise ValueError(f"policy_loss: {field} has shape {x.shape}, expected {shape} + (J,)")


def _zero_padding(batch: PolicyBatch) -> PolicyBatch:
  """Zeroes per-token inputs on padding so inf / NaN there cannot reach the gradient."""
  m_BC = batch.mask_BC > 0
  fix = lambda x: None if x is None else jnp.where(
      m_BC.reshape(m_BC.shape + (1,) * (x.ndim - 2)), x, 0)
  return batch._replace(
      logp_BC=fix(batch.logp_BC), old_logp_BC=fix(batch.old_logp_BC),
      entropy_BC=fix(batch.entropy_BC), ref_logp_BC=fix(batch.ref_logp_BC),
      topk_logp_BCJ=fix(batch.topk_logp_BCJ),
      old_topk_logp_BCJ=fix(batch.old_topk_logp_BCJ), is_weight_BC=fix(batch.is_weight_BC))


def policy_loss(kind: str, batch: PolicyBatch,
                cfg: LossConfig = LossConfig()) -> tuple[Array, dict[str, Array]]:
  """The policy loss of `kind` ("ppo", "gspo", "simko") plus beta * KL.

  Returns:
    (loss, aux): loss is a scalar to minimise; aux holds clip fractions
    (clip_frac, clip_frac_low, clip_frac_high), ratio statistics (ratio_mean,
    ratio_min, ratio_max), pg_loss, entropy (if given), kl (if ref given),
    zero_adv_frac (rows with tokens whose advantage is exactly 0: degenerate
    groups, noise-masked or invalid samples), token_frac, and for SimKO
    forked_frac and boosted_frac.
  """
  if kind not in LOSSES:
    raise ValueError(f"unknown policy loss kind {kind!r}; known: {KINDS}")
  _check_batch(batch)
  batch = _zero_padding(batch)
  loss, aux = LOSSES[kind](batch, cfg)
  penalty, common = _common_aux(batch, cfg)
  aux.update(common)
  return loss + penalty, aux
