"""What a run loads before its first step, and what it exports: the trainer's I/O.

Every path here may be local or ``gs://`` (``capo_jax.runtime.fs``): HF checkpoint
and tokenizer directories are copied to the local cache first, the training
file is read through the path layer, and the HF export is staged locally and
then moved (local) or uploaded (Cloud Storage) into place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from capo_jax.data import datasets as data
from capo_jax.data.tokenizer import Tokenizer, load_tokenizer
from capo_jax.rl import train_step as ts
from capo_jax.run import programs
from capo_jax.run.spec import ConfigError, Data, RunSpec
from capo_jax.runtime import fs, model_files
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.runtime.distributed import is_main_process
from models import hf_weights, lora, qwen2
from models.config import Qwen2Config
from models.sharding import to_host

log = logging.getLogger(__name__)

SPLIT_FILE = "data_split.json"


@dataclasses.dataclass
class Policy:
  """An initial policy handed in by the caller (e.g. the demo's warm start)."""

  cfg: Qwen2Config
  params: Any


def tokenizer_for(spec: RunSpec) -> Tokenizer:
  """The run's tokenizer (``tokenizer_path``, else ``model.hf_path``), rendering prompts
  as ``config.prompt`` says."""
  field = "tokenizer_path" if spec.tokenizer_path else "model.hf_path"
  path = spec.tokenizer_path or spec.model.hf_path
  if not path:
    raise ConfigError(
      "config.tokenizer_path is empty and there is no model.hf_path to take the tokenizer from"
    )
  try:
    return load_tokenizer(path, prompt=spec.prompt_format())
  except FileNotFoundError as e:
    raise ConfigError(f"config.{field}={path!r}: {e}") from e
  except ValueError as e:  # a chat-template option the tokenizer cannot honour
    raise ConfigError(f"config.prompt / config.{field}={path!r}: {e}") from e


def initial_params(
  spec: RunSpec, model_cfg: Qwen2Config, policy: Policy | None, shardings: Any
) -> Any:
  """The run's starting params (also the frozen reference), in the train shardings."""
  if policy is not None:
    return jax.device_put(policy.params, shardings)
  if spec.model.hf_path:
    local = fs.model_dir(spec.model.hf_path)
    try:
      model_files.check_model_dir(local)
    except FileNotFoundError as e:
      raise ConfigError(f"config.model.hf_path={spec.model.hf_path!r}: {e}") from e
    _, params = hf_weights.load_pretrained(local, dtype=model_cfg.weight_dtype, shardings=shardings)
    return params
  if not spec.model.random_init:  # never a random policy that nobody asked for
    raise ConfigError(
      "config.model.hf_path='': no weights to start from; set model.hf_path, "
      "or model.random_init=True for random weights of model.preset"
    )
  init = lambda key: qwen2.init_params(model_cfg, key)
  return jax.jit(init, out_shardings=shardings)(jax.random.key(spec.seed))


@dataclasses.dataclass(frozen=True)
class PolicyWeights:
  """What a run keeps of the policy besides its train state, and how it reads it.

  Attributes:
    base: LoRA's frozen base (the param dtype, train shardings); None without LoRA.
    reference: the frozen reference policy: LoRA's base itself (no second copy),
      else a compute-dtype copy of the initial params when the noise mask or
      the KL term needs it, else None.
    to_sampling: trainable params -> the sampler's weights (compute dtype,
      sampling shardings); LoRA merges the adapters into them, once per step.
    full: trainable params -> every param of the policy (LoRA: merged, float32),
      for the HF exports.
    lora: the LoRA config, or None.
  """

  base: Any
  reference: Any
  to_sampling: Callable[[Any], Any]
  full: Callable[[Any], Any]
  lora: lora.LoraConfig | None

  @property
  def frozen(self) -> tuple[Any, ...]:
    """The train step's arguments after the batch: (base,) with LoRA."""
    return () if self.base is None else (self.base,)

  def checkpoint_record(self, hf_path: str) -> dict[str, Any]:
    """What a checkpoint of adapters needs besides them: the LoRA config and the base."""
    if self.lora is None:
      return {}
    return {"lora": {**self.lora.to_json(), "base": hf_path or None}}


def policy_weights(
  spec: RunSpec,
  model_cfg: Qwen2Config,
  policy: Policy | None,
  tcfg: ts.TrainConfig,
  mesh: jax.sharding.Mesh,
  rules: Any,
) -> tuple[Any, PolicyWeights]:
  """The run's initial policy (``initial_params``) split into what trains and what is frozen.

  Returns the initial trainable params (every param, or fresh LoRA adapters: the
  train state's start, which the caller drops once the state exists) and the rest.
  """
  p_sh = mesh_lib.param_shardings(model_cfg, mesh, rules)
  # The sampler's mesh holds the same devices in the same order: one program reshards.
  sampling_sh = qwen2.param_shardings(model_cfg, programs.sampling_layout(spec, model_cfg, mesh))
  cast = lambda p, dt: jax.tree.map(lambda x: x.astype(dt), p)  # noqa: E731
  params0 = initial_params(spec, model_cfg, policy, p_sh)
  lcfg = tcfg.lora
  if lcfg is None:
    # The reference is frozen at the initial params, kept in the compute dtype.
    ref = (
      jax.jit(lambda p: cast(p, model_cfg.dtype), out_shardings=p_sh)(params0)
      if spec.needs_reference
      else None
    )
    return params0, PolicyWeights(
      None,
      ref,
      jax.jit(lambda p: cast(p, model_cfg.dtype), out_shardings=sampling_sh),
      lambda p: p,
      None,
    )
  shapes = qwen2.param_shapes(model_cfg)
  adapters0 = jax.jit(
    lambda key: lora.init_adapters(shapes, lcfg, key),
    out_shardings=ts.trainable_shardings(model_cfg, tcfg, mesh, rules),
  )(jax.random.fold_in(jax.random.key(spec.seed), 1))
  merge_sampling = jax.jit(
    lambda a, b: lora.merge(b, a, lcfg, model_cfg.dtype), out_shardings=sampling_sh
  )
  merge_full = jax.jit(lambda a, b: lora.merge(b, a, lcfg, jnp.float32), out_shardings=p_sh)
  return adapters0, PolicyWeights(
    params0, params0, lambda a: merge_sampling(a, params0), lambda a: merge_full(a, params0), lcfg
  )


def drop_long_prompts(
  examples: Sequence[data.Example], tokenizer: Tokenizer, max_len: int, source: str
) -> list[data.Example]:
  """Drops questions whose rendered prompt exceeds ``max_len`` tokens (logged, as verl does)."""
  if not examples:
    raise data.DataError(f"{source}: no training questions (the file is empty)")
  kept = [
    e for e in examples if len(tokenizer.encode(tokenizer.render_prompt(e.problem))) <= max_len
  ]
  if len(kept) < len(examples):
    log.warning(
      "dropped %d of %d training questions longer than rollout.max_prompt_len=%d",
      len(examples) - len(kept),
      len(examples),
      max_len,
    )
  if not kept:
    raise ConfigError(
      f"config.rollout.max_prompt_len={max_len}: every training prompt of {source} is longer"
    )
  return kept


def training_data(d: Data, workdir: str) -> data.Split:
  """The fixed-seed train / validation split of ``data.train``; ids go to the workdir.

  ``data_split.json`` records both id lists. A resumed run recomputes the
  split and stops if it differs (the data file changed under the run).
  """
  ds = data.load_examples(d.train, data_dir=d.data_dir or None, skip_bad=d.skip_bad_rows)
  if not ds.examples:
    raise data.DataError(
      f"{ds.source}: no training questions (the file is empty"
      + (f"; {ds.num_skipped} bad rows skipped" if ds.num_skipped else "")
      + ")"
    )
  split = data.split_train_val(ds.examples, d.train_size, d.val_size, d.split_seed, ds.source)
  record = {
    "source": ds.source,
    "split_seed": d.split_seed,
    "train_size": len(split.train),
    "val_size": len(split.val),
    **split.ids(),
  }
  path = fs.join(workdir, SPLIT_FILE)
  if fs.exists(path):
    old = json.loads(fs.read_text(path))
    if old.get("train_ids") != record["train_ids"] or old.get("val_ids") != record["val_ids"]:
      raise data.DataError(
        f"{path}: the run's recorded train / validation split differs "
        f"from the split of {ds.source} now; did the file change? Use "
        "another --workdir for a new run."
      )
  elif is_main_process():
    fs.write_text(path, json.dumps(record) + "\n")
  log.info(
    "data: %d training and %d validation questions from %s (split seed %d)",
    len(split.train),
    len(split.val),
    ds.source,
    d.split_seed,
  )
  return split


def export_policy(
  model_cfg: Qwen2Config,
  params: Any,
  path: str,
  tokenizer: Tokenizer | None = None,
  files: Callable[[], Mapping[str, str]] | None = None,
) -> None:
  """Writes the policy (and a HF tokenizer) as a HF directory, local or ``gs://``.

  ``files()``: more text files by name (the model card, ``run.model_card``), called on
  process 0 only. Process 0 writes; every process must call (the params are gathered).
  ``config.json`` is written last, so a reader that finds it finds the weights.
  """
  host_params = jax.tree.map(to_host, params)
  if is_main_process():
    with fs.staged_dir(path, last=("config.json",)) as local:
      hf_weights.save_pretrained(model_cfg, host_params, local)
      if tokenizer is not None and hasattr(tokenizer, "hf"):
        tokenizer.hf.save_pretrained(local)
      for name, text in (files() if files else {}).items():
        with open(os.path.join(local, name), "w", encoding="utf-8") as f:
          f.write(text)
    log.info("exported the policy as a HF checkpoint to %s", path)
