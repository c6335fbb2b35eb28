"""The cued bandit (studies/cued_bandit): its update, its metrics and one behaviour."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from studies.cued_bandit import bandit, run


def _two_questions() -> bandit.Questions:
  x_QAF = jnp.array(
    [
      [[1.5, 1.0], [0.2, 0.0], [-0.4, 0.0]],  # cued: the cue is answer 0
      [[0.3, 0.0], [0.9, 1.0], [0.1, 0.0]],
    ]
  )  # trap: the cue is answer 1
  return bandit.Questions(x_QAF, jnp.array([0, 1]), jnp.array([False, True]))


def test_the_update_is_the_hand_derived_softmax_policy_gradient():
  q, theta_F = _two_questions(), jnp.array([0.7, -0.3])
  a_QG = jnp.array([[0, 2, 0], [1, 0, 1]])
  adv_QG = jnp.array([[0.5, -1.0, 0.5], [-0.2, 0.9, -0.7]])
  # d log pi(a) / d theta = x_a - sum_b pi_b x_b for a softmax over x . theta.
  x = np.asarray(q.x_QAF, np.float64)
  want = np.zeros(2)
  for i in range(2):
    z = x[i] @ np.asarray(theta_F, np.float64)
    pi = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    for g in range(3):
      want += float(adv_QG[i, g]) * (x[i, int(a_QG[i, g])] - pi @ x[i])
  want /= 6  # the mean over Q * G
  np.testing.assert_allclose(bandit.pg_grad(theta_F, q, a_QG, adv_QG), want, rtol=1e-5)


def test_a_train_step_moves_theta_by_lr_times_the_policy_gradient_of_its_own_samples():
  task, grpo = bandit.Task(questions=4, samples=5, lr=0.3), bandit.METHODS["grpo"]
  theta_F, key = jnp.array([1.0, 0.2]), jax.random.key(3)
  new_F, acc = jax.jit(lambda th, k: bandit.train_step(th, k, task, grpo))(theta_F, key)

  @jax.jit
  def by_hand(th, k):  # the same questions and samples, by the step's documented key split
    k_q, k_a = jax.random.split(k)
    q = bandit.make_questions(k_q, task, 4)
    a_QG, s_QG = bandit.sample(k_a, th, q, 5)
    r_QG = (a_QG == 0).astype(jnp.float32)
    grad_F = bandit.pg_grad(th, q, a_QG, grpo(r_QG, s_QG, jnp.ones((4, 5), bool)))
    s_ref_QG = jnp.take_along_axis(bandit.log_policy(th, q), a_QG, axis=1)
    return th + 0.3 * grad_F, r_QG.mean(), s_QG, s_ref_QG

  want_F, want_acc, s_QG, s_ref_QG = by_hand(theta_F, key)
  np.testing.assert_allclose(s_QG, s_ref_QG, rtol=1e-6)
  np.testing.assert_allclose(new_F, want_F, rtol=1e-5)
  assert float(acc) == pytest.approx(float(want_acc))


def test_with_the_cue_weight_fixed_at_zero_nothing_is_learned_about_the_cue():
  task = bandit.Task(steps=20)
  path_STF = np.asarray(
    bandit.train_seeds([0, 1], task, bandit.METHODS["grpo"], fixed_F=jnp.array([False, True]))
  )
  assert np.all(path_STF[..., 1] == 0.0)
  assert np.all(path_STF[:, -1, 0] != task.theta0[0])  # the other weight did move

  # So the policy is blind to where the cue points: moving it changes no probability.
  @jax.jit
  def both(th):
    q = bandit.make_questions(jax.random.key(5), task, 50, trap_share=0.5)
    moved = bandit.Questions(
      q.x_QAF.at[..., 1].set(jnp.roll(q.x_QAF[..., 1], 1, axis=1)), q.cue_Q, q.trap_Q
    )
    return bandit.log_policy(th, q), bandit.log_policy(th, moved)

  np.testing.assert_array_equal(*both(jnp.asarray(path_STF[0, -1])))


@pytest.mark.parametrize("cue_right,sign", [(1.0, 1), (0.0, -1)])
def test_grpo_trusts_a_cue_that_is_always_right_and_distrusts_one_always_wrong(cue_right, sign):
  task = bandit.Task(cue_right=cue_right, steps=40)
  w_cue_S = np.asarray(bandit.train_seeds([0, 1], task, bandit.METHODS["grpo"]))[:, -1, 1]
  assert np.all(sign * w_cue_S > 0.5), w_cue_S


def test_heldout_metrics_against_loops_and_sklearn():
  # 4 questions x 3 samples; answer 0 is the true one. q2 and q3 are traps (cues 2, 1).
  a_QG = np.array([[0, 1, 0], [2, 2, 3], [2, 0, 2], [1, 1, 1]])
  s_QG = np.array([[-0.2, -1.5, -0.2], [-0.9, -0.9, -2.0], [-0.3, -1.2, -0.3], [-0.1, -0.1, -0.1]])
  cue_Q, trap_Q = np.array([0, 0, 2, 1]), np.array([False, False, True, True])
  got = run.heldout_metrics(a_QG, s_QG, cue_Q, trap_Q)
  c_QG = a_QG == 0
  assert got["accuracy"] == pytest.approx(3 / 12)
  # Mixed: q0 (correct -0.2, -0.2 above wrong -1.5: AUC 1) and q2 (correct -1.2 below
  # both wrong -0.3: AUC 0).
  assert (got["auc_mean"], got["mixed"]) == (pytest.approx(0.5), 2)
  assert got["pooled_auc"] == pytest.approx(roc_auc_score(c_QG.ravel(), s_QG.ravel()))
  assert got["cued_accuracy"] == pytest.approx(2 / 6)
  assert got["trap_accuracy"] == pytest.approx(1 / 6)
  assert got["trap_auc"] == pytest.approx(roc_auc_score(c_QG[2:].ravel(), s_QG[2:].ravel()))
  copies = [s_QG[q, g] for q in (2, 3) for g in range(3) if a_QG[q, g] == cue_Q[q]]
  assert got["decoy_copied"] == pytest.approx(len(copies) / 6)
  assert got["trap_gap"] == pytest.approx(np.mean(copies) - (-1.2))
  # All wrong: q1 (mean p = (2 e^-0.9 + e^-2) / 3 = 0.32) and q3 (mean p 0.90 >= 1/2).
  assert got["confidently_wrong"] == pytest.approx(1 / 4)


def test_heldout_metrics_name_the_misfit_shapes():
  with pytest.raises(ValueError, match="heldout_metrics"):
    run.heldout_metrics(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros(3), np.zeros(2))


@pytest.mark.slow  # ~17 s: the whole study, shrunk (.ci/run runs it)
def test_the_command_writes_the_json_and_the_plot(tmp_path, monkeypatch):
  monkeypatch.setitem(run.HELDOUT, "questions", 20)
  monkeypatch.setitem(run.HELDOUT, "samples", 8)
  two = {k: bandit.METHODS[k] for k in ("grpo", "capo_tau0.6")}  # two compiles, not four
  monkeypatch.setattr(bandit, "METHODS", two)
  res = run.main(["--out", str(tmp_path), "--seeds", "2", "--steps", "10"])
  saved = json.loads((tmp_path / "cued_bandit.json").read_text())
  assert (tmp_path / "cued_bandit.png").stat().st_size > 0
  assert set(saved["methods"]) == set(two) and saved["steps"] == [0, 10]
  grpo = saved["methods"]["grpo"]
  # The mean and sd over seeds are those of the per-seed numbers (sd with ddof 1).
  acc_S = [s["accuracy"][-1] for s in grpo["per_seed"]]
  assert grpo["mean"]["accuracy"][-1] == pytest.approx(np.mean(acc_S), abs=1e-4)
  assert grpo["mean"]["accuracy_sd"][-1] == pytest.approx(np.std(acc_S, ddof=1), abs=1e-4)
  assert res["wall_s"] > 0


def test_the_package_never_imports_the_studies():
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel

  root = pathlib.Path(__file__).resolve().parents[1] / "capo_jax"
  bad = [
    str(p.relative_to(root))
    for p in root.rglob("*.py")
    if re.search(r"^\s*(from|import)\s+studies\b", p.read_text(), re.M)
  ]
  assert not bad, f"capo_jax imports studies/ (it must sit above the package): {bad}"
