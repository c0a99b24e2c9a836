"""insert_loop_prefetches: IR (FileCheck) of the prefetches before and in a loop with a
dynamic bound, loads left alone, rejections (message and unchanged payload). Prefetches
do not change what a kernel computes; tests/lighthouse/test_xegpu_attention.py and
test_xegpu_cross_entropy.py check that the key and class loops prefetch down to SPIR-V
that validates."""

from torch_mlir import ir

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from transform_ext.insert_loop_prefetches import insert_loop_prefetches, tile_key

# a key loop (dynamic bound %n) loading [32, 64] tiles at row 2 * iv + 32 and at row iv,
# and one [32, 64] tile of a descriptor made in the loop
KERNEL = """
module attributes {gpu.container_module} {
  gpu.module @kernels {
    gpu.func @main(%k: memref<256x64xf16>, %v: memref<256x64xf16>, %n: index) kernel {
      %c0 = arith.constant 0 : index
      %c2 = arith.constant 2 : index
      %c32 = arith.constant 32 : index
      %cst = arith.constant dense<0.0> : vector<32x64xf16>
      %dk = xegpu.create_nd_tdesc %k : memref<256x64xf16> -> !xegpu.tensor_desc<32x64xf16, #xegpu.block_tdesc_attr<boundary_check = false>>
      %dv = xegpu.create_nd_tdesc %v : memref<256x64xf16> -> !xegpu.tensor_desc<32x64xf16, #xegpu.block_tdesc_attr<boundary_check = false>>
      %r = scf.for %i = %c0 to %n step %c32 iter_args(%acc = %cst) -> (vector<32x64xf16>) {
        %i2 = arith.muli %i, %c2 : index
        %row = arith.addi %i2, %c32 : index
        %tk = xegpu.load_nd %dk[%row, 0] : !xegpu.tensor_desc<32x64xf16, #xegpu.block_tdesc_attr<boundary_check = false>> -> vector<32x64xf16>
        %tv = xegpu.load_nd %dv[%i, 0] : !xegpu.tensor_desc<32x64xf16, #xegpu.block_tdesc_attr<boundary_check = false>> -> vector<32x64xf16>
        %dl = xegpu.create_nd_tdesc %v : memref<256x64xf16> -> !xegpu.tensor_desc<32x64xf16, #xegpu.block_tdesc_attr<boundary_check = false>>
        %tl = xegpu.load_nd %dl[%i, 0] : !xegpu.tensor_desc<32x64xf16, #xegpu.block_tdesc_attr<boundary_check = false>> -> vector<32x64xf16>
        %s = arith.addf %tk, %tv : vector<32x64xf16>
        %t = arith.addf %s, %tl : vector<32x64xf16>
        %a = arith.addf %acc, %t : vector<32x64xf16>
        scf.yield %a : vector<32x64xf16>
      }
      gpu.return
    }
  }
}
"""
LAYOUT = "#xegpu.layout<sg_layout = [4, 2], sg_data = [8, 32], inst_data = [8, 16]>"


def _layouts(key=tile_key(32, 64, "f16")):
    return {key: ir.Attribute.parse(LAYOUT)}


def test_prefetches_the_first_steps_before_the_loop_and_the_step_ahead_in_it():
    payload = parse(KERNEL)
    apply(payload, lambda root: insert_loop_prefetches(match(root, "gpu.func"), 2, _layouts()))
    hints = ("<{l1_hint = #xegpu.cache_hint<cached>, l2_hint = #xegpu.cache_hint<cached>, "
             "l3_hint = #xegpu.cache_hint<cached>, layout = " + LAYOUT + "}>")
    check(payload, """
        CHECK-LABEL: gpu.func @main
        CHECK-DAG: %[[C0:.*]] = arith.constant 0 : index
        CHECK-DAG: %[[C2:.*]] = arith.constant 2 : index
        CHECK-DAG: %[[C32:.*]] = arith.constant 32 : index
        CHECK: %[[DK:.*]] = xegpu.create_nd_tdesc %arg0
        CHECK: %[[DV:.*]] = xegpu.create_nd_tdesc %arg1
        CHECK: %[[S0:.*]] = arith.muli %[[C32]], %{{.*}} : index
        CHECK: %[[IV0:.*]] = arith.addi %[[C0]], %[[S0]] : index
        CHECK: %[[M0:.*]] = arith.muli %[[IV0]], %[[C2]] : index
        CHECK: %[[R0:.*]] = arith.addi %[[M0]], %[[C32]] : index
        CHECK: xegpu.prefetch_nd %[[DK]][%[[R0]], 0] HINTS
        CHECK: xegpu.prefetch_nd %[[DK]]
        CHECK: %[[V0:.*]] = arith.addi %[[C0]], %{{.*}} : index
        CHECK-NEXT: xegpu.prefetch_nd %[[DV]][%[[V0]], 0] HINTS
        CHECK: xegpu.prefetch_nd %[[DV]]
        CHECK: scf.for %[[I:.*]] = %[[C0]] to %arg2 step %[[C32]]
        CHECK: %[[SA:.*]] = arith.muli %[[C32]], %{{.*}} : index
        CHECK: %[[IVA:.*]] = arith.addi %[[I]], %[[SA]] : index
        CHECK: xegpu.prefetch_nd %[[DV]][%[[IVA]], 0] HINTS
        CHECK: %[[SB:.*]] = arith.muli %[[C32]], %{{.*}} : index
        CHECK: %[[IVB:.*]] = arith.addi %[[I]], %[[SB]] : index
        CHECK: %[[MB:.*]] = arith.muli %[[IVB]], %[[C2]] : index
        CHECK: %[[RB:.*]] = arith.addi %[[MB]], %[[C32]] : index
        CHECK: xegpu.prefetch_nd %[[DK]][%[[RB]], 0] HINTS
        CHECK: xegpu.load_nd %[[DK]]
        CHECK-NOT: xegpu.prefetch_nd
        CHECK: gpu.return
    """.replace("HINTS", hints.replace("[", "{{\\[}}")))
    # two steps ahead before the loop and one in it for %dk and %dv; none for %dl (made in
    # the loop)
    assert str(payload).count("xegpu.prefetch_nd") == 2 * 2 + 2


def test_rejects_a_tile_without_a_layout():
    payload = parse(KERNEL)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: insert_loop_prefetches(match(root, "gpu.func"), 1, _layouts("16x64")))
    assert "transform_ext.insert_loop_prefetches: xegpu.load_nd" in message
    assert "no prefetch layout for a 32x64xf16 tile" in message
    assert str(payload) == before


def test_a_tile_mapped_to_unit_is_not_prefetched():
    payload = parse(KERNEL)
    apply(payload, lambda root: insert_loop_prefetches(
        match(root, "gpu.func"), 1, {tile_key(32, 64, "f16"): ir.UnitAttr.get()}))
    assert "xegpu.prefetch_nd" not in str(payload)


def test_a_layout_is_per_element_type():
    """A layout for [32, 64] i8 tiles does not apply to [32, 64] f16 ones (their instruction
    tiles differ: 2-D block rows are at least 32 bytes wide)."""
    payload = parse(KERNEL)
    message = apply_expect_failure(
        payload, lambda root: insert_loop_prefetches(match(root, "gpu.func"), 1,
                                                     _layouts(tile_key(32, 64, "i8"))))
    assert "no prefetch layout for a 32x64xf16 tile" in message


def test_rejects_no_step_ahead():
    payload = parse(KERNEL)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: insert_loop_prefetches(match(root, "gpu.func"), 0, _layouts()))
    assert "transform_ext.insert_loop_prefetches: gpu.func" in message
    assert "nb_prefetch = 0: at least one step ahead" in message
    assert str(payload) == before
