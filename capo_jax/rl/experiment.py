"""From an ml_collections run config to the objects a run needs.

Every check of the configuration happens here, at start, with a message that
names the field and the value; nothing fails an hour into a run because of a
typo in a config file.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import ml_collections

from capo_jax.rl import advantages
from capo_jax.rl import losses
from capo_jax.rl import rollout
from capo_jax.rl.optim import OptimConfig
from capo_jax.rl.train_step import TrainConfig
from capo_jax.runtime import fs
from capo_jax.runtime import mesh as mesh_lib
from models import hub, lora
from models.config import PRESETS, Qwen2Config

log = logging.getLogger(__name__)

ALGORITHMS = ("capo", "grpo", "dr_grpo", "gspo", "codapo", "cde", "simko")
# Which policy loss each algorithm trains with (advantages.py gives its advantage).
LOSS_KIND = {"capo": "ppo", "grpo": "ppo", "dr_grpo": "ppo", "codapo": "ppo", "cde": "ppo",
             "gspo": "gspo", "simko": "simko"}


# loss.agg="auto": each algorithm's published token aggregation. SimKO's paper
# aggregates with the token mean (DAPO's); the others with GRPO's per-sequence mean.
DEFAULT_AGG = {"simko": "token-mean"}


def loss_aggregation(c: ml_collections.ConfigDict) -> str:
  """``loss.agg``, with "auto" resolved for ``algo.name``."""
  return DEFAULT_AGG.get(c.algo.name, "seq-mean-token-mean") if c.loss.agg == "auto" \
      else c.loss.agg


class ConfigError(ValueError):
  """A configuration field has a bad value."""


def _fail(field: str, value: Any, why: str) -> None:
  raise ConfigError(f"config.{field}={value!r}: {why}")


def uses_noise_mask(c: ml_collections.ConfigDict) -> bool:
  """``algo.mask``: "auto" masks for CAPO only; "on" / "off" force it (ablations)."""
  mode = c.algo.mask
  if mode not in ("auto", "on", "off"):
    _fail("algo.mask", mode, "expected 'auto', 'on' or 'off'")
  return mode == "on" or (mode == "auto" and c.algo.name == "capo")


def needs_reference(c: ml_collections.ConfigDict) -> bool:
  """Reference log-probs are computed only when the KL term or the mask uses them."""
  return c.loss.beta > 0 or uses_noise_mask(c)


def validate(c: ml_collections.ConfigDict, *, num_devices: int | None = None,
             policy_given: bool = False) -> None:
  """Raises ConfigError naming the first bad field.

  ``policy_given``: the caller supplies the initial policy (the demo's warm
  start), so no model source is needed in the config.
  """
  if c.algo.name not in ALGORITHMS:
    _fail("algo.name", c.algo.name, f"unknown algorithm; expected one of {ALGORITHMS}")
  uses_noise_mask(c)
  r, t = c.rollout, c.train
  if r.num_samples < 2:
    _fail("rollout.num_samples", r.num_samples, "G must be >= 2 (advantages compare samples)")
  if r.num_prompts < 1:
    _fail("rollout.num_prompts", r.num_prompts, "must be >= 1")
  if t.mini_batch_prompts < 1 or r.num_prompts % t.mini_batch_prompts:
    _fail("train.mini_batch_prompts", t.mini_batch_prompts,
          f"must divide rollout.num_prompts={r.num_prompts}")
  rows = t.mini_batch_prompts * r.num_samples
  if t.micro_batch_size < 1 or rows % t.micro_batch_size:
    _fail("train.micro_batch_size", t.micro_batch_size,
          f"must divide the mini-batch rows mini_batch_prompts * num_samples = {rows}")
  B = r.num_prompts * r.num_samples
  if t.logprob_rows < 0 or (t.logprob_rows and B % t.logprob_rows):
    _fail("train.logprob_rows", t.logprob_rows,
          f"must be 0 (all rows at once) or divide num_prompts * num_samples = {B}")
  if r.prompts_per_call < 0 or (r.prompts_per_call and r.num_prompts % r.prompts_per_call):
    _fail("rollout.prompts_per_call", r.prompts_per_call,
          f"must be 0 (all at once) or divide rollout.num_prompts={r.num_prompts}")
  if r.max_active_rows < 0:
    _fail("rollout.max_active_rows", r.max_active_rows,
          "must be 0 (all rows at once) or the number of rows decoded at once")
  if r.dynamic_sampling and r.dynamic_max_draws < 2:
    _fail("rollout.dynamic_max_draws", r.dynamic_max_draws,
          "must be >= 2 with rollout.dynamic_sampling (1 draw per step is no filter)")
  for field in ("max_prompt_len", "max_new_tokens"):
    if r[field] < 1:
      _fail(f"rollout.{field}", r[field], "must be >= 1")
  if t.num_steps < 0:
    _fail("train.num_steps", t.num_steps, "must be >= 0")
  if r.old_logprobs not in ("trainer", "sampler"):
    _fail("rollout.old_logprobs", r.old_logprobs, "expected 'trainer' or 'sampler'")
  if c.algo.tau <= 0:
    _fail("algo.tau", c.algo.tau, "must be > 0")
  if c.algo.norm not in advantages.NORMS:
    _fail("algo.norm", c.algo.norm, f"expected one of {advantages.NORMS}")
  if c.algo.score not in advantages.SCORES:
    _fail("algo.score", c.algo.score, f"expected one of {advantages.SCORES}")
  if c.algo.mask_mode not in advantages.MASK_MODES:
    _fail("algo.mask_mode", c.algo.mask_mode, f"expected one of {advantages.MASK_MODES}")
  if not policy_given and not c.model.hf_path:
    if not c.model.preset:
      _fail("model.hf_path", c.model.hf_path,
            "set model.hf_path (a HF checkpoint directory or hub id) or model.preset (random "
            f"weights, one of {sorted(PRESETS)})")
    if c.model.preset not in PRESETS:
      _fail("model.preset", c.model.preset, f"expected one of {sorted(PRESETS)}")
  if c.model.hf_path:
    try:  # a hub id is fetched here (once, into the hub cache): its config is needed next
      hf_dir = hub.resolve(c.model.hf_path)
    except FileNotFoundError as e:
      _fail("model.hf_path", c.model.hf_path, str(e))
    if not fs.is_file(fs.join(hf_dir, "config.json")):
      _fail("model.hf_path", c.model.hf_path, "not a HF checkpoint directory (no config.json)")
  for field in ("train_size", "val_size"):
    if c.data[field] < 0:
      _fail(f"data.{field}", c.data[field], "must be >= 0 (0: all the rest / no validation)")
  e = c.eval
  if e.every_steps < 0:
    _fail("eval.every_steps", e.every_steps, "must be >= 0 (0: no evaluation)")
  for field in ("num_samples", "max_new_tokens", "batch_size"):
    if e[field] < 1:
      _fail(f"eval.{field}", e[field], "must be >= 1")
  if e.limit < 0:
    _fail("eval.limit", e.limit, "must be >= 0 (0: every question)")
  for field in ("every_steps", "samples_every_steps"):
    if c.log[field] < 0:
      _fail(f"log.{field}", c.log[field], "must be >= 0")
  if c.checkpoint.export_hf_every < 0:
    _fail("checkpoint.export_hf_every", c.checkpoint.export_hf_every, "must be >= 0")
  sizes = {ax: c.mesh[ax] for ax in mesh_lib.MESH_AXES}
  n = num_devices if num_devices is not None else jax.device_count()
  fixed = 1
  for ax, size in sizes.items():
    if size == 0 or size < -1:
      _fail(f"mesh.{ax}", size, "must be a positive size or -1 (the remaining devices)")
    fixed *= max(size, 1)
  if fixed > n or (n % fixed):
    _fail("mesh", dict(sizes), f"the mesh needs a multiple of {fixed} devices; "
          f"{n} are available")
  lora_config(c)
  train_config(c)  # dataclass checks (loss, optimizer) with field names


def train_config(c: ml_collections.ConfigDict) -> TrainConfig:
  """The jitted step's static configuration."""
  l, o = c.loss, c.optim
  try:
    loss_cfg = losses.LossConfig(
        eps_low=l.eps_low, eps_high=l.eps_high, agg=loss_aggregation(c), beta=l.beta,
        kl_estimator=l.kl_estimator, max_len=c.rollout.max_new_tokens,
        gspo_eps_low=l.gspo_eps_low, gspo_eps_high=l.gspo_eps_high,
        simko_alpha=l.simko_alpha, simko_k=l.simko_k, simko_lambda=l.simko_lambda,
        simko_quantile=l.simko_quantile)
    optim = OptimConfig(learning_rate=o.lr, warmup_steps=o.warmup_steps, schedule=o.schedule,
                        total_steps=num_updates(c), weight_decay=o.weight_decay, b1=o.b1,
                        b2=o.b2, grad_clip=o.grad_clip)
  except ValueError as e:
    raise ConfigError(f"config.loss / config.optim: {e}") from e
  rows = c.train.mini_batch_prompts * c.rollout.num_samples
  pack_len, pack_rows = packing_shape(c)
  return TrainConfig(loss_kind=LOSS_KIND[c.algo.name], loss=loss_cfg, optim=optim,
                     num_microbatches=rows // c.train.micro_batch_size,
                     logprob_chunk_size=c.train.logprob_chunk, lora=lora_config(c),
                     pack_len=pack_len, pack_rows=pack_rows)


def lora_config(c: ml_collections.ConfigDict) -> lora.LoraConfig | None:
  """``model.lora_rank`` > 0: adapters on a frozen base (``models.lora``); 0: full training."""
  m = c.model
  if m.lora_rank < 0:
    _fail("model.lora_rank", m.lora_rank, "must be >= 0 (0: no LoRA, train every param)")
  if m.lora_rank == 0:
    return None
  if m.lora_alpha <= 0:
    _fail("model.lora_alpha", m.lora_alpha, "must be > 0 (the delta is scaled by alpha / rank)")
  names = [t.strip() for t in str(m.lora_targets).split(",") if t.strip()]
  bad = [t for t in names if t not in lora.TARGETS]
  if bad or not names:
    _fail("model.lora_targets", m.lora_targets, f"unknown target(s) {bad}; expected a "
          f"comma-separated subset of {lora.ALL_TARGETS}")
  return lora.LoraConfig(int(m.lora_rank), float(m.lora_alpha), tuple(names))



def packing_shape(c: ml_collections.ConfigDict) -> tuple[int, int]:
  """(row length, rows per micro-batch) of packing; (0, 1) when ``train.pack`` is off."""
  t = c.train
  if not t.get("pack", False):
    return 0, 1
  if c.model.get("lora_rank", 0):
    _fail("train.pack", t.pack, f"the packed passes do not apply LoRA adapters yet "
          f"(model.lora_rank={c.model.lora_rank}); add --config.train.pack=false")
  if t.pack_len < 0 or t.pack_rows < 0:
    _fail("train.pack_len / pack_rows", (t.pack_len, t.pack_rows), "must be >= 0 (0: default)")
  longest = c.rollout.max_prompt_len + c.rollout.max_new_tokens
  if t.pack_len and t.pack_len < longest:
    _fail("train.pack_len", t.pack_len, f"a packed row must hold the longest sequence, "
          f"rollout.max_prompt_len + max_new_tokens = {longest}")
  return t.pack_len or longest, t.pack_rows or t.micro_batch_size


def advantage_spec(c: ml_collections.ConfigDict) -> rollout.AdvantageSpec:
  """The static configuration of ``rollout.score_rollout``."""
  a = c.algo
  return rollout.AdvantageSpec(
      algo=a.name, hparams=tuple(sorted(advantage_hparams(c).items())),
      noise_mask=uses_noise_mask(c), mask_high=a.mask_high, mask_low=a.mask_low,
      mask_mode=a.mask_mode, num_steps=c.train.num_steps)


def rollout_spec(c: ml_collections.ConfigDict) -> rollout.RolloutSpec:
  """What ``rollout.collect`` needs from the config: sampling, advantages, log-probs."""
  r = c.rollout
  return rollout.RolloutSpec(
      num_samples=r.num_samples, max_prompt_len=r.max_prompt_len,
      max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
      adv=advantage_spec(c), old_from_sampler=r.old_logprobs == "sampler",
      simko_k=c.loss.simko_k if c.algo.name == "simko" else 0,
      prompts_per_call=r.prompts_per_call, max_active_rows=r.max_active_rows,
      dynamic_max_draws=r.dynamic_max_draws if r.dynamic_sampling else 1)


def num_updates(c: ml_collections.ConfigDict) -> int:
  """Optimizer updates over the run (PPO mini-batches x epochs x RL steps)."""
  per_step = c.rollout.num_prompts // c.train.mini_batch_prompts * c.train.ppo_epochs
  return max(per_step * c.train.num_steps, 1)


def advantage_hparams(c: ml_collections.ConfigDict) -> dict[str, Any]:
  """The chosen estimator's hyper-parameters from ``config.algo``."""
  a = c.algo
  available = {"tau": a.tau, "norm": a.norm, "score": a.score, "adaptive_tau": a.adaptive_tau,
               "kappa": a.cde_kappa, "alpha": a.cde_alpha, "omega": a.cde_omega}
  return {k: available[k] for k in advantages.hparam_names(a.name) if k in available}


def model_config(c: ml_collections.ConfigDict) -> Qwen2Config:
  """The policy's architecture: from ``model.hf_path`` when set (it wins over
  ``model.preset``, which the run configs set for shape checks), else the preset."""
  m = c.model
  kw = dict(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat,
            attention=m.get("attention", "auto"))
  try:
    if m.hf_path:
      return Qwen2Config.from_hf(fs.local_copy(fs.join(hub.resolve(m.hf_path), "config.json")),
                                 **kw)
    overrides = dict(m.preset_overrides.to_dict()) if m.preset_overrides else {}
    return PRESETS[m.preset](**{**overrides, **kw})
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.model: {e}") from e


def make_mesh(c: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  return mesh_lib.make_mesh({ax: c.mesh[ax] for ax in mesh_lib.MESH_AXES})
