"""One RL step: rollouts -> advantages -> policy loss -> sharded update (the loop: capo_jax.run)."""

from capo_jax.rl.algorithms import ALGORITHMS, Estimator
from capo_jax.rl.batch import TrainBatch
from capo_jax.rl.losses import LossConfig, PolicyLoss, policy_loss
from capo_jax.rl.optim import OptimConfig
from capo_jax.rl.train_state import TrainConfig, TrainState
from capo_jax.rl.train_step import make_train_step

__all__ = [
  "ALGORITHMS",
  "Estimator",
  "LossConfig",
  "OptimConfig",
  "PolicyLoss",
  "TrainBatch",
  "TrainConfig",
  "TrainState",
  "make_train_step",
  "policy_loss",
]
