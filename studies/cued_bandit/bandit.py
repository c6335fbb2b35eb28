"""A cued contextual bandit: one-token questions whose prompt carries a cue.

Each question has A answers; answer 0 is the true one (answers are exchangeable, so
its index carries no information the policy could use). The question shows a cue:
the true answer on a cued question, a decoy (another answer) on a trap. The policy
is a softmax over answers with two shared weights ``theta_F = (w_true, w_cue)`` on two
features, the policy's own evidence for each answer and the cue:

  logit[q, a] = w_true * (skill[q] * [a is true] + noise[q, a]) + w_cue * [a is the cue]

``skill`` (uniform on [0, skill_max]) is how well the policy can work the question out
(near 0: its evidence is noise, and only the cue helps); ``noise`` (normal, sd
``noise``) is fixed per question and answer. Neither is learned: RL can only decide
how far to trust the evidence (w_true; trusting it more also trusts its noise more)
and how far to trust the cue (w_cue). The reward is
correctness, the score of a sample its log-probability s = log pi(a) (the one-token
analogue of the mean token log-prob), and the update is the policy gradient
``mean_{q,g} A_qg grad log pi(a_qg)`` with plain SGD, the advantages from
``capo_jax.rl.advantages``. SGD keeps the gradient's direction, which is what the
estimator decides: Adam would rescale w_true and w_cue separately.

Letters: Q questions, G samples per question, A answers, F features (2), S seeds.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from capo_jax.rl import advantages

Array = jax.Array
# (rewards_QG, s_QG, valid_QG) -> adv_QG
Estimator = Callable[[Array, Array, Array], Array]

METHODS: dict[str, Estimator] = {
  "grpo": lambda r, s, v: advantages.grpo(r, v),
  "dr_grpo": lambda r, s, v: advantages.dr_grpo(r, v),
  "capo_tau0.6": lambda r, s, v: advantages.capo(r, s, v, tau=0.6),
  "capo_tau1": lambda r, s, v: advantages.capo(r, s, v, tau=1.0),
}


@dataclasses.dataclass(frozen=True)
class Task:
  """The bandit and its training settings.

  answers: A. cue_right: share of training questions whose cue is the true answer.
  skill_max / noise: the per-question skill range and the sd of the answer noise.
  theta0: the base policy's (w_true, w_cue). questions / samples: Q and G of a step.
  lr: SGD step size. steps: RL steps.
  """

  answers: int = 6
  cue_right: float = 0.8
  skill_max: float = 2.0
  noise: float = 1.0
  theta0: tuple[float, float] = (1.0, 0.0)
  questions: int = 32
  samples: int = 8
  lr: float = 0.5
  steps: int = 200

  def __post_init__(self):
    if self.answers < 2:
      raise ValueError(
        f"Task.answers must be >= 2 (a decoy needs a wrong answer), got {self.answers}"
      )
    if not 0.0 <= self.cue_right <= 1.0:
      raise ValueError(f"Task.cue_right must lie in [0, 1], got {self.cue_right}")


@dataclasses.dataclass(frozen=True)
class Questions:
  """A batch of questions: ``x_QAF`` the features of each answer (evidence, cue),
  ``cue_Q`` the cued answer, ``trap_Q`` whether the cue is a decoy."""

  x_QAF: Array
  cue_Q: Array
  trap_Q: Array


def make_questions(key: Array, task: Task, n: int, trap_share: float | None = None) -> Questions:
  """n questions; each a trap with probability ``trap_share`` (default 1 - cue_right).

  A trap's decoy is uniform over the wrong answers 1..A-1.
  """
  trap_share = 1.0 - task.cue_right if trap_share is None else trap_share
  k_trap, k_decoy, k_skill, k_noise = jax.random.split(key, 4)
  trap_Q = jax.random.bernoulli(k_trap, trap_share, (n,))
  decoy_Q = jax.random.randint(k_decoy, (n,), 1, task.answers)
  cue_Q = jnp.where(trap_Q, decoy_Q, 0)
  skill_Q = jax.random.uniform(k_skill, (n,), maxval=task.skill_max)
  answer_A = jnp.arange(task.answers)
  evidence_QA = (answer_A == 0)[None, :] * skill_Q[:, None] + task.noise * jax.random.normal(
    k_noise, (n, task.answers)
  )
  x_QAF = jnp.stack(
    [evidence_QA, (answer_A[None, :] == cue_Q[:, None]).astype(jnp.float32)], axis=-1
  )
  return Questions(x_QAF, cue_Q, trap_Q)


def log_policy(theta_F: Array, q: Questions) -> Array:
  """log pi(a | q) for every answer: [Q, A]."""
  return jax.nn.log_softmax(q.x_QAF @ theta_F, axis=-1)


def sample(key: Array, theta_F: Array, q: Questions, g: int) -> tuple[Array, Array]:
  """G answers per question and their scores s = log pi(a): ([Q, G] int, [Q, G])."""
  logp_QA = log_policy(theta_F, q)
  a_QG = jax.random.categorical(key, logp_QA[:, None, :], shape=(logp_QA.shape[0], g))
  return a_QG, jnp.take_along_axis(logp_QA, a_QG, axis=1)


def pg_grad(theta_F: Array, q: Questions, a_QG: Array, adv_QG: Array) -> Array:
  """The ascent direction ``mean_{q,g} A_qg grad log pi(a_qg)`` (advantages held fixed)."""

  def objective(th: Array) -> Array:
    logp_QG = jnp.take_along_axis(log_policy(th, q), a_QG, axis=1)
    return jnp.mean(jax.lax.stop_gradient(adv_QG) * logp_QG)

  return jax.grad(objective)(theta_F)


def train_step(
  theta_F: Array, key: Array, task: Task, estimator: Estimator, fixed_F: Array | None = None
) -> tuple[Array, Array]:
  """One RL step on fresh questions: (new theta, the step's accuracy).

  ``fixed_F``: bool per weight; a True weight is not updated (e.g. w_cue held at 0).
  """
  k_q, k_a = jax.random.split(key)
  q = make_questions(k_q, task, task.questions)
  a_QG, s_QG = sample(k_a, theta_F, q, task.samples)
  r_QG = (a_QG == 0).astype(jnp.float32)
  adv_QG = estimator(r_QG, s_QG, jnp.ones_like(r_QG, bool))
  grad_F = pg_grad(theta_F, q, a_QG, adv_QG)
  if fixed_F is not None:
    grad_F = jnp.where(fixed_F, 0.0, grad_F)
  return theta_F + task.lr * grad_F, r_QG.mean()


def train(key: Array, task: Task, estimator: Estimator, fixed_F: Array | None = None) -> Array:
  """theta after every step, [steps + 1, F] (row 0: theta0), one jitted scan."""

  def body(theta_F, k):
    theta_F, _ = train_step(theta_F, k, task, estimator, fixed_F)
    return theta_F, theta_F

  theta0_F = jnp.asarray(task.theta0, jnp.float32)
  _, path_TF = jax.lax.scan(body, theta0_F, jax.random.split(key, task.steps))
  return jnp.concatenate([theta0_F[None], path_TF], axis=0)


def train_seeds(
  seeds: list[int], task: Task, estimator: Estimator, fixed_F: Array | None = None
) -> Array:
  """``train`` for several seeds at once (vmapped): [S, steps + 1, F]."""
  keys_S = jnp.stack([jax.random.key_data(jax.random.key(s)) for s in seeds])
  run = lambda k: train(jax.random.wrap_key_data(k), task, estimator, fixed_F)  # noqa: E731
  return jax.jit(jax.vmap(run))(keys_S)
