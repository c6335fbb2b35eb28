"""Warm start of the CPU demo: supervised fine-tuning of a tiny Qwen2 to a base policy.

RL needs a policy that is right on some of its samples: ``get_or_train``
teaches a small random Qwen2-architecture model the task's written solutions
(teacher forcing, loss on completion tokens only) and stops once its sampled
accuracy on validation questions enters a target band, so GRPO and CAPO start
from a policy with room to improve. The result is cached under
``<workdir>/warm_start/<key>/`` (a HF safetensors directory plus
``warm_start.json``), keyed by a hash of every setting, and written to a
temporary directory that is renamed when complete: a second call loads it.
Its validation accuracy is ``capo_jax.demo.policy_eval``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from capo_jax.demo import policy_eval, tasks
from capo_jax.demo.char_tokenizer import CharTokenizer
from capo_jax.demo.task import Example, TaskConfig
from capo_jax.eval import evaluate
from capo_jax.rl.optim import OptimConfig, make_optimizer
from models import hf_weights, qwen2
from models.config import Qwen2Config
from models.qwen2 import Params

log = logging.getLogger(__name__)

_INFO_FILE = "warm_start.json"


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Supervised warm start.

  Every ``eval_every`` steps the policy's validation accuracy is measured:
  mean@``eval_samples`` at temperature 1 (like the final metric) on the first
  ``eval_questions`` questions of the training split, which SFT leaves out
  (the held-out split stays untouched for the final report). With
  ``early_stop``, training ends at the first evaluation with accuracy >=
  ``target_low``; above ``target_high`` it logs that it overshot (evaluate
  more often). Otherwise it runs ``max_steps``.
  """

  max_steps: int = 1500
  batch_size: int = 64
  lr: float = 1e-3
  warmup_steps: int = 50
  weight_decay: float = 0.01
  grad_clip: float = 1.0
  eval_every: int = 50
  eval_questions: int = 128
  eval_samples: int = 8
  early_stop: bool = True
  target_low: float = 0.40
  target_high: float = 0.55
  seed: int = 0

  def __post_init__(self) -> None:
    for name in ("max_steps", "batch_size", "eval_every", "eval_questions", "eval_samples"):
      if getattr(self, name) <= 0:
        raise ValueError(f"SFTConfig.{name} must be positive, got {getattr(self, name)}")
    if not 0 <= self.target_low <= self.target_high <= 1:
      raise ValueError(
        f"SFTConfig: need 0 <= target_low <= target_high <= 1, got "
        f"{self.target_low}, {self.target_high}"
      )


class WarmStart(NamedTuple):
  cfg: Qwen2Config
  params: Params
  tokenizer: CharTokenizer
  info: dict[str, Any]  # settings, SFT history, wall time; ``trained``: False when loaded


def default_model_config(tokenizer: CharTokenizer, **overrides: Any) -> Qwen2Config:
  """The demo's model: 4 layers, hidden 128, 4 heads (2 kv), MLP 512, float32 (~0.8M params).

  ``overrides`` (``config.demo.model``) may switch on the faster CPU forms,
  ``layer_unroll=4, trim_last_layer=True`` (``Qwen2Config``; docs/training.md, "CPU
  runs: small models"): about 1.3x less time an RL step, the same numbers up to float
  rounding, which a training run amplifies. They stay off by default so that the demo
  reproduces the recorded cued study's runs exactly.
  """
  kw: dict[str, Any] = dict(
    vocab_size=tokenizer.vocab_size,
    hidden_size=128,
    intermediate_size=512,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=256,
  )
  kw.update(overrides)
  return Qwen2Config.tiny(**kw)


# --- data --------------------------------------------------------------------


def encode_sft(
  tokenizer: CharTokenizer, examples: list[Example], seq_len: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Right-padded ``(tokens_BT, mask_BT, loss_mask_BT)`` of ``<bos> question solution <eos>``.

  ``loss_mask`` is 1 on the solution and ``<eos>``: the tokens the policy writes.
  """
  rows = []
  for ex in examples:
    prompt = tokenizer.encode_prompt(ex.problem)
    rows.append((prompt, tokenizer.encode(ex.meta["solution"]) + [tokenizer.eos_id]))
  longest = max(len(p) + len(c) for p, c in rows)
  T = longest if seq_len is None else seq_len
  if longest > T:
    raise ValueError(f"encode_sft: an example has {longest} tokens, more than seq_len={T}")
  tokens = np.full((len(rows), T), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(rows), T), np.int32)
  loss_mask = np.zeros((len(rows), T), np.int32)
  for b, (p, c) in enumerate(rows):
    tokens[b, : len(p) + len(c)] = p + c
    mask[b, : len(p) + len(c)] = 1
    loss_mask[b, len(p) : len(p) + len(c)] = 1
  return tokens, mask, loss_mask


def sft_loss(
  params: Params,
  cfg: Qwen2Config,
  tokens_BT: jax.Array,
  mask_BT: jax.Array,
  loss_mask_BT: jax.Array,
  slots: int = 0,
) -> jax.Array:
  """Mean next-token cross-entropy over the completion tokens of the batch.

  With ``cfg.trim_last_layer`` only the columns that predict a loss token are
  unembedded (``qwen2.hidden_states_at``), ``slots`` of them a row (0: every column;
  at least the most loss tokens a row has).
  """
  if not cfg.trim_last_layer:
    logits_BTV = qwen2.forward(params, cfg, tokens_BT[:, :-1], mask_BT[:, :-1])
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
    w_BT = loss_mask_BT[:, 1:].astype(jnp.float32)
    return jnp.sum(nll_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0)
  inputs_BT, seg_BT = tokens_BT[:, :-1], (mask_BT[:, :-1] > 0).astype(jnp.int32)
  B, T = inputs_BT.shape
  Z = slots or T
  # Column t predicts token t + 1: a row's k-th loss token goes to slot k (the rest drop).
  lm_BT = loss_mask_BT[:, 1:] > 0
  slot_BT = jnp.where(lm_BT, jnp.cumsum(lm_BT, axis=1) - 1, Z)
  rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  cols_BZ = (
    jnp.zeros((B, Z), jnp.int32)
    .at[rows_BT, slot_BT]
    .set(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), mode="drop")
  )
  w_BZ = (jnp.arange(Z)[None] < lm_BT.sum(1)[:, None]).astype(jnp.float32)
  positions_BT = qwen2.positions_from_mask(seg_BT)
  h_BZD = qwen2.hidden_states_at(params, cfg, inputs_BT, positions_BT, seg_BT, cols_BZ)
  logp_BZV = jax.nn.log_softmax(qwen2.logits_from_hidden(params, cfg, h_BZD), axis=-1)
  targets_BZ = jnp.take_along_axis(tokens_BT[:, 1:], cols_BZ, axis=1)
  nll_BZ = -jnp.take_along_axis(logp_BZV, targets_BZ[..., None], axis=-1)[..., 0]
  return jnp.sum(nll_BZ * w_BZ) / jnp.maximum(jnp.sum(w_BZ), 1.0)


def optim_config(sft: SFTConfig) -> OptimConfig:
  """The trainer's AdamW (``capo_jax.rl.optim``) with the warm start's settings."""
  return OptimConfig(
    learning_rate=sft.lr,
    warmup_steps=sft.warmup_steps,
    b1=0.9,
    b2=0.99,
    weight_decay=sft.weight_decay,
    grad_clip=sft.grad_clip,
  )


def make_sft_step(cfg: Qwen2Config, optimizer: optax.GradientTransformation, slots: int = 0):
  """A jitted ``(params, opt_state, tokens, mask, loss_mask) -> (params, opt_state, loss)``.

  Params and optimizer state are arguments (donated, updated in place); ``slots``: as
  ``sft_loss``'s.
  """

  def step(params, opt_state, tokens_BT, mask_BT, loss_mask_BT):
    loss, grads = jax.value_and_grad(sft_loss)(params, cfg, tokens_BT, mask_BT, loss_mask_BT, slots)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


# --- cache -------------------------------------------------------------------


# Part of the cache key: bump it when the code changes what a warm start trains to
# (2: Flax params init, the trainer's optimizer), so an older cached policy is not reused.
_RECIPE = 2


# How the model runs, not what it computes, but equal only up to float rounding: in the
# cache key only when switched on, so the keys of warm starts trained without them stay.
_EXECUTION_DEFAULTS = {"layer_unroll": 1, "trim_last_layer": False}


def _settings(task_cfg: tasks.AnyTask, model_cfg: Qwen2Config, sft_cfg: SFTConfig) -> dict:
  model = {
    k: v
    for k, v in dataclasses.asdict(model_cfg).items()
    if k not in _EXECUTION_DEFAULTS or v != _EXECUTION_DEFAULTS[k]
  }
  return {
    "recipe": _RECIPE,
    "task": dataclasses.asdict(task_cfg),
    "model": model,
    "sft": dataclasses.asdict(sft_cfg),
  }


def cache_dir(
  workdir: str, task_cfg: tasks.AnyTask, model_cfg: Qwen2Config, sft_cfg: SFTConfig
) -> str:
  """``<workdir>/warm_start/<hash of every setting>``: new settings train anew."""
  blob = json.dumps(_settings(task_cfg, model_cfg, sft_cfg), sort_keys=True)
  return os.path.join(workdir, "warm_start", hashlib.sha1(blob.encode()).hexdigest()[:12])


def cache_id(ws: WarmStart) -> str:
  """The warm start's settings hash (its cache folder's name): what caches derived from
  it are keyed on, so a study root copied or moved elsewhere keeps them valid."""
  return os.path.basename(os.path.normpath(ws.info["path"]))


def same_cache_key(cached: dict[str, Any], key: dict[str, Any]) -> bool:
  """Whether a cache written under ``cached`` serves ``key``; keys written before
  ``cache_id`` held the warm start's absolute path, of which the id is the last part."""
  old = cached.get("warm_start")
  if isinstance(old, str):
    cached = {**cached, "warm_start": os.path.basename(os.path.normpath(old))}
  return cached == key


def _load(path: str, model_cfg: Qwen2Config) -> tuple[Params, dict[str, Any]]:
  info_path = os.path.join(path, _INFO_FILE)
  try:
    with open(info_path, encoding="utf-8") as f:
      info = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{info_path}: invalid JSON at line {e.lineno}: {e.msg}") from e
  return hf_weights.load_params(model_cfg, path), info


def _save(path: str, model_cfg: Qwen2Config, params: Params, info: dict[str, Any]) -> None:
  """Writes to a sibling temp dir, then renames: a crash never leaves a partial cache."""
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".tmp-{os.path.basename(path)}-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  hf_weights.save_pretrained(model_cfg, params, tmp)
  with open(os.path.join(tmp, _INFO_FILE), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2, sort_keys=True)
  try:
    os.rename(tmp, path)
  except OSError:  # another process finished first: keep its copy
    shutil.rmtree(tmp, ignore_errors=True)
    if not os.path.isdir(path):
      raise


def get_or_train(
  workdir: str,
  task_cfg: tasks.AnyTask | None = None,
  model_cfg: Qwen2Config | None = None,
  sft_cfg: SFTConfig | None = None,
  *,
  progress: bool = True,
) -> WarmStart:
  """The warm-start policy: loaded from the cache, else trained and cached.

  ``model_cfg`` defaults to ``default_model_config``; its vocabulary must
  match the task's char tokenizer (``tasks.tokenizer``).
  """
  task_cfg = task_cfg or TaskConfig()
  sft_cfg = sft_cfg or SFTConfig()
  tokenizer = tasks.tokenizer(task_cfg)
  model_cfg = model_cfg or default_model_config(tokenizer)
  if model_cfg.vocab_size != tokenizer.vocab_size:
    raise ValueError(
      f"model_cfg.vocab_size={model_cfg.vocab_size} but the char tokenizer "
      f"has {tokenizer.vocab_size} tokens"
    )
  path = cache_dir(workdir, task_cfg, model_cfg, sft_cfg)
  if os.path.isdir(path):
    params, info = _load(path, model_cfg)
    return WarmStart(model_cfg, params, tokenizer, dict(info, trained=False, path=path))
  params, info = train_sft(task_cfg, model_cfg, sft_cfg, tokenizer, progress=progress)
  info["settings"] = _settings(task_cfg, model_cfg, sft_cfg)
  _save(path, model_cfg, params, info)
  return WarmStart(model_cfg, params, tokenizer, dict(info, trained=True, path=path))


def train_sft(
  task_cfg: tasks.AnyTask,
  model_cfg: Qwen2Config,
  sft_cfg: SFTConfig,
  tokenizer: CharTokenizer,
  *,
  progress: bool = True,
) -> tuple[Params, dict[str, Any]]:
  """Runs SFT from random init; returns params and a JSON-able history."""
  t0 = time.perf_counter()
  train = tasks.sft_examples(task_cfg)
  if len(train) <= sft_cfg.eval_questions:
    raise ValueError(
      f"TaskConfig.num_train={len(train)} must exceed "
      f"SFTConfig.eval_questions={sft_cfg.eval_questions}"
    )
  val, train = train[: sft_cfg.eval_questions], train[sft_cfg.eval_questions :]
  tokens, mask, loss_mask = encode_sft(tokenizer, train)
  max_new = policy_eval.completion_budget(tokenizer, train + val)
  rng = jax.random.key(sft_cfg.seed)
  params = qwen2.init_params(model_cfg, jax.random.fold_in(rng, 0))
  optimizer = make_optimizer(optim_config(sft_cfg))
  opt_state = optimizer.init(params)
  step_fn = make_sft_step(model_cfg, optimizer, slots=int(loss_mask.sum(1).max(initial=0)))
  order = np.random.default_rng(sft_cfg.seed)
  perm, cursor = order.permutation(len(train)), 0
  history: list[dict[str, float | None]] = []  # val_auc_mean None: no mixed group
  losses: list[jax.Array] = []  # read back only when logged, so dispatch stays async
  stopped = "max_steps"
  bar = tqdm(range(1, sft_cfg.max_steps + 1), desc="warm start (SFT)", disable=not progress)
  for step in bar:
    if cursor + sft_cfg.batch_size > len(perm):
      perm, cursor = order.permutation(len(train)), 0
    idx = perm[cursor : cursor + sft_cfg.batch_size]
    cursor += sft_cfg.batch_size
    params, opt_state, loss = step_fn(params, opt_state, tokens[idx], mask[idx], loss_mask[idx])
    losses.append(loss)
    if step % sft_cfg.eval_every == 0 or step == sft_cfg.max_steps:
      ev = policy_eval.evaluate_policy(
        evaluate.EvalPolicy(params, model_cfg, tokenizer),
        val,
        policy_eval.DemoSampling(num_samples=sft_cfg.eval_samples, max_new_tokens=max_new),
        jax.random.fold_in(rng, step),
      )
      history.append(
        dict(
          step=step,
          loss=float(np.mean(losses[-sft_cfg.eval_every :])),
          val_accuracy=ev["accuracy"],
          val_auc_mean=None if np.isnan(ev["auc_mean"]) else ev["auc_mean"],
          elapsed_s=time.perf_counter() - t0,
        )
      )
      bar.set_postfix(
        loss=f"{history[-1]['loss']:.3f}",
        val_acc=f"{ev['accuracy']:.3f}",
        elapsed=f"{history[-1]['elapsed_s']:.0f}s",
      )
      if sft_cfg.early_stop and ev["accuracy"] >= sft_cfg.target_low:
        stopped = "in_band" if ev["accuracy"] <= sft_cfg.target_high else "overshot"
        if stopped == "overshot":
          log.warning(
            "warm start overshot the target band: validation accuracy %.3f > %.3f "
            "at step %d (evaluate more often: SFTConfig.eval_every)",
            ev["accuracy"],
            sft_cfg.target_high,
            step,
          )
        break
    elif step % 10 == 0:
      bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
  bar.close()
  info = dict(
    steps=len(losses),
    stopped=stopped,
    wall_s=time.perf_counter() - t0,
    first_loss=float(losses[0]),
    final_loss=float(np.mean(losses[-10:])),
    history=history,
    num_params=qwen2.num_params(params),
    max_new_tokens=max_new,
  )
  return params, info
