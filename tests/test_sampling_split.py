"""The sampler with its weights split over a tensor group equals the one-device sampler.

On 8 fake CPU devices, ``capo_jax.runtime.mesh.sampling_mesh`` lays the devices out
as rows (data) x a tensor group; ``SAMPLING_RULES`` put 1 / group of each weight on
each chip of the group's MLP and vocabulary, and of the attention's weights 1 / the kv
heads (the KV cache's rows split over the rest of the group, its kv heads over them).
The child process samples the same prompts on one device and on each split, with
continuous batching (refills and tail phases) at float32, top-k (whole vocabulary rows)
and, for a group of 4, plain temperature (drawn inside the vocabulary shards,
``capo_jax.sampling.choice``), and checks the tokens are equal and the log-probs within
1e-5: the split reorders the reductions (the
attention output and MLP down projections, and the unembedding, sum per-chip partial
products across the group), so the two are not bitwise equal.

Also the run's own path: ``setup.policy_weights``' ``to_sampling`` reshards the
train params onto the sampling mesh in one program, and the trainer's sampler
layout (``programs.sampling_layout``, ``config.mesh.sampling_tensor``) uses it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = textwrap.dedent("""
    import dataclasses, math
    import jax, numpy as np
    from capo_jax.rl import train_step as ts
    from capo_jax.run import programs, setup
    from capo_jax.run.spec import RunSpec
    from capo_jax.runtime import mesh as mesh_lib
    from capo_jax.sampling import sampler as sampling, strategies
    from configs import common
    from models import qwen2
    from models.config import Qwen2Config
    from models.sharding import Layout
    assert jax.device_count() == 8

    def peaked(cfg):  # std 0.15 weights: draws far from uniform, as tests/test_engine.py
      p = qwen2.init_params(cfg, jax.random.key(0))
      return jax.tree_util.tree_map_with_path(
          lambda k, x: x if "norm" in jax.tree_util.keystr(k) else 7.5 * x, p)

    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 256, (4, 9)); mask = np.ones((4, 9), int); mask[1, :5] = 0
    # 16 rows in 8 slots: refills, then tail loops of fewer slots.
    spec = sampling.SamplingSpec(num_samples=4, max_new_tokens=12, max_active_rows=8,
                                 strategy=strategies.TopK(temperature=0.9, k=40), stop_ids=(7,))

    def same(one, split, what):
      np.testing.assert_array_equal(np.asarray(one.tokens_BC), np.asarray(split.tokens_BC), what)
      np.testing.assert_array_equal(np.asarray(one.mask_BC), np.asarray(split.mask_BC), what)
      d = np.abs(np.asarray(one.logprobs_BC) - np.asarray(split.logprobs_BC)).max()
      assert d <= 1e-5, (what, d)
      print(what, "max |log-prob difference|", d)

    # 1. Explicit groups on a tied model (the unembedding is the vocab-split embedding).
    cfg = Qwen2Config.tiny(num_heads=8, num_kv_heads=2, vocab_size=384)
    params = peaked(cfg)
    one = sampling.generate(params, cfg, tokens, mask, jax.random.key(1), spec)
    train_mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    for t, want in ((4, (2, 1, 2, 2)), (8, (1, 1, 2, 4))):
      layout = Layout.of(mesh_lib.sampling_mesh(train_mesh, cfg, t), mesh_lib.SAMPLING_RULES)
      assert tuple(layout.mesh.shape.values()) == want, layout.mesh.shape
      placed = jax.device_put(params, qwen2.param_shardings(cfg, layout))
      # Each chip holds 1 / t of the MLP / vocab weights, 1 / 2 of the attention's (a kv
      # head and its query heads); past the kv heads the group splits the attention's rows.
      lay = placed["layers"]
      q, k, g, e = (lay["q_kernel"], lay["k_kernel"], lay["gate_kernel"], placed["embed"])
      assert q.addressable_shards[0].data.size * 2 == q.size
      assert k.addressable_shards[0].data.size * 2 == k.size
      assert g.addressable_shards[0].data.size * t == g.size
      assert e.addressable_shards[0].data.size * t == e.size
      same(one, sampling.generate(placed, cfg, tokens, mask, jax.random.key(1), spec, layout),
           f"tensor group {t}")
      if t == 4:  # plain temperature: the draw inside the vocabulary shards (choice.py)
        spec_t = dataclasses.replace(spec, strategy=strategies.Temperature(0.9))
        same(sampling.generate(params, cfg, tokens, mask, jax.random.key(1), spec_t),
             sampling.generate(placed, cfg, tokens, mask, jax.random.key(1), spec_t, layout),
             "temperature, drawn inside the vocabulary shards")

    # 2. The run's path: train params (fsdp) -> to_sampling -> the sampler's own mesh.
    c = common.shrink(common.get_base_config())
    c.model.preset_overrides.num_heads = 8
    c.mesh.sampling_tensor = 4
    run = RunSpec.from_config(c, num_devices=8, policy_given=True)
    cfg = run.model_config()
    params = peaked(cfg)
    mesh = run.make_mesh()
    layout = programs.sampling_layout(run, cfg, mesh)
    assert dict(layout.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2, "tensor_q": 2}
    train_params, w = setup.policy_weights(run, cfg, setup.Policy(cfg, params),
                                           run.train_config(), mesh, mesh_lib.TRAIN_RULES)
    assert train_params["layers"]["q_kernel"].sharding.mesh == mesh
    sampling_params = w.to_sampling(train_params)
    want_sh = qwen2.param_shardings(cfg, layout)
    for got, want in zip(jax.tree.leaves(sampling_params), jax.tree.leaves(want_sh)):
      assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)
    one = sampling.generate(params, cfg, tokens, mask, jax.random.key(1), spec)
    same(one, sampling.generate(sampling_params, cfg, tokens, mask, jax.random.key(1), spec,
                                layout), "the run's sampling layout")
    print("OK")
""")


@pytest.mark.slow  # ~1-2 min on 2 cores: three sharded engines compile; .ci/run runs it
def test_split_sampler_equals_one_device():
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO,
    XLA_FLAGS="--xla_force_host_platform_device_count=8",
  )
  proc = subprocess.run(
    [sys.executable, "-c", _CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
  )
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
  print(proc.stdout)
