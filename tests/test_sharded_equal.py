"""On 8 fake CPU devices (data 2, fsdp 2, tensor 2) the log-prob pass and the train step,
with their activations constrained to the train rules (rows over data x fsdp, heads /
MLP / vocab over tensor, weights gathered per layer), equal one device's: packed and
one sequence per row, full fine-tuning and LoRA; and, packed, with the weights gathered
once per pass and per update (``config.mesh.gather_once``) on the eight devices; and,
one sequence per row (two micro-batches), with each shard's gradient summed over the
micro-batches where it lies and reduced once an update (``config.mesh.reduce_once``);
and, packed, the pass with each call's rows over all eight devices on a whole copy
(``config.mesh.logprob_data_parallel``).

The child process runs each case on both meshes from the same host arrays and prints
the largest differences; the test holds them to 1e-6.
"""

from __future__ import annotations

import json

import pytest

import fake_devices

TOL = 1e-6


def _case(
  pack: bool,
  use_lora: bool,
  gather_once: bool = False,
  reduce_once: bool = False,
  dp_pass: bool = False,
) -> dict[str, float]:
  import jax
  import numpy as np

  from batches import HostBatch, padded_pass, run_pass
  from capo_jax.rl import microbatches
  from capo_jax.rl import train_state as state_lib
  from capo_jax.rl import train_step as ts
  from capo_jax.rl.optim import OptimConfig
  from capo_jax.runtime import mesh as mesh_lib
  from models import lora as lora_lib
  from models import qwen2
  from models.config import Qwen2Config

  cfg = Qwen2Config.tiny()  # D 64, N 4, K 2, F 128, V 256: every axis divides by 2
  B, P, C, Y = 8, 6, 10, 4
  lcfg = lora_lib.LoraConfig(rank=4, alpha=8.0) if use_lora else None
  tcfg = state_lib.TrainConfig(
    optim=OptimConfig(learning_rate=1e-3, eps=1e-2), lora=lcfg, logprob_chunk_size=4
  )
  # One device is the reference: it runs without gathering once, the eight with it.
  tcfg_eight = tcfg.replace(gather_once=gather_once, reduce_once=reduce_once)
  rules = mesh_lib.TRAIN_RULES
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 256, (B, P)).astype(np.int32)
  pmask = (np.arange(P)[None] >= rng.integers(0, P - 1, (B, 1))).astype(np.int32)
  comp = rng.integers(0, 256, (B, C)).astype(np.int32)
  cmask = (np.arange(C)[None] < rng.integers(1, C + 1, (B, 1))).astype(np.int32)
  adv = rng.normal(size=(B,)).astype(np.float32)
  base = jax.tree.map(np.asarray, qwen2.init_params(cfg, jax.random.key(1)))
  adapters = None
  if lcfg is not None:  # B != 0, so the adapters change the pass
    adapters = lora_lib.init_adapters(qwen2.param_shapes(cfg), lcfg, jax.random.key(2))
    adapters = jax.tree.map(
      lambda x: np.asarray(x) + 0.05 * rng.normal(size=x.shape).astype(np.float32), adapters
    )
  row_len = 2 * (P + C) if pack else 0
  layout = microbatches.RowLayout(row_len, Y, pack)
  out = {}
  for name, axes, devs in (
    ("one", {"data": 1}, jax.devices()[:1]),
    ("eight", {"data": 2, "fsdp": 2, "tensor": 2}, None),
  ):
    mesh = mesh_lib.make_mesh(axes, devices=devs)
    trained = adapters if lcfg is not None else base
    state = state_lib.train_state_from_params(trained, cfg, tcfg, mesh, rules)
    p_sh = mesh_lib.param_shardings(cfg, mesh, rules)
    base_dev = jax.device_put(base, p_sh)
    once = gather_once and name == "eight"
    if dp_pass and once:  # config.mesh.logprob_data_parallel: a call's rows over all 8 chips
      lp = padded_pass(
        cfg,
        mesh,
        mesh_lib.PASS_RULES,
        8,
        chunk_size=4,
        layout=microbatches.RowLayout(row_len, 8, pack),
        gather_once=True,
        gathered=mesh_lib.PASS_RULES,
      )
    else:
      lp = padded_pass(
        cfg, mesh, rules, Y, chunk_size=4, lora=lcfg, layout=layout, gather_once=once
      )
    args = (base_dev, (prompt, pmask, comp, cmask), ("logp_BC", "entropy_BC"))
    got = run_pass(lp, *args, adapters=state.params if lcfg else None)
    old = got["logp_BC"] - 0.1 * adv[:, None]
    batch = HostBatch(prompt, pmask, comp, cmask, old, adv)
    step = ts.make_train_step(cfg, tcfg_eight if once else tcfg, mesh, rules, Y)
    extra = (base_dev,) if lcfg else ()
    tb = batch.train_batch(Y, pack=pack, row_len=row_len)
    # reduce_once accumulates each shard's share over the micro-batches: two or more.
    assert not reduce_once or tb.index_MBC.shape[0] > 1, tb.index_MBC.shape
    state, met = step(state, tb, *extra)
    out[name] = dict(
      pass_=got,
      params=jax.tree.map(np.asarray, state.params),
      loss=float(met["loss"]),
      grad_norm=float(met["grad_norm"]),
    )
  one, eight = out["one"], out["eight"]
  diff = lambda a, b: max(
    float(np.abs(np.asarray(x) - np.asarray(y)).max())  # noqa: E731
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  moved = diff(one["params"], adapters if lcfg else base)
  return {
    "pass": diff(one["pass_"], eight["pass_"]),
    "params": diff(one["params"], eight["params"]),
    "loss": abs(one["loss"] - eight["loss"]),
    "grad_norm_rel": abs(one["grad_norm"] / eight["grad_norm"] - 1),
    "moved": moved,
  }


def _child() -> None:
  results = {f"pack={p} lora={lo}": _case(p, lo) for p in (False, True) for lo in (False, True)}
  for lo in (False, True):
    results[f"pack=True lora={lo} gather_once"] = _case(True, lo, gather_once=True)
  results["pack=False lora=False gather_once reduce_once"] = _case(
    False, False, gather_once=True, reduce_once=True
  )
  results["pack=True lora=False gather_once logprob_data_parallel"] = _case(
    True, False, gather_once=True, dp_pass=True
  )
  print("RESULTS " + json.dumps(results))


@pytest.mark.slow  # ~1-2 min on 2 cores: eight small compiles; .ci/run runs it
def test_sharded_pass_and_step_equal_one_device():
  results = fake_devices.child_results(__file__, fast_compile=True, timeout=900)
  assert len(results) == 8
  for case, r in results.items():
    assert r["moved"] > 1e-5, (case, r)  # the step did something to compare
    for key in ("pass", "params", "loss", "grad_norm_rel"):
      assert r[key] <= TOL, (case, key, r)


if __name__ == "__main__":
  _child()
