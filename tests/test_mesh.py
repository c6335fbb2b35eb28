"""Mesh construction and the train / sampling sharding rules."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import jax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from capo_jax.runtime import mesh as mesh_lib
from models import qwen2
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


def test_sampling_rules_replicate_over_data_and_fsdp():
  cfg = Qwen2Config.tiny()
  specs = qwen2.param_specs(cfg, mesh_lib.SAMPLING_RULES, MESH_222)
  assert specs["embed"] == P("tensor", None)
  assert specs["layers"]["q_kernel"] == P(None, None, "tensor", None)
  assert specs["layers"]["down_kernel"] == P(None, "tensor", None)
  for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
    flat = [a for d in s if d is not None for a in ((d,) if isinstance(d, str) else d)]
    assert "data" not in flat and "fsdp" not in flat


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
