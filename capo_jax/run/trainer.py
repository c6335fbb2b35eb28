"""A run as a record and a step: ``setup(spec, workdir) -> (Run, state)``, ``rl_step``.

``setup`` reads the spec once: it builds the programs, loads the tokenizer,
data and weights, restores the newest checkpoint and opens the logs. What
it returns is all a step and the hooks (``capo_jax.run.hooks``) need.
``rl_step`` collects one rollout (``rollout.collect``) and runs the PPO
updates over it, and times each phase (``time/<phase>_s``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from capo_jax.data import datasets as data
from capo_jax.data import reward_fns
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.rl import rollout
from capo_jax.rl import train_step as ts
from capo_jax.run import programs as programs_lib
from capo_jax.run import setup as setup_lib
from capo_jax.run import train_eval
from capo_jax.run.spec import ConfigError, RunSpec
from capo_jax.runtime import checkpoint as ckpt_lib
from capo_jax.runtime import fs, metrics, run_record
from capo_jax.runtime import lease as lease_lib
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.runtime.distributed import is_main_process
from models.config import Qwen2Config

log = logging.getLogger(__name__)

EvalFn = Callable[[int, Any], dict[str, float]]

# The rollout's own phase times, renamed into the ``time/`` family of the row; the rest
# of ``collect`` (drawing prompts, the sampler's weights, sampling) is ``time/rollout_s``.
_ROLLOUT_PHASES = {"time_reward": "time/grading_s", "time_logprobs": "time/logprobs_s"}
_ROLLOUT_SAMPLE_TIME = "time_sample"  # sampling alone: inside time/rollout_s


@dataclasses.dataclass(frozen=True)
class Given:
  """What a caller hands in instead of what the config would load (the demo, tests).

  Attributes:
    policy: the initial policy (``setup.Policy``), else ``model.hf_path``.
    tokenizer: else ``tokenizer_path`` / ``model.hf_path``.
    train_examples: the training questions, else the split of ``data.train``.
    eval_fn: ``eval_fn(step, params) -> metrics``, else ``train_eval``'s.
    grader: grades every rollout and evaluation, else ``config.checker``'s.
  """

  policy: setup_lib.Policy | None = None
  tokenizer: Tokenizer | None = None
  train_examples: Sequence[data.Example] | None = None
  eval_fn: EvalFn | None = None
  grader: Any = None


@dataclasses.dataclass(frozen=True)
class Run:
  """What a run holds from its setup to its end, the train state aside.

  Attributes:
    spec: the run's config, for the hooks' schedules and the exports' model card.
    workdir: local or ``gs://``.
    model_cfg: the policy's architecture.
    tokenizer: renders prompts and decodes completions.
    programs: the jitted train step, log-prob pass and layouts (``programs.build``).
    weights: the frozen weights and their casts (``setup.PolicyWeights``).
    rollout: what ``rollout.collect`` calls: the sampler and grader, the upload, the
      log-prob pass (``programs.rollout_context``).
    iterator: the prompt stream (its state goes into each checkpoint).
    checkpointer: saves and restores ``<workdir>/checkpoints``.
    writer: metrics and samples (process 0 writes).
    eval_fn: the evaluation during training, or None.
    rng: the run's key; step ``n`` folds ``n`` in.
    start: the steps already done (the restored checkpoint's step, else 0).
    lease: the workdir's lease (process 0), else None.
  """

  spec: RunSpec
  workdir: str
  model_cfg: Qwen2Config
  tokenizer: Tokenizer
  programs: programs_lib.StepPrograms
  weights: setup_lib.PolicyWeights
  rollout: rollout.RolloutContext
  iterator: data.PromptIterator
  checkpointer: ckpt_lib.Checkpointer
  writer: metrics.MetricsWriter
  eval_fn: EvalFn | None
  rng: jax.Array
  start: int
  lease: lease_lib.Lease | None

  @property
  def num_steps(self) -> int:
    return self.spec.train.num_steps


@dataclasses.dataclass(frozen=True)
class StepOut:
  """What ``rl_step`` hands the hooks: the rollout, the metrics row, the updates skipped."""

  rollout: rollout.Rollout
  row: dict[str, float]
  skipped: int
  updates: int


def setup(
  spec: RunSpec, workdir: str, given: Given = Given(), lease: lease_lib.Lease | None = None
) -> tuple[Run, ts.TrainState]:
  """The run ``spec`` in ``workdir`` ready for its next step, and its train state.

  Config changes are checked before anything slow is loaded; ``config.json`` is
  written once the checkpoint restored (a failed resume leaves the previous one).
  """
  model_cfg = given.policy.cfg if given.policy is not None else spec.model_config()
  mesh = spec.make_mesh()
  progs = programs_lib.build(spec, model_cfg, mesh)
  tokenizer = given.tokenizer or setup_lib.tokenizer_for(spec)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ConfigError(
      f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
      f"{model_cfg.vocab_size} (config.model / config.tokenizer_path)"
    )
  fs.makedirs(workdir)
  checkpointer = ckpt_lib.Checkpointer(
    workdir, every_steps=spec.checkpoint.every_steps, keep=spec.checkpoint.keep
  )
  fs.check_writable(checkpointer.directory, "the checkpoint folder")  # not a save later
  record = run_record.record(
    spec.raw, workdir, resuming=checkpointer.latest_step() is not None, write=False
  )
  val_examples: list[data.Example] = []
  train_examples, source = given.train_examples, "the given training questions"
  if train_examples is None:
    split = setup_lib.training_data(spec.data, workdir)
    train_examples, val_examples, source = split.train, split.val, str(spec.data.train)
  train_examples = setup_lib.drop_long_prompts(
    train_examples, tokenizer, spec.rollout.max_prompt_len, source
  )
  iterator = data.PromptIterator(
    train_examples,
    spec.rollout.num_prompts,
    spec.seed,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  )
  # A caller's grader (tests, the demo's noisy one) grades everything.
  grader = given.grader or reward_fns.grader_for(
    spec.checker, spec.reward.timeout_s, spec.reward.worker_max_calls, spec.reward.worker_max_rss_mb
  )
  params0, w = setup_lib.policy_weights(
    spec, model_cfg, given.policy, progs.tcfg, mesh, mesh_lib.TRAIN_RULES
  )
  ctx = programs_lib.rollout_context(spec, progs, model_cfg, tokenizer, grader)
  eval_fn = given.eval_fn
  if eval_fn is None and spec.eval.every_steps > 0:
    eval_fn = train_eval.make_eval_fn(
      train_eval.EvalSetup(
        spec=spec.eval,
        model_cfg=model_cfg,
        tokenizer=tokenizer,
        layout=progs.sampling_layout,
        # data.eval benchmarks: their own checkers (evaluate_policy)
        grader=given.grader or {train_eval.VAL_BENCHMARK: grader},
      ),
      train_eval.eval_benchmarks(spec, val_examples),
      workdir,
      w.to_sampling,
    )

  rng = jax.random.key(spec.seed)
  abstract_state = jax.tree.map(
    lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
    jax.eval_shape(lambda p: ts.init_train_state(p, progs.tcfg), params0),
    progs.state_shardings,
  )
  try:
    restored = checkpointer.restore_latest(abstract_state)
  except ckpt_lib.TreeMismatch as e:
    raise _config_changed(e, record, workdir) from None
  if is_main_process():
    run_record.write_record(record, workdir)
  if restored is not None:
    start, state, meta = restored
    iterator.restore(meta["data"])
    rng = ckpt_lib.key_from_json(meta["rng"], rng)
    log.info("resuming at step %d from %s", start, checkpointer.directory)
  else:
    start = 0
    state = ts.train_state_from_params(params0, model_cfg, progs.tcfg, mesh, mesh_lib.TRAIN_RULES)
  writer = metrics.MetricsWriter(
    workdir, enabled=is_main_process(), resume_step=start, wandb=_wandb_config(spec)
  )
  return Run(
    spec,
    workdir,
    model_cfg,
    tokenizer,
    progs,
    w,
    ctx,
    iterator,
    checkpointer,
    writer,
    eval_fn,
    rng,
    start,
    lease,
  ), state


def rl_step(run: Run, state: ts.TrainState, step: int) -> tuple[ts.TrainState, StepOut]:
  """Step ``step`` (from 0): one rollout, then ``train.ppo_epochs`` passes of updates."""
  spec, w = run.spec, run.weights
  t0 = time.perf_counter()
  policy = rollout.PolicyArgs(
    sampling=w.to_sampling(state.params),
    train=w.base if w.lora else state.params,
    reference=w.reference,
    adapters=state.params if w.lora else None,
  )
  ro = rollout.collect(
    run.iterator.next_batch(),
    run.rollout,
    policy,
    step=step,
    rng=jax.random.fold_in(run.rng, step),
    draw_more=run.iterator.next_batch,
  )  # used only with dynamic sampling
  del policy  # the sampler's weights, before the updates need the memory
  t1 = time.perf_counter()
  updates = []
  batches = ro.minibatches()
  for _ in range(spec.train.ppo_epochs):
    for mb in batches:
      state, m = run.programs.train_step(state, mb, *w.frozen)
      updates.append(m)
  del batches
  t2 = time.perf_counter()
  # One host sync per step, once every update is dispatched: reading each
  # update's (or the rollout's) metrics back at once would stall the dispatch.
  updates, ro_metrics = jax.device_get((updates, ro.metrics))
  t3 = time.perf_counter()
  row = {
    k: v for k, v in ro_metrics.items() if k not in _ROLLOUT_PHASES and k != _ROLLOUT_SAMPLE_TIME
  }
  phases = {new: float(ro_metrics[old]) for old, new in _ROLLOUT_PHASES.items()}
  phases = {
    "time/rollout_s": t1 - t0 - sum(phases.values()),
    **phases,
    "time/update_dispatch_s": t2 - t1,
    "time/update_wait_s": t3 - t2,
  }
  skipped = int(sum(float(u["skipped"]) for u in updates))
  n_train_tokens = (
    int(ro.prompt_mask_BP.sum()) + int(ro.completion_mask_BC.sum())
  ) * spec.train.ppo_epochs
  row.update(
    _mean_metrics(updates),
    skipped_updates=skipped,
    **phases,
    train_tokens_per_s=n_train_tokens / max(t3 - t1, 1e-9),
  )
  return state, StepOut(ro, row, skipped, len(updates))


def _mean_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
  keys = rows[0].keys() if rows else ()
  return {k: float(np.mean([float(r[k]) for r in rows])) for k in keys}


def _config_changed(
  e: ckpt_lib.TreeMismatch, record: dict[str, Any], workdir: str
) -> run_record.ConfigChanged:
  """The config fields that changed since the checkpoint's run, as the reason for ``e``."""
  previous = record.get("previous") or {}
  diff = run_record.changed_fields(previous.get("config") or record["config"], record["config"])
  fields = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
  why = (
    f"the config changed since it was saved: {fields}"
    if fields
    else f"no config field changed ({run_record.CONFIG_FILE} of the checkpoint's run: git "
    f"commit {previous.get('git_commit') or record.get('git_commit')}); did the code?"
  )
  return run_record.ConfigChanged(
    f"{workdir}: {e}; {why}. Resume with the recorded values or use another --workdir."
  )


def _wandb_config(spec: RunSpec) -> metrics.WandbConfig | None:
  if not spec.log.wandb_project:
    return None
  return metrics.WandbConfig(
    project=spec.log.wandb_project,
    entity=spec.log.wandb_entity,
    name=spec.log.wandb_name,
    config=dict(spec.raw),
  )
