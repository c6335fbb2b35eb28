"""hlo_cost's rules for Pallas TPU kernels (``tpu_custom_call``), on hand-written HLO.

A kernel that declares its cost (``pl.CostEstimate``) counts what it declares; the
ragged decode attention (capo_jax/sampling/ragged.py) counts its keys and values by the
columns each slot copies, which the rows' lengths decide: the length model's
(``tools.rollout_sim.ragged_prefix``) in the step estimate. Expected figures are counted
by hand below; the length model against a loop over every column of every step.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from capo_jax.run import hlo_cost, hlo_ops
from models import splash_blocks
from tools import rollout_sim, step_estimate

W, K, R, H, S = 4, 2, 8, 128, 1024  # slots, kv heads, query heads (padded), head dim, columns
Q = W * K * R * H * 2  # bf16 queries [W, K, R, H]; the output alike
LENS = W * 4  # s32 [W]: the slots' first columns, and their ends
COL = W * 2 * K * H * 2  # one column of every slot's keys and values, bf16

_CALL = (
  'custom-call(%s, %e, %q, %k, %v), custom_call_target="tpu_custom_call", '
  "operand_layout_constraints={s32[4]{0}, s32[4]{0}, bf16[4,2,8,128]{3,2,1,0}, "
  "bf16[4,1024,256]{2,1,0}, bf16[4,1024,256]{2,1,0}}, frontend_attributes="
  '{kernel_metadata={}}, metadata={op_name="jit(f)/shard_map/pallas_call"}, '
  'backend_config={"custom_call_config":{"body":"TUxJUgA=","needs_layout_passes":true}}'
)
_PARAMS = """  %q = bf16[4,2,8,128]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %k = bf16[4,1024,256]{2,1,0:T(8,128)(2,1)} parameter(1)
  %v = bf16[4,1024,256]{2,1,0:T(8,128)(2,1)} parameter(2)
  %s = s32[4]{0:T(128)} parameter(3)
  %e = s32[4]{0:T(128)} parameter(4)
"""
_SIG = (
  "(q: bf16[4,2,8,128], k: bf16[4,1024,256], v: bf16[4,1024,256], s: s32[4], e: s32[4])"
  " -> bf16[4,2,8,128]"
)
# One call of the kernel as the TPU compiler prints it (body elided).
_RAGGED = f"""HloModule m

ENTRY %main {_SIG} {{
{_PARAMS}  ROOT %attend = bf16[4,2,8,128]{{3,2,1,0:T(8,128)(2,1)}} {_CALL}
}}
"""

# (start, end) of each slot and the 512-column blocks its range touches, by hand: a
# prompt from column 312 into the first completion column (blocks 0 and 1), one token
# at column 0 (block 0), columns 600..1023 (block 1), an idle slot (none).
RANGES = [(312, 513), (0, 1), (600, 1024), (5, 5)]
BLOCKS = [2, 1, 1, 0]
BLOCK = 512


def test_the_ragged_kernel_reads_the_blocks_its_rows_cover():
  cols = sum(BLOCKS) * BLOCK / W  # the columns a slot copies, mean over the slots
  cost = hlo_cost.hlo_cost(_RAGGED, cols=cols)
  kv = sum(BLOCKS) * BLOCK * (2 * K * H * 2)  # 4 blocks of 512 columns of k and v
  assert kv == 2_097_152
  # Queries, output and the two length vectors move whole; the keys and values by the
  # blocks copied, read from HBM and written into the kernel's VMEM buffers.
  assert cost["bytes"] == Q + Q + 2 * LENS + kv
  assert cost["ragged_bytes"] == kv
  assert cost["onchip_bytes"] == kv
  assert cost["ragged_col_hbm"] == COL and cost["ragged_cache_cols"] == S


def test_without_a_length_model_every_slot_reads_its_whole_cache():
  cost = hlo_cost.hlo_cost(_RAGGED)
  whole = 2 * W * S * K * H * 2  # keys and values [4, 1024, 256] bf16
  assert cost["bytes"] == Q + Q + 2 * LENS + whole  # the old count: every operand whole
  assert cost["ragged_bytes"] == whole


RATES = hlo_cost.Rates(flops=1.0, hbm=1.0, onchip=2.0, host=0.5, ici=0.25)


def test_columns_added_later_cost_what_counting_them_at_once_does():
  at_once = hlo_cost.hlo_cost(_RAGGED, rates=RATES, cols=300.0)
  later = hlo_cost.with_ragged_cols(hlo_cost.hlo_cost(_RAGGED, rates=RATES, cols=0.0), 300.0, RATES)
  for key in ("bytes", "onchip_bytes", "ragged_bytes", "op_s", "op_honest_s"):
    assert later[key] == at_once[key], key
  # No FLOPs counted: optimistic, its HBM traffic; honest, its HBM traffic too: the
  # kernel stages its keys and values into VMEM (300 * COL at 2 B/s) as it reads them.
  hbm = Q + Q + 2 * LENS + 300 * COL
  assert at_once["op_s"] == hbm and at_once["op_honest_s"] == hbm
  assert at_once["onchip_bytes"] == 300 * COL  # still counted, in the on-chip range


_DECLARED = """HloModule m

ENTRY %main (x: f32[8,128]) -> f32[8,128] {
  %x = f32[8,128]{1,0:T(8,128)} parameter(0)
  ROOT %k = f32[8,128]{1,0:T(8,128)} custom-call(%x), custom_call_target="tpu_custom_call", operand_layout_constraints={f32[8,128]{1,0}}, backend_config={"custom_call_config":{"body":"TUxJUgA=","cost_estimate":{"flops":"1234","transcendentals":"0","bytes_accessed":"5678","remote_bytes_transferred":"0"},"needs_layout_passes":true}}
}
"""  # noqa: E501  (HLO lines as the compiler prints them)


def test_a_kernel_that_declares_its_cost_counts_what_it_declares():
  cost = hlo_cost.hlo_cost(_DECLARED)
  assert cost["flops"] == 1234 and cost["bytes"] == 5678  # not its 8 KiB of operands
  undeclared = hlo_cost.hlo_cost(_DECLARED.replace('"cost_estimate":{', '"other":{'))
  assert undeclared["flops"] == 0 and undeclared["bytes"] == 2 * 8 * 128 * 4


# A splash-attention forward call as the TPU compiler prints it (body elided): the mask's
# block maps [1, 4, 4] (query blocks x key blocks), q [2, 1024, 128] (2 heads), k and v
# [1, 1024, 128], the segment ids; results: scratch, the output, the log-sum-exp.
_SPLASH = """HloModule m

ENTRY %main (a: s8[1,4,4], b: s8[1,4,4], q: bf16[2,1024,128], k: bf16[1,1024,128], v: bf16[1,1024,128], s: s32[1024,128], t: s32[8,1024]) -> (f32[256,128], bf16[2,1024,128], f32[2,1024,128]) {
  %a = s8[1,4,4]{2,1,0} parameter(0)
  %b = s8[1,4,4]{2,1,0} parameter(1)
  %q = bf16[2,1024,128]{2,1,0:T(8,128)(2,1)} parameter(2)
  %k = bf16[1,1024,128]{2,1,0:T(8,128)(2,1)} parameter(3)
  %v = bf16[1,1024,128]{2,1,0:T(8,128)(2,1)} parameter(4)
  %s = s32[1024,128]{1,0:T(8,128)} parameter(5)
  %t = s32[8,1024]{1,0:T(8,128)} parameter(6)
  ROOT %splash_mha_fwd_segmented_residuals.2 = (f32[256,128]{1,0:T(8,128)}, bf16[2,1024,128]{2,1,0:T(8,128)(2,1)}, f32[2,1024,128]{2,1,0:T(8,128)}) custom-call(%a, %b, %q, %k, %v, %s, %t), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/layers/shard_map/pallas_call"}, backend_config={"custom_call_config":{"body":"TUxJUgA=","needs_layout_passes":true}}
}
"""  # noqa: E501  (HLO lines as the compiler prints them)


def test_splash_attention_counts_the_matmuls_of_its_causal_blocks():
  # 4 x 4 blocks of 256: a causal mask computes 1 + 2 + 3 + 4 = 10 of them whole; per
  # block and query head two [256, 128] x [128, 256]-sized matmuls (scores, output).
  flops = 10 * 2 * 2 * (2 * 256 * 256 * 128)
  assert hlo_cost.hlo_cost(_SPLASH)["flops"] == flops
  for kind, matmuls in (("dkv", 4), ("dq", 3)):  # the backward's two kernels
    text = _SPLASH.replace("splash_mha_fwd_", f"splash_mha_{kind}_")
    assert hlo_cost.hlo_cost(text)["flops"] == flops // 2 * matmuls
  other = _SPLASH.replace("splash_mha_fwd_", "some_kernel_")  # unknown: its operands only
  assert hlo_cost.hlo_cost(other)["flops"] == 0
  # Keys fewer than the queries (a row's gathered prompts, a full mask): every block pair.
  # 4 query blocks of 256 x 2 key blocks of 256 (k and v [1, 512, 128]) = 8 pairs.
  short = _SPLASH.replace("s8[1,4,4]", "s8[1,4,2]").replace("bf16[1,1024,128]", "bf16[1,512,128]")
  assert hlo_cost.hlo_cost(short)["flops"] == flops // 10 * 8
  # Calls with per-row block tables (in their scope) skip the blocks two sequences meet
  # in: the causal pairs at the share the length model gives. A call compiled without
  # them, and the prompt call (a full mask over fewer keys), skip none.
  scoped = lambda t: t.replace("jit(f)/layers/", f"jit(f)/layers/{hlo_ops.ROW_BLOCKS_SCOPE}/")
  assert hlo_ops.ROW_BLOCKS_SCOPE == splash_blocks.SCOPE
  got = hlo_cost.hlo_cost(scoped(_SPLASH), splash_share=0.7)["flops"]
  assert got == pytest.approx(0.7 * flops)
  assert hlo_cost.hlo_cost(_SPLASH, splash_share=0.7)["flops"] == flops
  assert hlo_cost.hlo_cost(scoped(short), splash_share=0.7)["flops"] == flops // 10 * 8
  ops: hlo_cost.Ops = {}
  hlo_cost.hlo_cost(_SPLASH, rates=RATES, ops=ops)
  assert ops["splash attention (fwd)"][:2] == [flops, flops]  # FLOP-bound, and named


# The kernel inside a decode loop whose bound is known only at run time.
_T = "(s32[], s32[], bf16[4,2,8,128], bf16[4,1024,256], bf16[4,1024,256], s32[4], s32[4])"
_LOOP = f"""HloModule m

%body (c: {_T}) -> {_T} {{
  %c = {_T} parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] get-tuple-element(%c), index=1
  %q = bf16[4,2,8,128]{{3,2,1,0:T(8,128)(2,1)}} get-tuple-element(%c), index=2
  %k = bf16[4,1024,256]{{2,1,0:T(8,128)(2,1)}} get-tuple-element(%c), index=3
  %v = bf16[4,1024,256]{{2,1,0:T(8,128)(2,1)}} get-tuple-element(%c), index=4
  %s = s32[4]{{0:T(128)}} get-tuple-element(%c), index=5
  %e = s32[4]{{0:T(128)}} get-tuple-element(%c), index=6
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  %o = bf16[4,2,8,128]{{3,2,1,0:T(8,128)(2,1)}} {_CALL}
  ROOT %t = {_T} tuple(%i1, %n, %o, %k, %v, %s, %e)
}}

%cond (c: {_T}) -> pred[] {{
  %c = {_T} parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] get-tuple-element(%c), index=1
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

ENTRY %main (n: s32[], {_SIG[1:].split(") ->")[0]}) -> {_T} {{
  %n = s32[] parameter(5)
  %zero = s32[] constant(0)
{_PARAMS}  %t = {_T} tuple(%zero, %n, %q, %k, %v, %s, %e)
  ROOT %w = {_T} while(%t), condition=%cond, body=%body
}}
"""


def test_the_step_estimate_counts_each_loop_at_its_columns_per_slot():
  trips = step_estimate.Trips(
    phase_steps=(10,),
    phase_blocks=(0,),
    refills=0,
    logprob_calls=1,
    microbatches=1,
    real_token_fraction=1,
    phase_cols=(640.0,),
    phase_own_cols=(410.0,),
  )
  got = step_estimate.weighted_cost("decode", _LOOP, trips)
  step = 3 * 4 + Q + Q + 2 * LENS + 640 * COL  # the add's scalars, then the kernel
  assert got["bytes"] == 10 * step and got["step_bytes"] == step
  assert got["ragged_bytes"] == 10 * 640 * COL and got["step_ragged_bytes"] == 640 * COL
  assert got["step_ragged_whole_bytes"] == S * COL
  assert got["step_own_kv_bytes"] == 410 * COL  # the floor: the rows' own columns
  with pytest.raises(ValueError, match="phase_cols"):
    step_estimate.weighted_cost("decode", _LOOP, step_estimate.Trips((10,), (0,), 0, 1, 1, 1))


def test_the_operations_table_weights_each_loop_as_the_cost_does():
  trips = step_estimate.Trips((10,), (0,), 0, 1, 1, 1, phase_cols=(640.0,))
  got, ops = step_estimate.weighted("decode", _LOOP, trips, RATES)
  kernel = Q + Q + 2 * LENS + 640 * COL  # HBM bytes of one call, at 1 byte a second
  # The kernel's staging into VMEM streams beside its HBM reads: honest is the HBM side.
  assert ops[hlo_ops.RAGGED_LABEL] == [10 * kernel, 0.0, 10 * kernel, 10 * 640 * COL / 2, 0, 0]
  assert ops["add"][0] == 10 * 3 * 4  # the loop counter's add: two s32 read, one written
  assert set(ops) == {hlo_ops.RAGGED_LABEL, "add"}
  assert sum(row[0] for row in ops.values()) == got["op_honest_s"] == 10 * (kernel + 12)


def _copied_by_hand(P: int, p: int, steps: int, block: int, unit: int) -> int:
  """Columns the kernel copies for one row over ``steps`` decode steps: at step t the
  row attends to [P - p, P + max(t, 1)); blocks are laid from P - p rounded down to
  ``unit``, every block holding one of those columns is copied, and the last one only
  up to the ``unit``-column tiles that hold one. Counted column by column."""
  total, base = 0, (P - p) // unit * unit
  for t in range(steps):
    cols = range(P - p, P + max(t, 1))
    blocks = {(c - base) // block for c in cols}
    edge = base + max(blocks) * block  # the last block's first column
    total += (len(blocks) - 1) * block
    total += len({(c - edge) // unit for c in cols if c >= edge}) * unit
  return total


# ragged_align 128 with blocks of 32: whole blocks from the block edges (gcd 32); 8: from
# the prompt's first column (56) rounded down to 8, 56 itself, where the block edge is
# 32, and the last block cut to 8-column tiles.
@pytest.mark.parametrize("align, unit", [(128, 32), (8, 8)])
def test_the_length_model_copies_each_rows_own_blocks(align, unit):
  shape = rollout_sim.Shape(
    rows=64,
    samples=4,
    prompt_len=96,
    cap=200,
    ragged_block=32,
    ragged_align=align,
    prompt_tokens=40,
  )
  F = rollout_sim.ragged_prefix(shape)
  for steps in (0, 1, 2, 57, 200):
    assert F[steps] == _copied_by_hand(96, 40, steps, 32, unit), steps
  lengths = rollout_sim.sample_lengths(np.random.default_rng(3), shape)
  want = sum(_copied_by_hand(96, 40, int(n), 32, unit) for n in lengths)
  own = sum(sum(40 + max(t, 1) for t in range(int(n))) for n in lengths)  # [56, 96 + t)
  lockstep = rollout_sim.simulate(lengths, shape, None)
  engine = rollout_sim.simulate(lengths, shape, 16)  # 16 slots, then tail loops of 4, 1
  # However the rows are scheduled, each copies its own blocks over its own steps.
  assert lockstep["ragged_cols"] == engine["ragged_cols"] == want
  assert sum(engine["phase_ragged_cols"]) == want
  assert sum(engine["phase_own_cols"]) == own < want
  assert engine["phase_slots"] == [16, 4, 1][: len(engine["phase_steps"])]


def test_trips_give_the_mean_columns_a_slot_copies_per_step():
  """One call of 8 rows in 8 slots (no tail loops): the columns copied over all rows,
  divided by the slots and the steps (the longest row's)."""

  class Sh:  # the fields of aot_programs.Shapes that trips reads
    prompts_per_call, num_calls, num_samples, prompt_len = 1, 1, 8, 1024
    max_prompt_len, max_new_tokens, row_len = 1024, 3072, 4096
    rows_per_call = rows_per_microbatch = 8

  lengths = step_estimate.Lengths(prompt_tokens=200, seeds=1)
  t = step_estimate.trips(Sh, 1, 8, 1, lengths)
  shape = rollout_sim.Shape(rows=8, samples=8, prompt_len=1024, cap=3072, max_loops=1)
  L = rollout_sim.sample_lengths(np.random.default_rng(0), shape)
  copied = sum(_copied_by_hand(1024, 200, int(n), 512, 128) for n in L)
  held = sum(sum(200 + max(s, 1) for s in range(int(n))) for n in L)
  assert t.phase_steps == (L.max(),)
  assert t.phase_cols[0] == pytest.approx(copied / (8 * L.max()))
  assert t.phase_own_cols[0] == pytest.approx(held / (8 * L.max()))


@pytest.mark.tpu_aot
@pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed; run from tools/.venv-tpu (tools/setup_aot_tpu.sh)",
)
def test_the_compiled_kernel_is_recognised():
  """The kernel compiled for a v5e chip from this CPU host: its custom call has the
  signature ``hlo_ops.ragged_kv`` looks for."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from capo_jax.run import tpu_topology  # pylint: disable=import-outside-toplevel
  from capo_jax.sampling import ragged  # pylint: disable=import-outside-toplevel

  acc = tpu_topology.parse_accelerator("v5e-8")
  tpu_topology.set_tpu_env(acc)
  mesh = jax.sharding.Mesh(tpu_topology.topology_devices(acc)[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
  args = (
    sds((W, K, 6, H), jnp.bfloat16),
    sds((W, S, K * H), jnp.bfloat16),
    sds((W, S, K * H), jnp.bfloat16),
    sds((W,), jnp.int32),
    sds((W,), jnp.int32),
  )
  f = lambda q, k, v, s, e: ragged.attend(q, k, v, s, e, interpret=False)  # noqa: E731
  cost = hlo_cost.hlo_cost(jax.jit(f).lower(*args).compile().as_text(), cols=0.0)
  assert cost["ragged_col_hbm"] == COL and cost["ragged_cache_cols"] == S
  assert cost["ragged_bytes"] == 0 and cost["bytes"] < 2 * W * S * K * H * 2
