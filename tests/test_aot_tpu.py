"""Ahead-of-time TPU compilation of a tiny run's programs (capo_jax.run.aot), on a CPU host.

Needs libtpu (``jax[tpu]`` at the pinned jax version), which the default venv
does not have: these tests skip there. Run them from the TPU venv:

  tools/setup_aot_tpu.sh
  tools/.venv-tpu/bin/python -m pytest -q tests/test_aot_tpu.py

They compile the decode loop and the train step of the shrunk 1.5B config for
a v5e-8 topology (2x4 chips, one host) over a (1, 4, 2) mesh, and check that
XLA's TPU memory and cost analyses come back and that the compiled programs
take their inputs in the shardings the rules give; and jax's Pallas splash
attention kernel standalone, to show TPU kernels compile here too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from capo_jax.rl import train_step as ts
from capo_jax.run import aot, aot_programs, hlo_cost, programs, tpu_topology
from capo_jax.run import spec as spec_lib
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.sampling import ragged, slots
from configs import capo_qwen2p5_math_1p5b
from models import attention, qwen2, sharding

pytestmark = [
  pytest.mark.tpu_aot,
  pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (the default venv is CPU-only); run from "
    "tools/.venv-tpu, made by tools/setup_aot_tpu.sh",
  ),
]

ACCELERATOR = "v5e-8"


@pytest.fixture(scope="module")
def compiled():
  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  c = capo_qwen2p5_math_1p5b.get_config("shrink")
  c.mesh.fsdp, c.mesh.tensor = -1, 2
  spec = spec_lib.RunSpec.from_config(
    c, num_devices=len(tpu_topology.topology_devices(acc)), policy_given=True
  )
  mesh = tpu_topology.topology_mesh(spec, acc)
  progs = {p.name: p for p in aot.compile_step(spec, mesh, only=("decode", "train"))}
  return spec, mesh, progs


def _assert_same_shardings(got, want, shapes, what: str) -> None:
  got_l, want_l, shape_l = (jax.tree.leaves(t) for t in (got, want, shapes))
  assert len(got_l) == len(want_l) == len(shape_l), what
  for i, (g, w, s) in enumerate(zip(got_l, want_l, shape_l)):
    assert g.is_equivalent_to(w, len(s.shape)), f"{what} leaf {i}: {g} != {w}"


def test_topology_devices_are_tpu_chips():
  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  devices = tpu_topology.topology_devices(acc)
  assert len(devices) == 8 and all(d.platform == "tpu" for d in devices)
  assert tpu_topology.parse_accelerator("v4-32").chips == 16
  assert tpu_topology.parse_accelerator("v5p-64").topology == "v5p:2x4x4"


def test_memory_and_cost_analysis(compiled):
  _, _, progs = compiled
  assert set(progs) == {"decode", "train"}
  for p in progs.values():
    assert not p.error, p.error
    mem = p.memory
    assert mem["arguments"] > 0 and mem["temporaries"] >= 0 and mem["peak"] > 0, mem
    cost = p.cost
    assert cost["xla_flops"] > 0 and cost["xla_bytes"] > 0, cost
  # The tiny model's 2 layers run under lax.scan: counted per iteration they
  # cost about twice one body (less: the unembedding and update run once; a little
  # more for the attention, whose kernel runs once per row of a chip in a loop of its
  # own: per-row block tables, models/splash_blocks.py).
  text = progs["train"].compiled.as_text()
  once, full = hlo_cost.hlo_cost(text, trip_counts=False), hlo_cost.hlo_cost(text)
  assert 1.3 < full["flops"] / once["flops"] < 2.5, (once, full)
  assert full["flops"] == progs["train"].cost["flops"]
  # The decode loop has no constant bound (nor its refill copy and, past one
  # attention block, the blocks read per layer): counted once, and reported.
  assert progs["decode"].cost["unbounded_loops"] >= 1


def test_train_step_input_shardings_follow_the_rules(compiled):
  spec, mesh, progs = compiled
  model_cfg, tcfg = spec.model_config(), spec.train_config()
  (state_sh, batch_sh), _ = progs["train"].compiled.input_shardings
  want_state = ts.state_shardings(model_cfg, tcfg, mesh, mesh_lib.TRAIN_RULES)
  state_shapes = jax.eval_shape(
    lambda p: ts.init_train_state(p, tcfg), qwen2.param_shapes(model_cfg)
  )
  _assert_same_shardings(state_sh, want_state, state_shapes, "train state")
  # Params really are split over fsdp and tensor (a tiny model could replicate).
  q_spec = state_sh.params["layers"]["q_kernel"].spec
  assert "fsdp" in jax.tree.leaves(tuple(q_spec)) and "tensor" in jax.tree.leaves(tuple(q_spec))
  # Every batch array is [M, rows or slots, ...], split over the rows (axis 1).
  want_rows = ts.batch_sharding(mesh, mesh_lib.TRAIN_RULES, spec.packing_shape()[1])
  for i, sh in enumerate(jax.tree.leaves(batch_sh)):
    assert tuple(sh.spec)[:2] == tuple(want_rows.spec)[:2], (i, sh)


def test_decode_input_shardings_follow_the_rules(compiled):
  spec, mesh, progs = compiled
  model_cfg = spec.model_config()
  args_sh, _ = progs["decode"].compiled.input_shardings
  params_sh, prompts_sh = args_sh[:2]
  mesh = programs.sampling_layout(spec, model_cfg, mesh).mesh  # the sampler's own
  assert mesh.devices.size == 8 and mesh.shape["tensor"] > 1, mesh.shape
  want = mesh_lib.param_shardings(model_cfg, mesh, mesh_lib.SAMPLING_RULES)
  _assert_same_shardings(params_sh, want, qwen2.param_shapes(model_cfg), "sampling params")
  Q = spec.rollout.prompts_per_call or spec.rollout.num_prompts
  # The prompt cache the engine's slots are filled from: on TPU in the ragged decode
  # attention's [Q, P, K*H] layout, prompts over the batch axes and whole kv heads over
  # the tensor axis (capo_jax.sampling.ragged).
  k_QPX = prompts_sh.k[0]
  layout = sharding.Layout.of(mesh, mesh_lib.SAMPLING_RULES)
  spec = ragged.cache_spec(layout, Q, model_cfg.num_kv_heads)
  assert "tensor" in jax.tree.leaves(tuple(spec)), spec
  assert k_QPX.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), 3), k_QPX


def test_hlo_cost_counts_scan_bodies_per_iteration():
  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  mesh = jax.sharding.Mesh(tpu_topology.topology_devices(acc), ("x",))
  w = jax.ShapeDtypeStruct(
    (6, 256, 256),
    "bfloat16",
    sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
  )
  x = jax.ShapeDtypeStruct(
    (1024, 256),
    "bfloat16",
    sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")),
  )
  f = lambda w, x: jax.lax.scan(lambda h, wl: (h @ wl, None), x, w)[0]
  text = jax.jit(f).lower(w, x).compile().as_text()
  per_layer = 2 * (1024 // 8) * 256 * 256  # one [128, 256] x [256, 256] matmul per device
  assert hlo_cost.hlo_cost(text, trip_counts=False)["flops"] == per_layer
  assert hlo_cost.hlo_cost(text)["flops"] == 6 * per_layer


def test_loop_tree_counts_each_loop_by_its_own_trips():
  """A while loop with a run-time bound holding a 5-step scan and a nested run-time
  loop: ``loop_tree`` splits them, and the estimate weights each by its own count."""
  from tools import step_estimate  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  mesh = jax.sharding.Mesh(tpu_topology.topology_devices(acc)[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  w = jax.ShapeDtypeStruct((5, 256, 256), "float32", sharding=rep)
  x = jax.ShapeDtypeStruct((128, 256), "float32", sharding=rep)
  n = jax.ShapeDtypeStruct((), "int32", sharding=rep)

  def f(w, x, n):
    def body(carry):
      i, h = carry
      h = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), h, w)[0]  # 5 matmuls
      # A nested loop with a run-time bound: one more matmul per iteration.
      h = jax.lax.while_loop(
        lambda c: c[0] < n + i, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w[0])), (0, h)
      )[1]
      return i + 1, h

    return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

  text = jax.jit(f).lower(w, x, n).compile().as_text()
  matmul = 2 * 128 * 256 * 256
  root = hlo_cost.loop_tree(text)
  rest, loops = root.cost, root.nested
  assert rest["flops"] == 0 and len(loops) == 1, (rest, loops)
  assert loops[0].cost["flops"] == 5 * matmul
  assert len(loops[0].nested) == 1 and loops[0].nested[0].cost["flops"] == matmul
  trips = step_estimate.Trips(
    phase_steps=(7,),
    phase_blocks=(30,),
    refills=0,
    logprob_calls=1,
    microbatches=1,
    real_token_fraction=1,
  )
  got = step_estimate.weighted_cost("decode", text, trips)
  assert got["flops"] == 7 * 5 * matmul + 30 * matmul  # 7 outer iterations, 30 inner in all
  assert got["blocks_per_step"] == 30 / 7


@pytest.mark.parametrize("axes", [{"fsdp": 8}, {"fsdp": 4, "tensor": 2}])
def test_unembedding_moves_once_per_call(axes):
  """The chunked log-probs' gradient, compiled for TPU: the [D, V] unembedding is
  gathered and its gradient reduced once per call (capo_jax/rl/chunked_unembed.py),
  where the plain scan under XLA's partitioning did both once per chunk."""
  from capo_jax.rl import logprobs as lp_lib  # pylint: disable=import-outside-toplevel
  from capo_jax.run import hlo_ops, hlo_text  # pylint: disable=import-outside-toplevel
  from models.config import Qwen2Config  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  mesh = mesh_lib.make_mesh(axes, devices=tpu_topology.topology_devices(acc))
  layout = sharding.Layout.of(mesh, mesh_lib.TRAIN_RULES)
  cfg = dataclasses.replace(Qwen2Config.tiny(), hidden_size=256, vocab_size=4096)
  B, C, chunks = 16, 1024, 8
  shapes = qwen2.param_shapes(cfg)
  p_sh = mesh_lib.param_shardings(cfg, mesh, mesh_lib.TRAIN_RULES)
  params = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, p_sh
  )
  h = jax.ShapeDtypeStruct((B, C, cfg.hidden_size), "float32", sharding=layout.sharding(("batch",)))
  rows = layout.sharding(("batch",))
  tokens = jax.ShapeDtypeStruct((B, C), "int32", sharding=rows)

  def loss(p, h_, t):
    with sharding.activations(layout):
      targets = lp_lib.Targets(h_, t, jnp.ones_like(t))
      out = lp_lib.logprobs_from_hidden(
        p, cfg, targets, chunk_size=C // chunks, top_k=0, temperature=1.0
      )
    return out["logp_BC"].sum()

  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, h, tokens).compile().as_text()
  comps, entry = hlo_text.parse(text)
  walk = hlo_cost._walk(comps, entry, True, enter_unbounded=True)
  D, V = cfg.hidden_size, cfg.vocab_size
  dims = [f"{a},{b}]" for v in (V, V // 2) for a, b in ((D, v), (v, D))]
  moves = sum(
    w
    for name, w in walk.weight.items()
    for ins in comps[name]
    if ins.op.startswith(hlo_ops.COLLECTIVES) and any(d in ins.shape for d in dims)
  )
  # One gather in, one reduction of the gradient out (the forward's gather may be
  # repeated for the rematerialised backward): per chunk it would be >= 2 x chunks.
  assert 1 <= moves <= 3, moves


def test_splash_attention_kernel_compiles_for_tpu():
  # The trainer has no splash-attention path yet; this shows Pallas TPU
  # kernels (Mosaic custom calls) compile here, forward and backward.
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  mesh = jax.sharding.Mesh(tpu_topology.topology_devices(acc)[:1], ("x",))
  B, N, T, H = 2, 4, 512, 128
  kernel = splash.make_splash_mha(
    masks.MultiHeadMask([masks.CausalMask((T, T))] * N), head_shards=1, q_seq_shards=1
  )
  attend = lambda q, k, v: jax.vmap(kernel)(q, k, v)
  x_BNTH = jax.ShapeDtypeStruct(
    (B, N, T, H),
    "bfloat16",
    sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
  )
  fwd = jax.jit(attend).lower(x_BNTH, x_BNTH, x_BNTH).compile()
  loss = lambda q, k, v: attend(q, k, v).astype("float32").sum()
  bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x_BNTH, x_BNTH, x_BNTH).compile()
  assert fwd.as_text().count("tpu_custom_call") == 1
  assert bwd.as_text().count("tpu_custom_call") >= 2  # dq and dkv kernels
  assert fwd.memory_analysis() is not None


def test_hlo_cost_counts_the_models_splash_attention_by_its_causal_blocks():
  """The model's splash attention (a causal mask, segment ids, 256-column blocks) forward
  and backward for TPU: its FLOPs are the kernels' matmuls over the block pairs a causal
  mask computes (counted by hand), 2 forward, 4 + 3 backward, at most; the rows' tables
  skip some of them, which the cost model takes from a length model (``splash_share``)."""
  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  mesh = jax.sharding.Mesh(tpu_topology.topology_devices(acc)[:1], ("x",))
  B, T, N, K, H, width = 2, 1024, 4, 2, 128, 256
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  q = jax.ShapeDtypeStruct((B, T, N, H), "bfloat16", sharding=rep)
  kv = jax.ShapeDtypeStruct((B, T, K, H), "bfloat16", sharding=rep)
  seg = jax.ShapeDtypeStruct((B, T), "int32", sharding=rep)
  attend = lambda q, k, v, s: attention.splash(q, k, v, s, block=width, interpret=False)
  loss = lambda q, k, v, s: attend(q, k, v, s).astype("float32").sum()
  fwd = jax.jit(attend).lower(q, kv, kv, seg).compile().as_text()
  bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile().as_text()
  blocks = T // width
  pairs = sum(range(1, blocks + 1))  # causal: query block i computes key blocks 0..i
  per_matmul = B * N * pairs * 2 * width * width * H
  assert hlo_cost.hlo_cost(fwd)["flops"] == 2 * per_matmul
  # The backward recomputes the forward's residuals (2) and runs dkv (4) and dq (3).
  assert hlo_cost.hlo_cost(bwd)["flops"] == (2 + 4 + 3) * per_matmul
  # Every kernel, forward and backward, runs with per-row block tables (in their scope):
  # the cost model counts the pairs a length model leaves of them.
  assert hlo_cost.hlo_cost(fwd, splash_share=0.5)["flops"] == per_matmul
  assert hlo_cost.hlo_cost(bwd, splash_share=0.5)["flops"] == (2 + 4 + 3) * per_matmul / 2


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
  return [
    (dt, tuple(int(d) for d in dims.split(",") if d))
    for dt, dims in re.findall(r"\b(bf16|f32|s32|pred)\[([\d,]+)\]", text)
  ]


def test_activations_stay_split_by_rows():
  """Per device, the MLP activations and the logits chunk hold rows / (data x fsdp) rows:
  no program gathers the rows (as XLA did when only the params were sharded)."""
  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  c = capo_qwen2p5_math_1p5b.get_config("shrink")
  c.mesh.fsdp, c.mesh.tensor = -1, 2
  F, V = 192, 512  # distinctive sizes: nothing else in the program has them
  c.model.preset_overrides.intermediate_size = F
  spec = spec_lib.RunSpec.from_config(c, num_devices=8, policy_given=True)
  mesh = tpu_topology.topology_mesh(spec, acc)
  progs = {p.name: p for p in aot.compile_step(spec, mesh, only=("logprobs", "train"))}
  shapes = aot_programs.Shapes.from_spec(spec)
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  T, Z = shapes.row_len, shapes.targets_per_row
  for name, rows in (("logprobs", shapes.rows_per_call), ("train", shapes.rows_per_microbatch)):
    arrays = _arrays(progs[name].compiled.as_text())
    # [..., rows, T, F]: the rows before T (a leading axis may stack layers or micro-batches).
    mlp = [s for _, s in arrays if s[-1] in (F, F // 2) and len(s) >= 3 and s[-2] == T]
    assert (rows // shards, T, F // 2) in {s[-3:] for s in mlp}, (name, sorted(set(mlp)))
    assert max(s[-3] for s in mlp) == rows // shards, (name, sorted(set(mlp)))
    flat = [s for _, s in arrays if s[-1] in (F, F // 2) and len(s) == 2]  # [rows * T, F]
    assert max((s[0] for s in flat), default=0) <= rows // shards * T, (name, flat)
    logits = [s for dt, s in arrays if dt == "f32" and s[-1] in (V, V // 2)]
    assert any(s[-1] == V // 2 for s in logits), (name, logits)  # the vocab split over tensor
    assert max(math.prod(s) // s[-1] for s in logits) <= rows // shards * Z, (name, logits)


def test_a_group_past_the_kv_heads_splits_the_attention_rows():
  """A sampling group of 8 chips for 2 kv heads (tensor 2 x tensor_q 4), compiled for TPU:
  each chip attends for its own slots (the cache's rows over tensor_q), so no collective
  of the decode loop carries the KV cache's columns. With each kv head kept whole on the
  tensor_q chips that shared it, XLA gathered every layer's cache across them each step."""
  from capo_jax.run import hlo_ops, hlo_text  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  c = capo_qwen2p5_math_1p5b.get_config("shrink")
  c.model.preset_overrides.num_heads = 8  # 2 kv heads (the tiny preset's) x 4
  c.model.preset_overrides.hidden_size = 128
  c.mesh.sampling_tensor = 8
  c.rollout.max_new_tokens = 1024  # cache columns no other array of the loop has
  c.rollout.max_prompt_len = 512  # several refill chunks a prompt
  spec = spec_lib.RunSpec.from_config(c, num_devices=8, policy_given=True)
  mesh = tpu_topology.topology_mesh(spec, acc)
  plan = aot_programs.sampler_plan(spec, spec.model_config(), mesh)
  assert dict(plan.layout.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 2, "tensor_q": 4}
  progs = {p.name: p for p in aot.compile_step(spec, mesh, only=("decode",))}
  text = progs["decode"].compiled.as_text()
  comps, entry = hlo_text.parse(text)
  walk = hlo_cost._walk(comps, entry, True, enter_unbounded=True)
  arrays = lambda shape: [  # noqa: E731
    [int(d) for d in a.split(",") if d] for a in re.findall(r"\w+\[([\d,]*)\]", shape)
  ]
  loop_collectives = [
    ins.shape
    for name, w in walk.in_loop.items()
    if w and name not in walk.fused
    for ins in comps[name]
    if ins.op.startswith(hlo_ops.COLLECTIVES)
  ]
  assert loop_collectives  # the group's partial sums
  # Keys / values are [slots, columns, kv heads x head dim].
  caches = [
    s for s in loop_collectives if any(len(a) >= 3 and max(a) >= plan.gen_len for a in arrays(s))
  ]
  assert not caches, caches
  # The refill (the loop's conditional) sends a prompt's keys / values 128 columns at a
  # time, not its P = 512: [1, 128, K*H / kv-head shards] (the other arrays it sends,
  # indices, have at most two axes).
  branches = [
    b
    for body in comps.values()
    for ins in body
    if ins.op == "conditional"
    for b in re.findall(r"%([\w.\-]+)", ins.rest.split("branch_computations=")[-1])
    if b in comps
  ]
  refill = [
    a
    for b in branches
    for name, w in hlo_cost._walk(comps, b, True, enter_unbounded=True).weight.items()
    if w
    for ins in comps.get(name, [])
    if ins.op.startswith(hlo_ops.COLLECTIVES)
    for a in arrays(ins.shape)
    if len(a) >= 3
  ]
  assert refill and all(a[:2] == [1, slots.REFILL_CHUNK] for a in refill), refill


def test_the_prefill_keeps_the_rows_of_its_hidden_states():
  """The same group past the kv heads (tensor 2 x tensor_q 4): the prefill runs under the
  model's activation constraints, so no all-gather moves the prompts' hidden states
  [prompts, P, D] (the group's partial sums are all-reduced). Without them the TPU
  compiler took the prompt cache's rows over tensor_q into the layers and gathered every
  prompt's hidden states each layer (7B on v4-64, a group of 8: 119 GB a prefill)."""
  from capo_jax.run import hlo_text  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  c = capo_qwen2p5_math_1p5b.get_config("shrink")
  c.model.preset_overrides.num_heads = 8  # 2 kv heads (the tiny preset's) x 4
  D = c.model.preset_overrides.hidden_size = 160  # a size no other array has
  c.mesh.sampling_tensor = 8
  P = c.rollout.max_prompt_len = 512
  spec = spec_lib.RunSpec.from_config(c, num_devices=8, policy_given=True)
  mesh = tpu_topology.topology_mesh(spec, acc)
  plan = aot_programs.sampler_plan(spec, spec.model_config(), mesh)
  assert dict(plan.layout.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 2, "tensor_q": 4}
  progs = {p.name: p for p in aot.compile_step(spec, mesh, only=("prefill",))}
  comps, _ = hlo_text.parse(progs["prefill"].compiled.as_text())
  moved = [
    ins.shape
    for body in comps.values()
    for ins in body
    if ins.op.startswith("all-gather")
    and any(a[-2:] == (P, D) for _, a in hlo_text.arrays(ins.shape))
  ]
  assert not moved, moved


def _bf16_gathers(text: str, in_loop: bool) -> list[str]:
  """The bfloat16 all-gathers of a compiled program (the weights: rows, ids and scores are
  float32 or int32 here), those inside an unbounded loop (the micro-batches) or all."""
  from capo_jax.run import hlo_text  # pylint: disable=import-outside-toplevel

  comps, entry = hlo_text.parse(text)
  walk = hlo_cost._walk(comps, entry, True, enter_unbounded=True)
  return [
    ins.shape
    for name, body in comps.items()
    if walk.weight.get(name) and (walk.in_loop.get(name) or not in_loop)
    for ins in body
    if ins.op.startswith("all-gather") and ins.shape.lstrip("(").startswith("bf16")
  ]


def _microbatched(gather_once: bool, reduce_once: bool) -> tuple[spec_lib.RunSpec, Any]:
  """The 1.5B shrink run on 4 x 2 chips (fsdp x tensor) with several micro-batches an
  update (the loop the weights and their gradient's reduction should stay out of)."""
  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  c = capo_qwen2p5_math_1p5b.get_config("shrink")
  c.mesh.fsdp, c.mesh.tensor = -1, 2
  c.train.micro_batch_size = 4
  c.mesh.gather_once, c.mesh.reduce_once = gather_once, reduce_once
  spec = spec_lib.RunSpec.from_config(c, num_devices=8, policy_given=True)
  assert aot_programs.Shapes.from_spec(spec).microbatches > 1
  return spec, tpu_topology.topology_mesh(spec, acc)


def test_gather_once_moves_the_weights_once_a_pass_and_an_update():
  """``config.mesh.gather_once`` on 4 x 2 chips (fsdp x tensor), compiled for TPU: the
  log-prob calls take the weights whole and gather none of them, and the train program
  gathers the stacked weights once, outside its micro-batch loop. Without it, both gather
  every layer's weights in every call and in every micro-batch."""
  got = {}
  for once in (False, True):
    spec, mesh = _microbatched(gather_once=once, reduce_once=False)
    progs = {p.name: p for p in aot.compile_step(spec, mesh, only=("logprobs", "train"))}
    got[once] = {n: p.compiled.as_text() for n, p in progs.items()}
  assert _bf16_gathers(got[False]["logprobs"], in_loop=False)
  assert not _bf16_gathers(got[True]["logprobs"], in_loop=False)
  assert _bf16_gathers(got[False]["train"], in_loop=True)
  assert not _bf16_gathers(got[True]["train"], in_loop=True)
  # What it gathers: the layers' stacked weights [L, ...] (and the embedding [V, D]) once.
  cfg = spec.model_config()
  whole = (f"bf16[{cfg.num_layers},", f"bf16[{cfg.vocab_size},{cfg.hidden_size}]")
  stacked = _bf16_gathers(got[True]["train"], in_loop=False)
  assert stacked and all(s.lstrip("(").startswith(whole) for s in stacked), stacked


def test_data_parallel_passes_send_nothing_in_a_call():
  """``config.mesh.logprob_data_parallel`` on 4 x 2 chips (fsdp x tensor), compiled for
  TPU: a log-prob call takes its rows over all 8 chips and the weights whole, so it runs
  no collective that sends (the tensor-split call sums its heads' and MLP columns'
  partial products every layer), and the gather makes the copy whole over both axes."""
  sent = {}
  for dp in (False, True):
    acc = tpu_topology.parse_accelerator(ACCELERATOR)
    tpu_topology.set_tpu_env(acc)
    c = capo_qwen2p5_math_1p5b.get_config("shrink")
    c.mesh.fsdp, c.mesh.tensor = -1, 2
    c.mesh.gather_once, c.mesh.reduce_once = True, False
    c.mesh.logprob_data_parallel, c.train.logprob_pack_rows = dp, 8 if dp else 0
    spec = spec_lib.RunSpec.from_config(c, num_devices=8, policy_given=True)
    mesh = tpu_topology.topology_mesh(spec, acc)
    progs = {p.name: p for p in aot.compile_step(spec, mesh, only=("gather", "logprobs"))}
    call = hlo_cost.hlo_cost(progs["logprobs"].compiled.as_text())
    sent[dp] = call["collectives"]
    if dp:
      whole = jax.tree.leaves(progs["gather"].compiled.output_shardings)
      assert all(s.is_fully_replicated for s in whole), whole
      rows = progs["logprobs"].compiled.input_shardings[0][1].tokens_YT.spec
      assert rows[0] == ("data", "fsdp", "tensor"), rows
  assert sent[False] > 0 and sent[True] == 0, sent


def _weight_reduces(text: str, layers: int, in_loop: bool) -> list[str]:
  """The all-reduces (and reduce-scatters) of the stacked weights' gradients [L, ...],
  those inside an unbounded loop (the micro-batches) or outside every loop."""
  from capo_jax.run import hlo_ops, hlo_text  # pylint: disable=import-outside-toplevel

  comps, entry = hlo_text.parse(text)
  walk = hlo_cost._walk(comps, entry, True, enter_unbounded=True)
  found = []
  for name, body in comps.items():
    if not walk.weight.get(name) or bool(walk.in_loop.get(name)) != in_loop:
      continue
    shapes = {i.name: i.shape for i in body}
    for ins in body:
      fused = ins.op == "fusion" and hlo_ops.fused_collective(ins, comps, 8)[0]
      if ins.op.startswith(("all-reduce", "reduce-scatter")) or fused:
        operands = re.findall(r"%([\w.\-]+)", ins.rest.split("),")[0])
        seen = " ".join([ins.shape] + [shapes.get(o, "") for o in operands])
        if re.search(rf"\b(bf16|f32)\[{layers},", seen):
          found.append(ins.shape)
  return found


def test_reduce_once_sums_the_gradient_once_an_update():
  """``config.mesh.reduce_once`` on 4 x 2 chips (fsdp x tensor), compiled for TPU: no
  gradient of the stacked weights is reduced across chips inside the micro-batch loop,
  and the update reduces it once after the loop. Without it (the weights gathered once
  still), every micro-batch all-reduces that gradient."""
  got = {}
  for once in (False, True):
    spec, mesh = _microbatched(gather_once=True, reduce_once=once)
    got[once] = next(iter(aot.compile_step(spec, mesh, only=("train",)))).compiled.as_text()
  L = spec.model_config().num_layers
  assert _weight_reduces(got[False], L, in_loop=True)
  assert not _weight_reduces(got[True], L, in_loop=True)
  assert _weight_reduces(got[True], L, in_loop=False)


def test_every_row_in_a_slot_keeps_the_tail_loops_on_tpu_not_on_cpu():
  """``rollout.max_active_rows=0`` (W = B, the 7B run file's): on the TPU chips the engine
  still moves the tail to a quarter of the slots, twice; on CPU it stays one loop."""
  from capo_jax.run import programs as programs_lib  # pylint: disable=import-outside-toplevel
  from capo_jax.sampling import sampler  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  c = capo_qwen2p5_math_1p5b.get_config("shrink")
  c.rollout.num_prompts, c.rollout.max_active_rows = 16, 0
  spec = spec_lib.RunSpec.from_config(c, num_devices=8, policy_given=True)
  cfg, B = spec.model_config(), 16 * c.rollout.num_samples
  plan = aot_programs.sampler_plan(spec, cfg, tpu_topology.topology_mesh(spec, acc))
  assert plan.num_slots == B
  assert plan.phases == (B, B // 4, B // 16), plan.phases
  on_cpu = sampler.engine_plan(cfg, programs_lib.sampling_spec(spec), None, 16)
  assert on_cpu.num_slots == B and on_cpu.phases == (B,)


def test_tail_loops_hold_no_second_cache_at_the_real_shape():
  """The 1.5B run file's decode on v4-32 (every row in a slot, then the tail loops), at
  full size: its temporaries hold the slot cache and the first tail loop's smaller one,
  not a second slot cache. With every layer's move of rows across chips (an all-reduce
  of the smaller cache) in flight at once, they held about a second slot cache (the
  ``decode_tail_loops`` record of docs/results/tpu.md)."""
  from tools import memory_terms  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator("v4-32")
  tpu_topology.set_tpu_env(acc)
  c = capo_qwen2p5_math_1p5b.get_config()
  c.model.hf_path, c.model.random_init = "", True
  spec = spec_lib.RunSpec.from_config(c, num_devices=acc.chips, policy_given=True)
  mesh = tpu_topology.topology_mesh(spec, acc)
  plan = aot_programs.sampler_plan(spec, spec.model_config(), mesh)
  assert plan.num_slots == 1024 and len(plan.phases) == 3, plan.phases
  group = plan.layout.mesh.shape["tensor"] * plan.layout.mesh.shape.get("tensor_q", 1)
  terms = memory_terms.memory_terms(memory_terms.load_run("1.5B"), 1, 16, 1, 1, 1024, group)
  cache, tail = terms["KV cache (W slots)"], terms["tail loop cache (W/4 slots)"]
  assert tail == cache / 4
  decode = next(iter(aot.compile_step(spec, mesh, only=("decode",))))
  temp = decode.compiled.memory_analysis().temp_size_in_bytes
  assert cache < temp < cache + tail + cache / 2, (temp / 2**30, cache / 2**30)


@pytest.mark.parametrize("top_k, exchanged", [(0, False), (5, True)])
def test_plain_temperature_is_drawn_inside_the_vocabulary_shards(top_k: int, exchanged: bool):
  """A sampling group of 4 chips splits the vocabulary (V = 1536: 384 a chip). With the
  run's plain temperature no collective of the decode loop carries a chip's logits
  ([..., 384, ...]: only block sums and one block of 128 a row move); top-k needs whole
  rows, and there the loop exchanges them all-to-all (so the check can fail)."""
  from capo_jax.run import hlo_ops, hlo_text  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator(ACCELERATOR)
  tpu_topology.set_tpu_env(acc)
  c = capo_qwen2p5_math_1p5b.get_config("shrink")
  c.model.preset_overrides.vocab_size = 1536
  c.mesh.sampling_tensor = 4
  c.rollout.top_k = top_k
  spec = spec_lib.RunSpec.from_config(c, num_devices=8, policy_given=True)
  mesh = tpu_topology.topology_mesh(spec, acc)
  plan = aot_programs.sampler_plan(spec, spec.model_config(), mesh)
  assert plan.layout.shards("vocab") == 4
  text = next(iter(aot.compile_step(spec, mesh, only=("decode",)))).compiled.as_text()
  comps, entry = hlo_text.parse(text)
  walk = hlo_cost._walk(comps, entry, True, enter_unbounded=True)
  loop = [
    ins
    for name, w in walk.in_loop.items()
    if w and name not in walk.fused
    for ins in comps[name]
    if ins.op.startswith(hlo_ops.COLLECTIVES)
  ]
  logits = [i.shape for i in loop if re.search(r"f32\[([\d,]*,)?384(,[\d,]*)?\]", i.shape)]
  assert bool(logits) == exchanged, logits
  assert any(i.op.startswith("all-to-all") for i in loop) == exchanged
