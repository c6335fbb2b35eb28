"""The chunked unembedding on a mesh (``capo_jax/rl/chunked_unembed.py``), on 8 fake CPU
devices: its log-probs, entropy, top-k, argmax and gradients equal one device's (the
plain ``lax.scan`` path), with the vocabulary whole and split over tensor. That the
compiled gradient moves the [D, V] weight over the mesh once per call, not once per
chunk (what the module is for), only the TPU compiler shows: XLA:CPU hoists the plain
path's per-chunk collectives itself (``tests/test_aot_tpu.py``,
``test_unembedding_moves_once_per_call``).
"""

from __future__ import annotations

import json

import pytest

import fake_devices

TOL = 2e-5


def _child() -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from capo_jax.rl import logprobs as lp_lib
  from capo_jax.runtime import mesh as mesh_lib
  from models import qwen2, sharding
  from models.config import Qwen2Config

  cfg = Qwen2Config.tiny()  # D 64, V 256
  B, C, J = 8, 10, 3  # 5 chunks of 2
  rng = np.random.default_rng(0)
  params = jax.tree.map(np.asarray, qwen2.init_params(cfg, jax.random.key(0)))
  h = rng.normal(size=(B, C, cfg.hidden_size)).astype(np.float32)
  tokens = rng.integers(0, cfg.vocab_size, (B, C)).astype(np.int32)
  mask = (np.arange(C)[None] < rng.integers(1, C + 1, (B, 1))).astype(np.int32)
  ids = rng.integers(0, cfg.vocab_size, (B, C, J)).astype(np.int32)
  weights = rng.normal(size=(B, C)).astype(np.float32)

  def run(layout, top_k, given, temperature):
    def loss(p, h_):
      with sharding.activations(layout):
        targets = lp_lib.Targets(h_, tokens, mask, ids if given else None)
        out = lp_lib.logprobs_from_hidden(
          p, cfg, targets, chunk_size=2, top_k=top_k, temperature=temperature
        )
      total = jnp.sum(out["logp_BC"] * weights)
      if "topk_logp_BCJ" in out:
        total += 0.5 * jnp.sum(out["topk_logp_BCJ"])
      return total, out

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    p, h_ = params, h
    if layout is not None:
      p = jax.device_put(params, mesh_lib.param_shardings(cfg, layout.mesh, layout.rules))
      h_ = layout.put(h, ("batch", None, None))
    (_, out), grads = fn(p, h_)
    return out, grads

  diff = lambda a, b: max(
    float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  results = {}
  cases = ((0, False, 1.0), (J, False, 0.7), (0, True, 1.0))
  refs = {case: run(None, *case) for case in cases}  # one device: the same for each mesh
  for axes in ({"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 8}):
    layout = sharding.Layout.of(mesh_lib.make_mesh(axes), mesh_lib.TRAIN_RULES)
    for top_k, given, temperature in cases:
      ref_out, ref_grads = refs[top_k, given, temperature]
      out, grads = run(layout, top_k, given, temperature)
      results[f"{axes} top_k={top_k} given={given} t={temperature}"] = {
        "out": diff(ref_out, out),
        "grads": diff(ref_grads, grads),
        "argmax_same": bool(
          "is_argmax_BC" not in out
          or (np.asarray(out["is_argmax_BC"]) == np.asarray(ref_out["is_argmax_BC"])).all()
        ),
        "ids_same": bool(
          "topk_ids_BCJ" not in out
          or (np.asarray(out["topk_ids_BCJ"]) == np.asarray(ref_out["topk_ids_BCJ"])).all()
        ),
        "grad_scale": float(max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(ref_grads))),
      }
  print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def results() -> dict:
  return fake_devices.child_results(__file__)


def test_mesh_equals_one_device(results: dict) -> None:
  assert len(results) == 6
  for case, r in results.items():
    assert r["grad_scale"] > 1e-3, (case, r)  # gradients that can differ
    assert r["out"] <= TOL and r["grads"] <= TOL, (case, r)
    assert r["argmax_same"] and r["ids_same"], (case, r)


if __name__ == "__main__":
  _child()
