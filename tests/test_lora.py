"""LoRA (models/lora.py): adapters off = the base, merge = the adapted forward, only
adapters train, and a LoRA-CAPO run resumes exactly. Tiny models, few compiles."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_utils
import rl_driver
from batches import HostBatch
from capo_jax.rl import train_state as state_lib
from capo_jax.rl import train_step as ts
from capo_jax.rl.batch import TrainBatch
from capo_jax.rl.optim import OptimConfig
from capo_jax.run import spec as spec_lib
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.runtime import policy_io
from capo_jax.runtime.checkpoint import Checkpointer
from configs import common
from models import hf_weights, lora, qwen2
from models.config import Qwen2Config

CFG = Qwen2Config.tiny(tie_word_embeddings=False)
LCFG = lora.LoraConfig(rank=3, alpha=6.0)  # scale 2: a wrong scale shows
# Jitted once each: eager Flax applies dispatch (and compile) op by op, slowly.
forward = jax.jit(qwen2.forward, static_argnums=1)
merge = jax.jit(lora.merge, static_argnums=2)


def _batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  return hf_utils.left_padded_batch(np.random.default_rng(seed), [7, 4, 6], CFG.vocab_size)


def _nonzero_adapters(shapes: qwen2.Params, seed: int, std: float = 0.05) -> qwen2.Params:
  """Fresh adapters with B drawn too, so every delta is non-zero."""
  ad = lora.init_adapters(shapes, LCFG, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
  return jax.tree_util.tree_map_with_path(
    lambda p, x: (
      std * jax.random.normal(next(keys), x.shape) if str(p[-1].key).endswith("_lora_b") else x
    ),
    ad,
  )


def test_fresh_adapters_leave_the_logits_of_the_base():
  base = qwen2.init_params(CFG, jax.random.key(0))
  ad = lora.init_adapters(qwen2.param_shapes(CFG), LCFG, jax.random.key(1))
  names = set(ad["layers"])
  assert names == {
    f"{k}_kernel_lora_{x}" for k in ("q", "k", "v", "o", "gate", "up", "down") for x in "ab"
  }
  assert all(not np.any(ad["layers"][n]) for n in names if n.endswith("_b"))
  assert all(np.all(ad["layers"][n] != 0) for n in names if n.endswith("_a"))
  assert ad["layers"]["o_kernel_lora_a"].shape == (CFG.num_layers, CFG.num_heads, CFG.head_dim, 3)
  tokens, mask = _batch()
  np.testing.assert_array_equal(
    forward(lora.with_adapters(base, ad, LCFG), CFG, tokens, mask), forward(base, CFG, tokens, mask)
  )


def test_merged_export_equals_the_adapted_forward_in_ours_and_transformers(tmp_path):
  import transformers  # pylint: disable=g-import-not-at-top

  _, path = hf_utils.make_hf_model(tmp_path / "base", seed=3, tie_word_embeddings=False)
  cfg, base = hf_weights.load_pretrained(path)
  ad = _nonzero_adapters(qwen2.param_shapes(cfg), seed=5)
  tokens, mask = _batch(1)
  real = mask.astype(bool)
  adapted = np.asarray(forward(lora.with_adapters(base, ad, LCFG), cfg, tokens, mask))
  # The adapters really move the logits, so agreement below is not the base's.
  assert np.abs(adapted - np.asarray(forward(base, cfg, tokens, mask)))[real].max() > 0.05
  # Independent of models.lora.merge: the delta W + s * A @ B written out per kernel.
  L, s = cfg.num_layers, LCFG.scale
  a, b = ad["layers"], base["layers"]
  want_q = b["q_kernel"] + s * np.einsum(
    "ldr,lrnh->ldnh", a["q_kernel_lora_a"], a["q_kernel_lora_b"]
  )
  want_o = b["o_kernel"] + s * np.einsum(
    "lnhr,lrd->lnhd", a["o_kernel_lora_a"], a["o_kernel_lora_b"]
  )
  merged = merge(base, ad, LCFG)
  np.testing.assert_allclose(merged["layers"]["q_kernel"], want_q, atol=1e-6)
  np.testing.assert_allclose(merged["layers"]["o_kernel"], want_o, atol=1e-6)
  assert L == merged["layers"]["q_kernel"].shape[0]

  hf_weights.save_pretrained(cfg, merged, tmp_path / "merged")
  _, reloaded = hf_weights.load_pretrained(tmp_path / "merged")
  ours = np.asarray(forward(reloaded, cfg, tokens, mask))
  assert np.abs(ours - adapted)[real].max() <= 1e-5
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  np.testing.assert_array_equal(
    hf.state_dict()["model.layers.1.self_attn.q_proj.weight"].numpy(),
    np.asarray(merged["layers"]["q_kernel"][1]).reshape(cfg.hidden_size, -1).T,
  )
  assert np.abs(hf_utils.hf_logits(hf, tokens, mask) - adapted)[real].max() <= 1e-5


def _train_batch(B: int, P: int = 5, C: int = 6) -> TrainBatch:
  """B sequences, one per row, one micro-batch."""
  rng = np.random.default_rng(0)
  cmask = (np.arange(C)[None] < rng.integers(2, C + 1, (B, 1))).astype(np.int32)
  return HostBatch(
    prompt_tokens_BP=rng.integers(1, CFG.vocab_size, (B, P)).astype(np.int32),
    prompt_mask_BP=np.ones((B, P), np.int32),
    completion_tokens_BC=rng.integers(1, CFG.vocab_size, (B, C)).astype(np.int32),
    completion_mask_BC=cmask,
    old_logp_BC=np.full((B, C), -5.0, np.float32) * cmask,
    adv_B=rng.normal(size=B).astype(np.float32),
  ).train_batch(B)


def test_a_train_step_changes_only_the_adapters_with_the_chain_rule_gradient(tmp_path):
  tcfg = state_lib.TrainConfig(optim=OptimConfig(learning_rate=1e-2, weight_decay=0.0), lora=LCFG)
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  base = jax.device_put(
    qwen2.init_params(CFG, jax.random.key(0)),
    mesh_lib.param_shardings(CFG, mesh, mesh_lib.TRAIN_RULES),
  )
  base_before = jax.tree.map(np.array, base)
  ad = _nonzero_adapters(qwen2.param_shapes(CFG), seed=7)
  state = state_lib.train_state_from_params(ad, CFG, tcfg, mesh, mesh_lib.TRAIN_RULES)
  batch = _train_batch(4)

  # The LoRA gradient against the chain rule through the full-weight gradient
  # at the merged weights: dA = s * dW B^T, dB = s * A^T dW.
  # Jitted: one compile each instead of an eager op-by-op run.
  g_lora = jax.jit(lambda a, b: ts.loss_and_grads(a, batch, CFG, tcfg, base=b)[2])(ad, base)
  full = state_lib.TrainConfig(optim=tcfg.optim)
  g_full = jax.jit(lambda p: ts.loss_and_grads(p, batch, CFG, full)[2])(merge(base, ad, LCFG))
  s = LCFG.scale
  for kernel, n_in in (("q_kernel", 1), ("o_kernel", 2), ("down_kernel", 1)):
    dW = np.asarray(g_full["layers"][kernel])
    A = np.asarray(ad["layers"][f"{kernel}_lora_a"])
    B = np.asarray(ad["layers"][f"{kernel}_lora_b"])
    L, Z = A.shape[0], A.shape[-1]
    dW2, A2, B2 = dW.reshape(L, A[0, ..., 0].size, -1), A.reshape(L, -1, Z), B.reshape(L, Z, -1)
    np.testing.assert_allclose(
      g_lora["layers"][f"{kernel}_lora_a"],
      (s * dW2 @ B2.transpose(0, 2, 1)).reshape(A.shape),
      atol=2e-6,
    )
    np.testing.assert_allclose(
      g_lora["layers"][f"{kernel}_lora_b"],
      (s * A2.transpose(0, 2, 1) @ dW2).reshape(B.shape),
      atol=2e-6,
    )
    assert np.abs(g_lora["layers"][f"{kernel}_lora_b"]).max() > 1e-6

  step_fn = ts.make_train_step(CFG, tcfg, mesh, mesh_lib.TRAIN_RULES, rows_per_microbatch=4)
  new, metrics = step_fn(state, batch, base)
  assert float(metrics["skipped"]) == 0
  # The state holds adapters only: params, and Adam moments of the same size.
  assert set(new.params) == {"layers"} and set(new.params["layers"]) == set(ad["layers"])
  n_ad = qwen2.num_params(ad)
  assert sum(x.size for x in jax.tree.leaves(new.opt_state)) <= 2 * n_ad + 8
  for name, x in new.params["layers"].items():
    assert not np.array_equal(x, ad["layers"][name]), name
  # The base is bit-identical and was not donated (still readable).
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), base_before)

  # Save, restore into the shardings, step again: the same as stepping the live state.
  ckpt = Checkpointer(str(tmp_path), every_steps=1)
  ckpt.save(1, new, {"step": 1})
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), new
  )
  _, restored, _ = ckpt.restore_latest(abstract)
  ckpt.close()
  live, _ = step_fn(new, batch, base)
  again, _ = step_fn(restored, batch, base)
  jax.tree.map(
    lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), again, live
  )


def test_bad_lora_config_fails_naming_the_field():
  for field, value, needle in (
    ("lora_targets", "q,qkv", "config.model.lora_targets='q,qkv'"),
    ("lora_rank", -2, "config.model.lora_rank=-2"),
    ("lora_alpha", 0.0, "config.model.lora_alpha=0.0"),
  ):
    c = common.shrink(common.get_base_config())
    c.model.lora_rank = 4
    c.model[field] = value
    with pytest.raises(spec_lib.ConfigError, match=needle.replace("[", r"\[")):
      spec_lib.RunSpec.from_config(c, num_devices=1)
  c = common.shrink(common.get_base_config())
  c.model.lora_rank, c.model.lora_targets = 2, " q, v "
  spec_of = lambda c: spec_lib.RunSpec.from_config(c, num_devices=1)  # noqa: E731
  assert c.train.pack and spec_of(c).train_config().lora == lora.LoraConfig(2, 32.0, ("q", "v"))
  assert spec_of(common.shrink(common.get_base_config())).train_config().lora is None


@pytest.mark.slow  # ~1-4 min on the 2-core box: a whole run, compiled twice
def test_lora_capo_resumed_after_step_one_equals_two_uninterrupted_steps(tmp_path):
  """2 steps of LoRA-CAPO straight; then the same run from its step-1 checkpoint alone
  (later checkpoints and exports deleted) in a fresh ``train`` call: same adapters, bit
  for bit. In one process, so the second run reuses the compiled programs."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  tok = hf_utils.make_tokenizer_dir(tmp_path / "tok")
  data = tmp_path / "train.jsonl"
  data.write_text(
    "".join(
      json.dumps({"id": str(i), "problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
      for i in range(8)
    )
  )
  c = rl_driver.tiny_config(str(tok), str(data), 2)
  _, base_dir = hf_utils.make_hf_model(tmp_path / "base", seed=2, vocab_size=512)
  c.model.hf_path = str(base_dir)  # a HF base, so a checkpoint alone can be evaluated
  c.model.lora_rank, c.model.lora_alpha, c.model.lora_targets = 4, 8.0, "q,v,o,up,down"
  c.mesh.reduce_once = False  # the 1.5B run file's, for full fine-tuning only
  c.data.val_size = 0
  assert (
    c.algo.name == "capo"
    and spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True).needs_reference
  )
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  want = rl_driver.train(c, str(straight), grader=rl_driver.HashGrader())

  state_dir = straight / "checkpoints" / "2" / "state"
  tree = ocp.StandardCheckpointer().metadata(str(state_dir)).item_metadata.tree
  assert set(tree["params"]["layers"]) == {
    f"{k}_kernel_lora_{x}" for k in ("q", "v", "o", "up", "down") for x in "ab"
  }
  # Adapters, their two Adam moments and a few scalars: no base weight is saved.
  n_base = qwen2.num_params(
    qwen2.param_shapes(
      spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True).model_config()
    )
  )
  n_ad = sum(int(np.prod(m.shape)) for m in jax.tree.leaves(tree["params"]))
  n_saved = sum(int(np.prod(m.shape)) for m in jax.tree.leaves(tree))
  assert n_ad < n_base / 10 and 3 * n_ad <= n_saved <= 3 * n_ad + 8, (n_ad, n_saved, n_base)
  meta = json.loads((straight / "checkpoints" / "2" / "meta" / "metadata").read_text())
  assert meta["lora"] == {
    "rank": 4,
    "alpha": 8.0,
    "targets": ["q", "v", "o", "up", "down"],
    "base": str(base_dir),
  }
  # The export is the merged policy, in a HF directory.
  _, exported = hf_weights.load_pretrained(straight / "export_hf")
  jax.tree.map(
    lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), exported, want
  )

  # evaluate --policy=<workdir> without an export: the checkpoint's adapters merged
  # into the recorded base.
  shutil.copytree(straight, tmp_path / "ckpt_only")
  shutil.rmtree(tmp_path / "ckpt_only" / "export_hf")
  loaded = policy_io.load_policy(str(tmp_path / "ckpt_only"), dtype=jnp.float32)
  assert "checkpoint step 2" in loaded.source
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6),
    loaded.params,
    want,
  )

  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / "checkpoints" / "2")
  shutil.rmtree(resumed / "export_hf")
  got = rl_driver.train(c, str(resumed), grader=rl_driver.HashGrader())
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), got, want)
  rows = [json.loads(l) for l in (resumed / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2] and rows[-1]["grad_norm"] > 0
  one = pathlib.Path(resumed / "checkpoints" / "1")
  assert one.is_dir() and (resumed / "checkpoints" / "2").is_dir()


def test_memory_plan_lora_terms_by_hand():
  from tools import memory_plan as mp  # pylint: disable=g-import-not-at-top

  full = mp.load_run("7B")
  run = mp.with_lora(full, 64)
  D, F, K, H, L = 3584, 18944, 4, 128, 28
  # q, o: D -> N*H = D; k, v: D -> K*H; gate, up: D -> F; down: F -> D.
  per_layer = 64 * (2 * (D + D) + 2 * (D + K * H) + 3 * (D + F))
  assert mp.adapter_count(run) == L * per_layer == 161_480_704
  P, _ = mp.param_counts(run.model)
  shard = 8 * 2
  t = mp.memory_terms(run, 1, 8, 2)
  assert t["frozen base (bf16, = reference)"] == 2 * P / shard
  assert t["adapters (f32)"] == 4 * L * per_layer / shard
  assert t["AdamW moments (2 x f32)"] == 8 * L * per_layer / shard
  assert t["reference (bf16)"] == 0  # the base is the reference
  assert t["grads (2 x f32) + bf16 copy"] == 8 * L * per_layer / shard  # bf16 base: no copy
  # docs/lora.md's claim: LoRA fits 7B on half the slice.
  for small in ("v4-8", "v5e-16", "v6e-4"):
    assert mp.plan(run, mp.parse_slice(small)).fits
    assert not mp.plan(full, mp.parse_slice(small)).fits


def test_reduce_once_needs_gather_once_and_full_fine_tuning():
  """``mesh.reduce_once`` (the 1.5B run file's) keeps each chip's gradient of the gathered
  copy: with LoRA or without ``mesh.gather_once`` there is no such copy, and the run stops
  naming the field rather than running without it."""
  from configs import capo_qwen2p5_math_1p5b  # pylint: disable=import-outside-toplevel

  for change in ({"model.lora_rank": 4}, {"mesh.gather_once": False}):
    c = capo_qwen2p5_math_1p5b.get_config("shrink")
    assert c.mesh.reduce_once and c.mesh.gather_once
    for dotted, value in change.items():
      section, field = dotted.split(".")
      c[section][field] = value
    with pytest.raises(spec_lib.ConfigError, match=r"config\.mesh\.reduce_once=True"):
      spec_lib.RunSpec.from_config(c, num_devices=1)
  c = capo_qwen2p5_math_1p5b.get_config("shrink")
  c.model.lora_rank, c.mesh.reduce_once = 4, False
  assert spec_lib.RunSpec.from_config(c, num_devices=1).train_config().lora is not None
  with pytest.raises(ValueError, match="reduce_once needs gather_once"):
    state_lib.TrainConfig(reduce_once=True)


def test_data_parallel_passes_need_the_gathered_copy_and_rows_for_every_chip():
  """``mesh.logprob_data_parallel`` runs the passes on a whole copy gathered once: without
  ``mesh.gather_once``, or with LoRA, the run stops naming the field; a call's packed rows
  must split over every chip, and the error names the field that sets them."""
  from configs import capo_qwen2p5_math_1p5b  # pylint: disable=import-outside-toplevel

  def config(**changes: Any) -> Any:
    c = capo_qwen2p5_math_1p5b.get_config("shrink")
    c.mesh.logprob_data_parallel = True
    for dotted, value in changes.items():
      section, field = dotted.split("__")
      c[section][field] = value
    return c

  for change in (
    {"model__lora_rank": 4, "mesh__reduce_once": False},
    {"mesh__gather_once": False, "mesh__reduce_once": False},
  ):
    with pytest.raises(spec_lib.ConfigError, match=r"config\.mesh\.logprob_data_parallel=True"):
      spec_lib.RunSpec.from_config(config(**change), num_devices=1)
  rows = spec_lib.RunSpec.from_config(config(), num_devices=1).logprob_rows_per_call
  with pytest.raises(spec_lib.ConfigError, match=r"config\.train\.logprob_pack_rows"):
    spec_lib.RunSpec.from_config(config(), num_devices=rows * 2)
  spec = spec_lib.RunSpec.from_config(
    config(train__logprob_pack_rows=rows * 2), num_devices=rows * 2
  )
  assert spec.logprob_rows_per_call == rows * 2  # its own rows, the micro-batches' kept
  assert spec.packing_shape()[1] == rows
