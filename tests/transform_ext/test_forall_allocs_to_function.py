"""forall_allocs_to_function: a workgroup's own buffers (allocated in a forall's body) become
its rows of one function-level buffer, the iterations linearized row-major; deallocs
dropped; shared-memory and dynamic allocs left alone; a user that takes no strided memref
and a forall that is not normalized are refused (message, unchanged payload). The kernels
that use it are lowered to SPIR-V and built by ocloc in
tests/lighthouse/test_xegpu_linear_cross_entropy.py (the backward passes in D slices)."""

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from transform_ext.forall_allocs_to_function import forall_allocs_to_function

# a 2 x 3 grid whose iterations zero an accumulator of their own, add x to it, write it
GRID = """
func.func @main(%x: memref<6x4x8xf32>, %out: memref<6x4x8xf32>, %n: index) {
  %c0 = arith.constant 0 : index
  %c3 = arith.constant 3 : index
  %zero = arith.constant dense<0.0> : vector<4x8xf32>
  %pad = arith.constant 0.0 : f32
  scf.forall (%i, %j) in (2, 3) {
    %acc = memref.alloc() : memref<4x8xf32>
    %slm = memref.alloc() : memref<4x8xf32, 3>
    %dyn = memref.alloc(%n) : memref<?xf32>
    %k = affine.apply affine_map<(i, j) -> (i * 3 + j)>(%i, %j)
    vector.transfer_write %zero, %acc[%c0, %c0] {in_bounds = [true, true]} : vector<4x8xf32>, memref<4x8xf32>
    %a = vector.transfer_read %acc[%c0, %c0], %pad {in_bounds = [true, true]} : memref<4x8xf32>, vector<4x8xf32>
    %b = vector.transfer_read %x[%k, %c0, %c0], %pad {in_bounds = [true, true]} : memref<6x4x8xf32>, vector<4x8xf32>
    %s = arith.addf %a, %b : vector<4x8xf32>
    vector.transfer_write %s, %acc[%c0, %c0] {in_bounds = [true, true]} : vector<4x8xf32>, memref<4x8xf32>
    %r = vector.transfer_read %acc[%c0, %c0], %pad {in_bounds = [true, true]} : memref<4x8xf32>, vector<4x8xf32>
    vector.transfer_write %r, %out[%k, %c0, %c0] {in_bounds = [true, true]} : vector<4x8xf32>, memref<6x4x8xf32>
    USE
    memref.dealloc %acc : memref<4x8xf32>
  }
  return
}
func.func private @take(memref<4x8xf32>)
"""


def test_each_iteration_gets_its_rows_of_one_function_level_buffer():
    payload = parse(GRID.replace("USE", ""))
    apply(payload, lambda root: forall_allocs_to_function(match(root, "func.func")))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: %[[ALL:.*]] = memref.alloc() : memref<24x8xf32>
        CHECK-NEXT: scf.forall (%[[I:.*]], %[[J:.*]]) in (2, 3) {
        CHECK-NEXT:   %[[C3:.*]] = arith.constant 3 : index
        CHECK-NEXT:   %[[IJ:.*]] = arith.muli %[[I]], %[[C3]] : index
        CHECK-NEXT:   %[[K:.*]] = arith.addi %[[IJ]], %[[J]] : index
        CHECK-NEXT:   %[[C4:.*]] = arith.constant 4 : index
        CHECK-NEXT:   %[[ROW:.*]] = arith.muli %[[K]], %[[C4]] : index
        CHECK-NEXT:   %[[ACC:.*]] = memref.subview %[[ALL]][%[[ROW]], 0] [4, 8] [1, 1] : memref<24x8xf32> to memref<4x8xf32, strided<[8, 1], offset: ?>>
        CHECK-NEXT:   memref.alloc() : memref<4x8xf32, 3>
        CHECK-NEXT:   memref.alloc(%arg2) : memref<?xf32>
        CHECK: vector.transfer_write {{.*}}, %[[ACC]][%c0, %c0]
        CHECK: vector.transfer_read %[[ACC]][%c0, %c0]
        CHECK-NOT: memref.dealloc
        CHECK: return
    """)


def test_a_user_that_takes_no_strided_memref_is_refused():
    payload = parse(GRID.replace("USE", "func.call @take(%acc) : (memref<4x8xf32>) -> ()"))
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: forall_allocs_to_function(
        match(root, "func.func")))
    assert "transform_ext.forall_allocs_to_function: func.call" in message
    assert "takes no strided memref" in message
    assert str(payload) == before


def test_a_forall_that_is_not_normalized_is_refused():
    payload = parse(GRID.replace("USE", "").replace("scf.forall (%i, %j) in (2, 3)",
                                                    "scf.forall (%i, %j) = (0, 0) to (4, 3) step (2, 1)"))
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: forall_allocs_to_function(
        match(root, "func.func")))
    assert "allocates buffers per iteration but is not normalized" in message
    assert str(payload) == before
