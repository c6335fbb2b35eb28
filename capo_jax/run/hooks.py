"""What runs after each step: hooks ``(every, fn)``, in order, each timed.

After step N (``done`` = N, as logged) the hooks run in this order: samples,
the divergence check, the preemption sync, evaluation, HF export, checkpoint,
the profile, then the metrics row and the progress bar. Each timed hook adds
``time/<name>_s`` to the step's row (0 when not due), so the row, written
last, holds every phase of its step. A hook may stop the run (``Tick.stop``):
the hooks after it are skipped but the row is still written, and the loop
then ends the run through ``loop.finish``.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
from tqdm import tqdm

from capo_jax.data.tokenizer import Tokenizer
from capo_jax.rl import rollout
from capo_jax.run import model_card
from capo_jax.run.setup import export_policy
from capo_jax.run.trainer import Run, StepOut
from capo_jax.runtime import checkpoint as ckpt_lib
from capo_jax.runtime import fs, metrics, preemption
from capo_jax.runtime.distributed import is_main_process
from models.sharding import to_host

log = logging.getLogger(__name__)

PROFILE_DIR, FINAL_EXPORT = "profile", "export_hf"


class TrainingDiverged(RuntimeError):
  """Too many consecutive steps had a non-finite loss or gradient."""


@dataclasses.dataclass
class Tick:
  """One finished step as the hooks see it.

  Attributes:
    done: the steps finished (the step number logged).
    state: the train state after it.
    out: what ``rl_step`` returned (the rollout, the metrics row).
    t0: ``time.perf_counter()`` at the step's start.
    preempted: set by the preemption hook: every process saves this step and stops.
    stop: set by a hook that ends the run; ``loop.finish`` raises it.
  """

  done: int
  state: Any
  out: StepOut
  t0: float
  preempted: bool = False
  stop: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class Hook:
  """``fn(tick)`` after every ``every``-th step (0: never).

  Attributes:
    name: timed hooks log their wall time as ``time/<name>_s``.
    every: the period in steps.
    fn: the work.
    last: after the run's last step: True always, False never, None as ``every`` says.
    timed: whether the row carries its time (the row's own writing cannot).
    after_stop: runs even once a hook before it stopped the run.
  """

  name: str
  every: int
  fn: Callable[[Tick], None]
  last: bool | None = None
  timed: bool = True
  after_stop: bool = False

  def due(self, done: int, num_steps: int) -> bool:
    if done == num_steps and self.last is not None:
      return self.last
    return self.every > 0 and done % self.every == 0


class Hooks:
  """The hooks of one run (``with`` its preemption watch); ``close`` ends their work."""

  def __init__(self, run: Run, watch: preemption.PreemptionWatch) -> None:
    self.run = run
    spec = run.spec
    self.bar = tqdm(
      total=run.num_steps,
      initial=run.start,
      disable=not is_main_process(),
      desc=spec.algo.name,
      dynamic_ncols=True,
    )
    self.profile = Profile(spec.log.profile_steps, fs.join(run.workdir, PROFILE_DIR))
    skips = [0]  # consecutive steps whose every update was skipped

    def diverged(t: Tick) -> None:
      skips[0] = skips[0] + 1 if t.out.skipped == t.out.updates else 0
      if skips[0] >= spec.train.max_consecutive_skips:
        t.stop = TrainingDiverged(
          f"{skips[0]} consecutive steps had a non-finite loss or gradient (step "
          f"{t.done}); the last checkpoint is in {run.checkpointer.directory}. Lower "
          "config.optim.lr or check the data."
        )

    def preempt(t: Tick) -> None:  # every process, every step (JAX's protocol)
      t.preempted = watch.reached(t.done)

    def checkpoint(t: Tick) -> None:
      save(run, t.state, t.done, force=t.preempted or t.done == run.num_steps)
      if t.preempted and t.done < run.num_steps:
        t.stop = preemption.Preempted(t.done, run.checkpointer.directory)

    def export_step(t: Tick) -> None:
      path = (
        fs.join(run.workdir, FINAL_EXPORT)
        if t.done == run.num_steps
        else fs.join(run.workdir, "exports", f"step_{t.done:06d}")
      )
      export(run, t.state, path, t.done)

    def write_row(t: Tick) -> None:
      t.out.row["time_step"] = time.perf_counter() - t.t0
      run.writer.write(t.done, t.out.row)

    def progress(t: Tick) -> None:
      self.bar.update(1)
      self.bar.set_postfix_str(metrics.summary_line(t.out.row))

    samples = lambda t: run.writer.write_samples(  # noqa: E731
      t.done,
      sample_records(
        t.out.rollout, run.tokenizer, spec.rollout.num_samples, spec.log.num_samples_logged
      ),
    )
    evaluation = (
      [Hook("eval", spec.eval.every_steps, lambda t: evaluate(run, t.state, t.done), last=True)]
      if run.eval_fn is not None
      else []
    )
    profile = [Hook("profile", 1, self.profile.after)] if self.profile.steps else []
    self.hooks = [
      Hook("samples", spec.log.samples_every_steps, samples),
      Hook("divergence", 1, diverged, timed=False),
      Hook("preemption", 1, preempt, timed=False),
      *evaluation,
      # Exports before the checkpoint, so nothing slow stands between a checkpoint and
      # its step's row (a run killed there would resume past a row never written).
      Hook("export", spec.checkpoint.export_hf_every, export_step, last=spec.checkpoint.export_hf),
      Hook("checkpoint", 1, checkpoint),
      *profile,
      Hook("log", spec.log.every_steps, write_row, last=True, timed=False, after_stop=True),
      Hook("progress", 1, progress, timed=False, after_stop=True),
    ]

  def before(self, state: Any) -> None:
    """Before the run's first step here: the step-0 evaluation of a new run, the profile;
    for a run resumed at its end, the final HF export if it is missing."""
    run = self.run
    if run.eval_fn is not None and run.start == 0:
      evaluate(run, state, 0)
    final_export = fs.join(run.workdir, FINAL_EXPORT)
    if (
      run.start >= run.num_steps
      and run.spec.checkpoint.export_hf
      and not fs.exists(fs.join(final_export, "config.json"))
    ):
      export(run, state, final_export, run.num_steps)
    self.profile.start_before(run.start + 1)

  def after(self, tick: Tick) -> None:
    """Runs the hooks due after ``tick.done`` in order, timing each into the row."""
    for h in self.hooks:
      t0 = time.perf_counter()
      if (tick.stop is None or h.after_stop) and h.due(tick.done, self.run.num_steps):
        h.fn(tick)
      if h.timed:
        tick.out.row[f"time/{h.name}_s"] = time.perf_counter() - t0

  def close(self) -> None:
    self.bar.close()
    self.profile.close()


class Profile:
  """A ``jax.profiler`` trace of steps ``first``..``last`` (as logged) into ``directory``.

  The trace starts before step ``first`` (or the first step a resumed run takes
  in the range) and stops after step ``last``, once its updates have finished.
  A remote directory gets the trace after it stops (the profiler writes locally).
  """

  def __init__(self, steps: tuple[int, ...], directory: str) -> None:
    self.steps = tuple(steps)
    self.directory = directory
    self._local: str | None = None  # where the running trace goes; None: not tracing

  def start_before(self, step: int) -> None:
    if self._local is None and self.steps and self.steps[0] <= step <= self.steps[1]:
      self._local = (
        tempfile.mkdtemp(prefix="capo-profile-") if fs.is_remote(self.directory) else self.directory
      )
      log.info("profiling steps %d-%d into %s", step, self.steps[1], self.directory)
      jax.profiler.start_trace(self._local)

  def after(self, t: Tick) -> None:
    if self._local is not None and t.done >= self.steps[1]:
      jax.block_until_ready(t.state)  # the step's updates belong in the trace
      self.close()
    self.start_before(t.done + 1)

  def close(self) -> None:
    if self._local is None:
      return
    jax.profiler.stop_trace()
    if self._local != self.directory:
      fs.upload_tree(self._local, self.directory)
    log.info("the profile is in %s (tensorboard --logdir %s)", self.directory, self.directory)
    self._local = None


def save(run: Run, state: Any, step: int, force: bool = False) -> None:
  """A checkpoint of ``state`` with what a resume needs: the key, the data stream, the model."""
  w = run.weights
  run.checkpointer.save(
    step,
    state,
    {
      "rng": ckpt_lib.key_to_json(run.rng),
      "data": run.iterator.state(),
      "algo": run.spec.algo.name,
      "hf_config": run.model_cfg.to_hf(),
      **w.checkpoint_record(run.spec.model.hf_path),
    },
    force=force,
  )


def evaluate(run: Run, state: Any, step: int) -> None:
  log.info("evaluating the policy of step %d", step)
  if run.eval_fn is None:
    raise ValueError("hooks.evaluate: the run has no eval_fn (no held-out evaluation set up)")
  run.writer.write(step, {f"eval/{k}": v for k, v in run.eval_fn(step, state.params).items()})


def export(run: Run, state: Any, path: str, step: int) -> None:
  """The HF policy at ``path``, with its model card and prompt."""
  export_policy(
    run.model_cfg,
    run.weights.full(state.params),
    path,
    run.tokenizer,
    files=lambda: model_card.export_files(run.spec, run.workdir, step, run.tokenizer),
  )


def sample_records(
  ro: rollout.Rollout, tokenizer: Tokenizer, G: int, n: int
) -> list[dict[str, Any]]:
  """The first ``n`` completions of this process's groups, for a human to read."""
  adv_QG, s_QG = to_host(ro.adv_QG), to_host(ro.s_QG)  # a few rows, on logging steps
  picks = [(q, g, e) for q, e in enumerate(ro.examples_Q) if e is not None for g in range(G)][:n]
  rows = [q * G + g for q, g, _ in picks]
  texts = tokenizer.decode_completions(ro.completion_tokens_BC[rows], ro.completion_mask_BC[rows])
  recs = []
  for (q, g, e), text in zip(picks, texts):
    recs.append(
      {
        "question": e.problem,
        "gold": e.answer,
        "completion": text,
        "reward": float(ro.rewards_QG[q, g]),
        "s": float(s_QG[q, g]),
        "advantage": float(adv_QG[q, g]),
      }
    )
  return recs
