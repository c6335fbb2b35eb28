"""Mesh construction and the train / sampling sharding rules."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import textwrap
import types

import jax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from capo_jax.runtime import mesh as mesh_lib
from models import qwen2, sharding
from models.config import Qwen2Config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_make_mesh_one_device_forms():
  n = len(jax.devices())
  m = mesh_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  assert m.axis_names == ("data", "fsdp", "tensor") and m.shape["data"] == n
  m = mesh_lib.make_mesh([("fsdp", 1), ("data", -1)])
  assert m.axis_names == ("fsdp", "data", "tensor") and m.devices.size == n


@pytest.mark.parametrize(
  "axes, match",
  [
    ({"data": 1, "fsdp": 2 * len(jax.devices()), "tensor": 1}, "fsdp="),
    ({"data": -1, "tensor": -1}, "only one axis may be -1"),
    ({"data": 0}, "data=0"),
    ({"data": 1, "fsdp": 3 * len(jax.devices()), "tensor": -1}, "does not divide"),
  ],
)
def test_make_mesh_errors_name_the_field(axes, match):
  with pytest.raises(ValueError, match=match):
    mesh_lib.make_mesh(axes)


MESH_222 = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))


def test_train_rules_shard_params_over_fsdp_and_tensor():
  cfg = Qwen2Config.tiny(tie_word_embeddings=False)  # D 64, N 4, K 2, F 128, V 256
  specs = qwen2.param_specs(cfg, mesh_lib.TRAIN_RULES, MESH_222)
  assert specs["embed"] == P("tensor", "fsdp")
  assert specs["lm_head"] == P("fsdp", "tensor")
  assert specs["final_norm"] == P(None)
  lay = specs["layers"]
  assert lay["q_kernel"] == P(None, "fsdp", "tensor", None)
  assert lay["k_kernel"] == P(None, "fsdp", "tensor", None)
  assert lay["o_kernel"] == P(None, "tensor", None, "fsdp")
  assert lay["gate_kernel"] == P(None, "fsdp", "tensor")
  assert lay["down_kernel"] == P(None, "tensor", "fsdp")
  assert lay["q_bias"] == P(None, "tensor", None)
  assert lay["attn_norm"] == P(None, None)


# A sampling mesh: 2 rows shards x a group of 4 chips (2 kv-head halves x 2 query halves).
SAMPLING_2122 = AbstractMesh((2, 1, 2, 2), ("data", "fsdp", "tensor", "tensor_q"))
GROUP = ("tensor", "tensor_q")


def test_sampling_rule_table_splits_each_weight_over_the_tensor_group():
  cfg = Qwen2Config.tiny(num_heads=8, num_kv_heads=2, tie_word_embeddings=False)
  specs = qwen2.param_specs(cfg, mesh_lib.SAMPLING_RULES, SAMPLING_2122)
  want = {
    "embed": P(GROUP, None),  # [V, D]
    "lm_head": P(None, GROUP),  # [D, V]
    "final_norm": P(None),
    "layers": {
      "q_kernel": P(None, None, "tensor", None),  # [L, D, N, H]: a kv head's 4 query heads
      "k_kernel": P(None, None, "tensor", None),  # [L, D, K, H]: one kv head a chip pair
      "v_kernel": P(None, None, "tensor", None),
      "o_kernel": P(None, "tensor", None, None),  # [L, N, H, D]
      "q_bias": P(None, "tensor", None),
      "k_bias": P(None, "tensor", None),
      "v_bias": P(None, "tensor", None),
      "gate_kernel": P(None, None, GROUP),  # [L, D, F]
      "up_kernel": P(None, None, GROUP),
      "down_kernel": P(None, GROUP, None),  # [L, F, D]
      "attn_norm": P(None, None),
      "mlp_norm": P(None, None),
    },
  }
  assert specs == want
  # Per chip: 1 / 4 of the MLP and vocabulary, 1 / 2 of the attention's (whole kv heads
  # with their query heads: tensor_q splits the attention's rows instead), norms whole.
  shapes = qwen2.param_shapes(cfg)
  mesh = {"data": 2, "fsdp": 1, "tensor": 2, "tensor_q": 2}
  split = lambda s: math.prod(  # noqa: E731
    mesh[a] for d in s if d is not None for a in ((d,) if isinstance(d, str) else d)
  )
  per_chip = jax.tree.map(lambda x, s: x.size // split(s), shapes, specs)
  assert per_chip["layers"]["gate_kernel"] == shapes["layers"]["gate_kernel"].size // 4
  assert per_chip["layers"]["q_kernel"] == shapes["layers"]["q_kernel"].size // 2
  assert per_chip["layers"]["k_kernel"] == shapes["layers"]["k_kernel"].size // 2
  # The KV cache and the attention's activations: rows over data x tensor_q, kv heads
  # over tensor; the other activations' rows over data only (whole in the group).
  rules = mesh_lib.SAMPLING_RULES
  cache = sharding.logical_to_spec(("attn_batch", "kv_heads"), rules, (8, 2), SAMPLING_2122)
  assert cache == P(("data", "fsdp", "tensor_q"), "tensor"), cache
  rows = sharding.logical_to_spec(("batch", "act_embed"), rules, (8, 64), SAMPLING_2122)
  assert rows == P(("data", "fsdp"), None), rows


def test_sampling_rules_need_a_sampling_mesh():
  with pytest.raises(ValueError, match="no axis 'tensor_q'"):
    qwen2.param_specs(Qwen2Config.tiny(), mesh_lib.SAMPLING_RULES, MESH_222)


@pytest.mark.parametrize(
  "heads, tensor, want",
  [
    ((12, 2), 1, (1, 1)),
    ((12, 2), 2, (2, 1)),  # Qwen2.5-1.5B: a kv head a chip
    ((12, 2), 4, (2, 2)),  # ... then the attention's rows over 2
    ((12, 2), 8, (2, 4)),  # 12 query heads need not split over 8
    ((12, 2), 3, (1, 3)),  # kv heads whole, the attention's rows over 3
    ((28, 4), 4, (4, 1)),  # Qwen2.5-7B
    ((28, 4), 2, (2, 1)),  # two kv heads a chip
    ((28, 4), 8, (4, 2)),
    ((28, 4), 6, (2, 3)),
  ],
)
def test_tensor_split(heads, tensor, want):
  cfg = Qwen2Config.tiny(num_heads=heads[0], num_kv_heads=heads[1], hidden_size=8 * heads[0])
  assert mesh_lib.tensor_split(cfg, tensor) == want


@pytest.mark.parametrize("tensor", [0, -2])
def test_tensor_split_refuses_no_chips(tensor):
  with pytest.raises(ValueError, match=f"group of {tensor} chips"):
    mesh_lib.tensor_split(Qwen2Config.tiny(), tensor)


def test_auto_sampling_tensor_takes_a_hosts_chips():
  host = lambda i: types.SimpleNamespace(process_index=i)  # noqa: E731
  v4_32 = [host(i // 4) for i in range(16)]  # 4 hosts of 4 chips
  assert mesh_lib.auto_sampling_tensor(v4_32) == 4
  assert mesh_lib.auto_sampling_tensor([host(i // 8) for i in range(64)]) == 8
  assert mesh_lib.auto_sampling_tensor([host(i) for i in range(8)]) == 1  # a chip a host
  assert mesh_lib.auto_sampling_tensor([host(0)] * 6 + [host(1)] * 6) == 6
  # The host's chips must also divide all devices: 6 of 9 do not; 3 do.
  assert mesh_lib.auto_sampling_tensor([host(0)] * 6 + [host(1)] * 3) == 3


def test_strided_groups_keep_a_group_on_one_host():
  # v4-32's train mesh order interleaves the 4 hosts (tools: make_mesh on its topology).
  interleaved = [0, 1, 2, 3] * 4
  assert mesh_lib.strided_groups(interleaved, 4)  # devices 0, 4, 8, 12: host 0
  assert not mesh_lib.strided_groups(sorted(interleaved), 4)  # consecutive already
  assert not mesh_lib.strided_groups([0] * 8, 4)  # one host: consecutive
  assert not mesh_lib.strided_groups([0, 1, 1, 0], 2)  # neither: consecutive


def test_non_dividing_axes_replicate_with_a_log_line(caplog):
  cfg = Qwen2Config.tiny(num_heads=3, num_kv_heads=1, hidden_size=48, vocab_size=255)
  with caplog.at_level(logging.INFO):
    specs = qwen2.param_specs(cfg, mesh_lib.TRAIN_RULES, MESH_222)
  assert specs["layers"]["k_kernel"] == P(None, "fsdp", None, None)  # K = 1 on tensor 2
  assert specs["embed"] == P(None, "fsdp")  # V = 255 on tensor 2
  assert "not divisible" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.INFO):
    assert mesh_lib.batch_spec(MESH_222, mesh_lib.TRAIN_RULES, 8) == P(("data", "fsdp"))
    assert mesh_lib.batch_spec(MESH_222, mesh_lib.TRAIN_RULES, 6) == P("data")
    assert mesh_lib.batch_spec(MESH_222, mesh_lib.TRAIN_RULES, 3) == P(None)
  assert "batch" in caplog.text and "not divisible" in caplog.text


_EIGHT_DEVICES = textwrap.dedent("""
    import jax, numpy as np
    from capo_jax.runtime import mesh as mesh_lib
    from tests import host_utils
    assert len(jax.devices()) == 8
    m = mesh_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": -1})
    assert dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}, m.shape
    try:
      mesh_lib.make_mesh({"data": 4, "fsdp": 4})
      raise SystemExit("no error for a 16-device mesh")
    except ValueError as e:
      assert "data=4, fsdp=4" in str(e) and "8 are available" in str(e), e
    small = mesh_lib.make_mesh({"data": 2, "fsdp": 1, "tensor": 1})
    assert small.devices.size == 2
    batch = {"x_BC": np.arange(16 * 3).reshape(16, 3), "y_B": np.arange(16)}
    out = host_utils.shard_batch(batch, m, mesh_lib.TRAIN_RULES)
    shards = out["x_BC"].addressable_shards
    assert len(shards) == 8 and {s.data.shape for s in shards} == {(4, 3)}
    for s in shards:  # each device holds the rows its (data, fsdp) index names
      np.testing.assert_array_equal(np.asarray(s.data), batch["x_BC"][s.index])
    np.testing.assert_array_equal(np.asarray(out["y_B"]), batch["y_B"])
    # The sampler's mesh: the same devices in the same order, as rows x a group of 4.
    from models.config import Qwen2Config
    cfg = Qwen2Config.tiny(num_heads=8, num_kv_heads=2)
    sm = mesh_lib.sampling_mesh(m, cfg, 4)
    assert dict(sm.shape) == {"data": 2, "fsdp": 1, "tensor": 2, "tensor_q": 2}, sm.shape
    assert list(sm.devices.flat) == list(m.devices.flat)
    assert dict(mesh_lib.sampling_mesh(m, cfg).shape)["tensor"] == 2  # auto: the kv heads
    print("OK")
""")


def test_eight_fake_devices():
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO,
    XLA_FLAGS=("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"),
  )
  res = subprocess.run(
    [sys.executable, "-c", _EIGHT_DEVICES],
    env=env,
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
