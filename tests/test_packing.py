"""Packing: packed log-probs, losses, gradients and training steps equal the unpacked ones."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from batches import HostBatch, padded_pass, run_pass
from capo_jax.rl import losses, packing
from capo_jax.rl import train_step as ts
from capo_jax.rl.batch import unpack
from capo_jax.rl.logprobs import packed_token_logprobs, token_logprobs
from capo_jax.rl.optim import OptimConfig
from capo_jax.runtime import mesh as mesh_lib
from models import lora, qwen2
from models.config import Qwen2Config

# The packed side runs the blocked attention over several blocks; the unpacked
# side the reference attention: the comparison covers both.
CFG = Qwen2Config.tiny(vocab_size=96, num_layers=2, attention="reference")
PACKED_CFG = CFG.replace(attention="flash", attention_block=8)
B, P, C, J, ROW = 8, 6, 10, 3, 24
PROMPT_LEN = [6, 3, 1, 4, 5, 2, 6, 3]
COMP_LEN = [10, 2, 7, 0, 1, 9, 4, 5]  # one empty completion: a row with no tokens


def _batch(rng: np.random.Generator) -> HostBatch:
  prompt = rng.integers(1, CFG.vocab_size, (B, P)).astype(np.int32)
  comp = rng.integers(1, CFG.vocab_size, (B, C)).astype(np.int32)
  pmask = (np.arange(P)[None] >= P - np.array(PROMPT_LEN)[:, None]).astype(np.int32)
  cmask = (np.arange(C)[None] < np.array(COMP_LEN)[:, None]).astype(np.int32)
  prompt, comp = prompt * pmask, comp * cmask  # padding ids 0, as the tokenizer's pad
  return HostBatch(
      prompt_tokens_BP=prompt, prompt_mask_BP=pmask, completion_tokens_BC=comp,
      completion_mask_BC=cmask,
      old_logp_BC=(rng.normal(size=(B, C)) * 0.3 - 4.6).astype(np.float32) * cmask,
      adv_B=rng.normal(size=B).astype(np.float32),
      ref_logp_BC=(rng.normal(size=(B, C)) * 0.3 - 4.6).astype(np.float32) * cmask,
      correct_B=rng.random(B) > 0.5,
      old_topk_ids_BCJ=rng.integers(0, CFG.vocab_size, (B, C, J)).astype(np.int32),
      old_topk_logp_BCJ=(rng.normal(size=(B, C, J)) * 0.3 - 4.6).astype(np.float32))


@pytest.fixture(scope="module")
def setup():
  params = jax.jit(qwen2.init_params, static_argnums=0)(CFG, jax.random.key(0))
  params = jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)  # livelier logits
  return params, _batch(np.random.default_rng(0))


def test_plan_places_every_token_once(setup):
  _, b = setup
  pl = packing.plan(b.prompt_tokens_BP, b.prompt_mask_BP, b.completion_tokens_BC,
                    b.completion_mask_BC, ROW)
  rows = pl.rows
  assert rows.tokens_YT.shape[1] == ROW and rows.tokens_YT.shape[0] < B  # it packed
  for i in range(B):
    p, c = PROMPT_LEN[i], COMP_LEN[i]
    r, s = pl.row_B[i], pl.start_B[i]
    seq = np.concatenate([b.prompt_tokens_BP[i, P - p:], b.completion_tokens_BC[i, :c]])
    np.testing.assert_array_equal(rows.tokens_YT[r, s:s + p + c], seq)
    np.testing.assert_array_equal(rows.positions_YT[r, s:s + p + c], np.arange(p + c))
    assert len(set(rows.segment_ids_YT[r, s:s + p + c])) == 1 > 0
    flat = pl.index_BC[i, :c]
    np.testing.assert_array_equal(rows.targets_YT.reshape(-1)[flat], b.completion_tokens_BC[i, :c])
  assert rows.target_mask_YT.sum() == sum(COMP_LEN)
  # Segments are distinct within a row and no sequence overlaps another.
  assert (rows.segment_ids_YT > 0).sum() == sum(PROMPT_LEN) + sum(COMP_LEN)
  assert [packing.bucket(n) for n in (1, 8, 9, 33, 57, 100)] == [8, 8, 10, 40, 64, 112]


def test_sequence_longer_than_a_row_is_an_error(setup):
  _, b = setup
  with pytest.raises(ValueError, match=r"sequence 0 has 16 tokens .* packed row of 12 tokens"):
    packing.plan(b.prompt_tokens_BP, b.prompt_mask_BP, b.completion_tokens_BC,
                 b.completion_mask_BC, 12)


def _stats(params, b, packed: bool):
  """The current policy's per-token stats in the [B, C] layout, differentiable."""
  if not packed:
    return token_logprobs(params, CFG, b.prompt_tokens_BP, b.prompt_mask_BP,
                          b.completion_tokens_BC, b.completion_mask_BC,
                          topk_ids_BCJ=b.old_topk_ids_BCJ, chunk_size=4)
  pl = packing.plan(b.prompt_tokens_BP, b.prompt_mask_BP, b.completion_tokens_BC,
                    b.completion_mask_BC, ROW, b.old_topk_ids_BCJ)
  rows, slot_BC = pl.group(0, pl.rows.tokens_YT.shape[0])
  n_Y, Z = rows.target_mask_YZ.sum(1), rows.targets_YZ.shape[1]
  assert n_Y.sum() == sum(COMP_LEN) and Z >= n_Y.max() > Z * 0.75  # bucketed to the fullest row
  out = packed_token_logprobs(params, PACKED_CFG, rows, chunk_size=5)
  return {k.replace("_YZJ", "_BCJ").replace("_YZ", "_BC"):
          unpack(v, slot_BC, b.completion_mask_BC) for k, v in out.items()}


def test_packed_logprobs_equal_unpacked(setup):
  params, b = setup
  want = jax.jit(lambda p: _stats(p, b, False))(params)
  got = jax.jit(lambda p: _stats(p, b, True))(params)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k], np.float64), np.asarray(want[k], np.float64),
                               atol=1e-5, rtol=1e-5, err_msg=k)


def test_every_loss_and_gradient_packed_equals_unpacked(setup):
  """Loss and gradient of every aggregation x kind: the chain rule through one VJP per
  layout (the per-token stats), so the model is compiled twice, not eighteen times."""
  params, b = setup
  vjps = {packed: jax.vjp(jax.jit(lambda p, packed=packed: _stats(p, b, packed)), params)
          for packed in (False, True)}
  apply = jax.jit(lambda vjp, cot: vjp(cot)[0])  # one backward compile per layout
  kinds = (losses.Ppo(), losses.Gspo(), losses.Simko(k=J))
  for agg, kind in itertools.product(losses.AGGS, kinds):
    tcfg = ts.TrainConfig(policy_loss=kind, loss=losses.LossConfig(agg=agg, beta=0.05))
    loss_of = lambda lp: losses.policy_loss(kind, ts.policy_batch(lp, b.seqs(), tcfg), tcfg.loss)[0]
    results = []
    for packed in (False, True):
      stats, vjp = vjps[packed]
      diff = {k: v for k, v in stats.items() if jnp.issubdtype(v.dtype, jnp.floating)}
      rest = {k: v for k, v in stats.items() if k not in diff}
      loss, dl = jax.value_and_grad(lambda d: loss_of({**d, **rest}))(diff)
      cot = {k: dl[k] if k in dl else np.zeros(v.shape, jax.dtypes.float0)
             for k, v in stats.items()}
      results.append((float(loss), apply(vjp, cot)))
    (l0, g0), (l1, g1) = results
    assert l1 == pytest.approx(l0, rel=1e-5, abs=1e-7), (agg, kind)
    n0 = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g0))))
    err = float(jnp.sqrt(sum(jnp.sum((x - y) ** 2) for x, y in
                             zip(jax.tree.leaves(g0), jax.tree.leaves(g1)))))
    assert n0 > 0 and err <= 1e-5 * n0, (agg, kind, err, n0)


def _two_steps(params, batch, tcfg, mesh, pack: bool, rows_per_microbatch: int,
               base=None, cfg=PACKED_CFG):
  step = ts.make_train_step(cfg, tcfg, mesh, mesh_lib.TRAIN_RULES, rows_per_microbatch)
  trainable = params if base is None else base
  state = ts.train_state_from_params(trainable, cfg, tcfg, mesh, mesh_lib.TRAIN_RULES)
  metrics = []
  for _ in range(2):
    b = batch.train_batch(rows_per_microbatch, pack=pack, row_len=ROW if pack else 0)
    state, m = step(state, b, *(() if base is None else (params,)))
    metrics.append(jax.device_get(m))
  return state.params, metrics


@pytest.mark.slow  # two train-step compiles: ~40 s idle, ~95 s on the shared box
def test_two_training_steps_packed_equal_unpacked(setup):
  params, batch = setup
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  base = ts.TrainConfig(policy_loss=losses.Simko(k=J), loss=losses.LossConfig(agg="token-mean"),
                        # eps 1e-4: Adam's 1 / sqrt(v) would blow float noise in
                        # near-zero gradients up to a full step of lr.
                        optim=OptimConfig(learning_rate=1e-3, eps=1e-4))
  # One packed row per micro-batch: several packed micro-batches, as the unpacked side has two.
  p0, m0 = _two_steps(params, batch, base, mesh, pack=False, rows_per_microbatch=B // 2,
                      cfg=CFG)
  p1, m1 = _two_steps(params, batch, base, mesh, pack=True, rows_per_microbatch=1)
  # Step 1 starts from the same params: its loss agrees to float rounding. Step 2
  # starts from params that already differ by float noise (up to ~5e-7, bounded
  # below), and its loss is a near-cancelling sum (-0.003 of per-token terms of
  # |adv| x ratio ~ 0.1-3), so it is held to that noise on the terms' scale: 1e-6
  # absolute (measured 1.5e-7); a token lost or misplaced would move it by about one
  # term over the 38 tokens, ~1e-2.
  for a, c, tol in zip(m0, m1, (1e-7, 1e-6)):
    assert float(c["loss"]) == pytest.approx(float(a["loss"]), rel=1e-5, abs=tol)
    assert int(c["num_tokens"]) == int(a["num_tokens"]) == sum(COMP_LEN)
  moved = max(float(jnp.abs(x - y).max()) for x, y in
              zip(jax.tree.leaves(p0), jax.tree.leaves(params)))
  diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0),
                                                          jax.tree.leaves(p1)))
  assert moved > 1e-4 and diff < 1e-6, (moved, diff)


def _lora(params):
  """A rank-2 LoRA config and adapters with B != 0 (fresh ones would change nothing)."""
  lcfg = lora.LoraConfig(2, 4.0, tuple(lora.TARGETS))
  adapters = lora.init_adapters(qwen2.param_shapes(CFG), lcfg, jax.random.key(3))
  adapters = jax.tree.map(
      lambda a, k: a + 0.05 * jax.random.normal(k, a.shape),
      adapters, jax.tree.unflatten(jax.tree.structure(adapters),
                                   list(jax.random.split(jax.random.key(4),
                                                         len(jax.tree.leaves(adapters))))))
  return lcfg, adapters


def test_packed_logprob_pass_applies_the_adapters(setup):
  """The packed pass of a LoRA policy equals the pass of the merged weights, and
  differs from the bare base's (so a pass that dropped the adapters fails here)."""
  params, b = setup
  lcfg, adapters = _lora(params)
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  rules, Y = mesh_lib.TRAIN_RULES, 2
  pas = padded_pass(PACKED_CFG, mesh, rules, Y, lora=lcfg,
                    layout=packing.RowLayout(ROW, Y, pack=True))
  xs = (b.prompt_tokens_BP, b.prompt_mask_BP, b.completion_tokens_BC, b.completion_mask_BC)
  got = run_pass(pas, params, xs, adapters=adapters)["logp_BC"]
  bare = run_pass(pas, params, xs)["logp_BC"]
  merged = run_pass(pas, lora.merge(params, adapters, lcfg, jnp.float32), xs)["logp_BC"]
  np.testing.assert_allclose(got, merged, atol=2e-5)
  assert float(np.abs(got - bare).max()) > 1e-2


@pytest.mark.slow  # two LoRA train-step compiles
def test_two_lora_capo_steps_packed_equal_unpacked(setup):
  params, batch = setup
  lcfg, adapters = _lora(params)
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  tcfg = ts.TrainConfig(policy_loss=losses.Ppo(), lora=lcfg,
                        optim=OptimConfig(learning_rate=1e-3, eps=1e-4))
  p0, m0 = _two_steps(params, batch, tcfg, mesh, pack=False, rows_per_microbatch=B // 2,
                      base=adapters, cfg=CFG)
  p1, m1 = _two_steps(params, batch, tcfg, mesh, pack=True, rows_per_microbatch=1,
                      base=adapters)
  moved = max(float(jnp.abs(x - y).max()) for x, y in
              zip(jax.tree.leaves(p0), jax.tree.leaves(adapters)))
  diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0),
                                                          jax.tree.leaves(p1)))
  assert moved > 1e-4 and diff < 1e-6, (moved, diff)
  assert float(m1[0]["loss"]) == pytest.approx(float(m0[0]["loss"]), rel=1e-5, abs=1e-7)
