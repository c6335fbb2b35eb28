"""The RL training run: ``train(spec, workdir)``.

``trainer.setup`` reads the spec into a ``Run``; then each step is
``trainer.rl_step`` (draw Q prompts, sample G responses each, grade them,
old-policy and, when the KL term or the noise mask needs them, reference
log-probs, advantages, then ``train.ppo_epochs`` passes of PPO updates over
``train.mini_batch_prompts``-question batches) and the hooks after it
(``capo_jax.run.hooks``); ``finish`` ends the run, whole or stopped.

What the run writes to its workdir (local or ``gs://``):

  config.json        the resolved config, package version and git commit
  data_split.json    ids of the training and held-out validation questions
  metrics.jsonl, tb/ every ``log.every_steps`` steps (JSONL and TensorBoard)
  samples.jsonl      a few completions every ``log.samples_every_steps``
  checkpoints/<N>/   Orbax, every ``checkpoint.every_steps`` and at the end
  eval/step_<N>/     results.json of each ``eval.every_steps`` evaluation
  exports/step_<N>/  HF exports every ``checkpoint.export_hf_every`` steps
  export_hf/         the final HF export (each export has a model card, README.md)
  profile/           a jax.profiler trace of ``log.profile_steps``, when set

  lease.json         who runs here now (``runtime.lease``): one run per workdir

A restart with the same workdir resumes from the newest readable checkpoint
and drops the metrics rows logged past it. SIGTERM (a TPU preemption notice)
makes every process save the same step and exit with status 0. A second
command on a workdir that a live run holds stops at once, naming the holder.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from capo_jax.data import datasets as data
from capo_jax.data.tokenizer import Tokenizer
from capo_jax.run import hooks as hooks_lib
from capo_jax.run import trainer
from capo_jax.run.hooks import TrainingDiverged  # noqa: F401  (raised by train)
from capo_jax.run.setup import Policy
from capo_jax.run.spec import RunSpec
from capo_jax.run.trainer import EvalFn, Run
from capo_jax.runtime import fs, preemption
from capo_jax.runtime import lease as lease_lib
from capo_jax.runtime.distributed import is_main_process

log = logging.getLogger(__name__)


def train(
  spec: RunSpec,
  workdir: str,
  *,
  policy: Policy | None = None,
  tokenizer: Tokenizer | None = None,
  train_examples: Sequence[data.Example] | None = None,
  eval_fn: EvalFn | None = None,
  grader: Any = None,
) -> Any:
  """Runs (or resumes) the RL run ``spec`` in ``workdir``; returns the final params.

  ``policy``, ``tokenizer``, ``train_examples`` and ``grader`` replace what the
  config would load (``trainer.Given``; the demo passes its warm start and
  synthetic task). ``eval_fn(step, params)`` is called every ``eval.every_steps``
  and at the end; by default it evaluates the validation split and ``data.eval``
  (``capo_jax.run.train_eval``). Raises ``preemption.Preempted`` (exit status 0)
  after a preemption checkpoint; LeaseHeld, naming the holder, while another
  run holds ``workdir``; TrainingDiverged after too many non-finite steps.
  """
  workdir = str(workdir)
  lease = _hold_lease(workdir)
  try:
    given = trainer.Given(policy, tokenizer, train_examples, eval_fn, grader)
    run, state = trainer.setup(spec, workdir, given, lease)
    with preemption.PreemptionWatch() as watch:
      hooks = hooks_lib.Hooks(run, watch)
      hooks.before(state)
      for step in range(run.start, run.num_steps):
        _check_lease(run, step)
        t0 = time.perf_counter()
        state, out = trainer.rl_step(run, state, step)
        tick = hooks_lib.Tick(step + 1, state, out, t0)
        hooks.after(tick)
        if tick.stop is not None:
          finish(run, hooks, state, tick.stop)
        del tick, out  # this step's rollout, before the next step's needs the memory
      return finish(run, hooks, state)
  finally:
    if lease is not None:
      lease.release()


def finish(run: Run, hooks: hooks_lib.Hooks, state: Any, stop: BaseException | None = None) -> Any:
  """The end of every run, whole or stopped: closes what it opened; returns the final
  params, or raises ``stop`` (a preemption, a divergence)."""
  hooks.close()
  run.checkpointer.close()
  run.writer.close()
  if isinstance(stop, preemption.Preempted):
    log.warning(stop.message)
  if stop is not None:
    raise stop
  return run.weights.full(state.params)


def _hold_lease(workdir: str) -> lease_lib.Lease | None:
  """Process 0 takes the workdir's lease for every process of the run (None elsewhere);
  every process raises the same error when it cannot."""
  lease = None
  if is_main_process():
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
  return lease


def _check_lease(run: Run, step: int) -> None:
  if run.lease is not None and run.lease.lost:
    raise lease_lib.LeaseHeld(
      f"{run.lease.path}: another run took this workdir over at step "
      f"{step}; this run stops (its last checkpoint is in "
      f"{run.checkpointer.directory})"
    )
