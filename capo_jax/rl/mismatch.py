"""The sampler / trainer mismatch: measured every step, corrected as an option; truncated rows.

The sampler draws each completion token with its own numerics (KV-cache decode,
its dtype and kernels); the trainer recomputes the same tokens' log-probs with
the old policy's params in a full forward. Per real completion token

  rho_t = pi_trainer_old(o_t) / pi_sampler(o_t) = exp(logp_old_t - logp_sampler_t).

Three levels of the ratio (``SPEC.md`` 5b of the project; ``docs/mismatch.md``), as
verl names them:

  token      rho_t
  sequence   rho = exp(sum_t log rho_t), the product: the importance ratio of the
             whole response (suffix ``_seq``)
  geometric  rho = exp(mean_t log rho_t), near 1 for long responses (suffix ``_geo``)

A sequence-level ratio is put on each of the row's real tokens; it is kept in log
space until capped, so a 3,000-token product neither overflows nor turns into NaN.
Logged every step (``mismatch_metrics``): mean |log rho_t|, the k3 estimate of
KL(sampler || trainer) from the sampler's tokens, mean_t (rho_t - 1 - log rho_t),
quantiles of rho_t, and the rows' |log rho| at the sequence and geometric levels.

Corrections (``MismatchSpec.correction``; "none" is the paper's run) multiply each
token's policy-gradient term by a detached weight w, or reject it (C = ``cap``):

  tis_token / tis_seq / tis_geo   w = min(rho, C)                      (never rejects)
  mis_token / mis_seq / mis_geo   w = rho if 1/C <= rho <= C, else rejected
                                  (``mis_two_sided=False``: rejected only above C)
  icepop                          w = rho if low <= rho <= high, else rejected (token level)

A rejected token (``_seq`` / ``_geo``: every token of the row) leaves the loss's
numerator and its denominator: the rollout folds ``keep_BC`` into the sequences'
completion mask, which every aggregation and the micro-batch weights divide by.
``mask_truncated`` folds the rows that hit ``max_new_tokens`` out the same way.
The PPO ratio stays pi_theta / pi_trainer_old; w enters as a factor on the
advantage (w >= 0, so min(rho A w, clip(rho) A w) = w min(rho A, clip(rho) A)).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from capo_jax.masked import masked_mean
from capo_jax.rl.batch import Sequences
from capo_jax.types import Array

CORRECTIONS = (
  "none",
  "tis_token",
  "tis_seq",
  "tis_geo",
  "mis_token",
  "mis_seq",
  "mis_geo",
  "icepop",
)
LEVELS = ("token", "seq", "geo")  # the suffix of tis_* / mis_*: token, sequence, geometric
QUANTILES = (0.01, 0.5, 0.99)  # logged as mismatch/ratio_p01, _p50, _p99


@dataclasses.dataclass(frozen=True)
class MismatchSpec:
  """What the rollout does with the sampler's log-probs and truncated rows (hashable).

  Attributes:
    measure: log the mismatch metrics (False when the old log-probs are the
      sampler's: rho = 1, nothing to measure).
    correction: one of ``CORRECTIONS``.
    cap: C of TIS (w = min(rho, C)) and MIS (kept within [1/C, C]).
    mis_two_sided: MIS rejects rho outside [1/C, C] (verl's mask mode); False:
      only rho > C (the one-sided variant).
    low, high: IcePop's two-sided band [low, high] of kept ratios.
    mask_truncated: rows that hit ``max_new_tokens`` leave the loss.
  """

  measure: bool = True
  correction: str = "none"
  cap: float = 2.0
  mis_two_sided: bool = True
  low: float = 0.5
  high: float = 5.0
  mask_truncated: bool = False

  def __post_init__(self) -> None:
    if self.correction not in CORRECTIONS:
      raise ValueError(f"MismatchSpec.correction={self.correction!r} is not one of {CORRECTIONS}")
    if not self.cap > 0:
      raise ValueError(f"MismatchSpec.cap={self.cap} must be > 0")
    if not isinstance(self.mis_two_sided, bool):
      raise TypeError(f"MismatchSpec.mis_two_sided={self.mis_two_sided!r} must be a bool")
    if self.correction.startswith("mis") and self.mis_two_sided and not self.cap > 1:
      raise ValueError(
        f"MismatchSpec.cap={self.cap}: two-sided MIS keeps [1/cap, cap], which needs cap > 1"
      )
    if not 0 <= self.low < self.high:
      raise ValueError(f"MismatchSpec.low={self.low}, high={self.high}: need 0 <= low < high")
    if self.correction != "none" and not self.measure:
      raise ValueError(
        f"MismatchSpec.correction={self.correction!r} needs the trainer's old "
        "log-probs (with the sampler's, rho = 1: there is nothing to correct)"
      )

  @property
  def active(self) -> bool:
    """Whether the rollout does anything here at all (the default run: measure only)."""
    return self.measure or self.correction != "none" or self.mask_truncated

  def correct(
    self, seqs: Sequences, sampler_logp_BC: Array, keep_B: Array | None = None
  ) -> tuple[Sequences, dict[str, Array]]:
    """The rollout's sequences with the correction and ``mask_truncated`` folded in, and
    the logged metrics (``mismatch/...``: device scalars, left for the caller to read with
    the step's other metrics after the updates are dispatched; nothing here waits on them).

    ``keep_B``: the device flags of the rows that did not hit ``max_new_tokens``; needed
    with ``mask_truncated`` only.
    """
    if not self.active:
      return seqs, {}
    if self.correction == "none" and not self.mask_truncated:  # measured only (the default)
      metrics = _measure(seqs.old_logp_BC, sampler_logp_BC, seqs.completion_mask_BC)
    else:
      if self.mask_truncated and keep_B is None:
        raise ValueError("MismatchSpec.correct: mask_truncated needs the kept rows keep_B")
      seqs, metrics = _correct(
        seqs, sampler_logp_BC, keep_B if self.mask_truncated else None, spec=self
      )
    return seqs, {f"mismatch/{k}": v for k, v in metrics.items()}


def log_ratio(old_logp_BC: Array, sampler_logp_BC: Array, mask_BC: Array) -> Array:
  """log rho_t = logp_old_t - logp_sampler_t on real tokens, 0 on padding."""
  return jnp.where(mask_BC > 0, old_logp_BC - sampler_logp_BC, 0.0)


def level_log_ratio(lr_BC: Array, mask_BC: Array, level: str) -> Array:
  """log rho at ``level`` on each token, from the token log-ratios ``lr_BC``.

  "token": log rho_t; "seq": the row's sum_t log rho_t (the log of the product);
  "geo": the row's mean_t log rho_t. Sums and means run over the real tokens only.
  """
  m = mask_BC > 0
  if level == "token":
    return lr_BC
  if level == "seq":
    row_B = jnp.where(m, lr_BC, 0.0).sum(-1)
  elif level == "geo":
    row_B = masked_mean(lr_BC, m, axis=-1)
  else:
    raise ValueError(f"level_log_ratio: level={level!r} is not one of {LEVELS}")
  return jnp.broadcast_to(row_B[:, None], lr_BC.shape)


def mismatch_metrics(
  old_logp_BC: Array, sampler_logp_BC: Array, mask_BC: Array
) -> dict[str, Array]:
  """The logged mismatch over the real completion tokens (token level unless named seq_).

  ``abs_log_ratio`` mean |log rho_t|; ``k3_kl`` mean (rho_t - 1 - log rho_t), an
  estimate of KL(sampler || trainer) from the sampler's own tokens;
  ``ratio_p01/p50/p99`` NumPy-default (linear) quantiles of rho_t, ``ratio_min``,
  ``ratio_max``; over the rows with a real token, ``seq_abs_log_ratio`` the mean of
  |mean_t log rho_t| (geometric level) and ``seq_abs_sum_log_ratio`` the mean of
  |sum_t log rho_t| (sequence level: the log of the product).
  """
  m = mask_BC > 0
  lr_BC = log_ratio(old_logp_BC, sampler_logp_BC, mask_BC).astype(jnp.float32)
  rho_BC = jnp.exp(lr_BC)
  out = {
    "abs_log_ratio": masked_mean(jnp.abs(lr_BC), m),
    # expm1: exp(x) - 1 - x in float32 would cancel to 0 below |x| ~ 1e-4
    "k3_kl": masked_mean(jnp.expm1(lr_BC) - lr_BC, m),
  }
  q = jnp.nanquantile(jnp.where(m, rho_BC, jnp.nan), jnp.asarray(QUANTILES))
  out.update({f"ratio_p{round(p * 100):02d}": q[i] for i, p in enumerate(QUANTILES)})
  out["ratio_min"] = jnp.where(m, rho_BC, jnp.inf).min()
  out["ratio_max"] = jnp.where(m, rho_BC, -jnp.inf).max()
  rows_B = m.any(-1)
  for name, level in (("seq_abs_log_ratio", "geo"), ("seq_abs_sum_log_ratio", "seq")):
    out[name] = masked_mean(jnp.abs(level_log_ratio(lr_BC, m, level)[:, 0]), rows_B)
  return out


def is_weights(
  old_logp_BC: Array, sampler_logp_BC: Array, mask_BC: Array, spec: MismatchSpec
) -> tuple[Array, Array]:
  """(w_BC, keep_BC) of ``spec.correction``: the detached weight of each kept token (0
  elsewhere) and the tokens that stay in the loss (real and not rejected)."""
  m = mask_BC > 0
  lr_BC = log_ratio(old_logp_BC, sampler_logp_BC, mask_BC).astype(jnp.float32)
  kind = spec.correction
  if kind == "none":
    return jnp.where(m, 1.0, 0.0), m
  if kind == "icepop":  # token level, two-sided band [low, high]
    rho_BC = jnp.exp(jnp.minimum(lr_BC, math.log(spec.high)))
    keep_BC = m & (lr_BC <= math.log(spec.high)) & (rho_BC >= spec.low)
    return jax.lax.stop_gradient(jnp.where(keep_BC, rho_BC, 0.0)), keep_BC
  family, level = kind.split("_")
  if family not in ("tis", "mis") or level not in LEVELS:
    raise ValueError(f"is_weights: correction={kind!r} is not one of {CORRECTIONS}")
  lr_BC = level_log_ratio(lr_BC, m, level)
  log_cap = math.log(spec.cap)
  # min(rho, C) taken in log space: a long row's product exp(sum) never reaches inf.
  w_BC = jnp.exp(jnp.minimum(lr_BC, log_cap))
  keep_BC = m
  if family == "mis":  # kept below C (w = rho there), and above 1/C when two-sided
    keep_BC = m & (lr_BC <= log_cap)
    if spec.mis_two_sided:
      keep_BC = keep_BC & (lr_BC >= -log_cap)
  return jax.lax.stop_gradient(jnp.where(keep_BC, w_BC, 0.0)), keep_BC


_measure = jax.jit(mismatch_metrics)


@functools.partial(jax.jit, static_argnames="spec")
def _correct(
  seqs: Sequences, sampler_logp_BC: Array, keep_B: Array | None, *, spec: MismatchSpec
) -> tuple[Sequences, dict[str, Array]]:
  mask_BC = seqs.completion_mask_BC
  metrics: dict[str, Array] = {}
  if spec.measure:
    metrics.update(mismatch_metrics(seqs.old_logp_BC, sampler_logp_BC, mask_BC))
  real = jnp.maximum((mask_BC > 0).sum(), 1)
  keep_BC, w_BC = mask_BC > 0, None
  if spec.correction != "none":
    w_BC, keep_BC = is_weights(seqs.old_logp_BC, sampler_logp_BC, mask_BC, spec)
    # Of the real tokens: the share rejected, and the mean weight of the kept ones.
    metrics["reject_frac"] = 1.0 - keep_BC.sum() / real
    metrics["weight_mean"] = masked_mean(w_BC, keep_BC)
  if keep_B is not None:
    keep_BC = keep_BC & keep_B[:, None]
  metrics["loss_token_frac"] = keep_BC.sum() / real
  seqs = dataclasses.replace(
    seqs, completion_mask_BC=keep_BC.astype(mask_BC.dtype), is_weight_BC=w_BC
  )
  return seqs, metrics
