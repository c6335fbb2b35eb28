"""Qwen3 dense against transformers' ``Qwen3ForCausalLM``: logits, cache, export, sampler, step.

References: tiny random ``Qwen3ForCausalLM`` models built from configs (no
download), with ``head_dim`` set apart from hidden_size / num_heads and every
weight (q / k norms included) randomised; transformers' greedy ``generate``;
torch autograd through transformers for the policy gradient; the model cards'
parameter totals.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_utils
from batches import HostBatch
from capo_jax.rl import train_state as state_lib
from capo_jax.rl import train_step as ts
from capo_jax.sampling import sampler as sampling
from capo_jax.sampling import strategies
from models import hf_layout, hf_weights, qwen2
from models.config import Qwen2Config
from models.kv_cache import init_cache

forward = jax.jit(qwen2.forward, static_argnums=1)
forward_with_cache = jax.jit(qwen2.forward_with_cache, static_argnums=1)

# head_dim is never hidden_size / num_heads here (64 / 4 = 16, 48 / 6 = 8, ...).
PARITY_CASES = {
  "tied_R2_h32": dict(tie_word_embeddings=True, head_dim=32),
  "untied_R4_h24": dict(
    tie_word_embeddings=False,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=24,
    rope_theta=1e6,
  ),
  "untied_R6_mqa_h16": dict(
    tie_word_embeddings=False,
    hidden_size=48,
    num_attention_heads=6,
    num_key_value_heads=1,
    head_dim=16,
    num_hidden_layers=3,
  ),
  "tied_R1_mha_h8": dict(
    tie_word_embeddings=True,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    rms_norm_eps=1e-5,
  ),
}


def _port(hf_model) -> tuple[Qwen2Config, dict]:
  cfg = Qwen2Config.from_hf(hf_model.config.to_dict())
  state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
  return cfg, hf_weights.params_from_state_dict(cfg, state)


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_logits_match_transformers_qwen3(case):
  hf_model, _ = hf_utils.make_hf_model(None, seed=len(case), arch="qwen3", **PARITY_CASES[case])
  assert type(hf_model).__name__ == "Qwen3ForCausalLM"
  cfg, params = _port(hf_model)
  assert cfg.model_type == "qwen3" and cfg.head_dim == PARITY_CASES[case]["head_dim"]
  layer = params["layers"]
  assert "q_bias" not in layer and layer["q_norm"].shape == (cfg.num_layers, cfg.head_dim)
  assert ("lm_head" in params) != cfg.tie_word_embeddings
  tokens, mask = hf_utils.left_padded_batch(np.random.default_rng(1), [11, 4, 8, 1], 256)
  ref = hf_utils.hf_logits(hf_model, tokens, mask)
  ours = np.asarray(forward(params, cfg, tokens, mask))
  real = mask.astype(bool)
  assert np.abs(ref[real]).std() > 0.3  # logits far from zero, so the check has teeth
  assert np.abs(ours - ref)[real].max() <= 1e-4
  # The q / k norms matter: unit scales change the logits far beyond the tolerance.
  unit = {
    **params,
    "layers": {
      **layer,
      "q_norm": jnp.ones_like(layer["q_norm"]),
      "k_norm": jnp.ones_like(layer["k_norm"]),
    },
  }
  assert np.abs(np.asarray(forward(unit, cfg, tokens, mask)) - ref)[real].max() > 1e-2


def test_qwen3_cached_decode_equals_full_forward():
  hf_model, _ = hf_utils.make_hf_model(
    None, seed=3, arch="qwen3", head_dim=32, tie_word_embeddings=False
  )
  cfg, params = _port(hf_model)
  rng = np.random.default_rng(2)
  tokens, mask = hf_utils.left_padded_batch(rng, [7, 3, 5], 256)
  tokens = np.concatenate([tokens, rng.integers(0, 256, (3, 3), dtype=np.int32)], axis=1)
  mask = np.concatenate([mask, np.ones((3, 3), np.int32)], axis=1)
  full = np.asarray(forward(params, cfg, tokens, mask))
  cache = init_cache(cfg, 3, 12)
  assert cache.k_LBSKH.shape[-1] == 32
  out = []
  for lo, hi in [(0, 7), (7, 8), (8, 9), (9, 10)]:
    logits, cache = forward_with_cache(params, cfg, tokens[:, lo:hi], mask[:, lo:hi], cache)
    out.append(np.asarray(logits))
  assert np.abs(np.concatenate(out, 1) - full)[mask.astype(bool)].max() <= 1e-5


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_load_export_transformers_round_trip(tmp_path, tied):
  import transformers  # pylint: disable=g-import-not-at-top

  hf_model, path = hf_utils.make_hf_model(
    tmp_path / "src", seed=1, arch="qwen3", head_dim=32, tie_word_embeddings=tied
  )
  cfg, params = hf_weights.load_pretrained(path)
  assert cfg == Qwen2Config.from_hf(hf_model.config.to_dict())
  assert set(hf_layout.expected_tensors(cfg)) == set(hf_model.state_dict()) - (
    {"lm_head.weight"} if tied else set()
  )
  tokens, mask = hf_utils.left_padded_batch(np.random.default_rng(0), [9, 5], 256)
  ref = hf_utils.hf_logits(hf_model, tokens, mask)
  real = mask.astype(bool)
  assert np.abs(np.asarray(forward(params, cfg, tokens, mask)) - ref)[real].max() <= 1e-4

  hf_weights.save_pretrained(cfg, params, tmp_path / "out")
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == "qwen3" and written["attention_bias"] is False
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(reloaded).__name__ == "Qwen3ForCausalLM"
  for name, value in hf_model.state_dict().items():
    np.testing.assert_array_equal(reloaded.state_dict()[name].numpy(), value.numpy(), err_msg=name)
  np.testing.assert_array_equal(hf_utils.hf_logits(reloaded, tokens, mask), ref)


def test_qwen3_presets_match_the_model_cards():
  # (total, non-embedding) parameters as the Qwen3 model cards round them.
  cards = {
    "qwen3_0p6b": (0.6, 0.44),
    "qwen3_1p7b": (1.7, 1.4),
    "qwen3_4b": (4.0, 3.6),
    "qwen3_8b": (8.2, 6.95),
    "qwen3_14b": (14.8, 13.2),
    "qwen3_32b": (32.8, 31.2),
  }
  for name, (total, non_embedding) in cards.items():
    cfg = getattr(Qwen2Config, name)()
    n = qwen2.num_params(qwen2.param_shapes(cfg))
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    digits = len(str(non_embedding).split(".")[1])
    assert round(n / 1e9, 1) == total, name
    assert round((n - embed) / 1e9, digits) == non_embedding, name
    assert cfg.head_dim == 128 and cfg.model_type == "qwen3" and not cfg.qkv_bias
  assert qwen2.num_params(qwen2.param_shapes(Qwen2Config.qwen3_0p6b())) == 596_049_920
  assert Qwen2Config.qwen3_0p6b().hidden_size // Qwen2Config.qwen3_0p6b().num_heads == 64


def test_from_hf_qwen3_fields_and_errors():
  base = dict(
    model_type="qwen3",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    rope_theta=1e6,
  )
  # transformers' Qwen3Config defaults head_dim to 128, not hidden / heads.
  assert Qwen2Config.from_hf(base).head_dim == 128
  assert Qwen2Config.from_hf({**base, "head_dim": 4}).head_dim == 4
  with pytest.raises(NotImplementedError, match="attention_bias"):
    Qwen2Config.from_hf({**base, "attention_bias": True})
  with pytest.raises(NotImplementedError, match="sliding"):
    Qwen2Config.from_hf({**base, "layer_types": ["sliding_attention"]})
  with pytest.raises(ValueError, match="model_type='llama'.*qwen2.*qwen3"):
    Qwen2Config.from_hf({**base, "model_type": "llama"})
  with pytest.raises(ValueError, match="model_type='qwen4'"):
    Qwen2Config.tiny(model_type="qwen4")


def test_greedy_sampler_matches_transformers_generate_qwen3(tmp_path):
  import torch  # pylint: disable=g-import-not-at-top

  hf_model, path = hf_utils.make_hf_model(tmp_path, seed=0, arch="qwen3", head_dim=32)
  cfg, params = hf_weights.load_pretrained(path)
  tokens, mask = hf_utils.left_padded_batch(np.random.default_rng(0), [5, 11, 8], 256, low=3)
  with torch.no_grad():
    ref = hf_model.generate(
      input_ids=torch.as_tensor(tokens, dtype=torch.long),
      attention_mask=torch.as_tensor(mask, dtype=torch.long),
      max_new_tokens=10,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )[:, tokens.shape[1] :].numpy()
  assert len(np.unique(ref)) > 3  # not one repeated token
  out = sampling.generate(
    params,
    cfg,
    tokens,
    mask,
    jax.random.key(0),
    sampling.SamplingSpec(num_samples=1, max_new_tokens=10, strategy=strategies.Greedy(), pad_id=0),
  )
  np.testing.assert_array_equal(np.asarray(out.tokens_BC), ref)


def test_qwen3_train_step_matches_torch_gradient():
  """One jitted ``train_step`` on a Qwen3 equals one step taken on torch's gradient.

  At theta = theta_old, grad L = -(1/R) sum_i A_i grad s_i (seq-mean-token-mean),
  s_i the mean completion log-prob; the reference is torch autograd through
  transformers' Qwen3. Adam's first update is -lr * g / (|g| + eps) exactly (no
  clipping, no decay), so with lr = eps = 1 the step moves each weight by a
  known function of its gradient.
  """
  import torch  # pylint: disable=g-import-not-at-top

  from capo_jax.rl.optim import OptimConfig  # pylint: disable=g-import-not-at-top

  hf_model, _ = hf_utils.make_hf_model(
    None, seed=7, arch="qwen3", head_dim=32, std=0.05, tie_word_embeddings=False
  )
  cfg, params = _port(hf_model)
  rng = np.random.default_rng(0)
  B, P, C = 4, 5, 4
  prompt, prompt_mask = hf_utils.left_padded_batch(rng, [5, 3, 4, 2], 256)
  completion = rng.integers(0, 256, (B, C)).astype(np.int32)
  completion_mask = (np.arange(C)[None] < np.array([4, 2, 3, 1])[:, None]).astype(np.int32)
  adv = rng.normal(size=(B,)).astype(np.float32)

  tokens = np.concatenate([prompt, completion], 1)
  mask = np.concatenate([prompt_mask, np.ones_like(completion)], 1)
  logits = hf_model(
    input_ids=torch.as_tensor(tokens, dtype=torch.long),
    attention_mask=torch.as_tensor(mask),
    position_ids=torch.as_tensor((mask.cumsum(-1) - 1).clip(0)),
  ).logits
  logp = torch.log_softmax(logits[:, P - 1 : -1].float(), -1).gather(
    -1, torch.as_tensor(completion, dtype=torch.long)[..., None]
  )[..., 0]
  m = torch.as_tensor(completion_mask, dtype=torch.float32)
  s_B = (logp * m).sum(1) / m.sum(1)
  (-(torch.as_tensor(adv) * s_B).sum() / B).backward()
  grads = {k: p.grad.numpy() for k, p in hf_model.named_parameters()}

  batch = HostBatch(
    prompt,
    prompt_mask,
    completion,
    completion_mask,
    jnp.asarray(logp.detach().numpy()),
    jnp.asarray(adv),
  ).train_batch(B)
  tcfg = state_lib.TrainConfig(
    optim=OptimConfig(learning_rate=1.0, eps=1.0, weight_decay=0.0, grad_clip=0.0)
  )
  step = jax.jit(ts.train_step, static_argnames=("model_cfg", "tcfg"))
  state, metrics = step(state_lib.init_train_state(params, tcfg), batch, model_cfg=cfg, tcfg=tcfg)
  assert int(metrics["skipped"]) == 0
  np.testing.assert_allclose(
    float(metrics["grad_norm"]),
    np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values())),
    rtol=1e-4,
  )
  delta = jax.tree.map(lambda a, b: a - b, state.params, params)
  ours = hf_weights.state_dict_from_params(cfg, delta)
  assert set(ours) == set(grads)
  for name, g in grads.items():
    want = -g / (np.abs(g) + 1.0)
    scale = np.abs(want).max()
    assert scale > 0, name  # q_norm / k_norm included: every weight gets a gradient
    np.testing.assert_allclose(ours[name] / scale, want / scale, atol=2e-4, err_msg=name)
