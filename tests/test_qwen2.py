"""The JAX Qwen2 port against transformers: logits, KV cache, presets, config, sharding."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_utils
from models import decoder, hf_weights, qwen2
from models.config import PRESETS, Qwen2Config
from models.kv_cache import KVCache, init_cache

forward = jax.jit(qwen2.forward, static_argnums=1)
forward_with_cache = jax.jit(qwen2.forward_with_cache, static_argnums=1)


def _port(hf_model, **cfg_kw) -> tuple[Qwen2Config, dict]:
  cfg = Qwen2Config.from_hf(hf_model.config.to_dict(), **cfg_kw)
  state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
  return cfg, hf_weights.params_from_state_dict(cfg, state)


PARITY_CASES = {
  "tied_theta1e4_gqa2": dict(tie_word_embeddings=True, rope_theta=1e4),
  "untied_theta1e6_gqa4": dict(
    tie_word_embeddings=False,
    rope_theta=1e6,
    num_attention_heads=8,
    num_key_value_heads=2,
    hidden_size=64,
  ),
  "untied_theta1e4_mqa3": dict(
    tie_word_embeddings=False,
    rope_theta=1e4,
    num_attention_heads=6,
    num_key_value_heads=1,
    hidden_size=48,
    num_hidden_layers=3,
  ),
  "tied_theta1e6_mha": dict(
    tie_word_embeddings=True,
    rope_theta=1e6,
    num_attention_heads=4,
    num_key_value_heads=4,
    rms_norm_eps=1e-5,
  ),
}


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_logits_match_transformers_on_left_padded_batch(case):
  hf_model, _ = hf_utils.make_hf_model(None, seed=len(case), **PARITY_CASES[case])
  cfg, params = _port(hf_model)
  tokens, mask = hf_utils.left_padded_batch(np.random.default_rng(1), [11, 4, 8, 1], 256)
  ref = hf_utils.hf_logits(hf_model, tokens, mask)
  ours = np.asarray(forward(params, cfg, tokens, mask))
  real = mask.astype(bool)
  assert np.abs(ref[real]).std() > 0.3  # logits far from zero, so the check has teeth
  assert np.abs(ours - ref)[real].max() <= 1e-4
  # A left-padded row equals the same row run alone, unpadded.
  alone = np.asarray(forward(params, cfg, tokens[1:2, -4:], mask[1:2, -4:]))
  np.testing.assert_allclose(ours[1, -4:], alone[0], atol=1e-5)


def _cached_logits(params, cfg, tokens, mask, prefill_chunks, max_len):
  """Prefill ``tokens[:, :P]`` in the given chunks, then decode one token at a time."""
  B, T = tokens.shape
  cache = init_cache(cfg, B, max_len)
  out = []
  for lo, hi in prefill_chunks:
    logits, cache = forward_with_cache(params, cfg, tokens[:, lo:hi], mask[:, lo:hi], cache)
    out.append(logits)
  for t in range(prefill_chunks[-1][1], T):
    logits, cache = forward_with_cache(params, cfg, tokens[:, t : t + 1], mask[:, t : t + 1], cache)
    out.append(logits)
  return np.concatenate([np.asarray(x) for x in out], axis=1), cache


@pytest.mark.parametrize("chunks", [[(0, 9)], [(0, 4), (4, 9)]], ids=["one_prefill", "two_chunks"])
def test_cached_decode_equals_full_forward(chunks):
  hf_model, _ = hf_utils.make_hf_model(None, seed=3, tie_word_embeddings=False)
  cfg, params = _port(hf_model)
  rng = np.random.default_rng(2)
  prompt_lens, new = [9, 3, 6], 5
  tokens, mask = hf_utils.left_padded_batch(rng, prompt_lens, 256)
  tokens = np.concatenate([tokens, rng.integers(0, 256, (3, new), dtype=np.int32)], axis=1)
  mask = np.concatenate([mask, np.ones((3, new), np.int32)], axis=1)
  full = np.asarray(forward(params, cfg, tokens, mask))
  cached, cache = _cached_logits(params, cfg, tokens, mask, chunks, max_len=16)
  real = mask.astype(bool)
  assert np.abs(cached - full)[real].max() <= 1e-5
  np.testing.assert_array_equal(np.asarray(cache.positions_B), np.array(prompt_lens) + new)
  assert int(cache.index) == tokens.shape[1]


def repeat_rows(cache: KVCache, times: int) -> KVCache:
  """Each row repeated ``times`` times in place (row b -> rows b*times..)."""
  rep = lambda x, axis: jnp.repeat(x, times, axis=axis)
  return KVCache(
    k_LBSKH=rep(cache.k_LBSKH, 1),
    v_LBSKH=rep(cache.v_LBSKH, 1),
    mask_BS=rep(cache.mask_BS, 0),
    positions_B=rep(cache.positions_B, 0),
    index=cache.index,
  )


def test_repeat_rows_shares_one_prefill():
  hf_model, _ = hf_utils.make_hf_model(None, seed=4)
  cfg, params = _port(hf_model)
  tokens, mask = hf_utils.left_padded_batch(np.random.default_rng(3), [5, 2], 256)
  _, cache = forward_with_cache(params, cfg, tokens, mask, init_cache(cfg, 2, 8))
  cache = repeat_rows(cache, 3)
  nxt = np.arange(6, dtype=np.int32)[:, None] + 7
  logits, _ = forward_with_cache(params, cfg, nxt, np.ones((6, 1), np.int32), cache)
  full_tokens = np.concatenate([np.repeat(tokens, 3, axis=0), nxt], axis=1)
  full_mask = np.concatenate([np.repeat(mask, 3, axis=0), np.ones((6, 1), np.int32)], axis=1)
  full = np.asarray(forward(params, cfg, full_tokens, full_mask))
  assert np.abs(np.asarray(logits)[:, 0] - full[:, -1]).max() <= 1e-5


def test_bfloat16_compute_stays_close_to_float32():
  import copy  # pylint: disable=g-import-not-at-top

  import torch  # pylint: disable=g-import-not-at-top

  hf_model, _ = hf_utils.make_hf_model(None, seed=5, tie_word_embeddings=False)
  cfg, params = _port(hf_model)
  tokens, mask = hf_utils.left_padded_batch(np.random.default_rng(4), [12, 7], 256)
  ref = np.asarray(forward(params, cfg, tokens, mask))
  cfg16 = cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  out = forward(params16, cfg16, tokens, mask)
  assert out.dtype == jnp.float32
  real = mask.astype(bool)
  err = np.abs(np.asarray(out) - ref)[real] / ref[real].std()
  # Stated tolerance, relative to the float32 logit spread: mean error <= 2%, max <= 12%
  # (bf16 keeps 8 mantissa bits; measured ~1.1% / ~6-9% here), and no worse than 1.5x the
  # error of transformers' own bfloat16 model on the same weights.
  hf_err = (
    np.abs(hf_utils.hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16), tokens, mask) - ref)[real]
    / ref[real].std()
  )
  assert err.mean() <= 0.02 and err.max() <= 0.12
  assert err.mean() <= 1.5 * hf_err.mean()
  assert err.max() > 0  # it really ran in lower precision


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_param_count_and_hf_config_roundtrip(name):
  import transformers  # pylint: disable=g-import-not-at-top

  cfg = PRESETS[name]()
  assert qwen2.num_params(qwen2.param_shapes(cfg)) == hf_utils.hf_num_params(cfg.to_hf())
  hf_dict = transformers.AutoConfig.for_model(**cfg.to_hf()).to_dict()  # Qwen2 or Qwen3
  assert Qwen2Config.from_hf(hf_dict) == cfg


def test_preset_numbers_of_released_checkpoints():
  # Published parameter totals (model cards: 0.49B, 1.54B) and the Math rope base.
  assert qwen2.num_params(qwen2.param_shapes(Qwen2Config.qwen2p5_0p5b())) == 494_032_768
  assert qwen2.num_params(qwen2.param_shapes(Qwen2Config.qwen2p5_1p5b())) == 1_543_714_304
  assert Qwen2Config.qwen2p5_math_1p5b().rope_theta == 10000.0
  assert Qwen2Config.qwen2p5_math_7b().rope_theta == 10000.0
  assert Qwen2Config.qwen2p5_7b().head_dim == 128


BASE_HF = dict(
  vocab_size=32,
  hidden_size=16,
  intermediate_size=24,
  num_hidden_layers=1,
  num_attention_heads=4,
  num_key_value_heads=2,
)


def test_from_hf_reads_both_rope_spellings(tmp_path):
  old = Qwen2Config.from_hf(dict(BASE_HF, rope_theta=12345.0, rope_scaling=None))
  new = Qwen2Config.from_hf(
    dict(BASE_HF, rope_parameters={"rope_type": "default", "rope_theta": 54321.0})
  )
  assert old.rope_theta == 12345.0 and new.rope_theta == 54321.0
  (tmp_path / "config.json").write_text(
    '{"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,'
    ' "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,'
    ' "rope_theta": 777.0, "tie_word_embeddings": true}'
  )
  from_dir = Qwen2Config.from_hf(tmp_path)
  assert from_dir.rope_theta == 777.0 and from_dir.tie_word_embeddings and from_dir.head_dim == 4


@pytest.mark.parametrize(
  "rope",
  [
    {"rope_scaling": {"type": "yarn", "factor": 4.0}},
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
  ],
)
def test_from_hf_rejects_unsupported_rope(rope):
  kind = "yarn" if "rope_scaling" in rope else "linear"
  with pytest.raises(NotImplementedError, match=f"rope_type='{kind}'"):
    Qwen2Config.from_hf(dict(BASE_HF, rope_theta=1e4, **rope))


def test_from_hf_errors_name_the_field(tmp_path):
  with pytest.raises(KeyError, match="rope_theta"):
    Qwen2Config.from_hf(dict(BASE_HF))
  with pytest.raises(KeyError, match="intermediate_size"):
    Qwen2Config.from_hf(
      {k: v for k, v in BASE_HF.items() if k != "intermediate_size"} | {"rope_theta": 1e4}
    )
  with pytest.raises(ValueError, match="model_type='llama'"):
    Qwen2Config.from_hf(dict(BASE_HF, rope_theta=1e4, model_type="llama"))
  with pytest.raises(FileNotFoundError, match="no HF config"):
    Qwen2Config.from_hf(tmp_path)
  (tmp_path / "config.json").write_text("{\n  \"vocab_size\": 32,\n  oops\n}")
  with pytest.raises(ValueError, match="line 3"):
    Qwen2Config.from_hf(tmp_path)


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(num_heads=8, num_kv_heads=3), "num_kv_heads=3"),
    (dict(hidden_size=66, num_heads=4), "set head_dim"),
    (dict(head_dim=7), "head_dim=7 must be even"),
    (dict(num_layers=0), "num_layers must be positive"),
    (dict(compute_dtype="float16"), "compute_dtype='float16'"),
  ],
)
def test_config_invariants(kw, match):
  with pytest.raises(ValueError, match=match):
    Qwen2Config.tiny(**kw)


RULES = [
  ("embed", "fsdp"),
  ("mlp", "tp"),
  ("q_heads", "tp"),
  ("kv_heads", "tp"),
  ("vocab", "tp"),
  ("layers", None),
]


def test_param_specs_replicate_non_dividing_axes(caplog):
  mesh = jax.sharding.AbstractMesh((2, 4), ("fsdp", "tp"))
  cfg = Qwen2Config.tiny(num_kv_heads=2, vocab_size=250, tie_word_embeddings=False)
  with caplog.at_level(logging.INFO, logger="models.sharding"):
    specs = qwen2.param_specs(cfg, RULES, mesh)
  P = jax.sharding.PartitionSpec
  layers = specs["layers"]
  assert layers["q_kernel"] == P(None, "fsdp", "tp", None)
  assert layers["gate_kernel"] == P(None, "fsdp", "tp")
  assert layers["down_kernel"] == P(None, "tp", "fsdp")
  # 2 kv heads over tp=4 and a vocab of 250 over tp=4 do not divide: replicated, and logged.
  assert layers["k_kernel"] == P(None, "fsdp", None, None)
  assert specs["embed"] == P(None, "fsdp")
  assert specs["lm_head"] == P("fsdp", None)
  assert "not divisible" in caplog.text and "kv_heads" in caplog.text
  # Every spec divides its dimension, whatever the rules: checked leaf by leaf.
  shapes = qwen2.param_shapes(cfg)
  for spec, shape in zip(
    jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)), jax.tree.leaves(shapes)
  ):
    assert len(spec) == len(shape.shape)
    for dim, ax in zip(shape.shape, spec):
      axes = () if ax is None else (ax,) if isinstance(ax, str) else ax
      assert dim % int(np.prod([mesh.shape[a] for a in axes])) == 0


def test_param_specs_use_each_mesh_axis_once_and_check_names():
  mesh = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
  cfg = Qwen2Config.tiny()
  specs = qwen2.param_specs(cfg, [("embed", "model"), ("mlp", "model")], mesh)
  assert specs["layers"]["gate_kernel"] == jax.sharding.PartitionSpec(None, "model", None)
  without_mesh = qwen2.param_specs(cfg, [("mlp", ("data", "model"))])
  assert without_mesh["layers"]["up_kernel"] == jax.sharding.PartitionSpec(
    None, None, ("data", "model")
  )
  with pytest.raises(ValueError, match="mesh has no axis 'tp'"):
    qwen2.param_specs(cfg, [("mlp", "tp")], mesh)


def test_param_axes_cover_every_param():
  for tied in (True, False):
    cfg = Qwen2Config.tiny(tie_word_embeddings=tied)
    axes = qwen2.param_axes(cfg)
    shapes = qwen2.param_shapes(cfg)
    is_axes = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    flat_axes, _ = jax.tree_util.tree_flatten_with_path(axes, is_leaf=is_axes)
    flat_shapes, _ = jax.tree_util.tree_flatten_with_path(shapes)
    assert [p for p, _ in flat_axes] == [p for p, _ in flat_shapes]
    for (_, ax), (_, s) in zip(flat_axes, flat_shapes):
      assert len(ax) == len(s.shape)


def test_flax_module_is_pure_and_remat_is_real():
  cfg = Qwen2Config.tiny(num_layers=3)
  tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
  mask_BTS = jnp.tril(jnp.ones((5, 5), bool))[None].repeat(2, 0)
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  variables = decoder.Qwen2(cfg).init(jax.random.key(0), tokens, positions, mask_BTS)
  assert set(variables) == {"params"}  # no state collections: apply is a pure function
  # Stacked layers: one leading axis of num_layers on every layer param.
  assert all(x.shape[0] == 3 for x in jax.tree.leaves(nn.unbox(variables["params"]["layers"])))
  params = qwen2.init_params(cfg, jax.random.key(0))
  ones = jnp.ones((2, 5), jnp.int32)

  def grad_jaxpr(remat: bool) -> str:
    loss = lambda p: qwen2.forward(p, cfg.replace(remat=remat), tokens, ones).sum()
    return str(jax.make_jaxpr(jax.grad(loss))(params))

  assert "remat" in grad_jaxpr(True) or "checkpoint" in grad_jaxpr(True)
  assert "remat" not in grad_jaxpr(False) and "checkpoint" not in grad_jaxpr(False)


def test_remat_policy_recomputes_what_it_does_not_save():
  """Counted by hand, per layer (the scan's body): without remat the gradient has 9
  forward matmuls (q, k, v, o, gate, up, down, q k^T, p v) and 18 backward ones, plus
  the unembedding's 3. "full" recomputes every forward matmul whose output the backward
  reads (all but down's: 8); "projections" keeps the q / k / v / o / gate / up outputs
  and recomputes only the attention's two batched products."""
  cfg = Qwen2Config.tiny(num_layers=2)
  tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
  ones = jnp.ones((2, 5), jnp.int32)
  params = qwen2.init_params(cfg, jax.random.key(0))

  def dots(c: Qwen2Config, per_shard: bool) -> int:
    loss = lambda p: qwen2.forward(p, c, tokens, ones).sum()
    grad = jax.grad(loss)
    if per_shard:  # as mesh.reduce_once runs it: vmapped over copies of the weights,
      # which gives every projection a batch dim
      grad, p = jax.vmap(grad), jax.tree.map(lambda x: jnp.stack([x, x]), params)
    return str(jax.make_jaxpr(grad)(p if per_shard else params)).count("dot_general")

  for per_shard in (False, True):
    plain = dots(cfg, per_shard)
    assert plain == 9 + 18 + 3
    for policy, recomputed in (("full", 8), ("projections", 2)):
      c = cfg.replace(remat=True, remat_policy=policy)
      assert dots(c, per_shard) - plain == recomputed, (policy, per_shard)


def test_remat_policy_is_checked():
  with pytest.raises(ValueError, match="remat_policy='some'"):
    Qwen2Config.tiny(remat=True, remat_policy="some")
  with pytest.raises(ValueError, match="needs remat=True"):
    Qwen2Config.tiny(remat=False, remat_policy="projections")
