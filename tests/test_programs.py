"""One builder of a step's programs: the ahead-of-time compile lowers what the trainer runs.

A one-step run of the shrunk 1.5B config records what its programs were called
with; ``capo_jax.run.aot_programs`` builds its own from the same spec. The lowered HLO of
each log-prob pass and of the train step must be the same text for the same
arguments, the AOT's abstract arguments must have the structure and dtypes of
the real ones, and the engine's plan must be the one the sampler ran. Were the
AOT path to compile another step (the padded one while the run packs, or no
LoRA while the run trains adapters), a comparison here would fail.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

import rl_driver
from capo_jax.run import aot_programs
from capo_jax.run import programs as programs_lib
from capo_jax.run.spec import RunSpec
from capo_jax.sampling import engine


def _abstract(tree):
  return jax.tree.map(
    lambda x: (
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if hasattr(x, "sharding") else x
    ),
    tree,
  )


class _Recorded:
  """A jitted program that records its calls and still lowers."""

  def __init__(self, fn, calls):
    self.fn, self.calls = fn, calls

  def __call__(self, *args, **kwargs):
    self.calls.append((args, kwargs))
    return self.fn(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self.fn.lower(*args, **kwargs)


def _run_one_step(tmp_path, monkeypatch, **overrides):
  """One trainer step; returns the spec, the built programs and what each was called with."""
  assets = rl_driver.write_assets(tmp_path)
  c = rl_driver.tiny_config(assets["tok"], assets["data"], 1)
  for k, v in overrides.items():
    section, field = k.split("__")
    c[section][field] = v
  seen = {"train": [], "logprobs": [], "decode": []}
  built = []
  real_build = programs_lib.build

  def build(spec, model_cfg, mesh):
    progs = real_build(spec, model_cfg, mesh)
    progs = dataclasses.replace(
      progs,
      train_step=_Recorded(progs.train_step, seen["train"]),
      logprobs=dataclasses.replace(
        progs.logprobs, fn=_Recorded(progs.logprobs.fn, seen["logprobs"])
      ),
    )
    built.append(progs)
    return progs

  monkeypatch.setattr(programs_lib, "build", build)
  monkeypatch.setattr(engine, "decode_loop", _Recorded(engine.decode_loop, seen["decode"]))
  rl_driver.train(c, tmp_path / "run", grader=rl_driver.HashGrader())
  return RunSpec.from_config(c, num_devices=1), built[0], seen


@pytest.mark.parametrize(
  "overrides",
  [
    {},  # packed, full fine-tuning, the noise mask's reference pass
    # LoRA adapters through the packed passes (slow: the default suite keeps to 10 min)
    pytest.param({"model__lora_rank": 2, "mesh__reduce_once": False}, marks=pytest.mark.slow),
  ],
  ids=["packed", "lora"],
)
def test_aot_lowers_the_programs_the_trainer_ran(tmp_path, monkeypatch, overrides):
  spec, progs, seen = _run_one_step(tmp_path, monkeypatch, **overrides)
  assert spec.train.pack and spec.needs_reference
  assert len(seen["train"]) == spec.updates_per_step and len(seen["logprobs"]) >= 2
  mesh = spec.make_mesh()
  lowerables = {p.name: p for p in aot_programs.trainer_programs(spec, mesh)}
  # The old-policy pass runs first (with LoRA's adapters when set), then the reference's.
  old = seen["logprobs"][0]
  ref = next(
    call
    for call in seen["logprobs"][1:]
    if "adapters" not in call[1] or call[1]["adapters"] is None
  )
  for name, (args, kwargs), fn in (
    ("train", seen["train"][0], progs.train_step),
    ("logprobs", old, progs.logprobs.fn),
    ("logprobs_ref", ref, progs.logprobs.fn),
  ):
    lw = lowerables[name]
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    lw_kwargs = {k: v for k, v in lw.kwargs.items() if v is not None}
    # The AOT's abstract arguments have the structure, dtypes and ranks of the real ones ...
    assert jax.tree.structure((lw.args, lw_kwargs)) == jax.tree.structure((args, kwargs)), name
    for a, b in zip(jax.tree.leaves((lw.args, lw_kwargs)), jax.tree.leaves((args, kwargs))):
      assert a.dtype == b.dtype and len(a.shape) == len(b.shape), (name, a, b)
      # The AOT's shapes bound the run's (the largest a step can give).
      assert all(x >= y for x, y in zip(a.shape, b.shape)), (name, a.shape, b.shape)
    # ... and its program, lowered on the trainer's arguments, is the trainer's.
    real = _abstract((args, kwargs))
    assert lw.fn.lower(*real[0], **real[1]).as_text() == fn.lower(*args, **kwargs).as_text(), name

  # The engine: the AOT compiles the plan the sampler ran (slots, tail loops, strategy).
  aot_prefill, _ = aot_programs.sampler_programs(spec, progs.model_cfg, mesh)
  ran = seen["decode"][0][1]["plan"]
  assert aot_prefill.kwargs["plan"] == ran.prefill_plan
  assert aot_programs.sampler_plan(spec, progs.model_cfg, mesh) == ran
