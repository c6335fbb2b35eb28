"""Packing: packed log-probs, losses, gradients and training steps equal the unpacked ones."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from batches import HostBatch, padded_pass, run_pass
from capo_jax.rl import logprob_pass, losses, microbatches, packing
from capo_jax.rl import train_state as state_lib
from capo_jax.rl import train_step as ts
from capo_jax.rl.batch import ModelRows, unpack
from capo_jax.rl.logprobs import packed_token_logprobs, token_logprobs
from capo_jax.rl.optim import OptimConfig
from capo_jax.runtime import mesh as mesh_lib
from models import lora, qwen2, shared_prefix
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
    prompt_tokens_BP=prompt,
    prompt_mask_BP=pmask,
    completion_tokens_BC=comp,
    completion_mask_BC=cmask,
    old_logp_BC=(rng.normal(size=(B, C)) * 0.3 - 4.6).astype(np.float32) * cmask,
    adv_B=rng.normal(size=B).astype(np.float32),
    ref_logp_BC=(rng.normal(size=(B, C)) * 0.3 - 4.6).astype(np.float32) * cmask,
    correct_B=rng.random(B) > 0.5,
    old_topk_ids_BCJ=rng.integers(0, CFG.vocab_size, (B, C, J)).astype(np.int32),
    old_topk_logp_BCJ=(rng.normal(size=(B, C, J)) * 0.3 - 4.6).astype(np.float32),
  )


@pytest.fixture(scope="module")
def setup():
  params = jax.jit(qwen2.init_params, static_argnums=0)(CFG, jax.random.key(0))
  params = jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)  # livelier logits
  return params, _batch(np.random.default_rng(0))


def test_plan_places_every_token_once(setup):
  _, b = setup
  pl = packing.plan(
    b.prompt_tokens_BP, b.prompt_mask_BP, b.completion_tokens_BC, b.completion_mask_BC, ROW
  )
  rows = pl.rows
  assert rows.tokens_YT.shape[1] == ROW and rows.tokens_YT.shape[0] < B  # it packed
  for i in range(B):
    p, c = PROMPT_LEN[i], COMP_LEN[i]
    r, s = pl.row_B[i], pl.start_B[i]
    seq = np.concatenate([b.prompt_tokens_BP[i, P - p :], b.completion_tokens_BC[i, :c]])
    np.testing.assert_array_equal(rows.tokens_YT[r, s : s + p + c], seq)
    np.testing.assert_array_equal(rows.positions_YT[r, s : s + p + c], np.arange(p + c))
    assert len(set(rows.segment_ids_YT[r, s : s + p + c])) == 1 > 0
    flat = pl.index_BC[i, :c]
    np.testing.assert_array_equal(rows.target_tok_N[flat], b.completion_tokens_BC[i, :c])
    # Completion token j is predicted at the column before it.
    np.testing.assert_array_equal(rows.target_col_N[flat], s + p - 1 + np.arange(c))
    assert (rows.target_row_N[flat] == r).all()
  assert len(rows.target_tok_N) == sum(COMP_LEN)
  # Segments are distinct within a row and no sequence overlaps another.
  assert (rows.segment_ids_YT > 0).sum() == sum(PROMPT_LEN) + sum(COMP_LEN)
  assert [packing.bucket(n) for n in (1, 8, 9, 33, 57, 100)] == [8, 8, 10, 40, 64, 112]


def test_sequence_longer_than_a_row_is_an_error(setup):
  _, b = setup
  with pytest.raises(ValueError, match=r"sequence 0 has 16 tokens .* packed row of 12 tokens"):
    packing.plan(
      b.prompt_tokens_BP, b.prompt_mask_BP, b.completion_tokens_BC, b.completion_mask_BC, 12
    )


def _stats(params, b, packed: bool):
  """The current policy's per-token stats in the [B, C] layout, differentiable."""
  if not packed:
    return token_logprobs(
      params,
      CFG,
      b.prompt_tokens_BP,
      b.prompt_mask_BP,
      b.completion_tokens_BC,
      b.completion_mask_BC,
      topk_ids_BCJ=b.old_topk_ids_BCJ,
      chunk_size=4,
    )
  pl = packing.plan(
    b.prompt_tokens_BP,
    b.prompt_mask_BP,
    b.completion_tokens_BC,
    b.completion_mask_BC,
    ROW,
    b.old_topk_ids_BCJ,
  )
  rows, slot_BC = pl.group(0, pl.rows.tokens_YT.shape[0])
  n_Y, Z = rows.target_mask_YZ.sum(1), rows.targets_YZ.shape[1]
  assert n_Y.sum() == sum(COMP_LEN) and Z >= n_Y.max() > Z * 0.75  # bucketed to the fullest row
  out = packed_token_logprobs(params, PACKED_CFG, rows, chunk_size=5)
  return {
    k.replace("_YZJ", "_BCJ").replace("_YZ", "_BC"): unpack(v, slot_BC, b.completion_mask_BC)
    for k, v in out.items()
  }


def test_packed_logprobs_equal_unpacked(setup):
  params, b = setup
  want = jax.jit(lambda p: _stats(p, b, False))(params)
  got = jax.jit(lambda p: _stats(p, b, True))(params)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(
      np.asarray(got[k], np.float64),
      np.asarray(want[k], np.float64),
      atol=1e-5,
      rtol=1e-5,
      err_msg=k,
    )


def test_every_loss_and_gradient_packed_equals_unpacked(setup):
  """Loss and gradient of every aggregation x kind: the chain rule through one VJP per
  layout (the per-token stats), so the model is compiled twice, not eighteen times."""
  params, b = setup
  vjps = {
    packed: jax.vjp(jax.jit(lambda p, packed=packed: _stats(p, b, packed)), params)
    for packed in (False, True)
  }
  apply = jax.jit(lambda vjp, cot: vjp(cot)[0])  # one backward compile per layout
  kinds = (losses.Ppo(), losses.Gspo(), losses.Simko(k=J))
  for agg, kind in itertools.product(losses.AGGS, kinds):
    tcfg = state_lib.TrainConfig(policy_loss=kind, loss=losses.LossConfig(agg=agg, beta=0.05))
    loss_of = lambda lp: losses.policy_loss(kind, ts.policy_batch(lp, b.seqs(), tcfg), tcfg.loss)[0]
    results = []
    for packed in (False, True):
      stats, vjp = vjps[packed]
      diff = {k: v for k, v in stats.items() if jnp.issubdtype(v.dtype, jnp.floating)}
      rest = {k: v for k, v in stats.items() if k not in diff}
      loss, dl = jax.value_and_grad(lambda d: loss_of({**d, **rest}))(diff)
      cot = {
        k: dl[k] if k in dl else np.zeros(v.shape, jax.dtypes.float0) for k, v in stats.items()
      }
      results.append((float(loss), apply(vjp, cot)))
    (l0, g0), (l1, g1) = results
    assert l1 == pytest.approx(l0, rel=1e-5, abs=1e-7), (agg, kind)
    n0 = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g0))))
    err = float(
      jnp.sqrt(sum(jnp.sum((x - y) ** 2) for x, y in zip(jax.tree.leaves(g0), jax.tree.leaves(g1))))
    )
    assert n0 > 0 and err <= 1e-5 * n0, (agg, kind, err, n0)


def _two_steps(
  params, batch, tcfg, mesh, pack: bool, rows_per_microbatch: int, base=None, cfg=PACKED_CFG
):
  step = ts.make_train_step(cfg, tcfg, mesh, mesh_lib.TRAIN_RULES, rows_per_microbatch)
  trainable = params if base is None else base
  state = state_lib.train_state_from_params(trainable, cfg, tcfg, mesh, mesh_lib.TRAIN_RULES)
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
  base = state_lib.TrainConfig(
    policy_loss=losses.Simko(k=J),
    loss=losses.LossConfig(agg="token-mean"),
    # eps 1e-4: Adam's 1 / sqrt(v) would blow float noise in
    # near-zero gradients up to a full step of lr.
    optim=OptimConfig(learning_rate=1e-3, eps=1e-4),
  )
  # One packed row per micro-batch: several packed micro-batches, as the unpacked side has two.
  p0, m0 = _two_steps(params, batch, base, mesh, pack=False, rows_per_microbatch=B // 2, cfg=CFG)
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
  moved = max(
    float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(params))
  )
  diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)))
  assert moved > 1e-4 and diff < 1e-6, (moved, diff)


def _lora(params):
  """A rank-2 LoRA config and adapters with B != 0 (fresh ones would change nothing)."""
  lcfg = lora.LoraConfig(2, 4.0, tuple(lora.TARGETS))
  adapters = lora.init_adapters(qwen2.param_shapes(CFG), lcfg, jax.random.key(3))
  adapters = jax.tree.map(
    lambda a, k: a + 0.05 * jax.random.normal(k, a.shape),
    adapters,
    jax.tree.unflatten(
      jax.tree.structure(adapters),
      list(jax.random.split(jax.random.key(4), len(jax.tree.leaves(adapters)))),
    ),
  )
  return lcfg, adapters


def test_packed_logprob_pass_applies_the_adapters(setup):
  """The packed pass of a LoRA policy equals the pass of the merged weights, and
  differs from the bare base's (so a pass that dropped the adapters fails here)."""
  params, b = setup
  lcfg, adapters = _lora(params)
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  rules, Y = mesh_lib.TRAIN_RULES, 2
  pas = padded_pass(
    PACKED_CFG, mesh, rules, Y, lora=lcfg, layout=microbatches.RowLayout(ROW, Y, pack=True)
  )
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
  tcfg = state_lib.TrainConfig(
    policy_loss=losses.Ppo(), lora=lcfg, optim=OptimConfig(learning_rate=1e-3, eps=1e-4)
  )
  p0, m0 = _two_steps(
    params, batch, tcfg, mesh, pack=False, rows_per_microbatch=B // 2, base=adapters, cfg=CFG
  )
  p1, m1 = _two_steps(params, batch, tcfg, mesh, pack=True, rows_per_microbatch=1, base=adapters)
  moved = max(
    float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(adapters))
  )
  diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)))
  assert moved > 1e-4 and diff < 1e-6, (moved, diff)
  assert float(m1[0]["loss"]) == pytest.approx(float(m0[0]["loss"]), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("pack,per_call", [(True, 2), (False, 3)])
def test_step_pass_over_the_updates_rows_equals_unpacked(setup, pack, per_call):
  """The log-prob pass over a step's planned updates (two updates of micro-batches of 2
  rows; calls of the micro-batch rows, or of 3 rows regrouped on the devices) gives
  every token the log-prob of the unpacked reference forward."""
  params, b = setup
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  rules, Y = mesh_lib.TRAIN_RULES, 2
  xs = (b.prompt_tokens_BP, b.prompt_mask_BP, b.completion_tokens_BC, b.completion_mask_BC)
  plans = microbatches.plan_step(*xs, microbatches.RowLayout(ROW if pack else 0, Y, pack), B // 2)
  # Each update holds its own sequences, in slots of the step's [B] arrays.
  for u, p in enumerate(plans):
    assert sorted(p.take_MB[p.take_MB >= 0].tolist()) == list(range(u * B // 2, (u + 1) * B // 2))
  if pack:  # the updates' target slots differ: the calls pad them to the widest
    assert plans[0].rows.targets_YZ.shape[-1] != plans[1].rows.targets_YZ.shape[-1]
  lp = padded_pass(
    PACKED_CFG,
    mesh,
    rules,
    per_call,
    layout=microbatches.RowLayout(ROW if pack else 0, per_call, pack),
  )
  updates = logprob_pass.upload(plans, ts.batch_sharding(mesh, rules, Y))
  got = lp.run(params, updates, jnp.asarray(b.completion_mask_BC), ("logp_BC",))["logp_BC"]
  want = token_logprobs(params, CFG, *xs)["logp_BC"]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_a_step_uploads_its_rows_once_and_reads_its_metrics_once(tmp_path, monkeypatch):
  """One CAPO step (old and reference passes, two updates) in the loop: the updates' token
  rows cross to the devices in one transfer, both passes and both updates use them, and
  no metric is read before the one ``jax.device_get`` that follows the last update."""
  from jax._src import array as array_lib  # pylint: disable=import-outside-toplevel

  import rl_driver  # pylint: disable=import-outside-toplevel
  from capo_jax.rl import drawing, rollout, uploader  # pylint: disable=import-outside-toplevel
  from capo_jax.run import programs  # pylint: disable=import-outside-toplevel
  from configs import common  # pylint: disable=import-outside-toplevel

  assets = rl_driver.write_assets(tmp_path / "assets")
  c = common.shrink(common.get_base_config())
  c.tokenizer_path, c.data.train = assets["tok"], assets["data"]
  c.rollout.max_prompt_len, c.rollout.max_new_tokens = 256, 8
  c.train.num_steps, c.checkpoint.export_hf, c.log.samples_every_steps = 1, False, 0
  events: list[tuple] = []
  in_read = []

  def spy(name, fn, note=lambda *a: ()):
    def wrapped(*args, **kwargs):
      events.append((name, *note(*args)))
      return fn(*args, **kwargs)

    return wrapped

  make = jax.make_array_from_callback
  monkeypatch.setattr(
    jax, "make_array_from_callback", spy("array", make, lambda shape, *_: (tuple(shape),))
  )
  has_rows = lambda tree, *_: (
    any(
      isinstance(x, ModelRows)
      for x in jax.tree.leaves(  # noqa: E731
        tree, is_leaf=lambda x: isinstance(x, ModelRows)
      )
    ),
  )
  for mod in (uploader, logprob_pass):
    monkeypatch.setattr(mod, "put_global", spy("put", mod.put_global, has_rows))
  monkeypatch.setattr(rollout, "collect", spy("collect", rollout.collect))
  build = programs.build

  def build_spied(*args, **kwargs):
    progs = build(*args, **kwargs)
    step = spy("update", progs.train_step, lambda st, mb, *_: (mb.rows.tokens_YT.shape,))
    return dataclasses.replace(progs, train_step=step)

  monkeypatch.setattr(programs, "build", build_spied)

  def reader(fn):
    def read_tree(tree):
      keys = {
        str(k.key)
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
        for k in path
        if isinstance(k, jax.tree_util.DictKey)
      }
      scalars = sum(isinstance(x, jax.Array) and x.ndim == 0 for x in jax.tree.leaves(tree))
      events.append(("get", frozenset(keys), scalars))
      in_read.append(1)
      try:
        return fn(tree)
      finally:
        in_read.pop()

    return read_tree

  monkeypatch.setattr(jax, "device_get", reader(jax.device_get))
  # The rollout's other read: np.asarray inside, which ``_value`` does not see on CPU.
  monkeypatch.setattr(drawing, "to_host", reader(drawing.to_host))
  value = array_lib.ArrayImpl._value

  def read(self):
    if not in_read and self._npy_value is None and not self.shape:
      events.append(("scalar",))
    return value.fget(self)

  monkeypatch.setattr(array_lib.ArrayImpl, "_value", property(read))
  rl_driver.train(c, str(tmp_path / "run"), grader=rl_driver.HashGrader())

  step = events[next(i for i, e in enumerate(events) if e[0] == "collect") :]
  updates = [e for e in step if e[0] == "update"]
  assert len(updates) == 2
  puts = [i for i, e in enumerate(step) if e[0] == "put"]
  rows_puts = [i for i in puts if step[i][1]]
  assert len(rows_puts) == 1
  # Every array shaped like an update's token rows came in that one put_global.
  end = next((i for i in puts if i > rows_puts[0]), len(step))
  shapes = {e[1] for e in updates}
  token_arrays = [i for i, e in enumerate(step) if e[0] == "array" and e[1] in shapes]
  assert token_arrays and all(rows_puts[0] < i < end for i in token_arrays)
  last_update = max(i for i, e in enumerate(step) if e[0] == "update")
  metric_gets = [
    i for i, e in enumerate(step) if e[0] == "get" and {"auc_mean", "s_spread", "loss"} <= e[1]
  ]
  assert len(metric_gets) == 1 and metric_gets[0] > last_update
  assert "mismatch/abs_log_ratio" in step[metric_gets[0]][1]
  # Before it: no scalar read back, and no read of a metric.
  before = step[: metric_gets[0]]
  assert ("scalar",) not in before
  assert all(e[2] == 0 for e in before if e[0] == "get")


def test_shared_prompts_are_laid_once_a_chunk_and_each_completion_reads_as_alone():
  """Four sequences of two prompts (group_B): each chunk holds its prompt once and then
  its completions (branches 1, 2, ...); every completion token is predicted where it
  would be alone (token 0 at the prompt's last column), at its own position."""
  rng = np.random.default_rng(1)
  P, C, row = 6, 5, 24
  prompts = rng.integers(1, 50, (2, P)).astype(np.int32)
  group_B = np.array([0, 1, 0, 0])
  p_B, c_B = np.array([4, 6, 4, 4]), np.array([5, 3, 2, 4])
  prompt_BP = prompts[group_B]
  pmask = (np.arange(P)[None] >= P - p_B[:, None]).astype(np.int32)
  comp = rng.integers(1, 50, (4, C)).astype(np.int32)
  cmask = (np.arange(C)[None] < c_B[:, None]).astype(np.int32)
  pl = packing.plan(prompt_BP * pmask, pmask, comp * cmask, cmask, row, group_B=group_B)
  f = pl.rows
  # Group 0: prompt 4 + completions 5, 4, 2 = 15 tokens, one chunk; group 1: 6 + 3.
  assert (f.segment_ids_YT > 0).sum() == 15 + 9
  for b in range(4):
    r, s, p, c = pl.row_B[b], pl.start_B[b], p_B[b], c_B[b]
    np.testing.assert_array_equal(f.tokens_YT[r, s : s + p], prompt_BP[b, P - p :])
    assert (f.branch_ids_YT[r, s : s + p] == 0).all()
    flat = pl.index_BC[b, :c]
    cols = f.target_col_N[flat]
    assert cols[0] == s + p - 1  # token 0 from the prompt's last column
    own = cols[1:] + 1  # the columns of tokens 1.. of the completion
    np.testing.assert_array_equal(f.tokens_YT[r, own], comp[b, 1:c])
    np.testing.assert_array_equal(f.tokens_YT[r, cols[1:]], comp[b, : c - 1])
    np.testing.assert_array_equal(f.positions_YT[r, cols[1:]], p + np.arange(c - 1))
    np.testing.assert_array_equal(f.target_tok_N[flat], comp[b, :c])
    assert len(set(f.branch_ids_YT[r, own])) == 1 and f.branch_ids_YT[r, own[0]] > 0  # one branch
  mr, index = pl.group(0, f.tokens_YT.shape[0])
  np.testing.assert_array_equal(
    mr.segment_ids_YT, shared_prefix.tree_ids(f.segment_ids_YT, f.branch_ids_YT)
  )
  for b in range(4):  # the model's target slots hold each completion's tokens
    np.testing.assert_array_equal(
      np.asarray(mr.targets_YZ).reshape(-1)[index[b, : c_B[b]]], comp[b, : c_B[b]]
    )
  # At most prompt_cap prompt tokens a row: group 1's 6-token prompt alone is too many at
  # 5; at 6 the two chunks (prompts 4 and 6) take a row each, at 10 they share one.
  for cap, rows_needed in ((6, 2), (10, 1)):
    capped = packing.plan(
      prompt_BP * pmask, pmask, comp * cmask, cmask, row, group_B=group_B, prompt_cap=cap
    )
    assert capped.rows.tokens_YT.shape[0] == rows_needed
  with pytest.raises(ValueError, match="config.model.shared_prompt_cols"):
    packing.plan(prompt_BP * pmask, pmask, comp * cmask, cmask, row, group_B=group_B, prompt_cap=5)
  other = prompt_BP.copy()
  other[3, -1] += 1
  with pytest.raises(ValueError, match="sequences 0 and 3 share group 0"):
    packing.plan(other * pmask, pmask, comp * cmask, cmask, row, group_B=group_B)


@pytest.mark.parametrize("trim", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_shared_prompts_give_each_sequences_logprobs_and_gradients(setup, trim):
  """The batch's sequences in groups of two sharing a prompt (group_B): the model on the
  shared layout (each prompt forwarded once a chunk, models.shared_prefix's tree) gives
  the per-token log-probs of every sequence run alone, and their gradient."""
  params, b = setup
  group_B = np.arange(B) // 2
  share = lambda x: x[group_B * 2]  # each pair takes its first member's prompt  # noqa: E731
  prompt, pmask = share(b.prompt_tokens_BP), share(b.prompt_mask_BP)
  comp, cmask = b.completion_tokens_BC, b.completion_mask_BC
  cfg = CFG.replace(shared_prompts=True, trim_last_layer=trim)
  w = np.random.default_rng(5).normal(size=comp.shape).astype(np.float32) * cmask

  def shared(p):
    pl = packing.plan(prompt, pmask, comp, cmask, ROW, group_B=group_B)
    rows, slot_BC = pl.group(0, pl.rows.tokens_YT.shape[0])
    out = packed_token_logprobs(p, cfg, rows, chunk_size=5)
    return unpack(out["logp_YZ"], slot_BC, cmask)

  def alone(p):
    return token_logprobs(p, CFG, prompt, pmask, comp, cmask, chunk_size=4)["logp_BC"]

  got, want = jax.jit(shared)(params), jax.jit(alone)(params)
  np.testing.assert_allclose(got * cmask, want * cmask, atol=2e-5)
  g_got = jax.jit(jax.grad(lambda p: jnp.sum(shared(p) * w)))(params)
  g_want = jax.jit(jax.grad(lambda p: jnp.sum(alone(p) * w)))(params)
  for (path, a), c in zip(jax.tree_util.tree_leaves_with_path(g_want), jax.tree.leaves(g_got)):
    np.testing.assert_allclose(c, a, atol=2e-5 * float(np.abs(a).max()) + 1e-8, err_msg=str(path))
