"""The shared-prefix (tree) attention of ``models.shared_prefix`` against independent
references: the mask against a loop over every pair, the two merged splash calls
(Pallas interpret mode) against the full score matrix under that mask, values and
gradients."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, shared_prefix

# Two rows of 256 columns. Row 0: a prompt [0, 40) with completions [40, 100), [100, 130),
# then a second group, prompt [130, 150) and completion [150, 240), then padding. Row 1:
# one prompt [0, 10) and four completions, the last ending at the row's end.
ROWS = [
  [(1, 0, 0, 40), (1, 1, 40, 100), (1, 2, 100, 130), (2, 0, 130, 150), (2, 1, 150, 240)],
  [(1, 0, 0, 10), (1, 1, 10, 70), (1, 2, 70, 71), (1, 3, 71, 200), (1, 4, 200, 256)],
]
T, N, K, H = 256, 4, 2, 128


def _ids() -> tuple[np.ndarray, np.ndarray]:
  seg, branch = np.zeros((2, T), np.int32), np.zeros((2, T), np.int32)
  for b, row in enumerate(ROWS):
    for s, r, lo, hi in row:
      seg[b, lo:hi], branch[b, lo:hi] = s, r
  return seg, branch


def test_tree_mask_is_causal_within_a_group_and_hides_sibling_branches():
  seg, branch = _ids()
  got = np.asarray(shared_prefix.tree_mask(jnp.asarray(seg), jnp.asarray(branch)))
  for b in range(2):
    for t in range(T):
      for s in range(T):
        same = seg[b, t] == seg[b, s]
        seen = branch[b, s] == 0 or branch[b, s] == branch[b, t]
        assert got[b, t, s] == (s <= t and same and seen), (b, t, s)


def _inputs(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, T, N, H)), dtype)
  k = jnp.asarray(rng.normal(size=(2, T, K, H)), dtype)
  v = jnp.asarray(rng.normal(size=(2, T, K, H)), dtype)
  w = jnp.asarray(rng.normal(size=(2, T, N, H)), jnp.float32)
  return q, k, v, w


def test_two_splash_calls_merged_equal_the_tree_masked_reference():
  seg, branch = map(jnp.asarray, _ids())
  q, k, v, w = _inputs()
  real = (seg > 0)[..., None, None]  # padding rows attend among themselves: not compared

  def loss(f):
    return lambda q, k, v: jnp.sum(jnp.where(real, f(q, k, v), 0.0) * w)

  tree = lambda q, k, v: shared_prefix.splash(q, k, v, seg, branch, prompt_cols=128, block=128)
  ref = lambda q, k, v: shared_prefix.reference(q, k, v, seg, branch)
  got, want = jax.jit(tree)(q, k, v), ref(q, k, v)
  np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-6)
  g_got = jax.jit(jax.grad(loss(tree), (0, 1, 2)))(q, k, v)
  g_want = jax.grad(loss(ref), (0, 1, 2))(q, k, v)
  for name, a, b in zip("qkv", g_got, g_want):
    scale = float(jnp.abs(b).max())
    np.testing.assert_allclose(a, b, atol=2e-6 * scale, err_msg=f"d{name}")


def test_without_branches_it_is_the_causal_segment_attention():
  seg, _ = map(jnp.asarray, _ids())
  q, k, v, _ = _inputs()
  zero = jnp.zeros_like(seg)
  got = shared_prefix.splash(q, k, v, seg, zero, prompt_cols=128, block=128)
  want = attention.splash(q, k, v, seg, block=128, interpret=True)
  np.testing.assert_allclose(got, want, atol=2e-6)


def test_prompt_cols_must_be_whole_tiles():
  seg, branch = map(jnp.asarray, _ids())
  q, k, v, _ = _inputs()
  with pytest.raises(ValueError, match="prompt_cols=100"):
    shared_prefix.splash(q, k, v, seg, branch, prompt_cols=100)


@pytest.mark.tpu_aot
@pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed; run from tools/.venv-tpu (tools/setup_aot_tpu.sh)",
)
def test_both_calls_lower_for_tpu_and_the_prompt_call_costs_its_columns():
  """Forward and backward compiled for a v5e-8 from this CPU host: two kernels forward
  (the own causal call, the prompt call), six backward (both forwards for their
  residuals, each call's dq and dkv); FLOPs counted by hand per block pair."""
  from capo_jax.run import hlo_cost, tpu_topology  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator("v5e-8")
  tpu_topology.set_tpu_env(acc)
  mesh = jax.sharding.Mesh(tpu_topology.topology_devices(acc)[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  B, T, P, block = 2, 1024, 256, 512
  q = jax.ShapeDtypeStruct((B, T, N, H), "bfloat16", sharding=rep)
  kv = jax.ShapeDtypeStruct((B, T, K, H), "bfloat16", sharding=rep)
  ids = jax.ShapeDtypeStruct((B, T), "int32", sharding=rep)
  f = lambda q, k, v, s, b: shared_prefix.splash(
    q, k, v, s, b, prompt_cols=P, block=block, interpret=False
  )
  loss = lambda q, k, v, s, b: f(q, k, v, s, b).astype("float32").sum()
  fwd = jax.jit(f).lower(q, kv, kv, ids, ids).compile().as_text()
  bwd = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv, ids, ids).compile().as_text()
  assert fwd.count("tpu_custom_call") == 2 and bwd.count("tpu_custom_call") == 6
  matmul = 2 * B * N * block * block * H  # one matmul of one [512, 512] block pair
  own = 3 * matmul  # causal over 2 x 2 blocks: 3 pairs
  prompt = 2 * matmul * P // block  # 2 query blocks x the 256 prompt columns
  assert hlo_cost.hlo_cost(fwd)["flops"] == 2 * (own + prompt)  # scores and output
  assert hlo_cost.hlo_cost(bwd)["flops"] == (2 + 4 + 3) * (own + prompt)
