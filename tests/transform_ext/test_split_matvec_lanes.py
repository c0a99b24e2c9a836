"""split_matvec_lanes: IR (FileCheck) of the split, its k remainder, the contractions it
leaves alone (n > 1, k not innermost in A), and the refusal of a non-function target. The
numeric checks against torch are in tests/schedules/test_generic_matvec.py."""

from schedules.common import match
from transform_ext.fold_transposes_into_matvecs import fold_transposes_into_matvecs
from transform_ext.split_matvec_lanes import split_matvec_lanes
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

MATVEC = """
func.func @main(%a: tensor<6x{k}xf32>, %x: tensor<{k}x1xf32>, %init: tensor<6x1xf32>) -> tensor<6x1xf32> {{
  %r = linalg.matmul ins(%a, %x : tensor<6x{k}xf32>, tensor<{k}x1xf32>) outs(%init : tensor<6x1xf32>) -> tensor<6x1xf32>
  return %r : tensor<6x1xf32>
}}
"""


def _split(payload, lanes=16):
    apply(payload, lambda root: split_matvec_lanes(match(root, "func.func"), lanes))


def test_k_becomes_chunks_and_lanes_summed_at_the_end():
    payload = parse(MATVEC.format(k=64))
    _split(payload)
    check(payload, """
        CHECK-DAG: #[[A:.*]] = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
        CHECK-DAG: #[[X:.*]] = affine_map<(d0, d1, d2) -> (d1, d2)>
        CHECK-DAG: #[[P:.*]] = affine_map<(d0, d1, d2) -> (d0, d2)>
        CHECK-DAG: #[[SUM_OUT:.*]] = affine_map<(d0, d1, d2) -> (d0, d1)>
        CHECK: func.func @main(%[[AA:.*]]: tensor<6x64xf32>, %[[XX:.*]]: tensor<64x1xf32>, %[[INIT:.*]]: tensor<6x1xf32>)
        CHECK-DAG: %[[AV:.*]] = tensor.expand_shape %[[AA]] {{\\[\\[}}0], [1, 2]] output_shape [6, 4, 16]
        CHECK-DAG: %[[XS:.*]] = tensor.extract_slice %[[XX]][0, 0] [64, 1] [1, 1] : tensor<64x1xf32> to tensor<64xf32>
        CHECK-DAG: %[[XV:.*]] = tensor.expand_shape %[[XS]] {{\\[\\[}}0, 1]] output_shape [4, 16]
        CHECK: %[[Z:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%{{.*}} : tensor<6x16xf32>)
        CHECK: %[[PART:.*]] = linalg.generic {indexing_maps = [#[[A]], #[[X]], #[[P]]], iterator_types = ["parallel", "reduction", "parallel"]}
        CHECK-SAME: ins(%[[AV]], %[[XV]] : tensor<6x4x16xf32>, tensor<4x16xf32>) outs(%[[Z]] : tensor<6x16xf32>)
        CHECK: arith.mulf
        CHECK: arith.addf
        CHECK: %[[R:.*]] = linalg.generic {indexing_maps = [#[[P]], #[[SUM_OUT]]], iterator_types = ["parallel", "parallel", "reduction"]}
        CHECK-SAME: ins(%[[PART]] : tensor<6x16xf32>) outs(%[[INIT]] : tensor<6x1xf32>)
        CHECK-NOT: linalg.matmul
        CHECK: return %[[R]]
    """)


def test_the_k_remainder_is_the_contraction_on_the_last_columns():
    payload = parse(MATVEC.format(k=53))
    _split(payload)
    check(payload, """
        CHECK: func.func @main(%[[AA:.*]]: tensor<6x53xf32>, %[[XX:.*]]: tensor<53x1xf32>, %{{.*}}: tensor<6x1xf32>)
        CHECK: tensor.extract_slice %[[AA]][0, 0] [6, 48] [1, 1]
        CHECK: %[[SUM:.*]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<6x1xf32>)
        CHECK-DAG: %[[AT:.*]] = tensor.extract_slice %[[AA]][0, 48] [6, 5] [1, 1] : tensor<6x53xf32> to tensor<6x5xf32>
        CHECK-DAG: %[[XT:.*]] = tensor.extract_slice %[[XX]][48, 0] [5, 1] [1, 1] : tensor<53x1xf32> to tensor<5x1xf32>
        CHECK: %[[R:.*]] = linalg.matmul ins(%[[AT]], %[[XT]] : tensor<6x5xf32>, tensor<5x1xf32>) outs(%[[SUM]] : tensor<6x1xf32>)
        CHECK: return %[[R]]
    """)


def test_half_the_lanes_when_they_divide_k():
    payload = parse(MATVEC.format(k=40))
    _split(payload)
    check(payload, """
        CHECK: tensor.expand_shape %{{.*}} output_shape [6, 5, 8]
        CHECK-NOT: linalg.matmul
    """)


def test_matmuls_and_k_outer_operands_are_left_alone():
    payload = parse("""
        func.func @main(%a: tensor<6x64xf32>, %b: tensor<64x2xf32>, %c: tensor<6x2xf32>,
                        %at: tensor<64x6xf32>, %x: tensor<64xf32>, %y: tensor<6xf32>,
                        %short: tensor<6x16xf32>, %xs: tensor<16x1xf32>, %z: tensor<6x1xf32>)
            -> (tensor<6x2xf32>, tensor<6xf32>, tensor<6x1xf32>) {
          %mm = linalg.matmul ins(%a, %b : tensor<6x64xf32>, tensor<64x2xf32>) outs(%c : tensor<6x2xf32>) -> tensor<6x2xf32>
          %t = linalg.vecmat ins(%x, %at : tensor<64xf32>, tensor<64x6xf32>) outs(%y : tensor<6xf32>) -> tensor<6xf32>
          %s = linalg.matmul ins(%short, %xs : tensor<6x16xf32>, tensor<16x1xf32>) outs(%z : tensor<6x1xf32>) -> tensor<6x1xf32>
          return %mm, %t, %s : tensor<6x2xf32>, tensor<6xf32>, tensor<6x1xf32>
        }
    """)
    _split(payload)
    check(payload, """
        CHECK-NOT: linalg.generic
        CHECK: linalg.matmul
        CHECK: linalg.vecmat
        CHECK: linalg.matmul
        CHECK-NOT: linalg.generic
    """)


def test_a_target_that_is_not_a_function_is_refused():
    payload = parse(MATVEC.format(k=64))
    error = apply_expect_failure(
        payload, lambda root: split_matvec_lanes(match(root, "linalg.matmul"), 16))
    assert "not a func.func" in error
    check(payload, "CHECK: linalg.matmul")


SHORT = """
func.func @main(%x: tensor<{m}x64xf32>, %w: tensor<40x64xf32>, %init: tensor<{m}x40xf32>) -> tensor<{m}x40xf32> {{
  %y = linalg.generic {{indexing_maps = [affine_map<(m, n, k) -> (m, k)>, affine_map<(m, n, k) -> (n, k)>,
                                        affine_map<(m, n, k) -> (m, n)>],
                       iterator_types = ["parallel", "parallel", "reduction"]}}
      ins(%x, %w : tensor<{m}x64xf32>, tensor<40x64xf32>) outs(%init : tensor<{m}x40xf32>) {{
    ^bb0(%a: f32, %b: f32, %c: f32):
      %p = arith.mulf %a, %b : f32
      %s = arith.addf %c, %p : f32
      linalg.yield %s : f32
  }} -> tensor<{m}x40xf32>
  return %y : tensor<{m}x40xf32>
}}
"""


def test_a_short_product_pairs_rows_of_both_sides_on_short_lanes():
    """x @ W^T (x [3, 64], W [40, 64]) with short_rows = 4, short_lanes = 16: partial sums
    P[n, m, l] (the short side's rows together, innermost but the lanes; its loops n, m,
    k1, l: W's rows outside the batch's) summed over l into C[m, n]."""
    payload = parse(SHORT.format(m=3))
    apply(payload, lambda root: split_matvec_lanes(match(root, "func.func"), 64, 4, 16))
    check(payload, """
        CHECK-DAG: #[[X:.*]] = affine_map<(d0, d1, d2, d3) -> (d1, d2, d3)>
        CHECK-DAG: #[[W:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>
        CHECK-DAG: #[[P:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d1, d3)>
        CHECK-DAG: #[[PSUM:.*]] = affine_map<(d0, d1, d2) -> (d1, d0, d2)>
        CHECK-DAG: #[[C:.*]] = affine_map<(d0, d1, d2) -> (d0, d1)>
        CHECK-DAG: %[[XV:.*]] = tensor.expand_shape %arg0 {{\\[\\[}}0], [1, 2]] output_shape [3, 4, 16]
        CHECK-DAG: %[[WV:.*]] = tensor.expand_shape %arg1 {{\\[\\[}}0], [1, 2]] output_shape [40, 4, 16]
        CHECK: %[[Z:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%{{.*}} : tensor<40x3x16xf32>)
        CHECK: %[[PART:.*]] = linalg.generic {indexing_maps = [#[[X]], #[[W]], #[[P]]], iterator_types = ["parallel", "parallel", "reduction", "parallel"]}
        CHECK-SAME: ins(%[[XV]], %[[WV]] : tensor<3x4x16xf32>, tensor<40x4x16xf32>) outs(%[[Z]] : tensor<40x3x16xf32>)
        CHECK: %[[R:.*]] = linalg.generic {indexing_maps = [#[[PSUM]], #[[C]]], iterator_types = ["parallel", "parallel", "reduction"]}
        CHECK-SAME: ins(%[[PART]] : tensor<40x3x16xf32>) outs(%arg2 : tensor<3x40xf32>)
        CHECK: return %[[R]]
    """)


def test_short_products_of_more_rows_or_in_a_loop_are_left_alone():
    """5 rows over short_rows = 4; a product in a loop body (an LSTM step: its loop-invariant
    W^T copy is amortized, its outer-product register tiles ran 1.7x faster); short_rows
    = 0 (mat-vecs only)."""
    for payload, short_rows in ((parse(SHORT.format(m=5)), 4), (parse(SHORT.format(m=3)), 0)):
        apply(payload, lambda root: split_matvec_lanes(match(root, "func.func"), 64, short_rows, 16))
        check(payload, """
            CHECK-NOT: tensor.expand_shape
            CHECK: linalg.generic
            CHECK-NOT: linalg.generic
        """)
    looped = parse("""
        func.func @main(%x: tensor<3x64xf32>, %w: tensor<40x64xf32>, %init: tensor<3x40xf32>) -> tensor<3x40xf32> {
          %c0 = arith.constant 0 : index
          %c1 = arith.constant 1 : index
          %c5 = arith.constant 5 : index
          %r = scf.for %i = %c0 to %c5 step %c1 iter_args(%acc = %init) -> tensor<3x40xf32> {
            %e = tensor.empty() : tensor<64x40xf32>
            %wt = linalg.transpose ins(%w : tensor<40x64xf32>) outs(%e : tensor<64x40xf32>) permutation = [1, 0]
            %y = linalg.matmul ins(%x, %wt : tensor<3x64xf32>, tensor<64x40xf32>) outs(%acc : tensor<3x40xf32>) -> tensor<3x40xf32>
            scf.yield %y : tensor<3x40xf32>
          }
          return %r : tensor<3x40xf32>
        }
    """)
    apply(looped, lambda root: (fold_transposes_into_matvecs(match(root, "func.func"), 4),
                                split_matvec_lanes(match(root, "func.func"), 64, 4, 16)))
    check(looped, """
        CHECK-NOT: linalg.generic
        CHECK: linalg.transpose
        CHECK: linalg.matmul
    """)


def test_short_rows_without_short_lanes_are_refused():
    payload = parse(SHORT.format(m=3))
    error = apply_expect_failure(
        payload, lambda root: split_matvec_lanes(match(root, "func.func"), 64, 4, 0))
    assert "short_lanes = 0 must be >= 1 with short_rows = 4" in error
    check(payload, "CHECK-NOT: tensor.expand_shape")
