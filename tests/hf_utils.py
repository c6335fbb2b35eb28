"""Shared test helpers: tiny random transformers Qwen2 / Qwen3 models and an offline tokenizer.

Nothing here touches the network. Test modules import it as ``import hf_utils``
(pytest puts tests/ on sys.path: the folder is not a package).

    hf_model, path = make_hf_model(tmp_path, tie_word_embeddings=False)
    hf_model, path = make_hf_model(tmp_path, arch="qwen3", head_dim=32)  # Qwen3ForCausalLM
    cfg, params = models.hf_weights.load_pretrained(path)
    tok_path = make_tokenizer_dir(tmp_path / "tok")
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

# A tiny default: 4 query heads over 2 kv heads, bias on q/k/v.
TINY_HF_CONFIG: dict[str, Any] = dict(
  vocab_size=256,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  rope_theta=10000.0,
  rms_norm_eps=1e-6,
  tie_word_embeddings=True,
  max_position_embeddings=512,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
  "{% for message in messages %}"
  "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
  "Please reason step by step, and put your final answer within \\boxed{}.",
  "What is 1 + 2? The answer is \\boxed{3}.",
  "Let x be a real number such that 2x + 3 = 11. Then x = 4.",
  "The quick brown fox jumps over the lazy dog 0123456789 times.",
  "system user assistant question answer solve compute find the value of",
  "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
]


# model_type -> (transformers config class, model class).
HF_CLASSES = {
  "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
  "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_hf_config(arch: str = "qwen2", **overrides: Any) -> Any:
  """A ``transformers.Qwen2Config`` (or ``Qwen3Config``): TINY_HF_CONFIG updated with
  ``overrides``. (transformers' Qwen3 default head_dim is 128: pass it for tiny ones.)"""
  import transformers  # pylint: disable=g-import-not-at-top

  kw = dict(TINY_HF_CONFIG)
  kw.update(overrides)
  return getattr(transformers, HF_CLASSES[arch][0])(**kw)


def hf_model_class(hf_cfg: Any) -> Any:
  """``transformers.Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` for a config."""
  import transformers  # pylint: disable=g-import-not-at-top

  return getattr(transformers, HF_CLASSES[hf_cfg.model_type][1])


def randomize_(model: Any, seed: int = 0, std: float = 0.15) -> Any:
  """Overwrites every parameter in place with random values, so no weight is trivial.

  Kernels, biases and embeddings get normal(0, std); norm scales 1 + normal(0, 0.1).
  transformers' own init leaves biases at 0 and norms at 1, which would hide
  a wrong bias or norm mapping.
  """
  import torch  # pylint: disable=g-import-not-at-top

  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      value = 1.0 + 0.1 * noise if "norm" in name else std * noise
      p.copy_(value.to(p.dtype))
  return model


def make_hf_model(
  tmp_path: str | os.PathLike | None,
  seed: int = 0,
  std: float = 0.15,
  dtype: str = "float32",
  max_shard_size: str | int | None = None,
  arch: str = "qwen2",
  **config_overrides: Any,
) -> tuple[Any, pathlib.Path | None]:
  """A random tiny ``transformers.Qwen2ForCausalLM`` (eval mode, float32 in memory);
  ``arch="qwen3"``: a ``Qwen3ForCausalLM``.

  When ``tmp_path`` is given the model is saved there with ``save_pretrained``
  (in ``dtype``; sharded when ``max_shard_size`` is given) and that directory is
  returned, else ``None``. ``config_overrides`` update TINY_HF_CONFIG
  (``tie_word_embeddings``, ``rope_theta``, ``num_key_value_heads``, ...).
  """
  import torch  # pylint: disable=g-import-not-at-top

  hf_cfg = make_hf_config(arch, **config_overrides)
  model_class = hf_model_class(hf_cfg)
  torch.manual_seed(seed)
  model = model_class(hf_cfg).to(torch.float32)
  randomize_(model, seed, std)
  model.eval()
  if tmp_path is None:
    return model, None
  path = pathlib.Path(tmp_path)
  kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  if dtype == "float32":
    model.save_pretrained(path, **kw)
  else:
    # Save a converted copy so the returned model keeps its float32 weights.
    copy = model_class(hf_cfg)
    copy.load_state_dict(model.state_dict())
    copy.to(getattr(torch, dtype)).save_pretrained(path, **kw)
  return model, path


def hf_logits(model: Any, tokens_BT: np.ndarray, mask_BT: np.ndarray | None = None) -> np.ndarray:
  """Float32 logits [B, T, V] of a transformers causal LM (left-padded batches supported).

  Positions are passed explicitly (cumsum of the mask - 1) so that padded rows
  get the same RoPE positions as unpadded ones.
  """
  import torch  # pylint: disable=g-import-not-at-top

  tokens = torch.as_tensor(np.asarray(tokens_BT), dtype=torch.long)
  mask = (
    torch.ones_like(tokens)
    if mask_BT is None
    else torch.as_tensor(np.asarray(mask_BT), dtype=torch.long)
  )
  positions = (mask.cumsum(-1) - 1).clamp(min=0)
  with torch.no_grad():
    out = model(input_ids=tokens, attention_mask=mask, position_ids=positions)
  return out.logits.float().numpy()


def hf_num_params(hf_config_dict: dict[str, Any]) -> int:
  """Parameter count of the transformers model of a config (Qwen2 or Qwen3, by its
  ``model_type``), on the meta device."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  arch = hf_config_dict.get("model_type", "qwen2")
  hf_cfg = getattr(transformers, HF_CLASSES[arch][0])(**hf_config_dict)
  with torch.device("meta"):
    model = hf_model_class(hf_cfg)(hf_cfg)
  # parameters() de-duplicates the tied embedding / lm_head.
  return sum(p.numel() for p in model.parameters())


def left_padded_batch(
  rng: np.random.Generator, lengths: list[int], vocab_size: int, low: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Random tokens [B, max(lengths)] right-aligned, with mask 1 on real tokens.

  Padding slots hold random tokens too, so a leak through the mask shows.
  """
  T = max(lengths)
  tokens = rng.integers(low, vocab_size, size=(len(lengths), T)).astype(np.int32)
  mask = np.zeros((len(lengths), T), np.int32)
  for b, n in enumerate(lengths):
    mask[b, T - n :] = 1
  return tokens, mask


def make_tokenizer(vocab_size: int = 400, chat_template: bool = True) -> Any:
  """A small Qwen2-style byte-level BPE ``PreTrainedTokenizerFast``, trained offline.

  Special tokens ``<|endoftext|>`` (ids 0: eos and pad), ``<|im_start|>`` (1)
  and ``<|im_end|>`` (2), as in Qwen2.5 (where they are 151643-151645).
  """
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=SPECIAL_TOKENS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok,
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    additional_special_tokens=["<|im_start|>", "<|im_end|>"],
  )
  if chat_template:
    fast.chat_template = CHAT_TEMPLATE
  return fast


def make_tokenizer_dir(
  path: str | os.PathLike, chat_template: bool = True, vocab_size: int = 400
) -> pathlib.Path:
  """Saves ``make_tokenizer(...)`` with ``save_pretrained`` and returns the directory."""
  path = pathlib.Path(path)
  make_tokenizer(vocab_size, chat_template).save_pretrained(path)
  return path


def write_hub_snapshot(
  hub_cache: str | os.PathLike,
  repo_id: str,
  src: str | os.PathLike | None = None,
  files: dict[str, str] | None = None,
) -> pathlib.Path:
  """Lays out ``repo_id`` as huggingface_hub's cache does (``models--Org--Name/refs/main``
  and ``snapshots/<commit>/``), with the files of directory ``src`` and ``files``
  (name -> text); returns the snapshot directory. ``hub_cache`` is ``$HF_HOME/hub``."""
  import shutil  # pylint: disable=g-import-not-at-top

  commit = "0123456789abcdef0123456789abcdef01234567"
  store = pathlib.Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
  (store / "refs").mkdir(parents=True, exist_ok=True)
  (store / "refs" / "main").write_text(commit)
  snapshot = store / "snapshots" / commit
  if src is not None:
    shutil.copytree(src, snapshot, dirs_exist_ok=True)
  snapshot.mkdir(parents=True, exist_ok=True)
  for name, text in (files or {}).items():
    (snapshot / name).write_text(text)
  return snapshot


def offline_hub(monkeypatch: Any, hub_cache: str | os.PathLike) -> None:
  """This process reads the hub cache ``hub_cache`` only (HF_HUB_OFFLINE=1), as a process
  started with ``HF_HOME`` = its parent would (huggingface_hub reads HF_HOME at import)."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top

  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))


def stub_snapshot_of_preset(
  hub_cache: str | os.PathLike, repo_id: str, preset: str
) -> pathlib.Path:
  """A cached snapshot of ``repo_id`` whose config.json is ``preset``'s and whose weight and
  tokenizer files exist but are empty: enough for a run config to validate, not to load."""
  import json  # pylint: disable=g-import-not-at-top

  from models.config import PRESETS  # pylint: disable=g-import-not-at-top

  stubs = {n: "" for n in ("model.safetensors", "tokenizer.json", "tokenizer_config.json")}
  return write_hub_snapshot(
    hub_cache, repo_id, files={"config.json": json.dumps(PRESETS[preset]().to_hf()), **stubs}
  )
