"""The checks of a ``RunSpec`` as a whole: the fields that bound each other, the plug-ins
and weights a run loads, the mesh against the devices.

``RunSpec.validate`` runs them, section by section (``RunSpec.from_config`` calls it);
each raises a ConfigError that names the field and the value. They read sections, never
the spec, which derives the rest (``mismatch_spec``, ``packing_shape``, ...) itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from capo_jax.data import reward_fns as reward_lib
from capo_jax.rl import advantages
from capo_jax.run.sections import (
  Algo,
  Checkpoint,
  Data,
  Eval,
  Log,
  Mesh,
  Model,
  Reward,
  Rollout,
  Train,
  fail,
)
from capo_jax.runtime import model_files
from models import hub
from models.config import PRESETS

log = logging.getLogger(__name__)
# Estimators whose advantage reads only the binary label, never the shaped reward.
PAIRS_ON_CORRECT = ("capo",)


def batch(r: Rollout, t: Train) -> None:
  """The rollout's and the train step's sizes, which must divide each other."""
  if r.num_samples < 2:
    fail("rollout.num_samples", r.num_samples, "G must be >= 2 (advantages compare samples)")
  if r.num_prompts < 1:
    fail("rollout.num_prompts", r.num_prompts, "must be >= 1")
  if t.mini_batch_prompts < 1 or r.num_prompts % t.mini_batch_prompts:
    fail(
      "train.mini_batch_prompts",
      t.mini_batch_prompts,
      f"must divide rollout.num_prompts={r.num_prompts}",
    )
  rows = t.mini_batch_prompts * r.num_samples
  if t.micro_batch_size < 1 or rows % t.micro_batch_size:
    fail(
      "train.micro_batch_size",
      t.micro_batch_size,
      f"must divide the mini-batch rows mini_batch_prompts * num_samples = {rows}",
    )
  B = r.num_prompts * r.num_samples
  if t.logprob_rows < 0 or (t.logprob_rows and B % t.logprob_rows):
    fail(
      "train.logprob_rows",
      t.logprob_rows,
      f"must be 0 (all rows at once) or divide num_prompts * num_samples = {B}",
    )
  if t.logprob_pack_rows < 0:
    fail("train.logprob_pack_rows", t.logprob_pack_rows, "must be 0 (pack_rows) or positive")
  if r.prompts_per_call < 0 or (r.prompts_per_call and r.num_prompts % r.prompts_per_call):
    fail(
      "rollout.prompts_per_call",
      r.prompts_per_call,
      f"must be 0 (all at once) or divide rollout.num_prompts={r.num_prompts}",
    )
  if r.max_active_rows < 0:
    fail(
      "rollout.max_active_rows",
      r.max_active_rows,
      "must be 0 (all rows at once) or the number of rows decoded at once",
    )
  if r.dynamic_sampling and r.dynamic_max_draws < 2:
    fail(
      "rollout.dynamic_max_draws",
      r.dynamic_max_draws,
      "must be >= 2 with rollout.dynamic_sampling (1 draw per step is no filter)",
    )
  for field in ("max_prompt_len", "max_new_tokens"):
    if getattr(r, field) < 1:
      fail(f"rollout.{field}", getattr(r, field), "must be >= 1")
  if t.num_steps < 0:
    fail("train.num_steps", t.num_steps, "must be >= 0")
  if r.old_logprobs not in ("trainer", "sampler"):
    fail("rollout.old_logprobs", r.old_logprobs, "expected 'trainer' or 'sampler'")


def outputs(data: Data, e: Eval, lg: Log, ckpt: Checkpoint) -> None:
  """The data splits, evaluation, logging and checkpoint counts."""
  for field in ("train_size", "val_size"):
    if getattr(data, field) < 0:
      fail(
        f"data.{field}",
        getattr(data, field),
        "must be >= 0 (0: all the rest / no validation)",
      )
  if e.every_steps < 0:
    fail("eval.every_steps", e.every_steps, "must be >= 0 (0: no evaluation)")
  for field in ("num_samples", "max_new_tokens", "batch_size"):
    if getattr(e, field) < 1:
      fail(f"eval.{field}", getattr(e, field), "must be >= 1")
  if e.limit < 0:
    fail("eval.limit", e.limit, "must be >= 0 (0: every question)")
  for field in ("every_steps", "samples_every_steps"):
    if getattr(lg, field) < 0:
      fail(f"log.{field}", getattr(lg, field), "must be >= 0")
  steps = lg.profile_steps
  if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
    fail(
      "log.profile_steps",
      steps,
      "expected () or (first, last) with 1 <= first <= last (steps as logged)",
    )
  if ckpt.export_hf_every < 0:
    fail("checkpoint.export_hf_every", ckpt.export_hf_every, "must be >= 0")


def algo(a: Algo) -> None:
  """The advantage and noise-mask fields of ``config.algo``."""
  if a.mask not in ("auto", "on", "off"):
    fail("algo.mask", a.mask, "expected 'auto', 'on' or 'off'")
  if a.tau <= 0:
    fail("algo.tau", a.tau, "must be > 0")
  if a.norm not in advantages.NORMS:
    fail("algo.norm", a.norm, f"expected one of {advantages.NORMS}")
  if a.score not in advantages.SCORES:
    fail("algo.score", a.score, f"expected one of {advantages.SCORES}")
  if a.mask_mode not in advantages.MASK_MODES:
    fail("algo.mask_mode", a.mask_mode, f"expected one of {advantages.MASK_MODES}")
  if a.std not in advantages.STDS:
    fail("algo.std", a.std, f"GRPO's group std: expected one of {advantages.STDS}")


def reward(w: Reward, checker: str, algo_name: str, max_new_tokens: int) -> None:
  """Plug-ins are imported here (in this process), so a typo fails at the start."""
  for field, names in (("reward.correct", (checker,)), ("reward.fns", w.fns)):
    for name in names:
      if name in reward_lib.CHECKERS or (field == "reward.fns" and name == reward_lib.CORRECT):
        continue
      try:
        reward_lib.load(reward_lib.target_of(name))
      except Exception as e:  # noqa: BLE001 -- any import failure is the config's
        fail(field, name, f"cannot load the plug-in: {type(e).__name__}: {e}")
  if w.weights and len(w.weights) != len(w.fns):
    fail("reward.weights", w.weights, f"needs one weight per reward.fns entry ({len(w.fns)})")
  if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in w.weights):
    fail("reward.weights", w.weights, "must be finite numbers")
  if not w.timeout_s > 0:
    fail("reward.timeout_s", w.timeout_s, "must be > 0")
  calls = w.worker_max_calls
  if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
    fail("reward.worker_max_calls", calls, "must be an integer >= 0 (0: no limit)")
  if not (isinstance(w.worker_max_rss_mb, (int, float)) and w.worker_max_rss_mb >= 0):
    fail("reward.worker_max_rss_mb", w.worker_max_rss_mb, "must be MiB >= 0 (0: no limit)")
  if not 0 <= w.overlong_buffer <= max_new_tokens:
    fail(
      "reward.overlong_buffer",
      w.overlong_buffer,
      f"must be 0 (off) or in [1, rollout.max_new_tokens={max_new_tokens}]",
    )
  if algo_name in PAIRS_ON_CORRECT and (w.fns or w.overlong_buffer):
    # A comparison with shaping on would treat CAPO and the baselines differently.
    log.warning(
      "config.reward.fns=%s / reward.overlong_buffer=%d shape the scalar reward, "
      "which algo.name=%r does not read (it pairs on `correct`, the checker's "
      "label): they are logged but change no advantage; the baselines use them "
      "(docs/rewards.md)",
      tuple(w.fns),
      w.overlong_buffer,
      algo_name,
    )


def model(m: Model, tokenizer_path: str, policy_given: bool) -> None:
  """A run loads weights from ``model.hf_path``, or asks for random ones with
  ``model.random_init``; no weights and no ask is an error naming ``model.hf_path``."""
  if not policy_given and not m.hf_path:
    if not m.random_init:
      fail(
        "model.hf_path",
        m.hf_path,
        "no weights to start from: set model.hf_path (a HF checkpoint directory, gs:// "
        "path or hub id such as Qwen/Qwen2.5-Math-1.5B), or model.random_init=True with "
        f"model.preset (one of {sorted(PRESETS)}) for random weights",
      )
    if m.preset not in PRESETS:
      fail(
        "model.preset",
        m.preset,
        f"model.random_init=True needs a preset, one of {sorted(PRESETS)}",
      )
  if m.hf_path and not policy_given:
    try:  # a hub id is fetched here (once, into the hub cache): its files are checked next
      hf_dir = hub.resolve(m.hf_path)
      # The tokenizer comes from the same directory unless tokenizer_path names another.
      model_files.check_model_dir(hf_dir, tokenizer=not tokenizer_path)
    except FileNotFoundError as e:
      fail("model.hf_path", m.hf_path, str(e))


def mesh(sizes: Mapping[str, int], n: int) -> int:
  """The mesh's axis sizes against ``n`` devices; returns the rows' shards, data x fsdp."""
  fixed = 1
  for ax, size in sizes.items():
    if size == 0 or size < -1:
      fail(f"mesh.{ax}", size, "must be a positive size or -1 (the remaining devices)")
    fixed *= max(size, 1)
  if fixed > n or (n % fixed):
    fail("mesh", sizes, f"the mesh needs a multiple of {fixed} devices; {n} are available")
  rest = n // fixed  # the -1 axis
  shards = (rest if sizes["data"] == -1 else sizes["data"]) * (
    rest if sizes["fsdp"] == -1 else sizes["fsdp"]
  )
  return shards


def row_shards(rows: int, shards: int) -> None:
  """Warns where ``rows`` per micro-batch do not divide over the ``shards`` of the mesh."""
  if rows % shards:
    # Not an error (it runs), but each chip then computes every row of a micro-batch.
    log.warning(
      "config.train: %d model rows per micro-batch / log-prob call are not "
      "divisible by data x fsdp = %d, so the rows are replicated over it and "
      "every chip computes all of them; set train.pack_rows (or "
      "train.micro_batch_size) to a multiple of %d, or move devices to "
      "mesh.tensor",
      rows,
      shards,
      shards,
    )


def reduce_once(m: Mesh, lora: bool) -> None:
  """``mesh.reduce_once`` keeps each chip's gradient of the once-gathered copy: there is
  none without ``mesh.gather_once``, and LoRA's adapters' gradients are small."""
  if m.reduce_once and (not m.gather_once or lora):
    fail(
      "mesh.reduce_once",
      True,
      "needs mesh.gather_once=True and full fine-tuning (with LoRA the adapters' "
      "gradients are small): set --config.mesh.reduce_once=False",
    )


def logprob_data_parallel(
  m: Mesh, lora: bool, rows_per_call: int, devices: int, packed: bool
) -> None:
  """``mesh.logprob_data_parallel`` runs the passes on the once-gathered copy made whole
  (``mesh.gather_once``; a LoRA run's passes use the base's split copy), each call's
  rows split over every chip: a multiple of them."""
  if not m.logprob_data_parallel:
    return
  if not m.gather_once or lora:
    fail(
      "mesh.logprob_data_parallel",
      True,
      "needs mesh.gather_once=True and full fine-tuning: set "
      "--config.mesh.logprob_data_parallel=False",
    )
  if rows_per_call % devices:
    field = "train.logprob_pack_rows" if packed else "train.logprob_rows"
    fail(
      field,
      rows_per_call,
      f"with mesh.logprob_data_parallel each log-prob call's rows split over all {devices} "
      f"chips: set --config.{field} to a multiple of {devices}",
    )
