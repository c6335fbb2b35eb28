"""The training loop's hooks: what runs after which step (against the single-function loop
they replaced, written out below), the per-phase times of each row, the profile."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import signal
import time
from typing import Any

import pytest

import rl_driver
from capo_jax.run import hooks as hooks_lib
from capo_jax.run import loop, trainer
from capo_jax.run import spec as spec_lib
from capo_jax.runtime import preemption
from configs import common


@dataclasses.dataclass(frozen=True)
class Case:
  num_steps: int = 6
  start: int = 0
  log_every: int = 1
  samples_every: int = 0
  eval_every: int = 0
  evaluates: bool = False  # an eval_fn (given, or from eval.every_steps)
  ckpt_every: int = 1
  export_every: int = 0
  export_hf: bool = True
  export_exists: bool = False  # the final export is there from an earlier run
  preempt_after: int = 0  # SIGTERM during this step (0: none)
  diverge_from: int = 0  # every update skipped from this step on (0: never)
  max_skips: int = 2


def _reference(c: Case) -> tuple[list[tuple[Any, ...]], str]:
  """What the loop did before the hooks: its conditions as one function, the events as a
  list (the order within a step aside) and how the run ended."""
  every = lambda n, step: n > 0 and step % n == 0  # noqa: E731
  saved, events = {c.start} - {0}, []  # a resumed run restored its checkpoint at start

  def save(step, force=False):
    if (force or every(c.ckpt_every, step)) and step not in saved:
      saved.add(step)
      events.append(("save", step))

  if c.evaluates and c.start == 0:
    events.append(("eval", 0))
  skips = 0
  for step in range(c.start, c.num_steps):
    done = step + 1
    if every(c.log_every, done) or done == c.num_steps:
      events.append(("row", done))
    if every(c.samples_every, done):
      events.append(("samples", done))
    skips = skips + 1 if c.diverge_from and done >= c.diverge_from else 0
    if skips >= c.max_skips:
      return events, "diverged"
    if c.evaluates and every(c.eval_every, done):
      events.append(("eval", done))
    preempted = done == c.preempt_after
    save(done, force=preempted)
    if every(c.export_every, done) and done < c.num_steps:
      events.append(("export", f"exports/step_{done:06d}"))
    if preempted and done < c.num_steps:
      return events, "preempted"
  if c.evaluates and c.num_steps > c.start and not every(c.eval_every, c.num_steps):
    events.append(("eval", c.num_steps))
  save(c.num_steps, force=True)
  if c.export_hf and (c.num_steps > c.start or not c.export_exists):
    events.append(("export", "export_hf"))
  return events, "done"


class _Writer:
  def __init__(self, events):
    self.events, self.rows = events, []

  def write(self, step, m):
    self.events.append(("row", step))
    self.rows.append(dict(m))

  def write_samples(self, step, records):
    self.events.append(("samples", step))

  def close(self):
    pass


def _run_hooks(c: Case, tmp_path, monkeypatch) -> tuple[list[tuple[Any, ...]], str, _Writer]:
  """``loop.train`` with the setup and the step replaced by fakes that record the hooks."""
  cfg = common.shrink(common.get_base_config())
  cfg.train.num_steps, cfg.train.max_consecutive_skips = c.num_steps, c.max_skips
  cfg.log.every_steps, cfg.log.samples_every_steps = c.log_every, c.samples_every
  cfg.eval.every_steps = c.eval_every
  cfg.checkpoint.every_steps, cfg.checkpoint.export_hf_every = c.ckpt_every, c.export_every
  cfg.checkpoint.export_hf = c.export_hf
  spec = spec_lib.RunSpec.from_config(cfg, num_devices=1)
  workdir = str(tmp_path / "run")
  if c.export_exists:
    os.makedirs(os.path.join(workdir, "export_hf"))
    open(os.path.join(workdir, "export_hf", "config.json"), "w").close()
  events: list[tuple[Any, ...]] = []
  saved = {c.start} - {0}
  writer = _Writer(events)

  class Checkpointer:  # the real one's rule: every_steps, or forced; a step once
    directory = os.path.join(workdir, "checkpoints")

    def close(self):
      pass

  def save(run, state, step, force=False):
    if (force or (c.ckpt_every > 0 and step % c.ckpt_every == 0)) and step not in saved:
      saved.add(step)
      events.append(("save", step))

  weights = trainer.setup_lib.PolicyWeights(None, None, None, lambda p: p, None)
  run = trainer.Run(
    spec,
    workdir,
    None,
    None,
    None,
    weights,
    None,
    None,
    Checkpointer(),
    writer,
    (lambda step, p: {}) if c.evaluates else None,
    None,
    c.start,
    None,
  )

  def rl_step(run_, state, step):
    assert run_ is run
    if step + 1 == c.preempt_after:
      os.kill(os.getpid(), signal.SIGTERM)  # the watch's handler: save this step, then stop
    skipped = 2 if c.diverge_from and step + 1 >= c.diverge_from else 0
    return state, trainer.StepOut(None, {"loss": float(step)}, skipped, 2)

  monkeypatch.setattr(trainer, "setup", lambda *a, **k: (run, _State()))
  monkeypatch.setattr(trainer, "rl_step", rl_step)
  monkeypatch.setattr(hooks_lib, "save", save)
  monkeypatch.setattr(hooks_lib, "evaluate", lambda run, state, step: events.append(("eval", step)))
  monkeypatch.setattr(
    hooks_lib,
    "export",
    lambda run, state, path, step: events.append(("export", os.path.relpath(path, workdir))),
  )
  monkeypatch.setattr(hooks_lib, "sample_records", lambda *a: [])
  try:
    loop.train(spec, workdir)
    end = "done"
  except preemption.Preempted:
    end = "preempted"
  except loop.TrainingDiverged:
    end = "diverged"
  return events, end, writer


@dataclasses.dataclass
class _State:
  params: Any = "params"


CASES = {
  "defaults": Case(),
  "periods": Case(
    num_steps=7,
    log_every=2,
    samples_every=3,
    eval_every=3,
    evaluates=True,
    ckpt_every=3,
    export_every=2,
  ),
  "eval_only_at_the_ends": Case(evaluates=True, ckpt_every=0, export_hf=False),
  "resumed": Case(start=3, eval_every=2, evaluates=True, ckpt_every=2, export_every=4),
  "resumed_at_the_end": Case(start=6, evaluates=True),
  "resumed_at_the_end_exported": Case(start=6, export_exists=True),
  "preempted": Case(preempt_after=3, ckpt_every=0, export_every=3, eval_every=3, evaluates=True),
  "preempted_at_the_last_step": Case(preempt_after=6, ckpt_every=4),
  "diverged": Case(diverge_from=3, samples_every=1, eval_every=1, evaluates=True),
}


@pytest.mark.parametrize("name", CASES)
def test_the_hooks_run_what_the_single_function_loop_ran(name, tmp_path, monkeypatch):
  c = CASES[name]
  want, want_end = _reference(c)
  got, end, writer = _run_hooks(c, tmp_path, monkeypatch)
  assert end == want_end
  assert sorted(got, key=repr) == sorted(want, key=repr)
  # The row is the last thing of its step: it carries the times of the hooks before it.
  for i, (what, step) in enumerate(got):
    if what == "row":
      assert step not in [s for _, s in got[i + 1 :]], got
  phases = ("time/samples_s", "time/export_s", "time/checkpoint_s") + (
    ("time/eval_s",) if c.evaluates else ()
  )
  for row in writer.rows:
    assert all(row[k] >= 0 for k in phases) and row["time_step"] >= sum(row[k] for k in phases)


def test_hook_schedule_by_hand():
  hook = lambda every, last: hooks_lib.Hook("h", every, lambda t: None, last=last)  # noqa: E731
  due = lambda h: [d for d in range(1, 8) if h.due(d, 7)]  # noqa: E731
  assert due(hook(3, None)) == [3, 6]
  assert due(hook(3, True)) == [3, 6, 7]
  assert due(hook(7, False)) == []
  assert due(hook(0, True)) == [7]
  assert due(hook(0, None)) == []


@pytest.mark.parametrize(
  "steps,why", [((3,), "expected"), ((0, 2), "1 <= first"), ((4, 3), "first <= last")]
)
def test_bad_profile_steps_name_the_field(steps, why):
  c = common.shrink(common.get_base_config())
  c.log.profile_steps = steps
  with pytest.raises(spec_lib.ConfigError, match=rf"config\.log\.profile_steps.*{why}"):
    spec_lib.RunSpec.from_config(c, num_devices=1)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
  return rl_driver.write_assets(tmp_path_factory.mktemp("hooks_run"))


@pytest.mark.slow  # ~30 s: a real run with a profile (.ci/run runs it)
def test_rows_carry_every_phase_and_the_profile_is_written(assets, tmp_path):
  """3 tiny steps, evaluation at step 2, a profile of steps 2-3: every row holds each
  phase's time, non-negative, summing to at most the step's wall time; the trace exists."""
  c = rl_driver.tiny_config(assets["tok"], assets["data"], 3)
  c.eval.every_steps, c.log.profile_steps = 2, (2, 3)
  c.data.eval = ()  # the validation split only: no benchmark files here
  t0 = time.perf_counter()
  rl_driver.train(c, str(tmp_path), grader=rl_driver.HashGrader())
  wall = time.perf_counter() - t0
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == [1, 2, 3]
  phases = [
    "time/rollout_s",
    "time/grading_s",
    "time/logprobs_s",
    "time/update_dispatch_s",
    "time/update_wait_s",
    "time/samples_s",
    "time/eval_s",
    "time/export_s",
    "time/checkpoint_s",
    "time/profile_s",
  ]
  for r in train_rows:
    assert sorted(k for k in r if k.startswith("time/")) == sorted(phases)
    assert all(r[k] >= 0 for k in phases), r
    assert sum(r[k] for k in phases) <= r["time_step"] + 1e-3, r
    assert r["time/rollout_s"] > 0 and r["time/update_wait_s"] + r["time/update_dispatch_s"] > 0
  assert sum(r["time_step"] for r in train_rows) < wall
  # The hooks' times are where their work was: an evaluation at 2 and at the end (3).
  by_step = {r["step"]: r for r in train_rows}
  assert by_step[2]["time/eval_s"] > 100 * by_step[1]["time/eval_s"]
  assert by_step[3]["time/export_s"] > 100 * by_step[2]["time/export_s"]  # the final export
  assert all(r["time/checkpoint_s"] > 0.01 for r in train_rows)  # every_steps = 1
  traces = glob.glob(str(tmp_path / "profile" / "**" / "*.xplane.pb"), recursive=True)
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0, traces
