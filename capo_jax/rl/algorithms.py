"""The algorithms as typed values: advantage estimators, and each algorithm's name.

An estimator is a frozen dataclass of its hyper-parameters with one method,
``advantages(batch, step, total_steps) -> adv_QG``; frozen makes it hashable, so a
jitted function takes it as a static argument (``rollout.score_rollout``). Each is a
thin typed front of the module-level functions of ``capo_jax.rl.advantages``, which
hold the maths. An algorithm (``ALGORITHMS``) is an estimator class, a policy loss class
(``capo_jax.rl.losses``) and the token aggregation its paper uses; ``RunSpec`` builds
both from the config. Adding one: docs/algorithms.md, "Adding an estimator".
"""

from __future__ import annotations

import abc
import dataclasses

from capo_jax.rl import advantages as adv
from capo_jax.rl import losses
from capo_jax.rl.advantages import GroupBatch
from capo_jax.types import Array


class Estimator(abc.ABC):
  """An advantage estimator: subclasses are frozen dataclasses of its hyper-parameters."""

  @abc.abstractmethod
  def advantages(
    self, batch: GroupBatch, step: int | Array = 0, total_steps: int | Array = 1
  ) -> Array:
    """adv_QG of ``batch`` at training ``step`` of ``total_steps`` (a schedule's inputs;
    traced or not), exactly 0 on non-receiving rows and degenerate groups."""

  def confidence(self, s_QG: Array) -> Array:
    """The score this estimator ranks by (logged as its spread): s, unless converted."""
    return adv.to_score(s_QG)


@dataclasses.dataclass(frozen=True)
class GrpoNormalised(Estimator):
  """An estimator that ends in GRPO's normalisation: its ``eps`` and ``std`` (``STDS``)."""

  eps: float = adv.GRPO_EPS
  std: str = "unbiased"

  def __post_init__(self) -> None:
    adv.std_ddof(self.std, type(self).__name__)


@dataclasses.dataclass(frozen=True)
class Grpo(GrpoNormalised):
  """GRPO's group-normalised reward (GSPO and SimKO train with it too)."""

  def advantages(
    self, batch: GroupBatch, step: int | Array = 0, total_steps: int | Array = 1
  ) -> Array:
    return adv.grpo(
      batch.rewards_QG, batch.valid_QG, receive_QG=batch.receive_QG, eps=self.eps, std=self.std
    )


@dataclasses.dataclass(frozen=True)
class DrGrpo(Estimator):
  """Dr.GRPO: the reward minus the group mean."""

  def advantages(
    self, batch: GroupBatch, step: int | Array = 0, total_steps: int | Array = 1
  ) -> Array:
    return adv.dr_grpo(batch.rewards_QG, batch.valid_QG, receive_QG=batch.receive_QG)


@dataclasses.dataclass(frozen=True)
class Capo(Estimator):
  """CAPO on the labels, its score converted by ``score`` (``to_score``).

  ``adaptive_tau`` = c > 0: tau = c * the batch's ``score_spread`` (``tau`` when the
  batch has none); 0: the fixed ``tau``.
  """

  tau: float = 0.6
  norm: str = "group"
  score: str = "mean_logprob"
  adaptive_tau: float = 0.0

  def __post_init__(self) -> None:
    if not self.tau > 0:
      raise ValueError(f"Capo.tau={self.tau} must be > 0")
    for field, known in (("norm", adv.NORMS), ("score", adv.SCORES)):
      if getattr(self, field) not in known:
        raise ValueError(f"Capo.{field}={getattr(self, field)!r} is not one of {known}")
    if self.adaptive_tau < 0:
      raise ValueError(f"Capo.adaptive_tau={self.adaptive_tau} must be >= 0 (0: off)")

  def confidence(self, s_QG: Array) -> Array:
    return adv.to_score(s_QG, self.score)

  def advantages(
    self, batch: GroupBatch, step: int | Array = 0, total_steps: int | Array = 1
  ) -> Array:
    s_QG = self.confidence(batch.s_QG)
    tau: float | Array = self.tau
    if self.adaptive_tau > 0:
      tau = adv.adaptive_tau_value(
        s_QG, batch.labels_QG, batch.valid_QG, scale=self.adaptive_tau, fallback=self.tau
      )
    return adv.capo(
      batch.labels_QG, s_QG, batch.valid_QG, tau=tau, norm=self.norm, receive_QG=batch.receive_QG
    )


@dataclasses.dataclass(frozen=True)
class Codapo(GrpoNormalised):
  """CoDaPO: GRPO's advantage weighted by the group's difficulty and confidence."""

  def advantages(
    self, batch: GroupBatch, step: int | Array = 0, total_steps: int | Array = 1
  ) -> Array:
    return adv.codapo(
      batch.rewards_QG,
      batch.s_QG,
      batch.valid_QG,
      receive_QG=batch.receive_QG,
      eps=self.eps,
      std=self.std,
      correct_QG=batch.correct_QG,
    )


@dataclasses.dataclass(frozen=True)
class Cde(GrpoNormalised):
  """CDE: the perplexity bonus ``min(|r|/kappa, alpha * (-s))`` with weight ``omega`` in
  the first half of training (``cde_omega``) and 0 after, then GRPO's normalisation."""

  kappa: float = 3.0
  alpha: float = 1.0
  omega: float = 1.0

  def __post_init__(self) -> None:
    super().__post_init__()
    if not self.kappa > 0:
      raise ValueError(f"Cde.kappa={self.kappa} must be > 0 (the bonus divides by it)")

  def advantages(
    self, batch: GroupBatch, step: int | Array = 0, total_steps: int | Array = 1
  ) -> Array:
    return adv.cde(
      batch.rewards_QG,
      batch.s_QG,
      batch.valid_QG,
      omega=self.omega * adv.cde_omega(step, total_steps),
      params=adv.CdeParams(self.kappa, self.alpha, self.eps, self.std),
      receive_QG=batch.receive_QG,
      correct_QG=batch.correct_QG,
    )


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """What ``algo.name`` trains with.

  Attributes:
    estimator: the advantage estimator's class (its fields: ``config.algo``).
    loss: the policy loss's class (its fields: ``config.loss``).
    agg: the token aggregation of ``loss.agg = "auto"`` (``losses.AGGS``).
  """

  estimator: type[Estimator]
  loss: type[losses.PolicyLoss] = losses.Ppo
  agg: str = "seq-mean-token-mean"


# SimKO's paper aggregates with the token mean (DAPO's); Dr.GRPO divides each response's
# token sum by a constant, rollout.max_new_tokens (its MAX_TOKENS); GSPO and SimKO change
# GRPO's loss only.
ALGORITHMS: dict[str, Algorithm] = {
  "capo": Algorithm(Capo),
  "grpo": Algorithm(Grpo),
  "dr_grpo": Algorithm(DrGrpo, agg="seq-mean-token-sum-norm"),
  "gspo": Algorithm(Grpo, losses.Gspo),
  "codapo": Algorithm(Codapo),
  "cde": Algorithm(Cde),
  "simko": Algorithm(Grpo, losses.Simko, agg="token-mean"),
}


def algorithm(name: str) -> Algorithm:
  """``ALGORITHMS[name]``, or an error that lists the known names."""
  if name not in ALGORITHMS:
    raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}")
  return ALGORITHMS[name]
