"""Rewards from the config (capo_jax/data/reward_fns.py, docs/rewards.md): plug-in reward
functions and checkers in the deadline pool, their errors, the overlong penalty, the
split of ``correct`` and ``reward`` in the advantages, the config fields."""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest

from capo_jax.data import example_rewards, reward_fns, rewards
from capo_jax.data.rows import Example
from capo_jax.rl import advantages as adv
from capo_jax.rl import algorithms
from capo_jax.run import spec as spec_lib
from configs import common

EXAMPLE_FILE = os.path.join(os.path.dirname(example_rewards.__file__), "example_rewards.py")

PLUGINS = textwrap.dedent('''
    import math, time
    import numpy as np

    def raises(completions, examples):
      return [1.0 / ("bad" not in c) for c in completions]  # ZeroDivisionError on "bad"

    def nan_on_second(completions, examples):
      return [math.nan if i == 1 else 0.0 for i, _ in enumerate(completions)]

    def one_short(completions, examples):
      return [0.0] * (len(completions) - 1)

    def digits(completions, examples):
      return "7" * len(completions)

    def as_dict(completions, examples):
      return {c: 1.0 for c in completions}

    def huge_on_second(completions, examples):
      return [1e39 if i == 1 else 0.0 for i, _ in enumerate(completions)]

    def huge_int(completions, examples):
      return [10**400] * len(completions)

    def nested(completions, examples):
      return [[0.5] for _ in completions]

    def column(completions, examples):
      return np.zeros((len(completions), 1))

    def complex_values(completions, examples):
      return [1j] * len(completions)

    def generator(completions, examples):
      return (0.0 for _ in completions)

    def mixed_kinds(completions, examples):
      if examples[0].id == "q0":  # bools, numpy ints and float32, the float32 extremes
        return (True, np.int64(-3), np.float32(0.25), -3.4028234663852886e38)
      return np.array([2, 7], np.int32)

    def float32_max(completions, examples):
      return [3.4028234663852886e38] * len(completions)

    def hangs_on_slow(completions, examples):
      if any("slow" in c for c in completions):
        time.sleep(60)
      return [0.5] * len(completions)

    def check_len(completion, gold):
      if "slow" in completion:
        time.sleep(60)
      return len(completion) == int(gold)

    def check_not_bool(completion, gold):
      return 0.5

    def check_float_one(completion, gold):
      return 1.0

    def check_int_one(completion, gold):
      return 1

    def check_numpy_bool(completion, gold):
      return np.array([len(completion)]) == int(gold)  # a 1-element array is not a verdict

    def check_numpy_bool_scalar(completion, gold):
      return np.int64(len(completion)) == np.int64(gold)  # numpy.bool_
    ''')


@pytest.fixture(scope="module", autouse=True)
def _two_workers():
  """Plug-in pools start 2 workers here (the CI machine's cores are shared)."""
  old = os.environ.get("CAPO_GRADER_WORKERS")
  os.environ["CAPO_GRADER_WORKERS"] = "2"
  yield
  for pool in reward_fns._pools.values():  # pylint: disable=protected-access
    pool.close()
  reward_fns._pools.clear()  # pylint: disable=protected-access
  if old is None:
    del os.environ["CAPO_GRADER_WORKERS"]
  else:
    os.environ["CAPO_GRADER_WORKERS"] = old


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> str:
  path = tmp_path_factory.mktemp("plugins") / "plug.py"
  path.write_text(PLUGINS)
  return str(path)


def _batch(texts_per_question: list[list[str]]) -> tuple[list[str], list[Example]]:
  """Rows grouped by question, each group sharing one Example object (as the rollout does)."""
  texts, examples = [], []
  for q, group in enumerate(texts_per_question):
    e = Example(id=f"q{q}", problem=f"question {q}", answer="7")
    texts += group
    examples += [e] * len(group)
  return texts, examples


def test_overlong_penalty_hand_computed() -> None:
  # L_max = 10, L_b = 4: 0 up to 6, (6 - L) / 4 on (6, 10], -1 beyond.
  got = reward_fns.overlong_penalty(np.array([0, 5, 6, 7, 8, 9, 10, 11, 50]), 10, 4)
  np.testing.assert_array_equal(got, [0, 0, 0, -0.25, -0.5, -0.75, -1, -1, -1])
  assert got.dtype == np.float32
  with pytest.raises(ValueError, match="buffer=11"):
    reward_fns.overlong_penalty(np.array([1]), 10, 11)


def test_example_functions_hand_computed() -> None:
  texts = [r"so \boxed{7}", r"\boxed{}", "the answer is 7", r"\boxed{7", "x" * 3000]
  assert example_rewards.boxed_format(texts, [None] * 5) == [1.0, 0.0, 0.0, 0.0, 0.0]
  assert example_rewards.length_penalty(texts, [None] * 5) == [
    -12 / 2000,
    -8 / 2000,
    -15 / 2000,
    -8 / 2000,
    -1.0,
  ]


def test_weighted_sum_in_the_pool_equals_direct_calls() -> None:
  """correct + 0.5 * format (by module) + 2 * length (by file path) + overlong, computed
  in the workers, one call per question, against calling the functions here."""
  texts, examples = _batch(
    [[r"\boxed{7}", "no box", r"\boxed{3} " * 30], [r"long \boxed{1}" * 10, r"\boxed{7}"]]
  )
  correct = np.array([1, 0, 0, 0, 1], np.float32)
  lengths = np.array([3, 10, 14, 16, 5])
  fns = reward_fns.RewardFns(
    fns=("correct", "capo_jax.data.example_rewards:boxed_format", f"{EXAMPLE_FILE}:length_penalty"),
    weights=(1.0, 0.5, 2.0),
    timeout_s=10.0,
    max_len=16,
    overlong_buffer=4,
  )
  got, health = fns(texts, examples, correct, lengths)
  want = (
    correct
    + 0.5 * np.array(example_rewards.boxed_format(texts, examples))
    + 2.0 * np.array(example_rewards.length_penalty(texts, examples))
    + np.array([0, 0, -0.5, -1.0, 0])
  )
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert health == {"fn_timeout": 0}
  # Without fns the penalty is added to `correct`.
  only_penalty = reward_fns.RewardFns(max_len=16, overlong_buffer=4)
  np.testing.assert_allclose(
    only_penalty(texts, examples, correct, lengths)[0], correct + np.array([0, 0, -0.5, -1.0, 0])
  )


def test_default_grade_keeps_reward_equal_to_correct() -> None:
  class Fixed:
    def score(self, completions, golds):
      r = np.array([float(g == "7") for g in golds], np.float32)
      return r, rewards.RewardHealth(total=len(r), correct=int(r.sum()))

  texts, examples = _batch([["a", "b"]])
  correct, reward, health = reward_fns.grade(Fixed(), None, texts, examples, np.ones(2))
  assert reward is correct and health["total"] == 2 and "fn_timeout" not in health


@pytest.mark.parametrize(
  "fn,needle",
  [
    ("raises", r"plug.py:raises \(reward.fns\[0\]\) raised ZeroDivisionError: .* on row 3$"),
    (
      "nan_on_second",
      (
        r"plug.py:nan_on_second \(reward.fns\[0\]\) on row 1: returned nan, "
        r"not finite in float32 .* in list \[0.0, nan\]"
      ),
    ),
    (
      "one_short",
      (
        r"plug.py:one_short \(reward.fns\[0\]\) on rows 0-1: returned 1 values "
        r"for 2 completions: list \[0.0\]"
      ),
    ),
    ("digits", r"on rows 0-1: returned str '77', not a list, tuple or 1-D numpy array"),
    ("as_dict", r"on rows 0-1: returned dict \{'fine': 1.0, 'ok': 1.0\}, not a list"),
    ("huge_on_second", r"on row 1: returned 1e\+39, not finite in float32 \(\|v\| <= 3.403e\+38\)"),
    ("huge_int", r"on row 0: returned 1000.*, not finite in float32"),
    ("nested", r"on row 0: returned list \[0.5\], not a real number, in list \[\[0.5\], \[0.5\]\]"),
    ("column", r"on rows 0-1: returned ndarray .* \(shape \(2, 1\), dtype float64\), not a 1-D"),
    ("complex_values", r"on row 0: returned complex 1j, not a real number"),
    ("generator", r"on rows 0-1: returned generator .*, not a list, tuple or 1-D numpy array"),
  ],
)
def test_bad_functions_name_the_function_row_and_output(plugins: str, fn: str, needle: str) -> None:
  texts, examples = _batch([["ok", "fine"], ["good", "bad"]])
  fns = reward_fns.RewardFns(fns=(f"{plugins}:{fn}",), weights=(1.0,), timeout_s=10.0)
  with pytest.raises(reward_fns.RewardFnError, match=needle):
    fns(texts, examples, np.zeros(4), np.ones(4))


def test_real_number_kinds_accepted_and_float32_overflow_of_the_sum(plugins: str) -> None:
  texts, examples = _batch([["a", "b", "c", "d"], ["e", "f"]])
  fns = reward_fns.RewardFns(fns=(f"{plugins}:mixed_kinds",), weights=(1.0,), timeout_s=10.0)
  got, _ = fns(texts, examples, np.zeros(6), np.ones(6))
  np.testing.assert_array_equal(
    got, np.array([1, -3, 0.25, -np.finfo(np.float32).max, 2, 7], np.float32)
  )
  # Each value is float32's max, fine alone; their sum is not.
  twice = reward_fns.RewardFns(
    fns=(f"{plugins}:float32_max",) * 2, weights=(1.0, 1.0), timeout_s=10.0
  )
  with pytest.raises(reward_fns.RewardFnError, match=r"weighted sum .* is 6.8.*e\+38 on row 0"):
    twice(texts, examples, np.zeros(6), np.ones(6))


def test_hanging_function_is_cut_and_counted(plugins: str) -> None:
  texts, examples = _batch([["a", "b"], ["slow", "c"], ["d", "e"]])
  fns = reward_fns.RewardFns(fns=(f"{plugins}:hangs_on_slow",), weights=(2.0,), timeout_s=1.0)
  got, health = fns(texts, examples, np.zeros(6), np.ones(6))
  np.testing.assert_array_equal(got, [1, 1, 0, 0, 1, 1])  # the hung question's rows score 0
  assert health == {"fn_timeout": 2}


def test_plugin_checker_grades_and_times_out(plugins: str) -> None:
  grader = reward_fns.grader_for(f"{plugins}:check_len", timeout_s=1.0)
  assert reward_fns.grader_for(f"{plugins}:check_len", timeout_s=1.0) is grader
  got, health = grader.score(["abc", "abcd", "slow", "ab"], ["3", "3", "4", "2"])
  np.testing.assert_array_equal(got, [1, 0, 0, 1])
  assert (health.total, health.correct, health.timeout) == (4, 2, 1)
  assert reward_fns.grader_for("math") is rewards.default_grader()


@pytest.mark.parametrize(
  "fn,needle",
  [
    ("check_not_bool", "returned float 0.5, not a bool"),
    ("check_float_one", "returned float 1.0, not a bool"),
    ("check_int_one", "returned int 1, not a bool"),
    ("check_numpy_bool", r"returned ndarray array\(\[ True\]\), not a bool"),
  ],
)
def test_plugin_checker_rejects_non_bools(plugins: str, fn: str, needle: str) -> None:
  bad = reward_fns.grader_for(f"{plugins}:{fn}", timeout_s=5.0)
  with pytest.raises(
    reward_fns.RewardFnError, match=rf"checker .*plug.py:{fn} \(reward.correct\) on row 0: {needle}"
  ):
    bad.score(["x"], ["1"])


def test_plugin_checker_accepts_numpy_bools_with_one_call_per_worker(plugins: str) -> None:
  grader = reward_fns.grader_for(f"{plugins}:check_numpy_bool_scalar", 5.0, max_calls=1)
  got, health = grader.score(["abc", "abcd", "ab"], ["3", "3", "2"])
  np.testing.assert_array_equal(got, [1, 0, 1])
  assert health.correct == 2
  assert reward_fns.pool(5.0, max_calls=1).num_recycled == 3  # a fresh worker per call


def test_checker_and_target_names() -> None:
  assert reward_fns.checker_name("auto", "deepscaler") == "math"
  assert reward_fns.checker_name("auto", "/data/file.jsonl") == "math"
  assert reward_fns.checker_name("auto", "countdown") == "countdown"
  assert reward_fns.checker_name("math", "countdown") == "math"
  assert reward_fns.target_of("a.b:f") == "a.b:f"
  assert reward_fns.target_of("rel/x.py:f") == f"{os.path.abspath('rel/x.py')}:f"
  for bad in ("nocolon", "mod:", ":f", "mod:not-an-identifier"):
    with pytest.raises(ValueError, match="is not 'package.module:function'"):
      reward_fns.target_of(bad)


@pytest.mark.parametrize(
  "field,value,needle",
  [
    ("fns", ("no.such.module:f",), r"config.reward.fns='no.such.module:f': cannot load"),
    ("fns", ("capo_jax.data.example_rewards:nope",), r"has no function 'nope'"),
    ("fns", ("/no/such/file.py:f",), r"no such file"),
    ("correct", "bogus", r"config.reward.correct='bogus'"),
    ("weights", (1.0, 2.0), r"config.reward.weights=\(1.0, 2.0\): needs one weight"),
    ("timeout_s", 0.0, r"config.reward.timeout_s=0.0"),
    ("overlong_buffer", 17, r"config.reward.overlong_buffer=17: .*max_new_tokens=16"),
    ("worker_max_calls", -1, r"config.reward.worker_max_calls=-1: must be an integer >= 0"),
    ("worker_max_rss_mb", -1.0, r"config.reward.worker_max_rss_mb=-1.0: must be MiB >= 0"),
  ],
)
def test_bad_reward_config_fails_at_start(field: str, value, needle: str) -> None:
  c = common.shrink(common.get_base_config())
  if field == "weights":
    c.reward.fns = ("correct",)
  c.reward[field] = value
  with pytest.raises(spec_lib.ConfigError, match=needle):
    spec_lib.RunSpec.from_config(c, num_devices=1)


def test_config_defaults_off_and_on() -> None:
  c = common.shrink(common.get_base_config())
  s = spec_lib.RunSpec.from_config(c, num_devices=1)
  assert s.reward_fns() is None and s.checker == "math"
  c.reward.fns = ("correct", "capo_jax.data.example_rewards:boxed_format")
  c.reward.overlong_buffer = 4
  fns = spec_lib.RunSpec.from_config(c, num_devices=1).reward_fns()
  assert fns.weights == (1.0, 1.0) and (fns.max_len, fns.overlong_buffer) == (16, 4)
  assert (fns.worker_max_calls, fns.worker_max_rss_mb) == (1000, 2048.0)
  c.reward.worker_max_calls, c.reward.worker_max_rss_mb = 0, 512
  fns = spec_lib.RunSpec.from_config(c, num_devices=1).reward_fns()
  assert (fns.worker_max_calls, fns.worker_max_rss_mb) == (0, 512.0)


# -- `correct` and `reward` in the advantages ------------------------------------------------

R = np.array([[1.2, 0.2, 0.2, 1.0], [0.3, 0.1, 0.3, 0.3], [0.5, 0.5, 0.5, 0.5]], np.float32)
C = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 0, 0]], np.float32)
S = np.array(
  [[-0.5, -1.0, -0.2, -0.9], [-0.1, -0.2, -0.3, -0.4], [-1.0, -0.5, -0.7, -0.2]], np.float32
)
V = np.ones(R.shape, bool)


def test_grpo_reads_the_scalar_reward_capo_the_labels() -> None:
  batch = adv.GroupBatch(R, S, V, correct_QG=C)
  got = np.asarray(algorithms.Grpo().advantages(batch))
  # Hand-computed: row 0 mean 0.65, unbiased std sqrt((.55^2 + .45^2 * 2 + .35^2) / 3);
  # row 1: all wrong but the rewards differ, so not degenerate; row 2: equal rewards -> 0.
  want = np.zeros(R.shape)
  for q in (0, 1):
    want[q] = (R[q] - R[q].mean()) / (R[q].std(ddof=1) + adv.GRPO_EPS)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    got[0],
    np.array([0.55, -0.45, -0.45, 0.35]) / (np.sqrt((0.55**2 + 0.45**2 * 2 + 0.35**2) / 3) + 1e-6),
    rtol=1e-5,
  )
  capo = np.asarray(algorithms.Capo(tau=0.6).advantages(batch))
  np.testing.assert_allclose(capo, np.asarray(adv.capo(C, S, V, tau=0.6)), rtol=1e-6)
  assert (capo[1] == 0).all() and (capo[2] != 0).all()  # pairs exist only where C is mixed
  # CoDaPO's accuracy reads the labels: d = 1/2 on row 0 (w = 1).
  codapo = np.asarray(algorithms.Codapo().advantages(batch))
  np.testing.assert_allclose(codapo[0], want[0] * (np.exp(S[0].mean()) + 0.1), rtol=1e-5)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "capo", "codapo", "cde", "gspo"])
def test_labels_equal_to_binary_rewards_change_nothing(method: str) -> None:
  est = algorithms.ALGORITHMS[method].estimator(**{"capo": {"tau": 0.6}}.get(method, {}))
  plain = est.advantages(adv.GroupBatch(C, S, V))
  split = est.advantages(adv.GroupBatch(C, S, V, correct_QG=C))
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(split))


def test_score_rollout_masks_and_pairs_on_the_labels() -> None:
  from capo_jax.rl import rollout  # pylint: disable=import-outside-toplevel

  ref_s = np.log(np.array([[1 / 3.0, 1.0, 1.0, 1.0], [1.0] * 4, [1.0] * 4], np.float32))
  spec = rollout.AdvantageSpec(estimator=algorithms.Capo(tau=0.6), noise_mask=True)
  got, met = rollout.score_rollout(R, S, ref_s, 0, spec=spec, correct_QG=C)
  # Row 0, sample 0: correct with reference perplexity 3 > 2.5 -> masked (partner mode);
  # wrong samples all have perplexity 1 < 1.05 -> masked too.
  noisy = ((C == 1) & (np.exp(-ref_s) > 2.5)) | ((C == 0) & (np.exp(-ref_s) < 1.05))
  want = adv.capo(C, S, V, tau=0.6, receive_QG=~noisy)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
  np.testing.assert_allclose(float(met["masked_frac"]), noisy.mean(), rtol=1e-6)
  with pytest.raises(ValueError, match=r"correct_QG must be 0 or 1"):
    algorithms.Grpo().advantages(adv.GroupBatch(R, S, V, correct_QG=R))
