"""Sampler / trainer mismatch in the train step and the run: the corrected, masked step
against a full-batch reference written out by hand, the config checks, and one RL step end to
end. The weights and losses by hand: tests/test_mismatch.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rl_driver
from batches import ref_completion_logp
from capo_jax.rl import microbatches, mismatch
from capo_jax.rl import train_state as state_lib
from capo_jax.rl import train_step as ts
from capo_jax.rl.batch import Sequences
from capo_jax.rl.losses import LossConfig
from capo_jax.run import spec as spec_lib
from configs import common
from models import qwen2
from models.config import Qwen2Config

# --------------------------------------------------------------------------
# The train step: micro-batches, packing, the folded mask and the weights.
# --------------------------------------------------------------------------

CFG = Qwen2Config.tiny(vocab_size=128)
B, P, C = 8, 4, 6


@pytest.mark.parametrize(
  "agg",
  [
    pytest.param("seq-mean-token-mean", marks=pytest.mark.slow),  # ~15 s; token-mean stays
    "token-mean",
  ],
)
def test_train_step_with_icepop_and_truncation_equals_a_full_batch_reference(agg):
  params = jax.tree.map(
    lambda p: p * 4.0 if p.ndim >= 2 else p, qwen2.init_params(CFG, jax.random.key(0))
  )
  rng = np.random.default_rng(1)
  prompt = rng.integers(0, CFG.vocab_size, (B, P)).astype(np.int32)
  pmask = (np.arange(P)[None] >= rng.integers(0, P - 1, (B, 1))).astype(np.int32)
  comp = rng.integers(0, CFG.vocab_size, (B, C)).astype(np.int32)
  cmask = (np.arange(C)[None] < np.array([6, 1, 3, 6, 6, 2, 5, 4])[:, None]).astype(np.int32)
  truncated = np.array([1, 0, 0, 1, 0, 0, 0, 0], bool)
  adv = rng.normal(size=(B,)).astype(np.float32)
  old = np.asarray(ref_completion_logp(params, CFG, prompt, pmask, comp))
  old = old + rng.normal(scale=0.1, size=old.shape).astype(np.float32)  # some ratios clip
  sampler = old - rng.normal(scale=0.6, size=old.shape).astype(np.float32)
  spec = mismatch.MismatchSpec(
    correction="icepop", cap=2.0, low=0.5, high=5.0, mis_two_sided=True, mask_truncated=True
  )
  seqs = Sequences(
    completion_mask_BC=jnp.asarray(cmask), old_logp_BC=jnp.asarray(old), adv_B=jnp.asarray(adv)
  )
  seqs, metrics = spec.correct(seqs, jnp.asarray(sampler), jnp.asarray(~truncated))
  assert 0 < metrics["mismatch/reject_frac"] < 1

  # Reference: every token written out in [B, C], no aggregate() and no packing.
  rho = np.exp(np.where(cmask > 0, old - sampler, 0.0))
  keep = (cmask > 0) & (rho >= 0.5) & (rho <= 5.0) & ~truncated[:, None]
  w = np.where(keep, rho, 0.0)

  def ref_loss(p):
    ratio = jnp.exp(ref_completion_logp(p, CFG, prompt, pmask, comp) - old)
    a = adv[:, None]
    obj = jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a) * w * keep
    if agg == "token-mean":
      return -obj.sum() / keep.sum()
    rows = keep.any(1)
    return -(obj.sum(1) / np.maximum(keep.sum(1), 1)).sum() / rows.sum()

  mbs = microbatches.plan_update(
    prompt, pmask, comp, cmask, microbatches.RowLayout(P + C, B // 4, pack=False)
  )
  assert mbs.rows.tokens_YT.shape[0] == 4  # four micro-batches to accumulate
  batch = mbs.batch(jax.tree.map(np.asarray, seqs))
  tcfg = state_lib.TrainConfig(loss=LossConfig(agg=agg))
  loss, _, grads = jax.jit(ts.loss_and_grads, static_argnums=(2, 3))(params, batch, CFG, tcfg)
  assert float(loss) == pytest.approx(float(ref_loss(params)), rel=1e-5)
  want = jax.jit(jax.grad(ref_loss))(params)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    scale = float(jnp.abs(r).max()) + 1e-12
    np.testing.assert_allclose(np.asarray(g) / scale, np.asarray(r) / scale, atol=1e-4)


# --------------------------------------------------------------------------
# Config and the run.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "field,value,needle",
  [
    ("rollout.is_correction", "tis", "rollout.is_correction='tis'"),
    ("rollout.is_cap", 0.0, "rollout.is_cap=0.0"),
    ("rollout.icepop_low", 6.0, "icepop_low / icepop_high"),
    ("rollout.mis_two_sided", "yes", "rollout.mis_two_sided='yes'"),
  ],
)
def test_bad_mismatch_config_names_the_field(field, value, needle):
  # As a plain dict (a JSON config): a ConfigDict would refuse "yes" for a bool itself.
  c = json.loads(common.shrink(common.get_base_config()).to_json_best_effort())
  section, leaf = field.split(".")
  c[section][leaf] = value
  with pytest.raises(spec_lib.ConfigError, match=needle):
    spec_lib.RunSpec.from_config(c, num_devices=1)


def test_mis_sides_come_from_the_config_and_two_sided_needs_a_cap_above_one():
  c = common.shrink(common.get_base_config())
  c.rollout.is_correction = "mis_seq"
  assert spec_lib.RunSpec.from_config(c, num_devices=1).mismatch_spec().mis_two_sided
  c.rollout.mis_two_sided = False
  assert not spec_lib.RunSpec.from_config(c, num_devices=1).mismatch_spec().mis_two_sided
  c.rollout.is_cap = 0.8  # one-sided: rho <= 0.8 is a valid (if odd) choice
  assert spec_lib.RunSpec.from_config(c, num_devices=1).mismatch_spec().cap == 0.8
  c.rollout.mis_two_sided = True  # [1/0.8, 0.8] is empty
  with pytest.raises(spec_lib.ConfigError, match=r"rollout.is_cap=0.8.*is_cap > 1"):
    spec_lib.RunSpec.from_config(c, num_devices=1)
  c.rollout.is_correction = "tis_seq"  # TIS caps at any C > 0
  assert spec_lib.RunSpec.from_config(c, num_devices=1).mismatch_spec().cap == 0.8


def test_correction_with_sampler_old_logprobs_is_an_error_and_default_is_off():
  c = common.shrink(common.get_base_config())
  spec = spec_lib.RunSpec.from_config(c, num_devices=1).mismatch_spec()
  assert spec == mismatch.MismatchSpec(measure=True)  # measured, nothing corrected
  c.rollout.old_logprobs = "sampler"
  assert not spec_lib.RunSpec.from_config(c, num_devices=1).mismatch_spec().active
  c.rollout.is_correction = "icepop"
  with pytest.raises(spec_lib.ConfigError, match="old_logprobs='trainer'"):
    spec_lib.RunSpec.from_config(c, num_devices=1)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
  return rl_driver.write_assets(tmp_path_factory.mktemp("rl"))


@pytest.mark.slow  # ~40 s each on 2 cores
@pytest.mark.parametrize("correction,mask_truncated", [("mis_token", False), ("tis_seq", True)])
def test_a_corrected_run_trains_end_to_end_and_logs_the_mismatch(
  assets, tmp_path, correction, mask_truncated
):
  c = common.shrink(common.get_base_config())
  c.tokenizer_path, c.data.train = assets["tok"], assets["data"]
  c.rollout.max_prompt_len, c.rollout.max_new_tokens = 256, 8
  c.train.num_steps, c.checkpoint.export_hf, c.optim.lr = 1, False, 1e-3
  c.rollout.is_correction, c.rollout.mask_truncated = correction, mask_truncated
  rl_driver.train(c, str(tmp_path), grader=rl_driver.HashGrader())
  row = json.loads(open(tmp_path / "metrics.jsonl").readline())
  assert np.isfinite(row["loss"]) and row["skipped_updates"] == 0
  # float32 sampler and trainer on a CPU: the same numbers up to rounding.
  assert 0 <= row["mismatch/abs_log_ratio"] < 1e-3
  assert row["mismatch/ratio_p01"] <= row["mismatch/ratio_p50"] <= row["mismatch/ratio_p99"]
  assert row["mismatch/reject_frac"] == 0.0  # MIS's cap 2 is far above 1 + 1e-3
  if not mask_truncated:
    assert row["mismatch/loss_token_frac"] == 1.0 and row["grad_norm"] > 0
  elif row["truncation_rate"] == 1.0:  # a random tiny model rarely stops within 8 tokens
    assert row["mismatch/loss_token_frac"] == 0.0 and row["loss"] == row["grad_norm"] == 0.0
  else:
    assert 0.0 < row["mismatch/loss_token_frac"] < 1.0 and row["grad_norm"] > 0
