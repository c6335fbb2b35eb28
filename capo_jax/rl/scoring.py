"""A rollout's scores and advantages on the devices, as pure jitted programs.

``scores``: each sample's mean token log-prob (the confidence CAPO and the mask
read); ``score_rollout``: the noise mask, the advantages and their metrics;
``score_metrics``: the logged statistics of the scores. ``rollout.collect`` runs
them once per step; nothing here reads back to the host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from capo_jax.eval import calibration
from capo_jax.masked import mean_logprob
from capo_jax.rl import advantages, algorithms
from capo_jax.types import Array


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
  """The static half of ``score_rollout`` (hashable: a jit static argument).

  Attributes:
    estimator: the advantage estimator with its hyper-parameters (``algorithms.Capo()``, ...).
    noise_mask: apply CAPO's noise mask (needs the reference's scores).
    mask_high, mask_low: reference-perplexity thresholds of the mask.
    mask_mode: "partner" or "drop" (``advantages.split_masks``).
    num_steps: the run's planned steps (CDE's bonus schedule).
  """

  estimator: algorithms.Estimator
  noise_mask: bool = False
  mask_high: float = 2.5
  mask_low: float = 1.05
  mask_mode: str = "partner"
  num_steps: int = 1


@functools.partial(jax.jit, static_argnames="spec")
def score_rollout(
  rewards_QG: Array,
  s_QG: Array,
  ref_s_QG: Array | None,
  step: Array,
  *,
  spec: AdvantageSpec,
  correct_QG: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """One step's advantages and their metrics, as one pure jitted program.

  Noise mask (when ``spec.noise_mask``: from the reference's scores
  ``ref_s_QG``), split into valid / receiving rows, the estimator, the masked
  fractions and the within-group spread of the score. ``step`` is traced (CDE's
  schedule), so every step runs the same compiled program. ``correct_QG``: the binary
  labels when the rewards are not (reward plug-ins); the mask and CAPO's pairs read them.

  Returns:
    (adv_QG, metrics): float32 advantages and scalar metrics ``s_spread``,
    ``adv_abs_mean`` and, with the mask, ``masked_frac{,_correct,_wrong}``.
  """
  labels_QG = rewards_QG if correct_QG is None else correct_QG
  valid_QG = jnp.ones(rewards_QG.shape, bool)
  receive_QG = None
  metrics: dict[str, Array] = {}
  if spec.noise_mask:
    if ref_s_QG is None:
      raise ValueError("score_rollout: AdvantageSpec.noise_mask needs the reference's ref_s_QG")
    noisy_QG = advantages.noise_mask(
      labels_QG, advantages.ref_ppl(ref_s_QG), high=spec.mask_high, low=spec.mask_low
    )
    metrics.update(advantages.masked_fraction(noisy_QG, labels_QG, valid_QG))
    valid_QG, receive_QG = advantages.split_masks(valid_QG, noisy_QG, mode=spec.mask_mode)
  adv_QG = spec.estimator.advantages(
    advantages.GroupBatch(rewards_QG, s_QG, valid_QG, receive_QG, correct_QG), step, spec.num_steps
  )
  score_QG = spec.estimator.confidence(s_QG)
  metrics["s_spread"] = advantages.score_spread(score_QG, labels_QG, valid_QG)
  metrics["adv_abs_mean"] = jnp.abs(adv_QG).mean()
  return adv_QG, metrics


@jax.jit
def scores(logp_BC: Array, mask_BC: Array) -> Array:
  return mean_logprob(logp_BC, mask_BC)


@jax.jit
def score_metrics(s_QG: Array, correct_QG: Array) -> dict[str, Array]:
  """The logged statistics of the scores, on the devices: AUC-mean (over the finite
  scores: a diverged policy must not crash the logging) and the mean."""
  finite_QG = jnp.isfinite(s_QG)
  auc, n = calibration.auc_mean_traced(jnp.where(finite_QG, s_QG, 0.0), correct_QG, finite_QG)
  return {"auc_mean": auc, "auc_questions": n, "s_mean": s_QG.mean()}
