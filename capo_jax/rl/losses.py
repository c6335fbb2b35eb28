"""Policy losses: the PPO-style clipped surrogate, GSPO and SimKO, plus KL.

Inputs are per-token arrays over the completion (axis C), rows B = Q * G.
Each loss is a frozen dataclass of its own hyper-parameters (``Ppo()``,
``Gspo(eps_low=3e-4, eps_high=4e-4)``, ``Simko(alpha, k, lam, quantile)``); the
settings they share (PPO's clip, aggregation, KL) are one ``LossConfig``.
`policy_loss(loss, batch, cfg)` is the one entry point; it returns `(loss, aux)`
with aux a flat dict of scalars for logging.

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

import abc
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from capo_jax.masked import masked_mean
from capo_jax.types import Array

AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


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


def _check_clip(where: str, eps_low: float, eps_high: float) -> None:
  for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
    if eps < 0:
      raise ValueError(f"{where}.{name}={eps} must be >= 0")
  if eps_low >= 1:
    raise ValueError(
      f"{where}.eps_low={eps_low} must be < 1 (the ratio's lower clip bound "
      "1 - eps must stay positive)"
    )


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The settings every policy loss shares: PPO's clip (eps 0.2; GSPO clips with its
  own), the token aggregation and the KL term."""

  eps_low: float = 0.2
  eps_high: float = 0.2
  agg: str = "seq-mean-token-mean"
  beta: float = 0.0
  kl_estimator: str = "k3"
  max_len: int | None = None  # seq-mean-token-sum-norm's constant; None: C

  def __post_init__(self) -> None:
    if self.agg not in AGGS:
      raise ValueError(f"LossConfig.agg={self.agg!r} is not one of {AGGS}")
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(
        f"LossConfig.kl_estimator={self.kl_estimator!r} is not one of {KL_ESTIMATORS}"
      )
    _check_clip("LossConfig", self.eps_low, self.eps_high)
    if self.beta < 0:
      raise ValueError(f"LossConfig.beta={self.beta} must be >= 0")
    if self.max_len is not None and self.max_len <= 0:
      raise ValueError(f"LossConfig.max_len={self.max_len} must be positive")


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


def _clipped(
  ratio_BC: Array, adv_BC: Array, mask_BC: Array, eps_low: float, eps_high: float, cfg: LossConfig
) -> tuple[Array, dict[str, Array]]:
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
  """KL penalty term and the logging shared by every loss."""
  mask = batch.mask_BC
  has_tokens_B = mask.sum(-1) > 0
  aux = {
    "zero_adv_frac": (has_tokens_B & (batch.adv_B == 0)).sum() / jnp.maximum(has_tokens_B.sum(), 1),
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
    raise ValueError(
      f"policy_loss: LossConfig.beta={cfg.beta} > 0 needs PolicyBatch.ref_logp_BC, which is None"
    )
  return penalty, aux


def _weighted(adv_BC: Array, batch: PolicyBatch) -> Array:
  """The advantage times the mismatch weight: w >= 0 is detached, so
  min(rho A w, clip(rho) A w) = w min(rho A, clip(rho) A), the clip statistics unchanged."""
  if batch.is_weight_BC is None:
    return adv_BC
  return adv_BC * jax.lax.stop_gradient(batch.is_weight_BC)


# --------------------------------------------------------------------------
# The three losses, each a frozen dataclass (hashable: part of the train step's static
# configuration) of its own hyper-parameters, validated once here.
# --------------------------------------------------------------------------


class PolicyLoss(abc.ABC):
  """A policy loss: subclasses are frozen dataclasses with one method, ``loss``."""

  @property
  def top_k(self) -> int:
    """Candidates per position whose log-probs the loss reads (SimKO's K; 0: none)."""
    return 0

  @abc.abstractmethod
  def loss(self, batch: PolicyBatch, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
    """The aggregated loss (no KL) and its logging, on padding-free inputs."""


@dataclasses.dataclass(frozen=True)
class Ppo(PolicyLoss):
  """Token-level clipped surrogate (GRPO, Dr.GRPO, CAPO, CoDaPO, CDE)."""

  def loss(self, batch: PolicyBatch, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
    ratio_BC = jnp.exp(batch.logp_BC - batch.old_logp_BC)
    adv_BC = _weighted(jnp.broadcast_to(batch.adv_B[:, None], ratio_BC.shape), batch)
    return _clipped(ratio_BC, adv_BC, batch.mask_BC, cfg.eps_low, cfg.eps_high, cfg)


@dataclasses.dataclass(frozen=True)
class Gspo(PolicyLoss):
  """GSPO: one ratio per response, `exp(mean_t(logp - old_logp))`, clipped per response
  with its paper's eps (``LossConfig``'s PPO eps do not apply)."""

  eps_low: float = 3e-4
  eps_high: float = 4e-4

  def __post_init__(self) -> None:
    _check_clip("Gspo", self.eps_low, self.eps_high)

  def loss(self, batch: PolicyBatch, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
    log_ratio_B = masked_mean(batch.logp_BC - batch.old_logp_BC, batch.mask_BC, axis=-1)
    ratio_BC = jnp.broadcast_to(jnp.exp(log_ratio_B)[:, None], batch.mask_BC.shape)
    adv_BC = _weighted(jnp.broadcast_to(batch.adv_B[:, None], ratio_BC.shape), batch)
    return _clipped(ratio_BC, adv_BC, batch.mask_BC, self.eps_low, self.eps_high, cfg)


def forked_tokens(entropy_BC: Array, mask_BC: Array, quantile: float) -> Array:
  """SimKO's gate: tokens whose entropy is above their response's `quantile`.

  The quantile is numpy's default ("linear") over the row's completion tokens.
  """
  m = mask_BC > 0
  ent_BC = jax.lax.stop_gradient(entropy_BC)
  q_B = jnp.nanquantile(jnp.where(m, ent_BC, jnp.nan), quantile, axis=-1)
  return m & (ent_BC > q_B[:, None])  # NaN threshold (empty row) -> False


@dataclasses.dataclass(frozen=True)
class Simko(PolicyLoss):
  """SimKO: top-K lifted ratio on forked tokens of correct responses, lambda on the wrong ones.

  For a correct response and a forked token (entropy above the response's ``quantile``)
  the ratio becomes `(1 - alpha) rho + (alpha / K) sum_k rho_k sg(rho / rho_k)`: its
  value is rho but part of the gradient goes to the K most likely candidates. For a
  wrong response, forked tokens whose sampled token is the argmax get their advantage
  multiplied by ``lam``. Then the usual clipped loss (``LossConfig``'s eps).
  """

  alpha: float = 0.01
  k: int = 3
  lam: float = 1.1
  quantile: float = 0.8

  def __post_init__(self) -> None:
    if self.alpha < 0:
      raise ValueError(f"Simko.alpha={self.alpha} must be >= 0")
    if self.k < 1:
      raise ValueError(f"Simko.k={self.k} must be >= 1")
    if not 0.0 <= self.quantile <= 1.0:
      raise ValueError(f"Simko.quantile={self.quantile} must lie in [0, 1]")

  @property
  def top_k(self) -> int:
    return self.k

  def _check(self, batch: PolicyBatch) -> tuple[Array, Array, Array, Array, Array]:
    """The inputs SimKO needs, checked: (entropy_BC, topk_logp_BCJ,
    old_topk_logp_BCJ, is_argmax_BC, correct_B)."""
    fields = ("entropy_BC", "topk_logp_BCJ", "old_topk_logp_BCJ", "is_argmax_BC", "correct_B")
    got: list[Array] = []
    for field in fields:
      x = getattr(batch, field)
      if x is None:
        raise ValueError(
          f"Simko: PolicyBatch.{field} is required, got None (a train step "
          "fills it from Sequences.correct_B, old_topk_ids_BCJ and "
          "old_topk_logp_BCJ: the old pass's make_logprob_fn(top_k=Simko.k))"
        )
      got.append(x)
    entropy_BC, topk_BCJ, old_topk_BCJ, is_argmax_BC, correct_B = got
    if topk_BCJ.shape[-1] != self.k or old_topk_BCJ.shape != topk_BCJ.shape:
      raise ValueError(
        f"Simko: topk_logp_BCJ {topk_BCJ.shape} and "
        f"old_topk_logp_BCJ {old_topk_BCJ.shape} must end in "
        f"Simko.k={self.k}"
      )
    return entropy_BC, topk_BCJ, old_topk_BCJ, is_argmax_BC, correct_B

  def loss(self, batch: PolicyBatch, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
    entropy_BC, topk_BCJ, old_topk_BCJ, is_argmax_BC, correct_B = self._check(batch)
    rho_BC = jnp.exp(batch.logp_BC - batch.old_logp_BC)
    rho_BCJ = jnp.exp(topk_BCJ - old_topk_BCJ)
    lifted_BC = (rho_BCJ * jax.lax.stop_gradient(rho_BC[..., None] / rho_BCJ)).mean(-1)
    fork_BC = forked_tokens(entropy_BC, batch.mask_BC, self.quantile)
    correct_B1 = correct_B.astype(bool)[:, None]
    alpha_BC = jnp.where(fork_BC & correct_B1, self.alpha, 0.0)
    ratio_BC = (1.0 - alpha_BC) * rho_BC + alpha_BC * lifted_BC
    boost_BC = fork_BC & ~correct_B1 & is_argmax_BC.astype(bool)
    adv_BC = _weighted(batch.adv_B[:, None] * jnp.where(boost_BC, self.lam, 1.0), batch)
    loss, aux = _clipped(ratio_BC, adv_BC, batch.mask_BC, cfg.eps_low, cfg.eps_high, cfg)
    aux["forked_frac"] = masked_mean(fork_BC.astype(rho_BC.dtype), batch.mask_BC)
    aux["boosted_frac"] = masked_mean(boost_BC.astype(rho_BC.dtype), batch.mask_BC)
    return loss, aux


LOSSES: dict[str, type[PolicyLoss]] = {"ppo": Ppo, "gspo": Gspo, "simko": Simko}


def _check_batch(batch: PolicyBatch) -> None:
  shape = batch.logp_BC.shape
  if len(shape) != 2:
    raise ValueError(f"policy_loss: logp_BC must be [B, C], got shape {shape}")
  for field in (
    "old_logp_BC",
    "mask_BC",
    "entropy_BC",
    "ref_logp_BC",
    "is_argmax_BC",
    "is_weight_BC",
  ):
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

  def fix(x: Array) -> Array:
    return jnp.where(m_BC.reshape(m_BC.shape + (1,) * (x.ndim - 2)), x, 0)

  fix_opt = lambda x: None if x is None else fix(x)  # noqa: E731
  return batch._replace(
    logp_BC=fix(batch.logp_BC),
    old_logp_BC=fix(batch.old_logp_BC),
    entropy_BC=fix_opt(batch.entropy_BC),
    ref_logp_BC=fix_opt(batch.ref_logp_BC),
    topk_logp_BCJ=fix_opt(batch.topk_logp_BCJ),
    old_topk_logp_BCJ=fix_opt(batch.old_topk_logp_BCJ),
    is_weight_BC=fix_opt(batch.is_weight_BC),
  )


def policy_loss(
  loss: PolicyLoss, batch: PolicyBatch, cfg: LossConfig = LossConfig()
) -> tuple[Array, dict[str, Array]]:
  """The policy loss ``loss`` (``Ppo()``, ``Gspo()``, ``Simko()``) plus beta * KL.

  Returns:
    (loss, aux): loss is a scalar to minimise; aux holds clip fractions
    (clip_frac, clip_frac_low, clip_frac_high), ratio statistics (ratio_mean,
    ratio_min, ratio_max), pg_loss, entropy (if given), kl (if ref given),
    zero_adv_frac (rows with tokens whose advantage is exactly 0: degenerate
    groups, noise-masked or invalid samples), token_frac, and for SimKO
    forked_frac and boosted_frac.
  """
  if not isinstance(loss, PolicyLoss):
    raise TypeError(
      f"policy_loss: loss must be a PolicyLoss (one of "
      f"{[c.__name__ for c in LOSSES.values()]}), got {loss!r}"
    )
  _check_batch(batch)
  batch = _zero_padding(batch)
  value, aux = loss.loss(batch, cfg)
  penalty, common = _common_aux(batch, cfg)
  aux.update(common)
  return value + penalty, aux
