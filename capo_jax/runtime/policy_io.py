"""Loading a policy to evaluate: a HF directory or hub id, or a trainer workdir (local or gs://).

``load_policy`` looks, in order, for ``path/config.json`` (a HF model
directory), ``path/export_hf/config.json`` (the trainer's final HF export) and
``path/checkpoints`` (the params of the newest Orbax checkpoint). HF
directories on Cloud Storage are copied to the local cache first
(``capo_jax.runtime.fs.local_copy``): safetensors and tokenizers read local files.
A path that is neither local nor a URL is taken for a Hugging Face hub id
("Qwen/Qwen2.5-Math-1.5B") and fetched into the hub cache (``models.hub``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from capo_jax.runtime import fs
from models import hub
from models.config import Qwen2Config
from models.qwen2 import Params

EXPORT_DIR, CHECKPOINT_DIR = "export_hf", "checkpoints"
# Key of the checkpoint's JSON record that holds the model's HF config.json dict.
_META_CONFIG_KEY = "hf_config"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
PROMPT_FILE = "prompt.json"  # capo_jax.data.prompts.PROMPT_FILE (runtime imports no data)


@dataclasses.dataclass(frozen=True)
class Policy:
  """A loaded policy: ``tokenizer_dir`` is None when none was found next to it."""

  cfg: Qwen2Config
  params: Params
  tokenizer_dir: str | None
  source: str
  # The prompt the policy was trained with (capo_jax.data.prompts: an export's prompt.json,
  # or the prompt section of its run's config.json); None when neither exists.
  prompt: dict[str, Any] | None = None


def _has_tokenizer(path: str | os.PathLike | None) -> bool:
  if not path:
    return False
  return any(fs.is_file(fs.join(path, f)) for f in _TOKENIZER_FILES)


def _is_hf_dir(path: str) -> bool:
  """config.json and safetensors weights (a trainer workdir has a config.json too)."""
  from models import hf_weights  # pylint: disable=import-outside-toplevel

  return fs.is_file(fs.join(path, "config.json")) and any(
    fs.is_file(fs.join(path, f)) for f in (hf_weights.SINGLE_FILE, hf_weights.INDEX_FILE)
  )


def _restore_params(
  workdir: str, dtype: Any, base_model: str | None
) -> tuple[Qwen2Config, Params, int]:
  """Config and params of the latest Orbax checkpoint of a trainer workdir."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  from capo_jax.runtime.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel

  ckpt = Checkpointer(workdir, every_steps=0)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise FileNotFoundError(f"{ckpt.directory}: no complete checkpoint")
    step_dir = fs.join(ckpt.directory, str(step))
  finally:
    ckpt.close()
  meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
    fs.join(step_dir, "meta"), args=ocp.args.JsonRestore()
  )
  # The HF config.json: a dict in the record, else the base model's directory.
  hf_cfg: dict[str, Any] | str | None = (
    meta.get(_META_CONFIG_KEY) if isinstance(meta.get(_META_CONFIG_KEY), dict) else None
  )
  if hf_cfg is None:
    if not (base_model and _is_hf_dir(base_model)):
      raise ValueError(
        f"{step_dir}: its record has no model config (key {_META_CONFIG_KEY!r}); "
        "pass --base_model=<HF dir of the model the run started from>"
      )
    hf_cfg = fs.local_copy(base_model)
  name = jnp.dtype(dtype).name
  cfg = Qwen2Config.from_hf(hf_cfg, param_dtype=name, compute_dtype=name)
  state_dir = fs.join(step_dir, "state")
  tree = ocp.StandardCheckpointer().metadata(state_dir).item_metadata.tree
  # The trainer's state keeps params under "params"; a bare params tree also works.
  in_state = "params" in tree
  shapes = tree["params"] if in_state else tree
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  lora_rec = meta.get("lora")
  if lora_rec:  # LoRA: the checkpoint holds float32 adapters; the base is a HF directory
    base_dir = base_model or lora_rec.get("base")
    if not (base_dir and _is_hf_dir(base_dir)):
      raise ValueError(
        f"{step_dir}: a LoRA checkpoint holds only the adapters and its run "
        f"had no HF base (model.hf_path={lora_rec.get('base')!r}); pass "
        "--base_model=<HF dir of the base model>"
      )
    cfg = dataclasses.replace(cfg, param_dtype="float32")
  abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, cfg.weight_dtype), shapes)
  restore = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(dtype=a.dtype, sharding=device), abstract)
  wrap = (lambda x: {"params": x}) if in_state else (lambda x: x)
  # partial_restore: read only the params, not the optimizer moments (3x the size).
  out = ocp.PyTreeCheckpointer().restore(
    state_dir,
    args=ocp.args.PyTreeRestore(
      item=wrap(abstract), restore_args=wrap(restore), partial_restore=True
    ),
  )
  params = out["params"] if in_state else out
  if lora_rec:
    from models import hf_weights, lora  # pylint: disable=import-outside-toplevel

    cfg, base = hf_weights.load_pretrained(fs.local_copy(base_dir), dtype=dtype)
    lcfg = lora.LoraConfig(
      int(lora_rec["rank"]), float(lora_rec["alpha"]), tuple(lora_rec["targets"])
    )
    params = jax.jit(lora.merge, static_argnums=2)(base, params, lcfg)
  return cfg, params, step


def _recorded_prompt(hf_dir: str | None, workdir: str) -> dict[str, Any] | None:
  """``hf_dir/prompt.json``, else the ``prompt`` of ``workdir/config.json`` (a trainer's)."""
  if hf_dir and fs.is_file(fs.join(hf_dir, PROMPT_FILE)):
    return json.loads(fs.read_text(fs.join(hf_dir, PROMPT_FILE)))
  record = fs.join(workdir, "config.json")
  if fs.is_file(record):
    config = json.loads(fs.read_text(record)).get("config")  # a HF config.json has none
    prompt = config.get("prompt") if isinstance(config, dict) else None
    return prompt if isinstance(prompt, dict) else None
  return None


def load_policy(
  path: str | os.PathLike, *, base_model: str | None = None, dtype: Any = jnp.bfloat16
) -> Policy:
  """Loads a policy from a HF directory or a trainer workdir, in that order of lookup.

  1. ``path/config.json`` and safetensors weights exist: a HF model directory.
  2. ``path/export_hf/config.json`` exists: the trainer's final HF export.
  3. ``path/checkpoints``: the params of the latest Orbax checkpoint (only the
     ``params`` of the saved state are read). The model config comes from the
     checkpoint's JSON record (``hf_config``: a HF
     config.json dict) or else from ``base_model``'s config.json. A LoRA
     checkpoint (adapters only) is merged into ``base_model``, or else into the
     run's recorded ``model.hf_path``.

  ``tokenizer_dir`` is the HF directory used when it holds tokenizer files,
  else ``base_model`` when it does. ``path`` and ``base_model`` may be hub ids
  (``models.hub.resolve``: fetched into the hub cache, or an error naming
  both the local path and the hub id).
  """
  given = os.fspath(path)
  path = hub.resolve(given)
  base_model = hub.resolve(base_model) if base_model else None
  export = fs.join(path, EXPORT_DIR)
  for hf_dir in (path, export):
    if _is_hf_dir(hf_dir):
      from models import hf_weights  # pylint: disable=import-outside-toplevel

      cfg, params = hf_weights.load_pretrained(fs.local_copy(hf_dir), dtype=dtype)
      tok = hf_dir if _has_tokenizer(hf_dir) else base_model if _has_tokenizer(base_model) else None
      return Policy(
        cfg, params, tok, given if hf_dir == path else hf_dir, _recorded_prompt(hf_dir, path)
      )
  if fs.exists(fs.join(path, CHECKPOINT_DIR)):
    cfg, params, step = _restore_params(path, dtype, base_model)
    tok = base_model if _has_tokenizer(base_model) else None
    return Policy(
      cfg, params, tok, f"{path} (checkpoint step {step})", _recorded_prompt(None, path)
    )
  raise FileNotFoundError(
    f"--policy {path}: neither a HF model directory (no config.json) nor "
    f"a trainer workdir (no {EXPORT_DIR}/config.json, no {CHECKPOINT_DIR}/)"
  )
