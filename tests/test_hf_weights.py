"""HF checkpoint load / save against transformers (no torch inside models/hf_weights.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import hf_utils
from models import hf_layout, hf_weights, qwen2
from models.config import Qwen2Config

forward = jax.jit(qwen2.forward, static_argnums=1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(hf_model) -> dict[str, np.ndarray]:
  return {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}


def _batch():
  return hf_utils.left_padded_batch(np.random.default_rng(0), [9, 4, 6], 256)


def test_hf_weights_does_not_import_torch():
  code = (
    "import sys, models.hf_weights as w, jax.numpy as jnp; "
    "assert 'torch' not in sys.modules, 'torch imported'"
  )
  subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_then_transformers_from_pretrained_same_logits(tmp_path, tied):
  import transformers  # pylint: disable=g-import-not-at-top

  hf_model, path = hf_utils.make_hf_model(tmp_path / "src", seed=1, tie_word_embeddings=tied)
  cfg, params = hf_weights.load_pretrained(path)
  assert cfg.tie_word_embeddings == tied and ("lm_head" in params) != tied
  tokens, mask = _batch()
  ref = hf_utils.hf_logits(hf_model, tokens, mask)
  real = mask.astype(bool)
  assert np.abs(np.asarray(forward(params, cfg, tokens, mask)) - ref)[real].max() <= 1e-4

  hf_weights.save_pretrained(
    cfg, params, tmp_path / "out", generation_config={"eos_token_id": [2, 0]}
  )
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(reloaded).__name__ == "Qwen2ForCausalLM"
  # Same weights, bit for bit, so the same logits on every position.
  for name, value in _state(hf_model).items():
    np.testing.assert_array_equal(reloaded.state_dict()[name].numpy(), value, err_msg=name)
  np.testing.assert_array_equal(hf_utils.hf_logits(reloaded, tokens, mask), ref)
  gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
  assert gen["eos_token_id"] == [2, 0]


def test_load_sharded_index_checkpoint(tmp_path):
  hf_model, path = hf_utils.make_hf_model(
    tmp_path, seed=2, tie_word_embeddings=False, max_shard_size="40KB"
  )
  index = json.loads((path / hf_weights.INDEX_FILE).read_text())
  assert len(set(index["weight_map"].values())) > 2 and not (path / "model.safetensors").exists()
  cfg, params = hf_weights.load_pretrained(path)
  tokens, mask = _batch()
  real = mask.astype(bool)
  ref = hf_utils.hf_logits(hf_model, tokens, mask)
  assert np.abs(np.asarray(forward(params, cfg, tokens, mask)) - ref)[real].max() <= 1e-4
  # The stacked [L, ...] params hold exactly the per-layer HF tensors.
  state = _state(hf_model)
  np.testing.assert_array_equal(
    np.asarray(params["layers"]["k_kernel"][1]),
    state["model.layers.1.self_attn.k_proj.weight"].T.reshape(64, 2, 16),
  )
  np.testing.assert_array_equal(np.asarray(params["lm_head"]), state["lm_head.weight"].T)


def test_save_sharded_and_transformers_loads_it(tmp_path):
  import transformers  # pylint: disable=g-import-not-at-top

  hf_model, _ = hf_utils.make_hf_model(None, seed=3)
  cfg = Qwen2Config.from_hf(hf_model.config.to_dict())
  params = hf_weights.params_from_state_dict(cfg, _state(hf_model))
  hf_weights.save_pretrained(cfg, params, tmp_path, max_shard_size="30KB")
  index = json.loads((tmp_path / hf_weights.INDEX_FILE).read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 2 and all(os.path.getsize(tmp_path / f) < 80_000 for f in files)
  assert set(index["weight_map"]) == set(hf_layout.expected_tensors(cfg))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  tokens, mask = _batch()
  np.testing.assert_array_equal(
    hf_utils.hf_logits(reloaded, tokens, mask), hf_utils.hf_logits(hf_model, tokens, mask)
  )


def test_bfloat16_checkpoint_loads_and_saves(tmp_path):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  hf_model, path = hf_utils.make_hf_model(tmp_path / "bf16", seed=4, dtype="bfloat16")
  assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
  # The reference: the float32 weights rounded to bfloat16 by torch.
  rounded = {k: v.to(torch.bfloat16).float().numpy() for k, v in hf_model.state_dict().items()}
  cfg32, p32 = hf_weights.load_pretrained(path, dtype=jnp.float32)
  assert p32["embed"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(p32["embed"]), rounded["model.embed_tokens.weight"])
  cfg16, p16 = hf_weights.load_pretrained(path, dtype=jnp.bfloat16)
  assert cfg16.param_dtype == cfg16.compute_dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
  np.testing.assert_array_equal(
    np.asarray(p16["layers"]["down_kernel"][0]).astype(np.float32),
    rounded["model.layers.0.mlp.down_proj.weight"].T,
  )
  hf_weights.save_pretrained(cfg16, p16, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
  assert reloaded.dtype == torch.bfloat16
  for name, value in rounded.items():
    np.testing.assert_array_equal(reloaded.state_dict()[name].float().numpy(), value, err_msg=name)
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
    assert f.get_tensor("model.norm.weight").dtype == ml_dtypes.bfloat16


def _tiny_state(**overrides):
  hf_model, _ = hf_utils.make_hf_model(None, seed=5, **overrides)
  return Qwen2Config.from_hf(hf_model.config.to_dict()), _state(hf_model)


def test_missing_unexpected_and_misshaped_tensors_are_named():
  cfg, state = _tiny_state(tie_word_embeddings=False)
  missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
  with pytest.raises(
    ValueError,
    match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight "
    r"\(expected shape \[128, 64\]\)",
  ):
    hf_weights.params_from_state_dict(cfg, missing)
  extra = dict(state, **{"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)})
  with pytest.raises(
    ValueError,
    match=r"unexpected tensor model\.layers\.0\.self_attn\.q_norm"
    r"\.weight \(shape \[16\]\)",
  ):
    hf_weights.params_from_state_dict(cfg, extra)
  with pytest.raises(
    ValueError,
    match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has "
    r"shape \[128, 64\], expected \[96, 64\]",
  ):
    hf_weights.params_from_state_dict(cfg.replace(intermediate_size=96), state)
  untied_as_tied = cfg.replace(tie_word_embeddings=True)
  with pytest.raises(ValueError, match="lm_head.weight differs"):
    hf_weights.params_from_state_dict(untied_as_tied, state)


def test_tied_checkpoint_with_equal_lm_head_is_accepted(tmp_path):
  cfg, state = _tiny_state(tie_word_embeddings=True)
  assert "lm_head.weight" in state  # transformers' state_dict lists the tied copy
  params = hf_weights.params_from_state_dict(cfg, state)
  assert "lm_head" not in params
  # Old checkpoints carry rotary inv_freq buffers: ignored.
  state["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  hf_weights.params_from_state_dict(cfg, state)


def test_file_errors_name_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    hf_weights.load_params(Qwen2Config.tiny(), tmp_path)
  _, path = hf_utils.make_hf_model(tmp_path / "m", seed=6)
  with pytest.raises(
    ValueError,
    match=r"(?s)m does not match the config.*embed_tokens\.weight has "
    r"shape \[256, 64\], expected \[300, 64\]",
  ):
    hf_weights.load_params(Qwen2Config.from_hf(path, vocab_size=300), path)
  with pytest.raises(ValueError, match="max_shard_size='lots'"):
    hf_weights.save_pretrained(Qwen2Config.tiny(), {}, tmp_path / "x", max_shard_size="lots")


_SHARDED_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, sys.argv[2])
    import jax, numpy as np
    from jax.sharding import NamedSharding
    from models import hf_weights, qwen2
    from models.config import Qwen2Config
    assert jax.device_count() == 8
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    path = sys.argv[1]
    cfg = Qwen2Config.from_hf(path)
    rules = [("embed", "fsdp"), ("mlp", "tp"), ("q_heads", "tp"), ("kv_heads", "tp"),
             ("vocab", "tp"), ("layers", None)]
    specs = qwen2.param_specs(cfg, rules, mesh)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    reads = []
    orig = hf_weights._read_view
    def spy(src, m, cfg_, idx):
      out = orig(src, m, cfg_, idx)
      reads.append((m.hf_name, out.size))
      return out
    hf_weights._read_view = spy
    params = hf_weights.load_params(cfg, path, shardings)
    hf_weights._read_view = orig
    ref = hf_weights.load_params(cfg, path)
    for (p, a), b, s in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref),
                            jax.tree.leaves(shardings)):
      assert a.sharding == s, (p, a.sharding, s)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
    gate = params["layers"]["gate_kernel"]
    assert gate.addressable_shards[0].data.shape == (cfg.num_layers, 32, 32), gate.sharding
    # Each device read only its slice: an up_proj read is 1/8 of the [F, D] tensor.
    up = [n for name, n in reads if name.endswith("up_proj.weight")]
    assert max(up) == cfg.intermediate_size * cfg.hidden_size // 8, up
    # Replicated shards are read once per array, not once per device.
    norms = [n for name, n in reads if name == "model.norm.weight"]
    assert len(norms) == 1, norms
    print("OK")
""")


def test_load_into_shardings_on_8_fake_devices(tmp_path):
  _, path = hf_utils.make_hf_model(tmp_path, seed=7, tie_word_embeddings=False)
  script = tmp_path / "sharded.py"
  script.write_text(_SHARDED_SCRIPT)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, str(script), str(path), REPO],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
