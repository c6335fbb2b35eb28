"""Advantage estimators against their equations (docs/algorithms.md, "Advantages").

References are independent: NumPy double loops over pairs, `jax.grad` of the
pairwise surrogates written pair by pair, and hand-computed groups. Identities
with `jax.grad` run in float64 (`jax.enable_x64` context) with tolerance 1e-9;
float32 comparisons use rtol 1e-5 / atol 1e-6 (float32 epsilon is 1.2e-7 and
the advantages are O(1)).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import advantage_refs
from capo_jax.rl import advantages as adv
from capo_jax.rl import algorithms, losses
from capo_jax.rl.algorithms import ALGORITHMS

METHODS = ("grpo", "dr_grpo", "capo", "codapo", "cde", "gspo", "simko")


def _adv(method: str, batch: adv.GroupBatch, step: int = 0, total_steps: int = 1, **fields):
  """Algorithm ``method``'s estimator, built with ``fields``, on ``batch``."""
  return ALGORITHMS[method].estimator(**fields).advantages(batch, step, total_steps)


def _logistic_surrogate(s_G, r_G, v_G, tau: float, norm: str):
  """(1/n) sum_{i in P, j in N} log(1 + exp(-(s_i - s_j)/tau)), pair by pair."""
  g = len(r_G)
  pos = [i for i in range(g) if v_G[i] and r_G[i] == 1]
  neg = [j for j in range(g) if v_G[j] and r_G[j] == 0]
  n = {"group": int(v_G.sum()), "pairs": max(len(pos) * len(neg), 1), "none": 1}[norm]
  total = 0.0
  for i in pos:
    for j in neg:
      total = total + jnp.logaddexp(0.0, -(s_G[i] - s_G[j]) / tau)
  return total / n


@pytest.mark.parametrize("norm", adv.NORMS)
@pytest.mark.parametrize("tau", [0.1, 0.6, 2.0])
def test_capo_is_minus_grad_of_logistic_surrogate_float64(norm: str, tau: float) -> None:
  r, s, v = advantage_refs.random_batch(seed=int(tau * 10) + len(norm))
  with jax.enable_x64(True):
    a = np.asarray(adv.capo(r, jnp.asarray(s, jnp.float64), v, tau=tau, norm=norm))
    assert a.dtype == np.float64
    for q in range(r.shape[0]):
      g = -np.asarray(jax.grad(_logistic_surrogate)(jnp.asarray(s[q]), r[q], v[q], tau, norm))
      np.testing.assert_allclose(a[q], np.where(v[q], g, 0.0), rtol=0, atol=1e-9)


@pytest.mark.parametrize("norm", adv.NORMS)
def test_capo_matches_numpy_double_loop_float32(norm: str) -> None:
  r, s, v = advantage_refs.random_batch(seed=7, q=20, g=16)
  rng = np.random.default_rng(1)
  u = v & (rng.random(v.shape) < 0.8)
  got = adv.capo(r.astype(np.float32), s.astype(np.float32), v, tau=0.6, norm=norm, receive_QG=u)
  assert got.dtype == jnp.float32
  want = advantage_refs.capo_loop(r, s.astype(np.float32).astype(np.float64), v, u, 0.6, norm)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_capo_signs() -> None:
  r, s, v = advantage_refs.random_batch(seed=3, q=30, g=8, p_valid=1.0)
  a = np.asarray(adv.capo(r, s, v, tau=0.6))
  live = (r.max(1) == 1) & (r.min(1) == 0)
  assert live.sum() >= 20
  assert (a[live][r[live] == 1] > 0).all()
  assert (a[live][r[live] == 0] < 0).all()


@pytest.mark.parametrize("method", METHODS)
def test_exact_zeros_degenerate_invalid_and_masked(method: str) -> None:
  r = np.array([[1, 1, 1, 1, 0], [0, 0, 0, 0, 1], [1, 0, 1, 0, 1], [1, 0, 0, 1, 1]], np.float32)
  s = np.array(
    [
      [-0.3, -0.1, -0.9, -0.2, np.nan],
      [-0.5, -0.4, -0.7, -0.1, np.inf],
      [-0.2, -0.6, np.nan, -0.3, -0.8],
      [-0.2, -0.6, -0.4, -0.3, -0.8],
    ],
    np.float32,
  )
  valid = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 0, 1, 1], [1, 1, 1, 1, 1]], bool)
  receive = valid.copy()
  receive[3, 1] = receive[3, 3] = False  # noise-masked, still partners
  # CDE in its second half (omega = 0): its bonus would spread groups 0 and 1
  # (test_cde_all_correct_group_keeps_its_bonus).
  step = 9 if method == "cde" else 0
  a = np.asarray(_adv(method, adv.GroupBatch(r, s, valid, receive), step=step, total_steps=10))
  assert np.isfinite(a).all()
  assert (a[0] == 0).all() and (a[1] == 0).all()  # all-correct / all-wrong among valid
  assert a[2, 2] == 0 and a[3, 1] == 0 and a[3, 3] == 0
  assert (a[2, [0, 1, 3, 4]] != 0).all() and (a[3, [0, 2, 4]] != 0).all()


def test_capo_permutation_equivariant() -> None:
  r, s, v = advantage_refs.random_batch(seed=11, q=10, g=16)
  a = np.asarray(adv.capo(r, s, v, tau=0.5))
  rng = np.random.default_rng(0)
  for _ in range(3):
    perm = rng.permutation(16)
    ap = np.asarray(adv.capo(r[:, perm], s[:, perm], v[:, perm], tau=0.5))
    np.testing.assert_allclose(ap, a[:, perm], rtol=1e-6, atol=1e-7)


def test_capo_misranked_pairs_weigh_more() -> None:
  # Two correct (low and high confidence) and two wrong (low and high).
  r = np.array([[1, 1, 0, 0]], np.float32)
  s = np.array([[-1.0, -0.2, -1.1, -0.3]], np.float32)
  a = np.asarray(adv.capo(r, s, np.ones_like(r, bool), tau=0.3))[0]
  assert a[0] > a[1] > 0  # the unsure correct answer is pushed up more
  assert a[3] < a[2] < 0  # the confident wrong answer is pushed down more
  # One pair each: misranked (wrong more confident) vs well ranked.
  a_bad = np.asarray(
    adv.capo(np.array([[1.0, 0.0]]), np.array([[-0.8, -0.2]]), np.ones((1, 2), bool), tau=0.3)
  )
  a_good = np.asarray(
    adv.capo(np.array([[1.0, 0.0]]), np.array([[-0.2, -0.8]]), np.ones((1, 2), bool), tau=0.3)
  )
  assert abs(a_bad[0, 0]) > 5 * abs(a_good[0, 0])


def test_capo_large_tau_tends_to_dr_grpo_over_2tau() -> None:
  r, s, v = advantage_refs.random_batch(seed=5)
  dr = _dr_grpo_loop(r, v)
  errs = []
  for tau in (1e1, 1e2, 1e3):
    a = np.asarray(adv.capo(r, s, v, tau=tau))
    errs.append(np.abs(2 * tau * a - dr).max())
  assert errs[2] < 1e-3 and errs[0] > errs[1] > errs[2]


def _dr_grpo_loop(r: np.ndarray, v: np.ndarray) -> np.ndarray:
  out = np.zeros(r.shape)
  for q in range(r.shape[0]):
    rv = r[q][v[q]]
    if rv.min() != rv.max():
      out[q][v[q]] = rv - rv.mean()
  return out


@pytest.mark.parametrize("std,ddof", [("unbiased", 1), ("population", 0)])
def test_grpo_and_dr_grpo_against_numpy(std: str, ddof: int) -> None:
  r, s, v = advantage_refs.random_batch(seed=9, q=16, g=8)
  dr = _dr_grpo_loop(r, v)
  want = np.zeros(r.shape)
  for q in range(r.shape[0]):
    rv = r[q][v[q]]
    want[q][v[q]] = dr[q][v[q]] / (np.std(rv, ddof=ddof) + 1e-6)
  np.testing.assert_allclose(np.asarray(adv.dr_grpo(r, v)), dr, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(adv.grpo(r, v, std=std)), want, rtol=1e-5, atol=1e-6)
  if std == "unbiased":  # the default
    np.testing.assert_allclose(np.asarray(adv.grpo(r, v)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["grpo", "gspo", "simko", "codapo", "cde"])
def test_std_option_reaches_every_grpo_normalisation(method: str) -> None:
  """At G = 8 with 3 correct the unbiased std is sqrt(8/7) times the population std, so
  (A and the eps aside) every advantage of the default is sqrt(7/8) ~ 0.935 times the
  population one's."""
  r = np.array([[1, 0, 0, 1, 0, 1, 0, 0]], np.float32)
  s = np.linspace(-0.9, -0.2, 8, dtype=np.float32)[None]
  b = adv.GroupBatch(r, s, np.ones_like(r, bool))
  unb = np.asarray(_adv(method, b, total_steps=10))
  pop = np.asarray(_adv(method, b, total_steps=10, std="population"))
  assert (unb != 0).all()
  np.testing.assert_allclose(unb, pop * math.sqrt(7 / 8), rtol=1e-5)
  with pytest.raises(ValueError, match=r"std='sample' is not one of \('unbiased', 'population'\)"):
    _adv(method, b, total_steps=10, std="sample")


def test_config_algo_std_is_validated_and_reaches_the_estimators() -> None:
  from capo_jax.run import spec as spec_lib  # pylint: disable=import-outside-toplevel
  from configs import common  # pylint: disable=import-outside-toplevel

  c = common.shrink(common.get_base_config())
  spec = lambda: spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True)
  assert c.algo.std == "unbiased" and not hasattr(spec().estimator(), "std")  # capo
  for name in ("grpo", "gspo", "simko", "codapo", "cde"):
    c.algo.name = name
    assert spec().estimator().std == "unbiased"
  c.algo.std = "population"
  assert spec().estimator().std == "population"
  c.algo.std = "sample"
  with pytest.raises(ValueError, match=r"config\.algo\.std='sample': GRPO's group std"):
    spec()


def test_run_spec_builds_each_algorithms_estimator_from_config_algo() -> None:
  """Every config.algo field reaches its estimator's field (the config keeps its names)."""
  from capo_jax.run import spec as spec_lib  # pylint: disable=import-outside-toplevel
  from configs import common  # pylint: disable=import-outside-toplevel

  c = common.shrink(common.get_base_config())
  c.algo.tau, c.algo.norm, c.algo.score, c.algo.adaptive_tau = 0.3, "pairs", "neg_ppl", 0.5
  c.algo.cde_kappa, c.algo.cde_alpha, c.algo.cde_omega = 2.0, 0.4, 0.7
  c.algo.std = "population"
  want = {
    "capo": algorithms.Capo(tau=0.3, norm="pairs", score="neg_ppl", adaptive_tau=0.5),
    "grpo": algorithms.Grpo(std="population"),
    "dr_grpo": algorithms.DrGrpo(),
    "gspo": algorithms.Grpo(std="population"),
    "simko": algorithms.Grpo(std="population"),
    "codapo": algorithms.Codapo(std="population"),
    "cde": algorithms.Cde(kappa=2.0, alpha=0.4, omega=0.7, std="population"),
  }
  assert set(want) == set(ALGORITHMS)
  for name, est in want.items():
    c.algo.name = name
    got = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True).advantage_spec()
    assert got.estimator == est and type(got.estimator) is type(est), name
  c.algo.cde_kappa = 0.0  # checked by the class, named by the config section
  with pytest.raises(spec_lib.ConfigError, match=r"config\.algo: Cde\.kappa=0\.0 must be > 0"):
    spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True)


def test_adding_an_estimator_as_docs_algorithms_md_shows(monkeypatch) -> None:
  """The class and registry line of docs/algorithms.md, "Adding an estimator", run as
  written: RLOO against a leave-one-out loop, then a run config that names it."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel

  from capo_jax.run import spec as spec_lib  # pylint: disable=import-outside-toplevel
  from configs import common  # pylint: disable=import-outside-toplevel

  page = (pathlib.Path(__file__).parent.parent / "docs" / "algorithms.md").read_text()
  section = page.split("## Adding an estimator\n")[1].split("\n## ")[0]
  cls_code, line = re.findall(r"```python\n(.*?)```", section, re.S)
  ns: dict = {}
  exec(cls_code, ns)  # pylint: disable=exec-used
  ((name, algo),) = eval(
    "{" + line + "}",  # pylint: disable=eval-used
    {**ns, "Algorithm": algorithms.Algorithm},
  ).items()
  monkeypatch.setitem(ALGORITHMS, name, algo)
  r, s, v = advantage_refs.random_batch(seed=31, p_valid=0.8)
  want = np.zeros(r.shape)
  for q, g in itertools.product(*map(range, r.shape)):
    others = [r[q, j] for j in range(r.shape[1]) if v[q, j] and j != g]
    live = v[q].sum() > 1 and len(set(r[q][v[q]])) == 2
    want[q, g] = r[q, g] - np.mean(others) if v[q, g] and live else 0.0
  assert name == "rloo"
  got = ALGORITHMS["rloo"].estimator().advantages(adv.GroupBatch(r, s, v))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  c = common.shrink(common.get_base_config())
  c.algo.name = "rloo"
  spec = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True)
  assert spec.advantage_spec().estimator == ns["Rloo"]()
  assert spec.loss_aggregation == "seq-mean-token-mean"
  assert spec.train_config().policy_loss == losses.Ppo()


def test_estimators_are_hashable_values_that_check_their_fields() -> None:
  """Equal fields: equal and equally hashed (one compiled program per configuration)."""
  assert algorithms.Capo(tau=0.5) == algorithms.Capo(tau=0.5) != algorithms.Capo(tau=0.6)
  assert hash(algorithms.Cde(omega=0.5)) == hash(algorithms.Cde(omega=0.5))
  assert algorithms.Grpo() != algorithms.Codapo()  # same fields, other estimator
  for bad, needle in (
    (lambda: algorithms.Capo(tau=0.0), "Capo.tau=0.0 must be > 0"),
    (lambda: algorithms.Capo(norm="mean"), "Capo.norm='mean'"),
    (lambda: algorithms.Capo(score="ppl"), "Capo.score='ppl'"),
    (lambda: algorithms.Capo(adaptive_tau=-1.0), "Capo.adaptive_tau=-1.0"),
    (lambda: algorithms.Cde(kappa=-1.0), "Cde.kappa=-1.0"),
    (lambda: algorithms.Codapo(std="sample"), "Codapo: std='sample'"),
  ):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
      bad()


def test_group_with_one_valid_row_is_degenerate_under_both_stds() -> None:
  """n = 1: the unbiased std's n - 1 = 0 never divides; A = 0 (no partner to compare to)."""
  r = np.array([[1, 0, 0, 0], [1, 0, 1, 0]], np.float32)
  v = np.array([[1, 0, 0, 0], [1, 1, 0, 0]], bool)
  for std in adv.STDS:
    for method in ("grpo", "codapo", "cde"):
      a = np.asarray(_adv(method, adv.GroupBatch(r, r - 1, v), std=std))
      assert np.isfinite(a).all() and (a[0] == 0).all(), (method, std)
  # Two valid rows, one right: (1 - 1/2) / std; unbiased std = sqrt(1/2), population 1/2.
  np.testing.assert_allclose(
    np.asarray(adv.grpo(r, v))[1],
    [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 0, 0],
    rtol=1e-6,
  )
  np.testing.assert_allclose(
    np.asarray(adv.grpo(r, v, std="population"))[1],
    [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0, 0],
    rtol=1e-6,
  )


def _linear_surrogate(s_G, r_G, v_G):
  """(1/n) sum_{i in P, j in N} -(s_i - s_j): the surrogate GRPO descends."""
  g = len(r_G)
  pairs = [
    (i, j)
    for i, j in itertools.product(range(g), range(g))
    if v_G[i] and v_G[j] and r_G[i] == 1 and r_G[j] == 0
  ]
  return sum(-(s_G[i] - s_G[j]) for i, j in pairs) / int(v_G.sum())


def test_grpo_gradient_is_linear_pairwise_surrogate_gradient() -> None:
  """Dr.GRPO's A = -d/ds of the linear surrogate; GRPO's A = that / (std(R) + 1e-6).

  With A as a stop-gradient weight, the policy gradient -sum_i A_i grad s_i
  then equals the gradient of the surrogate composed with s(theta).
  """
  r, s, v = advantage_refs.random_batch(seed=13)
  with jax.enable_x64(True):
    a_dr = np.asarray(adv.dr_grpo(r, v))
    a_grpo = np.asarray(adv.grpo(r, v))
    for q in range(2, r.shape[0]):
      g = -np.asarray(jax.grad(_linear_surrogate)(jnp.asarray(s[q]), r[q], v[q]))
      g = np.where(v[q], g, 0.0)
      np.testing.assert_allclose(a_dr[q], g, rtol=0, atol=1e-12)
      np.testing.assert_allclose(a_grpo[q], g / (np.std(r[q][v[q]], ddof=1) + 1e-6), atol=1e-9)


def test_entry_point_is_jittable_with_traced_step() -> None:
  r, s, v = advantage_refs.random_batch(seed=21, p_valid=1.0)
  fn = jax.jit(
    lambda r, s, v, step: algorithms.Cde().advantages(
      adv.GroupBatch(r, s, v), step=step, total_steps=100
    )
  )
  eager0 = algorithms.Cde().advantages(adv.GroupBatch(r, s, v), step=0, total_steps=100)
  np.testing.assert_allclose(np.asarray(fn(r, s, v, 0)), np.asarray(eager0), rtol=1e-6)
  late = np.asarray(fn(r, s, v, 60))
  np.testing.assert_allclose(late, np.asarray(adv.grpo(2 * r - 1, v)), rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise_clear_errors() -> None:
  r = np.array([[1, 0.5]], np.float32)
  s = np.zeros((1, 2), np.float32)
  v = np.ones((1, 2), bool)
  with pytest.raises(ValueError, match=r"rewards_QG\[0, 1\] = 0.5"):
    algorithms.Grpo().advantages(adv.GroupBatch(r, s, v))
  with pytest.raises(ValueError, match="unknown algorithm 'ppo'"):
    algorithms.algorithm("ppo")
  with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):
    algorithms.Capo(temperature=0.5)  # pylint: disable=unexpected-keyword-arg
  with pytest.raises(ValueError, match="one shape"):
    algorithms.Grpo().advantages(adv.GroupBatch(np.ones((1, 3)), s, v))
  with pytest.raises(ValueError, match="norm='mean'"):
    adv.capo(np.ones((1, 2)), s, v, tau=0.6, norm="mean")
  with pytest.raises(ValueError, match="tau must be > 0"):
    adv.capo(np.ones((1, 2)), s, v, tau=0.0)
  with pytest.raises(ValueError, match="score='ppl'"):
    adv.to_score(s, "ppl")
  with pytest.raises(ValueError, match="mode='keep'"):
    adv.split_masks(v, v, mode="keep")


@pytest.mark.parametrize("mode", ["partner", "drop"])
def test_score_rollout_is_one_program_matching_numpy(mode: str) -> None:
  """rollout.score_rollout (mask -> split -> CAPO -> metrics, jitted) against NumPy loops;
  the step is traced, so a new step reuses the compiled program."""
  from capo_jax.rl import rollout  # pylint: disable=import-outside-toplevel

  r, s, _ = advantage_refs.random_batch(7)
  ref_s = -np.random.default_rng(8).gamma(1.0, 0.6, size=r.shape)  # ppl from 1 to ~10
  ppl = np.exp(-ref_s)
  noisy = ((r == 1) & (ppl > 2.5)) | ((r == 0) & (ppl < 1.05))
  assert noisy.any() and (~noisy).any()
  ones = np.ones(r.shape, bool)
  v, u = (ones, ~noisy) if mode == "partner" else (~noisy, ~noisy)
  spec = rollout.AdvantageSpec(
    estimator=algorithms.Capo(tau=0.6, norm="group"), noise_mask=True, mask_mode=mode, num_steps=10
  )
  got, met = rollout.score_rollout(r.astype(np.float32), s, ref_s, 3, spec=spec)
  want = advantage_refs.capo_loop(r, s, v, u, 0.6)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  c = r == 1
  np.testing.assert_allclose(float(met["masked_frac"]), noisy.mean(), rtol=1e-6)
  np.testing.assert_allclose(float(met["masked_frac_correct"]), noisy[c].mean(), rtol=1e-6)
  np.testing.assert_allclose(float(met["masked_frac_wrong"]), noisy[~c].mean(), rtol=1e-6)
  live = [q for q in range(r.shape[0]) if len(set(r[q][v[q]])) == 2]
  spread = np.mean([np.std(s[q][v[q]]) for q in live])
  np.testing.assert_allclose(float(met["s_spread"]), spread, rtol=1e-5)
  np.testing.assert_allclose(float(met["adv_abs_mean"]), np.abs(want).mean(), rtol=1e-5)
  n_compiled = rollout.score_rollout._cache_size()  # pylint: disable=protected-access
  rollout.score_rollout(r.astype(np.float32), s, ref_s, 4, spec=spec)
  assert rollout.score_rollout._cache_size() == n_compiled  # pylint: disable=protected-access
