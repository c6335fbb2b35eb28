"""Dynamic sampling (rollout.dynamic_sampling): the filter's choice, its bound, resume."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

import rl_driver
from capo_jax.data.rewards import RewardHealth
from capo_jax.rl import dynamic_sampling as ds
from capo_jax.run import spec as spec_lib
from configs import common


def _brute_force_choice(rewards_QG: np.ndarray, q: int) -> list[int]:
  """Walk the groups in draw order: mixed ones first, then degenerate ones to fill."""
  mixed, degenerate = [], []
  for i, row in enumerate(rewards_QG):
    (mixed if 0 < row.sum() < len(row) else degenerate).append(i)
  chosen = mixed[:q]
  return sorted(chosen + degenerate[: q - len(chosen)])


@pytest.mark.parametrize("p_correct", [0.02, 0.3, 0.5, 0.9, 1.0])
def test_select_groups_matches_a_brute_force_walk(p_correct):
  rng = np.random.default_rng(int(p_correct * 100))
  for trial in range(50):
    q, g = rng.integers(1, 9), rng.integers(2, 9)
    n = q * rng.integers(1, 4)
    rewards_QG = (rng.random((n, g)) < p_correct).astype(np.float32)
    idx, n_mixed = ds.select_groups(rewards_QG, q)
    expected = _brute_force_choice(rewards_QG, q)
    assert idx.tolist() == expected, (trial, rewards_QG)
    assert n_mixed == sum(0 < rewards_QG[i].sum() < g for i in expected)


def test_select_groups_refuses_too_few_groups():
  with pytest.raises(ValueError, match="3 groups drawn, fewer than the 4"):
    ds.select_groups(np.ones((3, 2)), 4)


def test_needs_more_counts_mixed_groups_and_stops_at_the_bound():
  rewards = np.array([[1, 0], [1, 1], [0, 0], [0, 1]], np.float32)  # 2 mixed of 4
  assert ds.needs_more(rewards, 4, draws=1, max_draws=3)
  assert not ds.needs_more(rewards, 2, draws=1, max_draws=3)  # enough mixed
  assert not ds.needs_more(rewards, 4, draws=3, max_draws=3)  # the bound


class ByGoldGrader:
  """Degenerate groups on purpose: gold "5" always right, gold "3" always wrong, the
  rest rewarded by the text's CRC32 (``rl_driver.HashGrader``), so mixed or not."""

  def __init__(self, constant: float | None = None) -> None:
    self.constant = constant
    self.hash = rl_driver.HashGrader()
    self.golds_seen: list[str] = []

  def score(self, completions, golds):
    self.golds_seen.extend(golds)
    r, _ = self.hash.score(completions, golds)
    if self.constant is not None:
      r = np.full(len(completions), self.constant, np.float32)
    else:
      r = np.where(np.asarray(golds) == "5", 1.0, np.where(np.asarray(golds) == "3", 0.0, r))
    r = r.astype(np.float32)
    return r, RewardHealth(total=len(r), correct=int(r.sum()))


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
  return rl_driver.write_assets(tmp_path_factory.mktemp("dyn"))


def _config(assets: dict[str, str], steps: int, max_draws: int = 3):
  c = common.shrink(common.get_base_config())
  c.tokenizer_path, c.data.train = assets["tok"], assets["data"]
  c.rollout.max_prompt_len, c.rollout.max_new_tokens = 256, 8
  c.rollout.dynamic_sampling, c.rollout.dynamic_max_draws = True, max_draws
  c.train.num_steps, c.checkpoint.export_hf, c.checkpoint.every_steps = steps, False, 1
  c.eval.every_steps = 0
  c.optim.lr = 1e-3
  return c


def _rows(workdir: pathlib.Path) -> list[dict]:
  return [json.loads(l) for l in open(workdir / "metrics.jsonl")]


def _data_position(workdir: pathlib.Path, step: int) -> int:
  meta = json.loads((workdir / "checkpoints" / str(step) / "meta" / "metadata").read_text())
  return meta["data"]["epoch"] * meta["data"]["num_examples"] + meta["data"]["position"]


@pytest.mark.slow  # ~40 s: a 3-step run (.ci/run runs it); the choice itself is tested above
def test_the_step_trains_on_mixed_groups_and_the_stream_covers_every_draw(assets, tmp_path):
  c = _config(assets, steps=3)
  Q = c.rollout.num_prompts
  grader = ByGoldGrader()
  rl_driver.train(c, str(tmp_path), grader=grader)
  rows = _rows(tmp_path)
  drawn = [int(r["prompts_drawn"]) for r in rows]
  assert all(d % Q == 0 and Q <= d <= 3 * Q for d in drawn)
  assert max(drawn) > Q  # the by-gold questions forced extra draws
  assert len(grader.golds_seen) == sum(drawn) * c.rollout.num_samples
  for r in rows:
    assert r["prompts_dropped"] == r["prompts_drawn"] - Q
    # Only a step that hit the bound may train on degenerate groups, and the logged
    # all-right / all-wrong fractions are of the batch actually trained on.
    if r["prompts_drawn"] < 3 * Q:
      assert r["groups_degenerate"] == 0
    assert r["frac_all_correct"] + r["frac_all_wrong"] == pytest.approx(r["groups_degenerate"] / Q)
  assert _data_position(tmp_path, 3) == sum(drawn)


@pytest.mark.slow  # ~30 s: a 2-step run (.ci/run runs it)
def test_all_degenerate_groups_stop_at_the_bound(assets, tmp_path):
  c = _config(assets, steps=2, max_draws=2)
  Q = c.rollout.num_prompts
  rl_driver.train(c, str(tmp_path), grader=ByGoldGrader(constant=1.0))
  rows = _rows(tmp_path)
  assert [r["prompts_drawn"] for r in rows] == [2 * Q, 2 * Q]
  assert [r["groups_degenerate"] for r in rows] == [Q, Q]
  assert all(r["adv_abs_mean"] == 0 for r in rows)  # zero advantage: nothing to learn
  assert _data_position(tmp_path, 2) == 4 * Q


@pytest.mark.slow  # ~1 min: three runs (.ci/run runs it)
def test_resume_continues_the_data_stream_exactly(assets, tmp_path):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  p_straight = rl_driver.train(_config(assets, 3), str(straight), grader=ByGoldGrader())
  rl_driver.train(_config(assets, 2), str(resumed), grader=ByGoldGrader())
  p_resumed = rl_driver.train(_config(assets, 3), str(resumed), grader=ByGoldGrader())
  assert _rows(straight)[-1]["prompts_drawn"] == _rows(resumed)[-1]["prompts_drawn"]
  assert _data_position(straight, 3) == _data_position(resumed, 3)
  for a, b in zip(jax.tree.leaves(p_straight), jax.tree.leaves(p_resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dynamic_sampling_needs_two_draws():
  c = common.shrink(common.get_base_config())
  c.rollout.dynamic_sampling, c.rollout.dynamic_max_draws = True, 1
  with pytest.raises(spec_lib.ConfigError, match="rollout.dynamic_max_draws"):
    spec_lib.RunSpec.from_config(c, num_devices=1)
