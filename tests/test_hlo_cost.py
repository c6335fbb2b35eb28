"""hlo_cost's byte accounting by memory space, on hand-written TPU-style HLO (no libtpu).

The TPU compiler writes ``S(n)`` into the layout of a buffer it places on chip
(VMEM; on v4 also CMEM): ``bytes`` is the HBM traffic the roofline times,
``onchip_bytes`` the rest. Expected figures are counted by hand below.
"""

from __future__ import annotations

from capo_jax.run import hlo_cost

# A KV block cut out of an HBM cache into on-chip memory (S(3)), then read by a dot
# fusion together with an HBM weight; the result goes back to HBM.
_SLICE_THEN_DOT = """HloModule m

%fused_dot (param_0.1: bf16[4,128], param_1.1: bf16[128,8]) -> f32[4,8] {
  %param_0.1 = bf16[4,128]{1,0:T(8,128)(2,1)S(3)} parameter(0)
  %param_1.1 = bf16[128,8]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %dot.1 = f32[4,8]{1,0:T(8,128)} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p0: bf16[16,128], p1: bf16[128,8], i: s32[]) -> f32[4,8] {
  %p0 = bf16[16,128]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[128,8]{1,0:T(8,128)(2,1)} parameter(1)
  %i = s32[]{:T(128)S(6)} parameter(2)
  %c = s32[]{:T(128)S(6)} constant(0)
  %ds = bf16[4,128]{1,0:T(8,128)(2,1)S(3)} dynamic-slice(%p0, %i, %c), dynamic_slice_sizes={4,128}
  ROOT %f = f32[4,8]{1,0:T(8,128)} fusion(%ds, %p1), kind=kOutput, calls=%fused_dot
}
"""  # noqa: E501  (HLO lines as the compiler prints them)

# The same block sliced inside the dot's fusion, straight from the HBM cache.
_SLICE_IN_FUSION = """HloModule m

%fused_dot (param_0.1: bf16[16,128], param_1.1: bf16[128,8], param_2.1: s32[]) -> f32[4,8] {
  %param_0.1 = bf16[16,128]{1,0:T(8,128)(2,1)} parameter(0)
  %param_2.1 = s32[]{:T(128)S(6)} parameter(2)
  %c.1 = s32[]{:T(128)S(6)} constant(0)
  %ds.1 = bf16[4,128]{1,0:T(8,128)(2,1)} dynamic-slice(%param_0.1, %param_2.1, %c.1), dynamic_slice_sizes={4,128}
  %param_1.1 = bf16[128,8]{1,0:T(8,128)(2,1)S(3)} parameter(1)
  ROOT %dot.1 = f32[4,8]{1,0:T(8,128)} dot(%ds.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p0: bf16[16,128], p1: bf16[128,8], i: s32[]) -> f32[4,8] {
  %p0 = bf16[16,128]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[128,8]{1,0:T(8,128)(2,1)S(3)} parameter(1)
  %i = s32[]{:T(128)S(6)} parameter(2)
  ROOT %f = f32[4,8]{1,0:T(8,128)} fusion(%p0, %p1, %i), kind=kOutput, calls=%fused_dot
}
"""  # noqa: E501  (HLO lines as the compiler prints them)

BLOCK = 4 * 128 * 2  # bf16 [4, 128]
WEIGHT = 128 * 8 * 2  # bf16 [128, 8]
OUT = 4 * 8 * 4  # f32 [4, 8]
SCALAR = 4


def test_a_block_staged_on_chip_costs_hbm_once():
  cost = hlo_cost.hlo_cost(_SLICE_THEN_DOT)
  # HBM: the block read out of the cache, the weight, the result written.
  assert cost["bytes"] == BLOCK + WEIGHT + OUT
  # On chip: the block written there by the slice, then read by the dot (a
  # dynamic-slice's scalar offsets, in S(6), scalar memory, are not counted).
  assert cost["onchip_bytes"] == BLOCK + BLOCK
  assert cost["flops"] == 2 * 4 * 8 * 128


def test_a_slice_inside_the_fusion_reads_where_its_operand_lives():
  cost = hlo_cost.hlo_cost(_SLICE_IN_FUSION)
  # The fusion reads only the block of the HBM cache (not all 16 rows), and its
  # weight operand from on chip (and the scalar offset from scalar memory).
  assert cost["bytes"] == BLOCK + OUT
  assert cost["onchip_bytes"] == WEIGHT + SCALAR


def test_without_memory_spaces_everything_is_hbm():
  plain = _SLICE_THEN_DOT.replace("S(3)", "").replace("S(6)", "").replace(":T(128)}", "}")
  cost = hlo_cost.hlo_cost(plain)
  assert cost["onchip_bytes"] == 0
  assert cost["bytes"] == 2 * BLOCK + BLOCK + WEIGHT + OUT  # the old count


# A weight prefetched from HBM into on-chip memory by an asynchronous copy, then read.
_PREFETCH = """HloModule m

ENTRY %main (p0: bf16[128,8]) -> bf16[128,8] {
  %p0 = bf16[128,8]{1,0:T(8,128)(2,1)} parameter(0)
  %cs = (bf16[128,8]{1,0:T(8,128)(2,1)S(3)}, bf16[128,8]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%p0)
  %cd = bf16[128,8]{1,0:T(8,128)(2,1)S(3)} copy-done(%cs)
  ROOT %n = bf16[128,8]{1,0:T(8,128)(2,1)} negate(%cd)
}
"""  # noqa: E501  (HLO lines as the compiler prints them)


def test_an_async_prefetch_reads_hbm_once_and_writes_on_chip():
  cost = hlo_cost.hlo_cost(_PREFETCH)
  # copy-start: the weight read from HBM, written on chip; negate: read on chip, the
  # result written to HBM; copy-done moves nothing of its own.
  assert cost["bytes"] == WEIGHT + WEIGHT
  assert cost["onchip_bytes"] == WEIGHT + WEIGHT


def test_a_copy_is_one_stream_and_a_computation_times_its_memory_in_turn():
  cost = hlo_cost.hlo_cost(_PREFETCH, rates=RATES)
  # copy-start moves: its slower side, 2,048 from HBM (its on-chip write, 2,048 / 2,
  # streams beside it). negate computes: its on-chip read then its HBM write.
  assert cost["op_honest_s"] == WEIGHT + (WEIGHT / RATES.onchip + WEIGHT)


# Rates of 1 FLOP / byte a second make a time equal to its count: on chip 2 bytes/s
# (the estimate's 2x HBM), host 0.5, ICI 0.25.
RATES = hlo_cost.Rates(flops=1.0, hbm=1.0, onchip=2.0, host=0.5, ici=0.25)

# A compute-bound dot and a memory-bound negate, both on HBM.
_DOT_THEN_NEGATE = """HloModule m

ENTRY %main (a: bf16[4,128], b: bf16[128,8], w: bf16[128,8]) -> (f32[4,8], bf16[128,8]) {
  %a = bf16[4,128]{1,0} parameter(0)
  %b = bf16[128,8]{1,0} parameter(1)
  %w = bf16[128,8]{1,0} parameter(2)
  %d = f32[4,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %n = bf16[128,8]{1,0} negate(%w)
  ROOT %t = (f32[4,8]{1,0}, bf16[128,8]{1,0}) tuple(%d, %n)
}
"""


def test_per_operation_roofline_sums_each_operations_bound():
  cost = hlo_cost.hlo_cost(_DOT_THEN_NEGATE, rates=RATES)
  t = hlo_cost.times(cost, RATES)
  flops = 2 * 4 * 8 * 128  # 8,192: the dot's bound (its bytes: 1,024 + 2,048 + 128)
  assert t["flop_s"] == flops and t["hbm_s"] == BLOCK + WEIGHT + OUT + 2 * WEIGHT
  # The program as a whole: max(8,192, 7,296); op by op: the dot's FLOPs, then the
  # negate's 4,096 bytes, which the whole-program roofline hid under the FLOPs.
  assert t["program_s"] == flops
  assert t["op_s"] == t["op_honest_s"] == flops + 2 * WEIGHT


def test_the_operations_table_names_each_operation_and_sums_to_the_honest_end():
  text = _DOT_THEN_NEGATE.replace(
    "rhs_contracting_dims={0}\n",
    'rhs_contracting_dims={0}, metadata={op_name="jit(step)/while/body/layers/mlp/dot_general"}\n',
  )
  ops: hlo_cost.Ops = {}
  cost = hlo_cost.hlo_cost(text, rates=RATES, ops=ops)
  flops = 2 * 4 * 8 * 128
  # Labelled by kind and the op name's last three parts (the jit scope dropped).
  assert set(ops) == {"dot layers/mlp/dot_general", "negate"}
  dot = dict(zip(hlo_cost.OP_PARTS, ops["dot layers/mlp/dot_general"]))
  assert dot == {
    "honest_s": flops,  # FLOP-bound
    "flop_s": flops,
    "hbm_s": BLOCK + WEIGHT + OUT,
    "onchip_s": 0.0,
    "host_s": 0.0,
    "ici_s": 0.0,
  }
  assert ops["negate"][:3] == [2 * WEIGHT, 0.0, 2 * WEIGHT]  # reads and writes its weight
  assert sum(row[0] for row in ops.values()) == cost["op_honest_s"]
  assert [r["op"] for r in hlo_cost.top_ops(ops, 1)] == ["dot layers/mlp/dot_general"]


def test_on_chip_traffic_is_a_range_from_free_to_its_assumed_bandwidth():
  cost = hlo_cost.hlo_cost(_SLICE_THEN_DOT, rates=RATES)
  t = hlo_cost.times(cost, RATES)
  assert t["onchip_s"] == 2 * BLOCK / RATES.onchip  # the top of [0, bytes / on-chip rate]
  flops = 2 * 4 * 8 * 128
  # Optimistic, op by op: the slice's HBM read, then the dot's FLOPs.
  assert cost["op_s"] == BLOCK + flops
  # Honest: the slice is one stream, HBM read into on-chip write, timed by its slower
  # side (1,024 from HBM, not + 1,024 / 2 on chip); the dot stays compute-bound (2,176
  # HBM + 1,024 / 2 on chip < 8,192).
  assert cost["op_honest_s"] == BLOCK + flops


# A weight offloaded to the host's memory (space 5) and brought back.
_HOST_OFFLOAD = """HloModule m

ENTRY %main (p0: bf16[128,8]) -> bf16[128,8] {
  %p0 = bf16[128,8]{1,0:T(8,128)(2,1)} parameter(0)
  %cs = (bf16[128,8]{1,0:T(8,128)(2,1)S(5)}, bf16[128,8]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%p0)
  %cd = bf16[128,8]{1,0:T(8,128)(2,1)S(5)} copy-done(%cs)
  %back = (bf16[128,8]{1,0:T(8,128)(2,1)}, bf16[128,8]{1,0:T(8,128)(2,1)S(5)}, u32[]{:S(2)}) copy-start(%cd)
  ROOT %bd = bf16[128,8]{1,0:T(8,128)(2,1)} copy-done(%back)
}
"""  # noqa: E501  (HLO lines as the compiler prints them)


def test_host_memory_space_is_host_traffic_not_on_chip():
  cost = hlo_cost.hlo_cost(_HOST_OFFLOAD, rates=RATES)
  # Out: read from HBM, written to the host; back: read from the host, written to HBM.
  assert cost["bytes"] == 2 * WEIGHT
  assert cost["host_bytes"] == 2 * WEIGHT
  assert cost["onchip_bytes"] == 0
  assert hlo_cost.times(cost, RATES)["host_s"] == 2 * WEIGHT / RATES.host
  # Each copy: one stream, as slow as its host side over PCIe (2,048 / 0.5 against
  # 2,048 from HBM).
  assert cost["op_honest_s"] == 2 * (WEIGHT / RATES.host)
  assert cost["op_s"] == 2 * WEIGHT  # the optimistic end leaves the host link out


# One collective of each kind, per device: groups of 4 (a list), of 4 (the iota form),
# of all 8 partitions (empty groups), a permute, and one over the mesh axis "b" of 2
# (the mesh form libtpu prints).
_COLLECTIVES = """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (w: bf16[128,8], g: f32[64]) -> f32[64] {
  %w = bf16[128,8]{1,0} parameter(0)
  %g = f32[64]{0} parameter(1)
  %ag = bf16[512,8]{1,0} all-gather(%w), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %rs = f32[16]{0} reduce-scatter(%g), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %ar = f32[64]{0} all-reduce(%g), channel_id=3, replica_groups={}, to_apply=%add
  %cp = f32[64]{0} collective-permute(%ar), channel_id=4, source_target_pairs={{0,1},{1,0}}
  ROOT %ag2 = f32[128]{0} all-gather(%cp), channel_id=5, replica_groups=mesh['a'=4,'b'=2] {'b'}, dimensions={0}
}
"""  # noqa: E501  (HLO lines as the compiler prints them)

GRAD = 64 * 4  # f32 [64]


def test_collectives_are_timed_by_the_bytes_each_chip_sends():
  cost = hlo_cost.hlo_cost(_COLLECTIVES, rates=RATES)
  sent = {
    "all-gather": 3 * WEIGHT,  # the 3 other shards of its group come in, its own goes out 3x
    "reduce-scatter": GRAD * 3 / 4,
    "all-reduce": 2 * GRAD * 7 / 8,  # reduce-scatter + all-gather over all 8
    "collective-permute": GRAD,
    "all-gather over b": GRAD,  # the other half comes in, its own goes out once
  }
  assert cost["ici_bytes"] == sum(sent.values())
  assert hlo_cost.times(cost, RATES)["ici_s"] == sum(sent.values()) / RATES.ici
  assert cost["collectives"] == len(sent)  # each one's fixed cost is not in the bytes
  # The older count, each collective's result: the all-gather whole, the
  # reduce-scatter by its shard.
  assert cost["collective_bytes"] == 4 * WEIGHT + GRAD / 4 + GRAD + GRAD + 2 * GRAD
  # Honest, op by op, a collective takes the longer of its HBM traffic and its sending
  # (here always the sending); the optimistic end counts only the HBM side.
  hbm = {
    "all-gather": WEIGHT + 4 * WEIGHT,
    "reduce-scatter": GRAD + GRAD / 4,
    "all-reduce": 2 * GRAD,
    "collective-permute": 2 * GRAD,
    "all-gather over b": GRAD + 2 * GRAD,
  }
  assert cost["op_s"] == sum(hbm.values())
  assert cost["op_honest_s"] == sum(max(hbm[k], sent[k] / RATES.ici) for k in sent)


# A reduce-scatter as the TPU compiler fuses it: an all-reduce over groups of 4 inside a
# kCustom fusion whose root slices out this device's quarter.
_FUSED_REDUCE_SCATTER = """HloModule m, num_partitions=8

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}

%all-reduce-scatter.clone (input.1: bf16[128,256]) -> bf16[32,256] {
  %input.1 = bf16[128,256]{1,0:T(8,128)(2,1)S(3)} parameter(0)
  %all-reduce.1 = bf16[128,256]{1,0:T(8,128)(2,1)} all-reduce(%input.1), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %partition-id.1 = u32[] partition-id()
  %c32 = u32[] constant(32)
  %off = u32[] multiply(%partition-id.1, %c32)
  %c0 = u32[] constant(0)
  ROOT %dynamic-slice.1 = bf16[32,256]{1,0:T(8,128)(2,1)S(3)} dynamic-slice(%all-reduce.1, %off, %c0), dynamic_slice_sizes={32,256}
}

%fused_neg (p.1: bf16[32,256]) -> bf16[32,256] {
  %p.1 = bf16[32,256]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %n.1 = bf16[32,256]{1,0:T(8,128)(2,1)} negate(%p.1)
}

ENTRY %main (g: bf16[128,256]) -> bf16[32,256] {
  %g = bf16[128,256]{1,0:T(8,128)(2,1)} parameter(0)
  %rs = bf16[32,256]{1,0:T(8,128)(2,1)S(3)} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.clone
  ROOT %f = bf16[32,256]{1,0:T(8,128)(2,1)} fusion(%rs), kind=kLoop, calls=%fused_neg
}
"""  # noqa: E501  (HLO lines as the compiler prints them)


def test_a_fused_reduce_scatter_is_a_collective():
  """Counted as the reduce-scatter it runs: 3 / 4 of its input sent (not an all-reduce's
  2 x 3 / 4), its shard the result; the fusion beside it sends nothing."""
  cost = hlo_cost.hlo_cost(_FUSED_REDUCE_SCATTER, rates=RATES)
  grad, shard = 128 * 256 * 2, 32 * 256 * 2
  assert cost["ici_bytes"] == grad * 3 / 4
  assert cost["collective_bytes"] == shard
  assert cost["collectives"] == 1
  assert hlo_cost.times(cost, RATES)["ici_s"] == grad * 3 / 4 / RATES.ici


# The engine's refill, as the TPU compiler fuses it: a slot's old block is read (kept
# where the row is not copied, by a select), and the result written back in place.
_SELECT_IN_PLACE = """HloModule m

%fused_refill (param_0: bf16[4,64,256], param_1: s32[], param_2: bf16[1,16,256], param_3: pred[]) -> bf16[4,64,256] {
  %param_0 = bf16[4,64,256]{2,1,0} parameter(0)
  %param_3 = pred[]{:T(512)S(6)} parameter(3)
  %b = pred[1,16,256]{2,1,0} broadcast(%param_3), dimensions={}
  %param_2 = bf16[1,16,256]{2,1,0} parameter(2)
  %param_1 = s32[]{:T(128)S(6)} parameter(1)
  %zero = s32[] constant(0)
  %old = bf16[1,16,256]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,16,256}
  %new = bf16[1,16,256]{2,1,0} select(%b, %param_2, %old)
  ROOT %dus = bf16[4,64,256]{2,1,0} dynamic-update-slice(%param_0, %new, %param_1, %zero, %zero)
}

ENTRY %main (cache: bf16[4,64,256], i: s32[], row: bf16[1,16,256], p: pred[]) -> bf16[4,64,256] {
  %cache = bf16[4,64,256]{2,1,0} parameter(0)
  %i = s32[]{:T(128)S(6)} parameter(1)
  %row = bf16[1,16,256]{2,1,0} parameter(2)
  %p = pred[]{:T(512)S(6)} parameter(3)
  ROOT %f = bf16[4,64,256]{2,1,0} fusion(%cache, %i, %row, %p), kind=kLoop, calls=%fused_refill
}
"""  # noqa: E501  (HLO lines as the compiler prints them)

ROW = 16 * 256 * 2  # bf16 [1, 16, 256]: one slot's block


def test_an_in_place_update_that_reads_its_old_block_costs_the_block_not_the_cache():
  cost = hlo_cost.hlo_cost(_SELECT_IN_PLACE)
  # HBM: the old block read, the new row read, the block written; not the 131,072-byte
  # cache (4 x 64 x 256 bf16), which stays in place.
  assert cost["bytes"] == ROW + ROW + ROW
  assert cost["onchip_bytes"] == SCALAR + 1  # the offset and the predicate, scalar memory
