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
