"""drop_forall_mapping: IR (FileCheck), the forall_to_parallel and GPU mapping it is for,
rejection (message and unchanged payload). The loop computes the same (only the mapping
goes): tests/lighthouse/test_xegpu*.py outline every kernel through it."""

from torch_mlir.dialects.transform import loop

from schedules.common import any_op, foreach, match, run_passes
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from transform_ext.drop_forall_mapping import drop_forall_mapping

FORALL = """
func.func @main(%x: memref<64xf32>) {
  scf.forall (%i) in (4) {
    %c16 = arith.constant 16 : index
    %o = arith.muli %i, %c16 : index
    %s = memref.subview %x[%o] [16] [1] : memref<64xf32> to memref<16xf32, strided<[1], offset: ?>>
    linalg.exp ins(%s : memref<16xf32, strided<[1], offset: ?>>) outs(%s : memref<16xf32, strided<[1], offset: ?>>)
  } {mapping = [#gpu.block<x>]}
  scf.forall (%j) in (2) {
  }
  return
}
"""


def test_the_mapping_goes_and_the_loop_stays():
    payload = parse(FORALL)
    apply(payload, lambda root: drop_forall_mapping(match(root, "scf.forall")))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: scf.forall (%{{.*}}) in (4)
        CHECK: linalg.exp
        CHECK-NOT: mapping
    """)


def test_then_gpu_map_parallel_loops_maps_the_parallel_loop():
    payload = parse(FORALL)

    def body(root):
        foralls = match(root, "scf.forall")
        drop_forall_mapping(foralls)
        foreach(foralls, lambda f: loop.ForallToParallelOp([any_op()], f))

    apply(payload, body)
    run_passes(payload, "func.func(gpu-map-parallel-loops)")
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: scf.parallel
        CHECK: } {mapping = [#gpu.loop_dim_map<processor = block_x, map = (d0) -> (d0), bound = (d0) -> (d0)>]}
    """)


def test_rejects_a_target_that_is_not_a_forall():
    payload = parse(FORALL)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: drop_forall_mapping(match(root, "linalg.exp")))
    assert "transform_ext.drop_forall_mapping: linalg.exp" in message
    assert "not an scf.forall" in message
    assert str(payload) == before
