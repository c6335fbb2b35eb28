"""The RL training run: ``train(config, workdir)``.

Each step (SPEC section 4): draw Q prompts, sample G responses each, grade
them, compute old-policy (and, when the KL term or the noise mask needs them,
reference) log-probs, advantages, then PPO mini-batch updates. Metrics go to
``metrics.jsonl`` and TensorBoard every step; checkpoints are periodic and
atomic, and a restart with the same workdir resumes where the last one
stopped. SIGTERM (a TPU preemption notice) saves a checkpoint and exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from capo_jax import checkpoint as ckpt_lib
from capo_jax import data, experiment, metrics, rewards, rollout
from capo_jax import mesh as mesh_lib
from capo_jax import train_step as ts
from capo_jax.distributed import is_main_process
from capo_jax.tokenizer import Tokenizer, load_tokenizer
from models import hf_weights, qwen2
from models.config import Qwen2Config

log = logging.getLogger(__name__)

EvalFn = Callable[[int, Any], dict[str, float]]


class TrainingDiverged(RuntimeError):
  """Too many consecutive steps had a non-finite loss or gradient."""


@dataclasses.dataclass
class Policy:
  """An initial policy handed in by the caller (e.g. the demo's warm start)."""
  cfg: Qwen2Config
  params: Any


class _Preemption:
  """Turns SIGTERM into a flag the loop checks after each step."""

  def __init__(self) -> None:
    self.requested = False
    self._previous = None

  def __enter__(self) -> _Preemption:
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread: no handler, no preemption saves
      self._previous = None
    return self

  def _handle(self, signum: int, frame: Any) -> None:
    del signum, frame
    log.warning("SIGTERM received: saving a checkpoint after this step, then exiting")
    self.requested = True

  def __exit__(self, *exc: object) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _tokenizer(c: ml_collections.ConfigDict) -> Tokenizer:
  path = c.tokenizer_path or c.model.hf_path
  if not path:
    raise experiment.ConfigError("config.tokenizer_path is empty and there is no "
                                 "model.hf_path to take the tokenizer from")
  return load_tokenizer(path)


def _initial_params(c: ml_collections.ConfigDict, model_cfg: Qwen2Config,
                    policy: Policy | None, shardings: Any) -> Any:
  """The run's starting params (also the frozen reference), in the train shardings."""
  if policy is not None:
    return jax.device_put(policy.params, shardings)
  if c.model.hf_path:
    _, params = hf_weights.load_pretrained(c.model.hf_path, dtype=model_cfg.weight_dtype,
                                           shardings=shardings)
    return params
  init = lambda key: qwen2.init_params(model_cfg, key)
  return jax.jit(init, out_shardings=shardings)(jax.random.key(c.seed))


def _drop_long_prompts(examples: Sequence[data.Example], tokenizer: Tokenizer, max_len: int
                       ) -> list[data.Example]:
  """Drops questions whose rendered prompt exceeds ``max_len`` tokens (logged, as verl does)."""
  kept = [e for e in examples if len(tokenizer.encode(tokenizer.render_prompt(e.problem)))
          <= max_len]
  if len(kept) < len(examples):
    log.warning("dropped %d of %d training questions longer than rollout.max_prompt_len=%d",
                len(examples) - len(kept), len(examples), max_len)
  if not kept:
    raise experiment.ConfigError(f"config.rollout.max_prompt_len={max_len}: every training "
                                 "prompt is longer")
  return kept


def _spec(c: ml_collections.ConfigDict) -> rollout.RolloutSpec:
  r = c.rollout
  return rollout.RolloutSpec(
      num_samples=r.num_samples, max_prompt_len=r.max_prompt_len,
      max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
      algo=c.algo.name, hparams=experiment.advantage_hparams(c),
      noise_mask=experiment.uses_noise_mask(c), mask_high=c.algo.mask_high,
      mask_low=c.algo.mask_low, mask_mode=c.algo.mask_mode,
      old_from_sampler=r.old_logprobs == "sampler",
      mini_batch_prompts=c.train.mini_batch_prompts, num_steps=c.train.num_steps,
      simko_k=c.loss.simko_k if c.algo.name == "simko" else 0,
      prompts_per_call=r.prompts_per_call)


def _mean_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
  keys = rows[0].keys() if rows else ()
  return {k: float(np.mean([float(r[k]) for r in rows])) for k in keys}


def _sample_records(ro: rollout.Rollout, examples: Sequence[data.Example], G: int, n: int
                    ) -> list[dict[str, Any]]:
  """The first ``n`` of this process's completions, for a human to read."""
  recs = []
  q0 = ro.local_rows.start // G
  for i, text in enumerate(ro.texts[:n]):
    q, g = divmod(i, G)
    recs.append({"question": examples[q].problem, "gold": examples[q].answer,
                 "completion": text, "reward": float(ro.rewards_QG[q0 + q, g]),
                 "s": float(ro.s_QG[q0 + q, g]), "advantage": float(ro.adv_QG[q0 + q, g])})
  return recs


def export_policy(model_cfg: Qwen2Config, params: Any, path: str,
                  tokenizer: Tokenizer | None = None) -> None:
  """Writes the policy (and a HF tokenizer) as a HF directory.

  Process 0 writes; every process must call (the params are gathered).
  """
  host = jax.tree.map(rollout.to_host, params)
  if is_main_process():
    hf_weights.save_pretrained(model_cfg, host, path)
    if hasattr(tokenizer, "hf"):
      tokenizer.hf.save_pretrained(path)
    log.info("exported the policy as a HF checkpoint to %s", path)


def train(c: ml_collections.ConfigDict, workdir: str, *, policy: Policy | None = None,
          tokenizer: Tokenizer | None = None,
          train_examples: Sequence[data.Example] | None = None,
          eval_fn: EvalFn | None = None, grader: Any = None) -> Any:
  """Runs (or resumes) the RL run of config ``c`` in ``workdir``; returns the final params.

  ``policy``, ``tokenizer`` and ``train_examples`` replace what the config
  would load (the demo passes its warm start and synthetic task).
  ``eval_fn(step, params)`` is called every ``eval.every_steps`` and at the end.
  """
  experiment.validate(c, policy_given=policy is not None)
  model_cfg = policy.cfg if policy is not None else experiment.model_config(c)
  tcfg = experiment.train_config(c)
  mesh = experiment.make_mesh(c)
  train_rules, sampling_rules = mesh_lib.TRAIN_RULES, mesh_lib.SAMPLING_RULES
  tokenizer = tokenizer or _tokenizer(c)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise experiment.ConfigError(
        f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
        f"{model_cfg.vocab_size} (config.model / config.tokenizer_path)")
  if train_examples is None:
    train_examples = data.load_examples(c.data.train, data_dir=c.data.data_dir or None,
                                        skip_bad=c.data.skip_bad_rows).examples
  train_examples = _drop_long_prompts(train_examples, tokenizer, c.rollout.max_prompt_len)
  Q, G = c.rollout.num_prompts, c.rollout.num_samples
  iterator = data.PromptIterator(train_examples, Q, c.seed, process_index=jax.process_index(),
                                 process_count=jax.process_count())
  grader = grader or rewards.default_grader()
  spec = _spec(c)
  main = is_main_process()
  writer = metrics.MetricsWriter(workdir, enabled=main)
  checkpointer = ckpt_lib.Checkpointer(workdir, every_steps=c.checkpoint.every_steps,
                                       keep=c.checkpoint.keep)

  state_sh = ts.state_shardings(model_cfg, tcfg, mesh, train_rules)
  params0 = _initial_params(c, model_cfg, policy, state_sh.params)
  needs_ref = experiment.needs_reference(c)
  # The reference is frozen at the initial params, kept in the compute dtype.
  ref_params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(model_cfg.dtype), p),
                       out_shardings=state_sh.params)(params0) if needs_ref else None
  rows_per_update = c.train.mini_batch_prompts * G
  step_fn = ts.make_train_step(model_cfg, tcfg, mesh, train_rules, rows_per_update)
  logprob_jit = ts.make_logprob_fn(model_cfg, mesh, train_rules, Q * G,
                                   chunk_size=c.train.logprob_chunk, top_k=spec.simko_k)
  rollout_sh = mesh_lib.batch_sharding(mesh, train_rules, Q * G)
  # Host inputs become global arrays first: jit refuses sharded numpy inputs multi-host.
  logprob_fn = lambda params, *xs: logprob_jit(params, *rollout.put_global(xs, rollout_sh))
  sampling_sh = mesh_lib.param_shardings(model_cfg, mesh, sampling_rules)
  to_sampling = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(model_cfg.dtype), p),
                        out_shardings=sampling_sh)
  batch_sh = mesh_lib.batch_sharding(mesh, train_rules, rows_per_update)
  ctx = rollout.RolloutContext(spec=spec, model_cfg=model_cfg, tokenizer=tokenizer,
                               grader=grader, logprob_fn=logprob_fn, mesh=mesh,
                               sampling_rules=sampling_rules)

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

  def save(step: int, force: bool = False) -> None:
    checkpointer.save(step, state, {"rng": ckpt_lib.key_to_json(rng), "data": iterator.state(),
                                    "algo": c.algo.name, "hf_config": model_cfg.to_hf()},
                      force=force)

  if eval_fn is not None and start == 0:
    writer.write(0, {f"eval/{k}": v for k, v in eval_fn(0, state.params).items()})
  consecutive_skips = 0
  bar = tqdm(total=c.train.num_steps, initial=start, disable=not main, desc=c.algo.name,
             dynamic_ncols=True)
  with _Preemption() as preemption:
    for step in range(start, c.train.num_steps):
      t0 = time.perf_counter()
      examples = iterator.next_batch()
      ro = rollout.collect(
          examples, ctx, params_sampling=to_sampling(state.params), params_train=state.params,
          ref_params=ref_params, step=step, rng=jax.random.fold_in(rng, step))
      t1 = time.perf_counter()
      update_metrics = []
      for _ in range(c.train.ppo_epochs):
        for mb in ro.minibatches(c.train.mini_batch_prompts, G):
          state, m = step_fn(state, rollout.put_global(mb, batch_sh))
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
      writer.write(step + 1, row)
      if c.log.samples_every_steps and (step + 1) % c.log.samples_every_steps == 0:
        writer.write_samples(step + 1, _sample_records(ro, examples, G,
                                                        c.log.num_samples_logged))
      bar.update(1)
      bar.set_postfix_str(metrics.summary_line(row))
      if consecutive_skips >= c.train.max_consecutive_skips:
        raise TrainingDiverged(
            f"{consecutive_skips} consecutive steps had a non-finite loss or gradient (step "
            f"{step + 1}); the last checkpoint is in {checkpointer.directory}. Lower "
            "config.optim.lr or check the data.")
      if eval_fn is not None and c.eval.every_steps and (step + 1) % c.eval.every_steps == 0:
        writer.write(step + 1, {f"eval/{k}": v for k, v in eval_fn(step + 1,
                                                                   state.params).items()})
      save(step + 1, force=preemption.requested)
      if preemption.requested:
        bar.close()
        checkpointer.close()
        writer.close()
        raise SystemExit(f"preempted: checkpoint of step {step + 1} saved; rerun the same "
                         "command to resume")
  bar.close()
  if eval_fn is not None and c.train.num_steps > start and not (
      c.eval.every_steps and c.train.num_steps % c.eval.every_steps == 0):
    writer.write(c.train.num_steps, {f"eval/{k}": v for k, v in eval_fn(
        c.train.num_steps, state.params).items()})
  save(c.train.num_steps, force=True)
  checkpointer.close()
  if c.checkpoint.export_hf and c.train.num_steps > start:
    export_policy(model_cfg, state.params, os.path.join(workdir, "export_hf"), tokenizer)
  writer.close()
  return state.params
