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
  export_hf/         the final HF export

A restart with the same workdir resumes from the newest readable checkpoint
and drops the metrics rows logged past it. SIGTERM (a TPU preemption notice)
makes every process save the same step and exit with status 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from capo_jax.data import datasets as data
from capo_jax.data import rewards
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.eval import train_eval
from capo_jax.rl import experiment
from capo_jax.rl import rollout
from capo_jax.rl import run_setup
from capo_jax.rl import train_step as ts
from capo_jax.rl.run_setup import Policy, export_policy
from capo_jax.runtime import checkpoint as ckpt_lib
from capo_jax.runtime import fs
from capo_jax.runtime import host
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.runtime import metrics
from capo_jax.runtime import preemption
from capo_jax.runtime import run_record
from capo_jax.runtime.distributed import is_main_process

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
  rows = [q * G + g for q, e in enumerate(ro.examples_Q) if e is not None for g in range(G)][:n]
  texts = tokenizer.decode_completions(ro.completion_tokens_BC[rows], ro.completion_mask_BC[rows])
  recs = []
  for i, text in zip(rows, texts):
    q, g = divmod(i, G)
    e = ro.examples_Q[q]
    recs.append({"question": e.problem, "gold": e.answer, "completion": text,
                 "reward": float(ro.rewards_QG[q, g]), "s": float(ro.s_QG[q, g]),
                 "advantage": float(ro.adv_QG[q, g])})
  return recs


def train(c: ml_collections.ConfigDict, workdir: str, *, policy: Policy | None = None,
          tokenizer: Tokenizer | None = None,
          train_examples: Sequence[data.Example] | None = None,
          eval_fn: EvalFn | None = None, grader: Any = None) -> Any:
  """Runs (or resumes) the RL run of config ``c`` in ``workdir``; returns the final params.

  ``policy``, ``tokenizer`` and ``train_examples`` replace what the config
  would load (the demo passes its warm start and synthetic task).
  ``eval_fn(step, params)`` is called every ``eval.every_steps`` and at the
  end; by default it evaluates the validation split and ``data.eval``
  (``capo_jax.eval.train_eval``). Raises ``preemption.Preempted`` (exit status 0)
  after a preemption checkpoint.
  """
  experiment.validate(c, policy_given=policy is not None)
  workdir = str(workdir)
  model_cfg = policy.cfg if policy is not None else experiment.model_config(c)
  tcfg = experiment.train_config(c)
  mesh = experiment.make_mesh(c)
  train_rules, sampling_rules = mesh_lib.TRAIN_RULES, mesh_lib.SAMPLING_RULES
  tokenizer = tokenizer or run_setup.tokenizer_for(c)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise experiment.ConfigError(
        f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
        f"{model_cfg.vocab_size} (config.model / config.tokenizer_path)")
  main = is_main_process()
  fs.makedirs(workdir)
  checkpointer = ckpt_lib.Checkpointer(workdir, every_steps=c.checkpoint.every_steps,
                                       keep=c.checkpoint.keep)
  # Config changes are checked before anything slow is loaded.
  run_record.record(c, workdir, resuming=checkpointer.latest_step() is not None, write=main)
  val_examples: list[data.Example] = []
  source = "the given training questions"
  if train_examples is None:
    split = run_setup.training_data(c, workdir)
    train_examples, val_examples, source = split.train, split.val, str(c.data.train)
  train_examples = run_setup.drop_long_prompts(train_examples, tokenizer,
                                               c.rollout.max_prompt_len, source)
  Q, G = c.rollout.num_prompts, c.rollout.num_samples
  iterator = data.PromptIterator(train_examples, Q, c.seed, process_index=jax.process_index(),
                                 process_count=jax.process_count())
  grader = grader or rewards.default_grader()
  spec = experiment.rollout_spec(c)

  state_sh = ts.state_shardings(model_cfg, tcfg, mesh, train_rules)
  w = run_setup.policy_weights(c, model_cfg, policy, tcfg, mesh, train_rules)
  params0 = w.trainable0
  rows_per_update = c.train.mini_batch_prompts * G
  step_fn = ts.make_train_step(model_cfg, tcfg, mesh, train_rules, rows_per_update)
  logprob_fn = rollout.make_host_logprob_fn(
      model_cfg, mesh, train_rules, Q * G,
      rows_per_call=tcfg.pack_rows if tcfg.pack_len else c.train.logprob_rows,
      chunk_size=c.train.logprob_chunk, top_k=spec.simko_k, lora=tcfg.lora,
      pack_len=tcfg.pack_len)
  to_sampling = w.to_sampling
  batch_sh = ts.batch_sharding(tcfg, mesh, train_rules, rows_per_update)
  ctx = rollout.RolloutContext(spec=spec, model_cfg=model_cfg, tokenizer=tokenizer,
                               grader=grader, logprob_fn=logprob_fn, mesh=mesh,
                               sampling_rules=sampling_rules)
  if eval_fn is None and c.eval.every_steps > 0:
    eval_fn = train_eval.make_eval_fn(
        c, model_cfg=model_cfg, tokenizer=tokenizer,
        benchmarks=train_eval.eval_benchmarks(c, val_examples), workdir=workdir,
        to_sampling=to_sampling, mesh=mesh, rules=sampling_rules, grader=grader)

  rng = jax.random.key(c.seed)
  abstract_state = jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      jax.eval_shape(lambda p: ts.init_train_state(p, tcfg), params0), state_sh)
  restored = checkpointer.restore_latest(abstract_state)
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
                                 wandb=_wandb_config(c))

  def save(step: int, force: bool = False) -> None:
    checkpointer.save(step, state, {"rng": ckpt_lib.key_to_json(rng), "data": iterator.state(),
                                    "algo": c.algo.name, "hf_config": model_cfg.to_hf(),
                                    **w.checkpoint_record(c)},
                      force=force)

  def evaluate(step: int) -> None:
    log.info("evaluating the policy of step %d", step)
    writer.write(step, {f"eval/{k}": v for k, v in eval_fn(step, state.params).items()})

  if eval_fn is not None and start == 0:
    evaluate(0)
  consecutive_skips = 0
  every = lambda n, step: n > 0 and step % n == 0  # noqa: E731
  bar = tqdm(total=c.train.num_steps, initial=start, disable=not main, desc=c.algo.name,
             dynamic_ncols=True)
  with preemption.PreemptionWatch() as watch:
    for step in range(start, c.train.num_steps):
      t0 = time.perf_counter()
      examples = iterator.next_batch()
      ro = rollout.collect(
          examples, ctx, params_sampling=to_sampling(state.params),
          params_train=w.base if tcfg.lora else state.params, ref_params=w.reference,
          step=step, rng=jax.random.fold_in(rng, step),
          adapters=state.params if tcfg.lora else None,
          draw_more=iterator.next_batch)  # used only with rollout.dynamic_sampling
      t1 = time.perf_counter()
      update_metrics = []
      for _ in range(c.train.ppo_epochs):
        for mb in ro.minibatches(c.train.mini_batch_prompts, G, tcfg.pack_len, tcfg.pack_rows):
          state, m = step_fn(state, host.put_global(mb, batch_sh), *w.frozen)
          update_metrics.append(m)
      # One host sync per step, once every update is dispatched: reading each
      # update's metrics back at once would stall the dispatch of the next.
      update_metrics = jax.device_get(update_metrics)
      t_train = time.perf_counter() - t1
      m = _mean_metrics(update_metrics)
      skipped = int(sum(float(u["skipped"]) for u in update_metrics))
      consecutive_skips = consecutive_skips + 1 if skipped == len(update_metrics) else 0
      n_train_tokens = (int(ro.prompt_mask_BP.sum()) + int(ro.completion_mask_BC.sum())) * \
          c.train.ppo_epochs
      row = {**ro.metrics, **m, "skipped_updates": skipped,
             "time_train": t_train, "time_step": time.perf_counter() - t0,
             "train_tokens_per_s": n_train_tokens / max(t_train, 1e-9)}
      done = step + 1
      if every(c.log.every_steps, done) or done == c.train.num_steps:
        writer.write(done, row)
      if every(c.log.samples_every_steps, done):
        writer.write_samples(done, _sample_records(ro, tokenizer, G, c.log.num_samples_logged))
      bar.update(1)
      bar.set_postfix_str(metrics.summary_line(row))
      if consecutive_skips >= c.train.max_consecutive_skips:
        raise TrainingDiverged(
            f"{consecutive_skips} consecutive steps had a non-finite loss or gradient (step "
            f"{done}); the last checkpoint is in {checkpointer.directory}. Lower "
            "config.optim.lr or check the data.")
      if eval_fn is not None and every(c.eval.every_steps, done):
        evaluate(done)
      preempted = watch.reached(done)  # every process, every step (JAX's protocol)
      save(done, force=preempted)
      if every(c.checkpoint.export_hf_every, done) and done < c.train.num_steps:
        export_policy(model_cfg, w.full(state.params),
                      fs.join(workdir, "exports", f"step_{done:06d}"), tokenizer)
      if preempted and done < c.train.num_steps:
        bar.close()
        checkpointer.close()
        writer.close()
        stop = preemption.Preempted(done, checkpointer.directory)
        log.warning(stop.message)
        raise stop
  bar.close()
  if eval_fn is not None and c.train.num_steps > start and not every(c.eval.every_steps,
                                                                      c.train.num_steps):
    evaluate(c.train.num_steps)
  save(c.train.num_steps, force=True)
  checkpointer.close()
  export_dir = fs.join(workdir, "export_hf")
  if c.checkpoint.export_hf and (c.train.num_steps > start
                                 or not fs.exists(fs.join(export_dir, "config.json"))):
    export_policy(model_cfg, w.full(state.params), export_dir, tokenizer)
  writer.close()
  return w.full(state.params)


def _wandb_config(c: ml_collections.ConfigDict) -> metrics.WandbConfig | None:
  if not c.log.wandb_project:
    return None
  return metrics.WandbConfig(project=c.log.wandb_project, entity=c.log.wandb_entity,
                             name=c.log.wandb_name, config=c.to_dict())
