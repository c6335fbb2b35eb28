"""The RL training run: ``train(config, workdir)``.

Each step: draw Q prompts, sample G responses each, grade them, compute
old-policy (and, when the KL term or the noise mask needs them, reference)
log-probs, advantages, then PPO mini-batch updates (``rollout.collect``, then
``train.ppo_epochs`` passes over ``train.mini_batch_prompts``-question batches).

What the run writes to its workdir (local or ``gs://``):

  config.json        the resolved config, package version and git commit
  data_split.json    ids of the training and held-out validation questions
  metrics.jsonl, tb/ every ``log.every_steps`` steps (JSONL and TensorBoard)
  samples.jsonl      a few completions every ``log.samples_every_steps``
  checkpoints/<N>/   Orbax, every ``checkpoint.every_steps`` and at the end
  eval/step_<N>/     results.json of each ``eval.every_steps`` evaluation
  exports/step_<N>/  HF exports every ``checkpoint.export_hf_every`` steps
  export_hf/         the final HF export (each export has a model card, README.md)

  lease.json         who runs here now (``runtime.lease``): one run per workdir

A restart with the same workdir resumes from the newest readable checkpoint
and drops the metrics rows logged past it. SIGTERM (a TPU preemption notice)
makes every process save the same step and exit with status 0. A second
command on a workdir that a live run holds stops at once, naming the holder.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from capo_jax.data import datasets as data
from capo_jax.data import reward_fns
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.rl import rollout
from capo_jax.rl import train_step as ts
from capo_jax.run import model_card
from capo_jax.run import programs as programs_lib
from capo_jax.run import setup
from capo_jax.run import train_eval
from capo_jax.run.setup import Policy, export_policy
from capo_jax.run.spec import ConfigError, RunSpec
from capo_jax.runtime import checkpoint as ckpt_lib
from capo_jax.runtime import fs
from capo_jax.runtime import lease as lease_lib
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.runtime import metrics
from capo_jax.runtime import preemption
from capo_jax.runtime import run_record
from capo_jax.runtime.distributed import is_main_process
from models.sharding import to_host

log = logging.getLogger(__name__)

EvalFn = Callable[[int, Any], dict[str, float]]


class TrainingDiverged(RuntimeError):
  """Too many consecutive steps had a non-finite loss or gradient."""


def _mean_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
  keys = rows[0].keys() if rows else ()
  return {k: float(np.mean([float(r[k]) for r in rows])) for k in keys}


def _sample_records(ro: rollout.Rollout, tokenizer: Tokenizer, G: int, n: int
                    ) -> list[dict[str, Any]]:
  """The first ``n`` completions of this process's groups, for a human to read."""
  adv_QG, s_QG = to_host(ro.adv_QG), to_host(ro.s_QG)  # a few rows, on logging steps
  rows = [q * G + g for q, e in enumerate(ro.examples_Q) if e is not None for g in range(G)][:n]
  texts = tokenizer.decode_completions(ro.completion_tokens_BC[rows], ro.completion_mask_BC[rows])
  recs = []
  for i, text in zip(rows, texts):
    q, g = divmod(i, G)
    e = ro.examples_Q[q]
    recs.append({"question": e.problem, "gold": e.answer, "completion": text,
                 "reward": float(ro.rewards_QG[q, g]), "s": float(s_QG[q, g]),
                 "advantage": float(adv_QG[q, g])})
  return recs


def train(spec: RunSpec, workdir: str, *, policy: Policy | None = None,
          tokenizer: Tokenizer | None = None,
          train_examples: Sequence[data.Example] | None = None,
          eval_fn: EvalFn | None = None, grader: Any = None) -> Any:
  """Runs (or resumes) the RL run ``spec`` in ``workdir``; returns the final params.

  ``policy``, ``tokenizer`` and ``train_examples`` replace what the config
  would load (the demo passes its warm start and synthetic task).
  ``eval_fn(step, params)`` is called every ``eval.every_steps`` and at the
  end; by default it evaluates the validation split and ``data.eval``
  (``capo_jax.run.train_eval``). Raises ``preemption.Preempted`` (exit status 0)
  after a preemption checkpoint; LeaseHeld, naming the holder, while another
  run holds ``workdir``.
  """
  workdir = str(workdir)
  lease = None
  if is_main_process():  # process 0 holds the lease for every process of the run
    error = None
    try:
      fs.check_writable(workdir, "the workdir")  # creates it
      lease = lease_lib.Lease(workdir).acquire()
    except Exception as e:  # pylint: disable=broad-except  (shared below, then re-raised)
      error = e
    lease_lib.share_outcome(str(error) if error else None)
    if error is not None:
      raise error
  else:
    lease_lib.share_outcome(None)
  try:
    return _run(spec, workdir, lease, policy=policy, tokenizer=tokenizer,
                train_examples=train_examples, eval_fn=eval_fn, grader=grader)
  finally:
    if lease is not None:
      lease.release()


def _run(spec: RunSpec, workdir: str, lease: lease_lib.Lease | None, *,
         policy: Policy | None, tokenizer: Tokenizer | None,
         train_examples: Sequence[data.Example] | None, eval_fn: EvalFn | None,
         grader: Any) -> Any:
  """``train`` once the workdir's lease is held (``lease``: None on processes > 0)."""
  model_cfg = policy.cfg if policy is not None else spec.model_config()
  mesh = spec.make_mesh()
  progs = programs_lib.build(spec, model_cfg, mesh)
  tcfg = progs.tcfg
  train_rules = mesh_lib.TRAIN_RULES
  tokenizer = tokenizer or setup.tokenizer_for(spec)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ConfigError(
        f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
        f"{model_cfg.vocab_size} (config.model / config.tokenizer_path)")
  main = is_main_process()
  fs.makedirs(workdir)
  checkpointer = ckpt_lib.Checkpointer(workdir, every_steps=spec.checkpoint.every_steps,
                                       keep=spec.checkpoint.keep)
  fs.check_writable(checkpointer.directory, "the checkpoint folder")  # not a save later
  # Config changes are checked before anything slow is loaded; the record is written
  # once the checkpoint restored (a failed resume leaves the previous one).
  record = run_record.record(spec.raw, workdir, resuming=checkpointer.latest_step() is not None,
                             write=False)
  val_examples: list[data.Example] = []
  source = "the given training questions"
  if train_examples is None:
    split = setup.training_data(spec.data, workdir)
    train_examples, val_examples, source = split.train, split.val, str(spec.data.train)
  train_examples = setup.drop_long_prompts(train_examples, tokenizer,
                                               spec.rollout.max_prompt_len, source)
  Q, G = spec.rollout.num_prompts, spec.rollout.num_samples
  iterator = data.PromptIterator(train_examples, Q, spec.seed, process_index=jax.process_index(),
                                 process_count=jax.process_count())
  given_grader = grader  # a caller's grader (tests, the demo's noisy one) grades everything
  grader = grader or reward_fns.grader_for(spec.checker, spec.reward.timeout_s,
                                           spec.reward.worker_max_calls,
                                           spec.reward.worker_max_rss_mb)

  state_sh = progs.state_shardings
  w = setup.policy_weights(spec, model_cfg, policy, tcfg, mesh, train_rules)
  params0 = w.trainable0
  step_fn = progs.train_step
  to_sampling = w.to_sampling
  ctx = rollout.RolloutContext(
      spec=spec.rollout_spec(), model_cfg=model_cfg, tokenizer=tokenizer, grader=grader,
      sampling=dataclasses.replace(progs.sampling, stop_ids=tuple(tokenizer.stop_ids),
                                   pad_id=tokenizer.pad_id),
      sampling_layout=progs.sampling_layout, logprobs=progs.logprobs,
      batches=progs.batch_layout, reward_fns=spec.reward_fns())
  if eval_fn is None and spec.eval.every_steps > 0:
    eval_fn = train_eval.make_eval_fn(
        train_eval.EvalSetup(spec=spec.eval, model_cfg=model_cfg, tokenizer=tokenizer,
                             layout=progs.sampling_layout,
                             # data.eval benchmarks: their own checkers (evaluate_policy)
                             grader=given_grader or {train_eval.VAL_BENCHMARK: grader}),
        train_eval.eval_benchmarks(spec, val_examples), workdir, to_sampling)

  rng = jax.random.key(spec.seed)
  abstract_state = jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      jax.eval_shape(lambda p: ts.init_train_state(p, tcfg), params0), state_sh)
  try:
    restored = checkpointer.restore_latest(abstract_state)
  except ckpt_lib.TreeMismatch as e:
    raise _config_changed(e, record, workdir) from None
  if main:
    run_record.write_record(record, workdir)
  if restored is not None:
    start, state, meta = restored
    iterator.restore(meta["data"])
    rng = ckpt_lib.key_from_json(meta["rng"], rng)
    log.info("resuming at step %d from %s", start, checkpointer.directory)
  else:
    start = 0
    state = ts.train_state_from_params(params0, model_cfg, tcfg, mesh, train_rules)
  del params0
  w.trainable0 = None
  writer = metrics.MetricsWriter(workdir, enabled=main, resume_step=start,
                                 wandb=_wandb_config(spec))

  def save(step: int, force: bool = False) -> None:
    checkpointer.save(step, state, {"rng": ckpt_lib.key_to_json(rng), "data": iterator.state(),
                                    "algo": spec.algo.name, "hf_config": model_cfg.to_hf(),
                                    **w.checkpoint_record(spec.model.hf_path)},
                      force=force)

  def evaluate(step: int) -> None:
    log.info("evaluating the policy of step %d", step)
    writer.write(step, {f"eval/{k}": v for k, v in eval_fn(step, state.params).items()})

  def export(path: str, step: int) -> None:  # the HF policy, its model card and prompt
    export_policy(model_cfg, w.full(state.params), path, tokenizer,
                  files=lambda: model_card.export_files(spec, workdir, step, tokenizer))

  if eval_fn is not None and start == 0:
    evaluate(0)
  consecutive_skips = 0
  every = lambda n, step: n > 0 and step % n == 0  # noqa: E731
  bar = tqdm(total=spec.train.num_steps, initial=start, disable=not main, desc=spec.algo.name,
             dynamic_ncols=True)
  with preemption.PreemptionWatch() as watch:
    for step in range(start, spec.train.num_steps):
      if lease is not None and lease.lost:
        raise lease_lib.LeaseHeld(f"{lease.path}: another run took this workdir over at step "
                                  f"{step}; this run stops (its last checkpoint is in "
                                  f"{checkpointer.directory})")
      t0 = time.perf_counter()
      examples = iterator.next_batch()
      policy_args = rollout.PolicyArgs(
          sampling=to_sampling(state.params),
          train=w.base if tcfg.lora else state.params, reference=w.reference,
          adapters=state.params if tcfg.lora else None)
      ro = rollout.collect(examples, ctx, policy_args, step=step,
                           rng=jax.random.fold_in(rng, step),
                           draw_more=iterator.next_batch)  # used only with dynamic sampling
      del policy_args
      t1 = time.perf_counter()
      update_metrics = []
      batches = ro.minibatches()
      for _ in range(spec.train.ppo_epochs):
        for mb in batches:
          state, m = step_fn(state, mb, *w.frozen)
          update_metrics.append(m)
      del batches
      # One host sync per step, once every update is dispatched: reading each
      # update's (or the rollout's) metrics back at once would stall the dispatch.
      update_metrics, ro_metrics = jax.device_get((update_metrics, ro.metrics))
      t_train = time.perf_counter() - t1
      m = _mean_metrics(update_metrics)
      skipped = int(sum(float(u["skipped"]) for u in update_metrics))
      consecutive_skips = consecutive_skips + 1 if skipped == len(update_metrics) else 0
      n_train_tokens = (int(ro.prompt_mask_BP.sum()) + int(ro.completion_mask_BC.sum())) * \
          spec.train.ppo_epochs
      row = {**ro_metrics, **m, "skipped_updates": skipped,
             "time_train": t_train, "time_step": time.perf_counter() - t0,
             "train_tokens_per_s": n_train_tokens / max(t_train, 1e-9)}
      done = step + 1
      if every(spec.log.every_steps, done) or done == spec.train.num_steps:
        writer.write(done, row)
      if every(spec.log.samples_every_steps, done):
        writer.write_samples(done, _sample_records(ro, tokenizer, G, spec.log.num_samples_logged))
      bar.update(1)
      bar.set_postfix_str(metrics.summary_line(row))
      if consecutive_skips >= spec.train.max_consecutive_skips:
        raise TrainingDiverged(
            f"{consecutive_skips} consecutive steps had a non-finite loss or gradient (step "
            f"{done}); the last checkpoint is in {checkpointer.directory}. Lower "
            "config.optim.lr or check the data.")
      if eval_fn is not None and every(spec.eval.every_steps, done):
        evaluate(done)
      preempted = watch.reached(done)  # every process, every step (JAX's protocol)
      save(done, force=preempted)
      if every(spec.checkpoint.export_hf_every, done) and done < spec.train.num_steps:
        export(fs.join(workdir, "exports", f"step_{done:06d}"), done)
      if preempted and done < spec.train.num_steps:
        bar.close()
        checkpointer.close()
        writer.close()
        stop = preemption.Preempted(done, checkpointer.directory)
        log.warning(stop.message)
        raise stop
  bar.close()
  if eval_fn is not None and spec.train.num_steps > start and not every(spec.eval.every_steps,
                                                                      spec.train.num_steps):
    evaluate(spec.train.num_steps)
  save(spec.train.num_steps, force=True)
  checkpointer.close()
  export_dir = fs.join(workdir, "export_hf")
  if spec.checkpoint.export_hf and (spec.train.num_steps > start
                                 or not fs.exists(fs.join(export_dir, "config.json"))):
    export(export_dir, spec.train.num_steps)
  writer.close()
  return w.full(state.params)


def _config_changed(e: ckpt_lib.TreeMismatch, record: dict[str, Any], workdir: str
                    ) -> run_record.ConfigChanged:
  """The config fields that changed since the checkpoint's run, as the reason for ``e``."""
  previous = record.get("previous") or {}
  diff = run_record.changed_fields(previous.get("config") or record["config"], record["config"])
  fields = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
  why = (f"the config changed since it was saved: {fields}" if fields else
         f"no config field changed ({run_record.CONFIG_FILE} of the checkpoint's run: git "
         f"commit {previous.get('git_commit') or record.get('git_commit')}); did the code?")
  return run_record.ConfigChanged(
      f"{workdir}: {e}; {why}. Resume with the recorded values or use another --workdir.")


def _wandb_config(spec: RunSpec) -> metrics.WandbConfig | None:
  if not spec.log.wandb_project:
    return None
  return metrics.WandbConfig(project=spec.log.wandb_project, entity=spec.log.wandb_entity,
                             name=spec.log.wandb_name, config=dict(spec.raw))
