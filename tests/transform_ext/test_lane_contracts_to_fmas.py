"""lane_contracts_to_fmas: IR (FileCheck) of a mat-vec step (rows, and x broadcast over
them), a widened bf16 one, a vector-matrix step (one element of x broadcast along A's run),
and the contractions it leaves alone (an outer product, a real reduction); a non-function
target is refused."""

from schedules.common import match
from transform_ext.lane_contracts_to_fmas import lane_contracts_to_fmas
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

STEP = """
#a = affine_map<(m, k1, l) -> (m, k1, l)>
#x = affine_map<(m, k1, l) -> (k1, l)>
#p = affine_map<(m, k1, l) -> (m, l)>
func.func @main(%a: vector<4x1x64x{t}>, %x: vector<1x64x{t}>, %p: vector<4x64xf32>) -> vector<4x64xf32> {{
  %r = vector.contract {{indexing_maps = [#a, #x, #p], iterator_types = ["parallel", "reduction", "parallel"], kind = #vector.kind<add>}}
      %a, %x, %p : vector<4x1x64x{t}>, vector<1x64x{t}> into vector<4x64xf32>
  return %r : vector<4x64xf32>
}}
"""


def _lower(payload):
    apply(payload, lambda root: lane_contracts_to_fmas(match(root, "func.func")))


def test_a_matvec_step_is_one_fma_with_x_broadcast_over_the_rows():
    payload = parse(STEP.format(t="f32"))
    _lower(payload)
    check(payload, """
        CHECK: func.func @main(%[[A:.*]]: vector<4x1x64xf32>, %[[X:.*]]: vector<1x64xf32>, %[[P:.*]]: vector<4x64xf32>)
        CHECK: %[[AR:.*]] = vector.shape_cast %[[A]] : vector<4x1x64xf32> to vector<4x64xf32>
        CHECK: %[[XR:.*]] = vector.shape_cast %[[X]] : vector<1x64xf32> to vector<64xf32>
        CHECK: %[[XB:.*]] = vector.broadcast %[[XR]] : vector<64xf32> to vector<4x64xf32>
        CHECK: %[[R:.*]] = vector.fma %[[AR]], %[[XB]], %[[P]] : vector<4x64xf32>
        CHECK-NOT: vector.contract
        CHECK: return %[[R]]
    """)


def test_bf16_operands_are_widened_first():
    payload = parse(STEP.format(t="bf16"))
    _lower(payload)
    check(payload, """
        CHECK: arith.extf %{{.*}} : vector<4x1x64xbf16> to vector<4x1x64xf32>
        CHECK: arith.extf %{{.*}} : vector<1x64xbf16> to vector<1x64xf32>
        CHECK: vector.fma {{.*}} : vector<4x64xf32>
        CHECK-NOT: vector.contract
    """)


def test_a_vector_matrix_step_is_one_fma_with_the_element_of_x_broadcast():
    """y[b, m] += A[b, k, m] x[b, k] with b and k of extent 1 (a batched A^T x, bf16)."""
    payload = parse("""
        #a = affine_map<(b, m, k) -> (b, k, m)>
        #x = affine_map<(b, m, k) -> (b, k)>
        #y = affine_map<(b, m, k) -> (b, m)>
        func.func @main(%a: vector<1x1x256xbf16>, %x: vector<1x1xbf16>, %y: vector<1x256xf32>)
            -> vector<1x256xf32> {
          %r = vector.contract {indexing_maps = [#a, #x, #y], iterator_types = ["parallel", "parallel", "reduction"], kind = #vector.kind<add>}
              %a, %x, %y : vector<1x1x256xbf16>, vector<1x1xbf16> into vector<1x256xf32>
          return %r : vector<1x256xf32>
        }
    """)
    _lower(payload)
    check(payload, """
        CHECK: func.func @main(%[[A:.*]]: vector<1x1x256xbf16>, %[[X:.*]]: vector<1x1xbf16>, %[[Y:.*]]: vector<1x256xf32>)
        CHECK: %[[AW:.*]] = arith.extf %[[A]] : vector<1x1x256xbf16> to vector<1x1x256xf32>
        CHECK: %[[AR:.*]] = vector.shape_cast %[[AW]] : vector<1x1x256xf32> to vector<1x256xf32>
        CHECK: %[[XW:.*]] = arith.extf %[[X]] : vector<1x1xbf16> to vector<1x1xf32>
        CHECK: %[[XR:.*]] = vector.shape_cast %[[XW]] : vector<1x1xf32> to vector<1xf32>
        CHECK: %[[XB:.*]] = vector.broadcast %[[XR]] : vector<1xf32> to vector<256x1xf32>
        CHECK: %[[XT:.*]] = vector.transpose %[[XB]], [1, 0] : vector<256x1xf32> to vector<1x256xf32>
        CHECK: %[[R:.*]] = vector.fma %[[AR]], %[[XT]], %[[Y]] : vector<1x256xf32>
        CHECK-NOT: vector.contract
        CHECK: return %[[R]]
    """)


def test_outer_products_and_real_reductions_are_left_alone():
    payload = parse("""
        #a = affine_map<(m, n, k) -> (m, k)>
        #b = affine_map<(m, n, k) -> (k, n)>
        #c = affine_map<(m, n, k) -> (m, n)>
        #r = affine_map<(m, k) -> (m, k)>
        #o = affine_map<(m, k) -> (m)>
        func.func @main(%a: vector<8x1xf32>, %b: vector<1x32xf32>, %c: vector<8x32xf32>,
                        %u: vector<4x16xf32>, %v: vector<4x16xf32>, %w: vector<4xf32>)
            -> (vector<8x32xf32>, vector<4xf32>) {
          %r = vector.contract {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction"], kind = #vector.kind<add>}
              %a, %b, %c : vector<8x1xf32>, vector<1x32xf32> into vector<8x32xf32>
          %s = vector.contract {indexing_maps = [#r, #r, #o], iterator_types = ["parallel", "reduction"], kind = #vector.kind<add>}
              %u, %v, %w : vector<4x16xf32>, vector<4x16xf32> into vector<4xf32>
          return %r, %s : vector<8x32xf32>, vector<4xf32>
        }
    """)
    _lower(payload)
    check(payload, """
        CHECK-NOT: vector.fma
        CHECK: vector.contract
        CHECK: vector.contract
    """)


def test_a_target_that_is_not_a_function_is_refused():
    payload = parse(STEP.format(t="f32"))
    error = apply_expect_failure(
        payload, lambda root: lane_contracts_to_fmas(match(root, "vector.contract")))
    assert "not a func.func" in error
