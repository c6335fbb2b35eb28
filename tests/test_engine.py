"""The rollout engine: samples independent of scheduling, against a brute-force reference.

References: a brute-force sampler that, for every token t, runs
``models.qwen2.forward`` over each row's prompt + tokens so far (no cache, no
slots) and draws with the uniform of (rng, row, t); teacher-forced log-probs;
and the same rollout at other slot counts W (all rows, a quarter, 3, which
does not divide B), unsharded and on 8 fake CPU devices (a subprocess, since
XLA_FLAGS must be set before jax is imported). Attention blocks of 16 columns
make the engine's blocked (filled-part only) attention run at these sizes; the
ragged kernel (capo_jax.sampling.ragged, interpreted) gives the same samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_utils
from capo_jax.sampling import decode, engine, plans, strategies
from capo_jax.sampling import sampler as sampling
from capo_jax.sampling import slots as slots_lib
from capo_jax.sampling.ragged import attend
from models import qwen2
from models.config import Qwen2Config

REPO = pathlib.Path(__file__).resolve().parent.parent
Q, G, C = 4, 5, 28  # B = 20: W = 5 is a quarter, W = 3 does not divide it
STRATEGY = strategies.TopK(temperature=0.9, k=40)


def tiny_policy():
  cfg = Qwen2Config.tiny()
  params = qwen2.init_params(cfg, jax.random.key(0))
  # Weights of std 0.15 (not 0.02), so the model is far from uniform.
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x if "norm" in jax.tree_util.keystr(p) else 7.5 * x, params
  )
  tokens, mask = hf_utils.left_padded_batch(
    np.random.default_rng(0), [5, 13, 2, 9], cfg.vocab_size, low=3
  )
  return cfg, params, tokens, mask


@contextlib.contextmanager
def small_blocks():
  """16-column attention blocks: the engine's blocked attention at these sizes."""
  old, plans.KV_BLOCK = plans.KV_BLOCK, 16
  try:
    yield
  finally:
    plans.KV_BLOCK = old


def run(
  cfg, params, tokens, mask, n: int, stops=(), layout=None, max_new: int = C, key: int = 2
) -> sampling.Samples:
  with small_blocks():
    return sampling.generate(
      params,
      cfg,
      tokens,
      mask,
      jax.random.key(key),
      sampling.SamplingSpec(
        num_samples=G, max_new_tokens=max_new, strategy=STRATEGY, stop_ids=stops, max_active_rows=n
      ),
      layout=layout,
    )


def stop_ids_for(cfg, params, tokens, mask) -> list[int]:
  """Stop ids (the tokens an unstopped run emits most) that end rows at many lengths."""
  out = run(cfg, params, tokens, mask, Q * G, key=1)  # the W = B program, reused below
  counts = np.bincount(np.asarray(out.tokens_BC).ravel(), minlength=cfg.vocab_size)
  return [int(t) for t in np.argsort(-counts)[:6]]


def schedules(
  cfg, params, tokens, mask, stops, layout=None, slots=(Q * G, Q * G // 4, 3)
) -> dict[int, sampling.Samples]:
  """The same rollout at W = B, B / 4 and 3 slots."""
  return {n: run(cfg, params, tokens, mask, n, stops, layout) for n in slots}


def assert_same(a: sampling.Samples, b: sampling.Samples) -> None:
  np.testing.assert_array_equal(np.asarray(a.tokens_BC), np.asarray(b.tokens_BC))
  np.testing.assert_array_equal(np.asarray(a.mask_BC), np.asarray(b.mask_BC))
  np.testing.assert_array_equal(np.asarray(a.truncated_B), np.asarray(b.truncated_B))
  np.testing.assert_allclose(np.asarray(a.logprobs_BC), np.asarray(b.logprobs_BC), atol=1e-5)


def loop_steps(lengths_B: np.ndarray, max_new: int, phases: tuple[int, ...]) -> list[int]:
  """Decode iterations each of the engine's loops runs, replaying its schedule in Python.

  Token 0 comes from the prefill, so a row of length L holds a slot for L - 1
  steps (none when it stopped at token 0 or ``max_new`` is 1); waiting rows
  take free slots in row order; a loop hands over to the next once no row
  waits and the active rows fit in the next loop's slots.
  """
  waiting = [int(L) - 1 for L in lengths_B if L > 1 and max_new > 1]
  left: list[int] = []  # steps left of each active row
  steps = []
  for i, n in enumerate(phases):
    smaller = phases[i + 1] if i + 1 < len(phases) else 0
    k = 0
    while (left or waiting) and (waiting or len(left) > smaller):
      while len(left) < n and waiting:
        left.append(waiting.pop(0))
      left = [r - 1 for r in left if r > 1]
      k += 1
    steps.append(k)
  return steps


def brute_force(cfg, params, tokens, mask, stops, rng, strategy, max_new: int) -> np.ndarray:
  """Row b's token t from a full forward over its prefix and the uniform of (rng, b, t)."""
  B, P = Q * G, tokens.shape[1]
  seq = np.concatenate([np.repeat(tokens, G, 0), np.zeros((B, max_new), np.int32)], 1)
  seq_mask = np.concatenate([np.repeat(mask, G, 0), np.zeros((B, max_new), np.int32)], 1)
  done = np.zeros(B, bool)
  fwd = jax.jit(lambda s, m: qwen2.forward(params, cfg, s, m))
  for t in range(max_new):
    logits_BV = fwd(jnp.asarray(seq), jnp.asarray(seq_mask))[:, P + t - 1]
    u_B = engine.row_uniforms(rng, jnp.arange(B), jnp.full((B,), t))
    tok = np.asarray(strategy.choose(logits_BV.T, u_B)[0])
    seq[~done, P + t], seq_mask[~done, P + t] = tok[~done], 1
    done |= np.isin(tok, stops)
  return seq[:, P:] * seq_mask[:, P:]


@pytest.fixture(scope="module")
def rollouts():
  cfg, params, tokens, mask = tiny_policy()
  stops = stop_ids_for(cfg, params, tokens, mask)
  return cfg, params, tokens, mask, stops, schedules(cfg, params, tokens, mask, stops)


def test_samples_do_not_depend_on_slots(rollouts):
  *_, outs = rollouts
  lengths = np.asarray(outs[Q * G].lengths_B)
  assert len(set(lengths.tolist())) >= 5 and lengths.min() < C // 2, lengths  # rows stop apart
  assert np.asarray(outs[Q * G].truncated_B).any() or lengths.max() > C // 2
  for n in (Q * G // 4, 3):
    assert_same(outs[Q * G], outs[n])


@pytest.mark.slow  # 10-21 s on 2 cores; .ci/run runs it
def test_engine_equals_brute_force_sampler(rollouts):
  cfg, params, tokens, mask, stops, outs = rollouts
  ref = brute_force(cfg, params, tokens, mask, stops, jax.random.key(2), STRATEGY, C)
  np.testing.assert_array_equal(np.asarray(outs[3].tokens_BC), ref)
  # Log-probs: the untempered policy's, teacher-forced over prompt + completion.
  P = tokens.shape[1]
  seq = np.concatenate([np.repeat(tokens, G, 0), ref], 1)
  seq_mask = np.concatenate([np.repeat(mask, G, 0), np.asarray(outs[3].mask_BC)], 1)
  logp = jax.nn.log_softmax(qwen2.forward(params, cfg, jnp.asarray(seq), jnp.asarray(seq_mask)))
  want = np.take_along_axis(np.asarray(logp)[:, P - 1 : -1], ref[..., None], -1)[..., 0]
  m = np.asarray(outs[3].mask_BC).astype(bool)
  np.testing.assert_allclose(np.asarray(outs[3].logprobs_BC)[m], want[m], atol=1e-4)


def test_tail_phases_schedule():
  plan = lambda n, **kw: plans.Plan(
    cfg=None, strategy=None, num_samples=1, num_slots=n, gen_len=8, **kw
  )
  assert plan(128, shrink=True).phases == (128, 32, 8)  # at most three loops
  assert plan(32, shrink=True, min_slots=8).phases == (32, 8)
  assert plan(20, shrink=True, min_slots=8).phases == (20,)  # 5 < 8 slots
  assert plan(3, shrink=True, min_slots=8).phases == (8,)
  assert plan(128).phases == (128,)  # no shrink: the lockstep decode's one loop
  assert loop_steps(np.array([1, 5, 3, 9]), 9, (2, 1)) == [4, 6]  # replayed by hand


def test_tail_phases_give_the_same_samples(rollouts, monkeypatch):
  """W = 16 of 20 rows, then 4, then 1 slot: each loop runs, samples unchanged."""
  cfg, params, tokens, mask, stops, outs = rollouts
  monkeypatch.setattr(decode, "MIN_ROWS_CPU", 1)  # loops of 4 and 1 slots on CPU too
  # key 6: lengths whose tail reaches all three loops (the fixture's key ends
  # with four rows at the cap together, which skips the last loop).
  ref = run(cfg, params, tokens, mask, Q * G, stops, key=6)
  steps = loop_steps(np.asarray(ref.lengths_B), C, (16, 4, 1))
  assert min(steps) > 0, steps
  assert_same(ref, run(cfg, params, tokens, mask, 16, stops, key=6))


@pytest.mark.parametrize("n", [1, 3, Q * G])
def test_ragged_attention_gives_the_same_samples(rollouts, monkeypatch, n):
  """The ragged kernel (decode.resolve's TPU choice, interpreted here) in place of the
  blocked XLA attention: the same tokens at float32 with one, a few and all rows active.

  Its 32-column copies, laid from each row's first column rounded down to 8, differ
  from the 16-column blocks of the reference run (and do not divide the 48-column
  cache), so the sums are not the same ones.
  """
  cfg, params, tokens, mask, stops, outs = rollouts
  monkeypatch.setattr(plans, "ATTENTION", "ragged")
  monkeypatch.setattr(plans, "RAGGED_BLOCK", 32)
  monkeypatch.setattr(plans, "RAGGED_ALIGN", 8)
  calls = []
  monkeypatch.setattr(decode.ragged, "attend", lambda *a, **k: calls.append(k) or attend(*a, **k))
  assert_same(outs[Q * G], run(cfg, params, tokens, mask, n, stops))
  assert len(calls) == cfg.num_layers and (calls[0]["block"], calls[0]["align"]) == (32, 8)


@pytest.mark.slow  # ~40 s: two more decode programs
def test_ragged_attention_through_the_tail_loops(rollouts, monkeypatch):
  """16 slots, then 4, then 1 (the caches gathered in the ragged [W, S, K*H] layout):
  the ragged kernel's samples equal the blocked attention's."""
  cfg, params, tokens, mask, stops, outs = rollouts
  monkeypatch.setattr(decode, "MIN_ROWS_CPU", 1)
  ref = run(cfg, params, tokens, mask, Q * G, stops, key=6)
  assert min(loop_steps(np.asarray(ref.lengths_B), C, (16, 4, 1))) > 0
  monkeypatch.setattr(plans, "ATTENTION", "ragged")
  monkeypatch.setattr(plans, "RAGGED_BLOCK", 32)
  assert_same(ref, run(cfg, params, tokens, mask, 16, stops, key=6))


def uneven_prompts(cfg) -> tuple[np.ndarray, np.ndarray]:
  """Prompts of 250, 1, 130 and 40 tokens: P = 256, two 128-column chunks at most."""
  return hf_utils.left_padded_batch(
    np.random.default_rng(4), [250, 1, 130, 40], cfg.vocab_size, low=3
  )


@pytest.mark.parametrize("attention", ["blocks", "ragged"])
def test_slots_reused_by_shorter_prompts(rollouts, monkeypatch, attention):
  """Prompts of 250, 1, 130 and 40 tokens (``uneven_prompts``), the longest first, over
  3 slots: rows of shorter prompts take the slots its rows held, and a refill copies only
  their own chunks. The same samples as every row in a fresh slot.

  A slot's mask row comes from its new prompt's length: with the last row's kept where
  the new prompt has none, the blocked run differs at once (the ragged kernel reads from
  the prompt's first column, by its length)."""
  cfg, params, _, _, stops, _ = rollouts
  tokens, mask = uneven_prompts(cfg)
  ref = run(cfg, params, tokens, mask, Q * G, stops, max_new=12)
  lengths = np.asarray(ref.lengths_B)
  assert lengths.min() < 6 and lengths[:G].min() < 12, lengths  # slots free up early
  if attention == "ragged":
    monkeypatch.setattr(plans, "ATTENTION", "ragged")
    monkeypatch.setattr(plans, "RAGGED_BLOCK", 32)
  assert_same(ref, run(cfg, params, tokens, mask, 3, stops, max_new=12))


def test_refill_writes_only_the_prompts_chunks():
  """Two rounds of refills into 4 slots (P = 384): a slot's prompt columns hold its row's
  128-column chunks counted from P and zeros, its last row's longer chunks zeroed; its
  completion columns are left alone (NaN here: the decode step writes them before they
  are unmasked); its mask row comes from the prompt's length."""
  cfg = Qwen2Config.tiny()
  X, W, P, C = cfg.num_kv_heads * cfg.head_dim, 4, 384, 8
  lengths = [384, 1, 129, 200, 1, 384, 5, 130]  # the second round's, in the same slots
  Q, L = len(lengths), cfg.num_layers
  rng = np.random.default_rng(0)
  k = tuple(jnp.asarray(rng.normal(size=(Q, P, X)), jnp.float32) for _ in range(L))
  v = tuple(x + 1 for x in k)
  prompts = plans.PromptCache(
    k, v, jnp.asarray(np.arange(P) >= P - np.c_[lengths]), jnp.asarray(lengths)
  )
  plan = plans.Plan(cfg=cfg, strategy=None, num_samples=1, num_slots=W, gen_len=C)
  empty = jnp.concatenate([jnp.zeros((W, P, X)), jnp.full((W, C, X), jnp.nan)], 1)
  cache = decode.SlotCache((empty,) * L, (empty,) * L, jnp.zeros((W, P + C), bool))
  slots = slots_lib.Slots(
    row_W=jnp.full((W,), Q, jnp.int32),
    t_W=jnp.zeros((W,), jnp.int32),
    active_W=jnp.zeros((W,), bool),
    last_W=jnp.zeros((W,), jnp.int32),
    next=jnp.zeros((), jnp.int32),
  )
  first = plans.FirstTokens(jnp.zeros((Q,), jnp.int32), jnp.zeros((Q,), jnp.float32))
  refill = jax.jit(functools.partial(slots_lib.refill, plan, prompts, first, jnp.arange(Q), Q))
  cols = np.arange(P + C)
  for rows in (range(W), range(W, Q)):
    slots, cache = refill(slots, cache)
    np.testing.assert_array_equal(np.asarray(slots.row_W), list(rows))
    for w, q in enumerate(rows):
      n = lengths[q]
      start = P - -(-n // 128) * 128  # the first column copied (slots_lib.REFILL_CHUNK)
      for got, src in zip(cache.k + cache.v, k + v):
        want = np.zeros((P, X), np.float32)
        want[start:] = np.asarray(src[q, start:])
        np.testing.assert_array_equal(np.asarray(got[w, :P]), want, err_msg=f"{q=} {n=}")
        assert np.isnan(np.asarray(got[w, P:])).all()
      np.testing.assert_array_equal(np.asarray(cache.mask_WS[w]), (cols >= P - n) & (cols < P))
    slots = dataclasses.replace(slots, active_W=jnp.zeros((W,), bool))  # the rows stop


def test_one_token_and_compile_count(rollouts):
  cfg, params, tokens, mask, stops, outs = rollouts
  before = dict(engine.TRACE_COUNTS)
  rng = np.random.default_rng(3)
  # The fixture compiled W = 3 at these shapes. Prompt lengths within the 16
  # bucket, max_new_tokens and stop sets within the 32 bucket reuse its
  # programs; another W compiles the decode loop once, not the prefill.
  for n, lengths, max_new, stop in [
    (3, [7, 7, 16, 1], 17, []),
    (3, [3, 4, 5, 6], 30, stops[:2]),
    (7, [5, 13, 2, 9], 20, stops),
    (7, [1, 2, 3, 4], 32, []),
  ]:
    t, m = hf_utils.left_padded_batch(rng, lengths, cfg.vocab_size, low=3)
    out = run(cfg, params, t, m, n, stop, max_new=max_new)
    assert out.tokens_BC.shape == (Q * G, max_new)
  new = {k: engine.TRACE_COUNTS[k] - before.get(k, 0) for k in ("prefill", "decode")}
  assert new == {"prefill": 0, "decode": 1}, new
  # max_new_tokens = 1: token 0 alone, from the prefill (the 16-token bucket: one
  # more decode program).
  one = run(cfg, params, tokens, mask, 3, stops, max_new=1)
  np.testing.assert_array_equal(np.asarray(one.tokens_BC), np.asarray(outs[3].tokens_BC[:, :1]))
  assert (np.asarray(one.lengths_B) == 1).all()
  assert engine.TRACE_COUNTS["decode"] - before.get("decode", 0) == 2


def test_bad_max_active_rows_is_named(rollouts):
  cfg, params, tokens, mask, *_ = rollouts
  with pytest.raises(ValueError, match="max_active_rows"):
    sampling.generate(
      params,
      cfg,
      tokens,
      mask,
      jax.random.key(0),
      sampling.SamplingSpec(num_samples=1, max_new_tokens=4, max_active_rows=0),
    )


_SHARDED = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, "tests")
    import jax, numpy as np
    from capo_jax.runtime import mesh as capo_mesh
    from models.sharding import Layout
    import test_engine as te
    assert len(jax.devices()) == 8
    cfg, params, tokens, mask = te.tiny_policy()
    ref = dict(np.load(sys.argv[1]))
    # 4 row shards x a tensor group of 2 (the sampler's own mesh).
    layout = Layout.of(capo_mesh.sampling_mesh(capo_mesh.make_mesh({"data": -1}), cfg, 2),
                       capo_mesh.SAMPLING_RULES)
    # A quarter of the rows (5 slots over 4 batch shards: replicated) and 3 slots.
    stops = [int(t) for t in ref.pop("stops")]
    eight = te.schedules(cfg, params, tokens, mask, stops, layout, slots=(5, 3))
    # 16 slots, then a tail loop of 4 (whole shards of the 4 batch shards).
    te.decode.MIN_ROWS_CPU = 1
    plan = te.plans.Plan(cfg=cfg, strategy=None, num_samples=te.G, num_slots=16, gen_len=8,
                          layout=layout, shrink=True)
    assert plan.phases == (16, 4), plan.phases
    assert min(te.loop_steps(ref["lengths"], te.C, plan.phases)) > 0
    eight[16] = te.run(cfg, params, tokens, mask, 16, stops, layout)
    rows = eight[3].tokens_BC.sharding
    assert rows.spec[0] in ("data", ("data", "fsdp")), rows
    for n, out in eight.items():
      np.testing.assert_array_equal(np.asarray(out.tokens_BC), ref["tokens"])
      np.testing.assert_array_equal(np.asarray(out.mask_BC), ref["mask"])
      np.testing.assert_allclose(np.asarray(out.logprobs_BC), ref["logprobs"], atol=1e-5)
    # Slots reused by rows of shorter prompts, each chunk taken from the shard holding it.
    out = te.run(cfg, params, *te.uneven_prompts(cfg), 3, stops, layout, max_new=12)
    np.testing.assert_array_equal(np.asarray(out.tokens_BC), ref["uneven_tokens"])
    np.testing.assert_allclose(np.asarray(out.logprobs_BC), ref["uneven_logprobs"], atol=1e-5)
    print("OK")
""")


@pytest.mark.slow  # ~60 s of CPU: a fresh process compiling four sharded programs
def test_sharded_schedules_equal_one_device(rollouts, tmp_path):
  cfg, params, *_, stops, outs = rollouts
  uneven = run(cfg, params, *uneven_prompts(cfg), Q * G, stops, max_new=12)
  ref = tmp_path / "one_device.npz"
  np.savez(
    ref,
    uneven_tokens=np.asarray(uneven.tokens_BC),
    uneven_logprobs=np.asarray(uneven.logprobs_BC),
    tokens=np.asarray(outs[Q * G].tokens_BC),
    mask=np.asarray(outs[Q * G].mask_BC),
    logprobs=np.asarray(outs[Q * G].logprobs_BC),
    stops=np.asarray(stops),
    lengths=np.asarray(outs[Q * G].lengths_B),
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  proc = subprocess.run(
    [sys.executable, "-c", _SHARDED, str(ref)],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.mark.slow  # ~20 s; the narrow model's slot test stays in the default suite
def test_samples_do_not_depend_on_slots_on_a_flat_wide_model():
  """Bitwise the same tokens and log-probs at every W, on a model with fragile draws.

  The tiny policy above is peaked, so a rounding difference rarely flips a
  draw. Here the next-token distribution is near uniform over 8,192 tokens
  and the matmuls contract 512 columns, the shapes at which XLA:CPU's GEMM
  rounds an [W, D] x [D, F] product differently below 64 rows and its row
  reductions differently below 8 (capo_jax.sampling.decode). On the
  benchmark model such ~3e-6 logit differences flipped draws within a
  hundred tokens; here the log-probs, compared exactly, show them at once.
  """
  cfg = Qwen2Config(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,
    num_layers=1,
    num_heads=8,
    num_kv_heads=2,
    tie_word_embeddings=True,
  )
  params = qwen2.init_params(cfg, jax.random.key(0))
  tokens, mask = hf_utils.left_padded_batch(
    np.random.default_rng(1), [9, 16, 4, 12, 7, 1, 14, 3], cfg.vocab_size, low=3
  )
  B = tokens.shape[0] * G
  stops = np.random.default_rng(2).choice(np.arange(3, cfg.vocab_size), 82, replace=False)

  def rollout(n: int | None) -> sampling.Samples:
    return sampling.generate(
      params,
      cfg,
      tokens,
      mask,
      jax.random.key(5),
      sampling.SamplingSpec(
        num_samples=G, max_new_tokens=48, stop_ids=stops.tolist(), max_active_rows=n
      ),
    )

  ref = rollout(None)
  assert np.asarray(ref.lengths_B).min() < 24 < np.asarray(ref.lengths_B).max()  # refills happen
  # W = 32 of 40 rows ends in a loop of 8 slots (plans.Plan.phases).
  assert min(loop_steps(np.asarray(ref.lengths_B), 48, (32, 8))) > 0
  for n in (32, B // 4, 3):
    out = rollout(n)
    assert_same(ref, out)
    np.testing.assert_array_equal(np.asarray(out.logprobs_BC), np.asarray(ref.logprobs_BC))
