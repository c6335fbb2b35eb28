"""Train step: gradient accumulation, non-finite skip, 8-device sharding (the optimizer:
tests/test_optim.py)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fake_devices
from batches import HostBatch, padded_pass, ref_completion_logp, run_pass
from capo_jax.rl import losses
from capo_jax.rl import train_state as state_lib
from capo_jax.rl import train_step as ts
from capo_jax.rl.batch import ModelRows, Sequences, TrainBatch
from capo_jax.rl.losses import LossConfig
from capo_jax.rl.optim import OptimConfig
from capo_jax.runtime import mesh as mesh_lib
from models import qwen2
from models.config import Qwen2Config

CFG = Qwen2Config.tiny(vocab_size=128)
B, P, C = 8, 4, 6
AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
_loss_and_grads = jax.jit(ts.loss_and_grads, static_argnums=(2, 3))


def _old_pass(cfg, mesh, params, batch, top_k=0):
  """The old-policy pass (one sequence per row, all rows in one call) in [B, C]."""
  keys = ("logp_BC",) + (("topk_ids_BCJ", "topk_logp_BCJ") if top_k else ())
  return run_pass(
    padded_pass(cfg, mesh, mesh_lib.TRAIN_RULES, B, top_k=top_k),
    params,
    (
      batch.prompt_tokens_BP,
      batch.prompt_mask_BP,
      batch.completion_tokens_BC,
      batch.completion_mask_BC,
    ),
    keys,
  )


# --------------------------------------------------------------------------
# Loss and gradients against a hand-written full-batch reference.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data():
  params = qwen2.init_params(CFG, jax.random.key(0))
  params = jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, CFG.vocab_size, (B, P)).astype(np.int32)
  prompt_mask = (np.arange(P)[None] >= rng.integers(0, P - 1, (B, 1))).astype(np.int32)
  completion = rng.integers(0, CFG.vocab_size, (B, C)).astype(np.int32)
  lengths = np.array([6, 1, 3, 0, 6, 2, 5, 4])  # uneven, one empty row
  completion_mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
  adv = rng.normal(size=(B,)).astype(np.float32)
  logp = np.asarray(ref_completion_logp(params, CFG, prompt, prompt_mask, completion))
  old = logp + rng.normal(scale=0.3, size=logp.shape).astype(np.float32)  # some ratios clip
  batch = HostBatch(
    prompt, prompt_mask, completion, completion_mask, jnp.asarray(old), jnp.asarray(adv)
  )
  return params, batch, logp


def _ref_losses(params, batch):
  """Clipped PPO loss under the three aggregations, written out by hand."""
  logp = ref_completion_logp(
    params, CFG, batch.prompt_tokens_BP, batch.prompt_mask_BP, batch.completion_tokens_BC
  )
  m = batch.completion_mask_BC.astype(jnp.float32)
  ratio = jnp.exp(logp - batch.old_logp_BC)
  a = batch.adv_B[:, None]
  obj = jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a) * m
  rows = (m.sum(1) > 0).sum()
  return jnp.stack(
    [
      -(obj.sum(1) / jnp.maximum(m.sum(1), 1)).sum() / rows,
      -obj.sum() / m.sum(),
      -obj.sum() / (C * rows),
    ]
  )


_ref_grads = jax.jit(jax.jacrev(_ref_losses))


def _assert_tree_close(got, want, atol=1e-4):
  def check(path, g, w):
    scale = float(jnp.abs(w).max()) + 1e-12
    np.testing.assert_allclose(
      np.asarray(g) / scale, np.asarray(w) / scale, atol=atol, err_msg=jax.tree_util.keystr(path)
    )

  jax.tree_util.tree_map_with_path(check, got, want)


@pytest.mark.parametrize(
  "agg, micro, remat, chunk",
  [
    ("seq-mean-token-mean", 1, False, 0),
    ("seq-mean-token-mean", 2, True, 4),
    ("token-mean", 4, False, 0),
    ("token-mean", 2, "projections", 4),
  ],
)
def test_accumulated_gradient_equals_full_batch(data, agg, micro, remat, chunk):
  params, batch, _ = data
  tcfg = state_lib.TrainConfig(loss=LossConfig(agg=agg), logprob_chunk_size=chunk)
  cfg = CFG.replace(remat=bool(remat), remat_policy=remat if remat == "projections" else "full")
  loss, aux, grads = _loss_and_grads(params, batch.train_batch(B // micro), cfg, tcfg)
  i = AGGS.index(agg)
  np.testing.assert_allclose(float(loss), float(_ref_losses(params, batch)[i]), rtol=1e-5)
  _assert_tree_close(grads, jax.tree.map(lambda g: g[i], _ref_grads(params, batch)))
  assert 0.0 < float(aux["clip_frac"]) < 1.0


def test_policy_gradient_at_old_policy(data):
  """At theta = theta_old, grad L = -(1/R) sum_i A_i grad s_i (seq-mean-token-mean)."""
  params, batch, logp = data
  batch = dataclasses.replace(batch, old_logp_BC=jnp.asarray(logp))
  _, _, grads = _loss_and_grads(params, batch.train_batch(B), CFG, state_lib.TrainConfig())
  m = batch.completion_mask_BC

  def weighted_scores(p):
    lp = ref_completion_logp(
      p, CFG, batch.prompt_tokens_BP, batch.prompt_mask_BP, batch.completion_tokens_BC
    )
    s_B = (lp * m).sum(1) / jnp.maximum(m.sum(1), 1)
    return -(batch.adv_B * s_B).sum() / (m.sum(1) > 0).sum()

  _assert_tree_close(grads, jax.jit(jax.grad(weighted_scores))(params))


def test_bfloat16_compute_gradients_are_close(data):
  params, batch, _ = data
  cfg16 = CFG.replace(compute_dtype="bfloat16", remat=True)
  tcfg = state_lib.TrainConfig(logprob_chunk_size=4)
  loss, _, grads = _loss_and_grads(params, batch.train_batch(B // 2), cfg16, tcfg)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  g16 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
  g32 = np.concatenate([np.ravel(g[0]) for g in jax.tree.leaves(_ref_grads(params, batch))])
  cos = g16 @ g32 / (np.linalg.norm(g16) * np.linalg.norm(g32))
  assert cos > 0.98, cos
  assert float(loss) == pytest.approx(float(_ref_losses(params, batch)[0]), rel=0.05, abs=0.02)


def test_bfloat16_gradient_keeps_no_bfloat16_copy_of_the_model():
  """The model casts each float32 master where it uses it, so the compiled bf16
  gradient holds neither a bf16 copy of the stacked layers nor their stacked bf16
  gradients. Reference: the same gradient with every param cast up front."""
  cfg = Qwen2Config.tiny(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=1024,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    compute_dtype="bfloat16",
    remat=True,
  )
  shapes = qwen2.param_shapes(cfg)
  layers_bf16 = sum(2 * s.size for s in jax.tree.leaves(shapes["layers"]))
  tcfg = state_lib.TrainConfig(logprob_chunk_size=32)
  spec = lambda dt, *s: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  i32, f32 = jnp.int32, jnp.float32
  batch = TrainBatch(  # one micro-batch of two 128-token rows, 96 completion tokens each
    ModelRows(
      spec(i32, 1, 2, 128),
      spec(i32, 1, 2, 128),
      spec(i32, 1, 2, 128),
      spec(i32, 1, 2, 96),
      spec(i32, 1, 2, 96),
      spec(i32, 1, 2, 96),
    ),
    spec(i32, 1, 2, 96),
    Sequences(spec(i32, 1, 2, 96), spec(f32, 1, 2, 96), spec(f32, 1, 2)),
  )
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), shapes)

  def temp(prepare):
    fn = jax.jit(lambda p, b: ts.loss_and_grads(prepare(p), b, cfg, tcfg)[2])
    return fn.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  ours, cast_first = temp(lambda p: p), temp(lambda p: ts.compute_params(p, cfg))
  assert ours < cast_first - layers_bf16, (ours, cast_first, layers_bf16)


def test_bfloat16_gradient_equals_the_cast_up_front_gradient(data):
  """Casting where used changes where the rounding happens, not the maths: every
  layer's gradient equals the cast-up-front one; the tied embedding's (summed over its
  two uses) is now summed in float32 and agrees to bfloat16 precision."""
  params, batch, _ = data
  cfg16 = CFG.replace(compute_dtype="bfloat16", remat=True)
  tcfg = state_lib.TrainConfig(logprob_chunk_size=4)
  tb = batch.train_batch(B)
  _, _, ours = _loss_and_grads(params, tb, cfg16, tcfg)
  _, _, first = _loss_and_grads(ts.compute_params(params, cfg16), tb, cfg16, tcfg)
  flat_ours = jax.tree_util.tree_flatten_with_path(ours)[0]
  flat_first = dict(jax.tree_util.tree_flatten_with_path(first)[0])
  for path, g in flat_ours:
    w = np.asarray(flat_first[path], np.float32)
    if "embed" in jax.tree_util.keystr(path):
      np.testing.assert_allclose(np.asarray(g), w, atol=2e-2 * np.abs(w).max())
    else:
      np.testing.assert_allclose(
        np.asarray(g), w, rtol=0, atol=1e-6 * np.abs(w).max(), err_msg=jax.tree_util.keystr(path)
      )


def test_simko_needs_old_topk_and_runs(data):
  params, batch, _ = data
  tcfg = state_lib.TrainConfig(policy_loss=losses.Simko())
  with pytest.raises(ValueError, match="old_topk_ids_BCJ|correct_B"):
    ts.loss_and_grads(params, batch.train_batch(B), CFG, tcfg)
  mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  # The layout the logprob fn expects: params placed under the train rules.
  params = jax.device_put(params, mesh_lib.param_shardings(CFG, mesh, mesh_lib.TRAIN_RULES))
  old = _old_pass(CFG, mesh, params, batch, top_k=3)
  batch = dataclasses.replace(
    batch,
    old_topk_ids_BCJ=old["topk_ids_BCJ"],
    old_topk_logp_BCJ=old["topk_logp_BCJ"],
    correct_B=jnp.asarray(batch.adv_B > 0),
  )
  loss, aux, grads = _loss_and_grads(params, batch.train_batch(B // 2), CFG, tcfg)
  assert np.isfinite(float(loss)) and np.isfinite(float(aux["forked_frac"]))
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


# --------------------------------------------------------------------------
# The jitted step: non-finite skip, then one real AdamW update.
# --------------------------------------------------------------------------


def test_step_skips_non_finite_then_updates(data):
  params, batch, _ = data
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  # Adam's first update is lr * g / (|g| + eps): with eps = 1e-8 it is sign(g), which turns
  # float rounding in near-zero entries into visible differences and hides g's scale.
  ocfg = OptimConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip=1e9, eps=1e-2)
  tcfg = state_lib.TrainConfig(optim=ocfg)
  state = state_lib.train_state_from_params(params, CFG, tcfg, mesh, mesh_lib.TRAIN_RULES)
  step = ts.make_train_step(CFG, tcfg, mesh, mesh_lib.TRAIN_RULES, B // 2)
  p0 = jax.tree.map(np.asarray, params)
  bad = dataclasses.replace(batch, adv_B=batch.adv_B.at[2].set(jnp.nan))
  state, met = step(state, bad.train_batch(B // 2))
  assert int(met["skipped"]) == 1 and int(state.num_skipped) == 1 and int(state.step) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), p0)
  assert all(
    float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(state.opt_state) if x.dtype == jnp.float32
  )  # moments untouched
  state, met = step(state, batch.train_batch(B // 2))
  assert int(met["skipped"]) == 0 and int(state.num_skipped) == 1 and int(state.step) == 2
  assert float(met["lr"]) == pytest.approx(1e-2)
  # First AdamW update by hand: m/sqrt(v) = g/(|g| + eps) after bias correction.
  g = jax.tree.map(lambda x: np.asarray(x[0], np.float64), _ref_grads(params, batch))
  want = jax.tree.map(lambda p, g: p - 1e-2 * (g / (np.abs(g) + 1e-2) + 0.1 * p), p0, g)
  got = jax.tree.map(np.asarray, state.params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6), got, want)
  assert float(met["grad_norm"]) == pytest.approx(
    math.sqrt(sum((x**2).sum() for x in jax.tree.leaves(g))), rel=1e-4
  )


# --------------------------------------------------------------------------
# 8 fake CPU devices: (data 2, fsdp 2, tensor 2) equals one device.
# --------------------------------------------------------------------------


def _sharded_check() -> None:
  from jax.sharding import PartitionSpec as Spec

  assert len(jax.devices()) == 8
  cfg = Qwen2Config.tiny()  # D 64, N 4, K 2, F 128, V 256: all divisible by 2
  # eps 1e-2: see test_step_skips_non_finite_then_updates (first Adam step ~ sign(g)).
  tcfg = state_lib.TrainConfig(optim=OptimConfig(learning_rate=1e-2, eps=1e-2))
  rules = mesh_lib.TRAIN_RULES
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 256, (B, P)).astype(np.int32)
  pmask = (np.arange(P)[None] >= rng.integers(0, P - 1, (B, 1))).astype(np.int32)
  comp = rng.integers(0, 256, (B, C)).astype(np.int32)
  cmask = (np.arange(C)[None] < rng.integers(1, C + 1, (B, 1))).astype(np.int32)
  adv = rng.normal(size=(B,)).astype(np.float32)
  results, old = {}, None
  for name, axes, devs in (
    ("one", {"data": 1}, jax.devices()[:1]),
    ("eight", {"data": 2, "fsdp": 2, "tensor": 2}, None),
  ):
    mesh = mesh_lib.make_mesh(axes, devices=devs)
    state = state_lib.create_train_state(cfg, tcfg, jax.random.key(1), mesh, rules)
    if old is None:  # one device; the same host array feeds both runs
      old = (
        np.asarray(
          _old_pass(cfg, mesh, state.params, HostBatch(prompt, pmask, comp, cmask, None, adv))[
            "logp_BC"
          ]
        )
        - 0.1 * adv[:, None]
      )
    batch = HostBatch(prompt, pmask, comp, cmask, old, adv)
    step = ts.make_train_step(cfg, tcfg, mesh, rules, B // 2)
    state, met = step(state, batch.train_batch(B // 2))
    results[name] = (state, met)
  (s1, m1), (s8, m8) = results["one"], results["eight"]
  diff = max(
    float(np.abs(np.asarray(a) - np.asarray(b)).max())
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s8.params))
  )
  moved = max(
    float(np.abs(np.asarray(a) - np.asarray(b)).max())
    for a, b in zip(
      jax.tree.leaves(s1.params), jax.tree.leaves(qwen2.init_params(cfg, jax.random.key(1)))
    )
  )
  assert diff <= 1e-5 and moved > 1e-4, (diff, moved)
  assert abs(float(m1["grad_norm"]) / float(m8["grad_norm"]) - 1) < 1e-5
  assert abs(float(m1["loss"]) - float(m8["loss"])) < 1e-6
  lay = s8.params["layers"]
  assert s8.params["embed"].sharding.spec == Spec("tensor", "fsdp")
  assert lay["q_kernel"].sharding.spec == Spec(None, "fsdp", "tensor", None)
  assert lay["down_kernel"].sharding.spec == Spec(None, "tensor", "fsdp")
  mu = s8.opt_state[1][0].mu  # chain(clip, adamw(...)) -> adamw's ScaleByAdamState
  assert mu["layers"]["q_kernel"].sharding.spec == Spec(None, "fsdp", "tensor", None)
  assert s8.step.sharding.is_fully_replicated
  print("OK", diff)


@pytest.mark.slow  # 15-27 s on 2 cores; .ci/run runs it
def test_eight_devices_match_one_device():
  res = fake_devices.run_child(__file__, fast_compile=True)
  assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


if __name__ == "__main__":
  _sharded_check()
