"""The sections of a ``RunSpec``: one small frozen dataclass per config section.

Field names are the config's (``configs/common.py`` documents each), so an error
can name ``config.<section>.<field>``; ``section`` builds one from its dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from capo_jax.rl import algorithms, losses
from capo_jax.runtime import mesh as mesh_lib


class ConfigError(ValueError):
  """A configuration field has a bad value."""


def fail(field: str, value: Any, why: str) -> None:
  raise ConfigError(f"config.{field}={value!r}: {why}")


@dataclasses.dataclass(frozen=True)
class Model:
  hf_path: str
  preset: str
  preset_overrides: Mapping[str, Any]
  param_dtype: str
  compute_dtype: str
  remat: bool
  remat_policy: str
  lora_rank: int
  lora_alpha: float
  lora_targets: str
  attention: str
  random_init: bool  # issue 31: random weights only when asked for
  shared_prompts: bool  # the passes and updates forward each prompt once a chunk
  shared_prompt_cols: int


@dataclasses.dataclass(frozen=True)
class Data:
  train: str
  data_dir: str
  skip_bad_rows: bool
  train_size: int
  val_size: int
  split_seed: int
  eval: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Rollout:
  num_prompts: int
  num_samples: int
  max_prompt_len: int
  max_new_tokens: int
  temperature: float
  top_p: float
  top_k: int
  old_logprobs: str
  prompts_per_call: int
  max_active_rows: int
  dynamic_sampling: bool
  dynamic_max_draws: int
  # Sampler / trainer mismatch correction and truncated rows (capo_jax/rl/mismatch.py).
  is_correction: str
  is_cap: float
  mis_two_sided: bool
  icepop_low: float
  icepop_high: float
  mask_truncated: bool


@dataclasses.dataclass(frozen=True)
class Algo:
  name: str
  tau: float
  norm: str
  score: str
  adaptive_tau: float
  mask: str
  mask_high: float
  mask_low: float
  mask_mode: str
  cde_kappa: float
  cde_alpha: float
  cde_omega: float
  std: str  # GRPO's group std: "unbiased" (ddof 1) or "population"


@dataclasses.dataclass(frozen=True)
class Loss:
  eps_low: float
  eps_high: float
  agg: str
  beta: float
  kl_estimator: str
  gspo_eps_low: float
  gspo_eps_high: float
  simko_alpha: float
  simko_k: int
  simko_lambda: float
  simko_quantile: float


@dataclasses.dataclass(frozen=True)
class Optim:
  lr: float
  warmup_steps: int
  schedule: str
  weight_decay: float
  b1: float
  b2: float
  grad_clip: float


@dataclasses.dataclass(frozen=True)
class Train:
  num_steps: int
  mini_batch_prompts: int
  ppo_epochs: int
  micro_batch_size: int
  logprob_chunk: int
  logprob_rows: int
  max_consecutive_skips: int
  pack: bool
  pack_len: int
  pack_rows: int
  logprob_pack_rows: int  # packed rows per log-prob call (0: pack_rows)


@dataclasses.dataclass(frozen=True)
class Mesh:
  data: int
  fsdp: int
  tensor: int
  # The sampler's tensor group (capo_jax.runtime.mesh.sampling_mesh); 0: auto.
  sampling_tensor: int
  # Gather the fsdp-split weights once per log-prob pass and per update (a compute-dtype
  # copy whole over fsdp), not layer by layer in every call and micro-batch.
  gather_once: bool
  # With gather_once and full fine-tuning: each chip sums its rows' float32 gradient over
  # an update's micro-batches and the update reduces the chips' sums once
  # (capo_jax.rl.local_grads), not an all-reduce per micro-batch.
  reduce_once: bool
  # With gather_once: the log-prob passes split their rows over every chip, tensor
  # included, on a whole copy (mesh.PASS_RULES); the updates keep the train mesh's split.
  logprob_data_parallel: bool

  def sizes(self) -> dict[str, int]:
    return {ax: getattr(self, ax) for ax in mesh_lib.MESH_AXES}


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  every_steps: int
  keep: int
  export_hf: bool
  export_hf_every: int


@dataclasses.dataclass(frozen=True)
class Log:
  every_steps: int
  samples_every_steps: int
  num_samples_logged: int
  wandb_project: str
  wandb_entity: str
  wandb_name: str
  profile_steps: tuple[int, ...]  # (first, last) step traced by jax.profiler, or ()


@dataclasses.dataclass(frozen=True)
class Eval:
  every_steps: int
  num_samples: int
  max_new_tokens: int
  temperature: float
  limit: int
  batch_size: int
  max_active_rows: int
  seed: int


@dataclasses.dataclass(frozen=True)
class Reward:
  """Rewards from the config (docs/rewards.md): what decides ``correct`` and the scalar reward.

  ``fns`` and ``overlong_buffer`` shape the scalar reward only: CAPO pairs on ``correct``,
  so they change no CAPO advantage (``RunSpec`` logs a line when a CAPO run sets them).
  """

  correct: str
  fns: tuple[str, ...]
  weights: tuple[float, ...]
  timeout_s: float
  overlong_buffer: int
  worker_max_calls: int
  worker_max_rss_mb: float


@dataclasses.dataclass(frozen=True)
class Prompt:
  """How a question becomes a prompt (``capo_jax.data.prompts.PromptFormat``)."""

  system: str
  template: str
  chat_template: str
  enable_thinking: str
  chat_template_kwargs: Mapping[str, Any]


SECTIONS = {
  "model": Model,
  "data": Data,
  "rollout": Rollout,
  "algo": Algo,
  "loss": Loss,
  "optim": Optim,
  "train": Train,
  "mesh": Mesh,
  "checkpoint": Checkpoint,
  "log": Log,
  "eval": Eval,
  "reward": Reward,
  "prompt": Prompt,
}
TOP_LEVEL = ("seed", "tokenizer_path", "compilation_cache_dir")


def section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
  """The ``cls`` of config section ``name``; an unknown or missing field is a ConfigError."""
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  if unknown:
    fail(
      f"{name}.{unknown[0]}",
      values[unknown[0]],
      f"unknown field; config.{name} has {sorted(fields)}",
    )
  missing = sorted(fields - set(values))
  if missing:
    fail(
      f"{name}.{missing[0]}",
      None,
      "missing (start run files from configs/common.get_base_config())",
    )
  if name == "data":
    values = {**values, "eval": tuple(values["eval"])}
  if name == "log":
    values = {**values, "profile_steps": tuple(values["profile_steps"])}
  if name == "reward":  # lists from JSON, or one name given as a plain string
    as_tuple = lambda v: ((v,) if v else ()) if isinstance(v, str) else tuple(v)  # noqa: E731
    values = {**values, "fns": as_tuple(values["fns"]), "weights": as_tuple(values["weights"])}
  return cls(**values)


# The typed algorithms' fields from the config, whose names stay as they are (run files
# and recorded config.json files use them). A class not listed takes its defaults.
def estimator_fields(a: Algo) -> dict[type[algorithms.Estimator], dict[str, Any]]:
  return {
    algorithms.Grpo: dict(std=a.std),
    algorithms.Codapo: dict(std=a.std),
    algorithms.Capo: dict(tau=a.tau, norm=a.norm, score=a.score, adaptive_tau=a.adaptive_tau),
    algorithms.Cde: dict(kappa=a.cde_kappa, alpha=a.cde_alpha, omega=a.cde_omega, std=a.std),
  }


def loss_fields(l: Loss) -> dict[type[losses.PolicyLoss], dict[str, Any]]:
  return {
    losses.Gspo: dict(eps_low=l.gspo_eps_low, eps_high=l.gspo_eps_high),
    losses.Simko: dict(
      alpha=l.simko_alpha, k=l.simko_k, lam=l.simko_lambda, quantile=l.simko_quantile
    ),
  }


def build(cls: type, fields: Mapping[str, Any], section: str) -> Any:
  """``cls(**fields)``; a bad value is a ConfigError naming ``config.<section>``."""
  try:
    return cls(**fields)
  except ValueError as e:
    raise ConfigError(f"config.{section}: {e}") from e
