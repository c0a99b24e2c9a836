"""fold_transposes_into_matvecs: IR (FileCheck) of the fold into a mat-vec and a vector-matrix
product, their unit dims dropped, a transpose kept for its other reader, the matmuls left
alone, an operand or a result of unit dims only, and the refusal of a non-function target.
Numerics against torch: tests/schedules/test_generic_matvec.py."""

from schedules.common import match
from transform_ext.fold_transposes_into_matvecs import fold_transposes_into_matvecs
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

PAYLOAD = """
func.func @main(%a: tensor<64x6xf32>, %x: tensor<64x1xf32>, %init: tensor<6x1xf32>,
                %y: tensor<1x6xf32>, %vinit: tensor<1x64xf32>, %b: tensor<64x2xf32>,
                %minit: tensor<6x2xf32>) -> (tensor<6x1xf32>, tensor<1x64xf32>, tensor<6x2xf32>) {
  %e = tensor.empty() : tensor<6x64xf32>
  %t = linalg.transpose ins(%a : tensor<64x6xf32>) outs(%e : tensor<6x64xf32>) permutation = [1, 0]
  %mv = linalg.matmul ins(%t, %x : tensor<6x64xf32>, tensor<64x1xf32>) outs(%init : tensor<6x1xf32>) -> tensor<6x1xf32>
  %e2 = tensor.empty() : tensor<6x64xf32>
  %t2 = linalg.transpose ins(%a : tensor<64x6xf32>) outs(%e2 : tensor<6x64xf32>) permutation = [1, 0]
  %vm = linalg.matmul ins(%y, %t2 : tensor<1x6xf32>, tensor<6x64xf32>) outs(%vinit : tensor<1x64xf32>) -> tensor<1x64xf32>
  %mm = linalg.matmul ins(%t2, %b : tensor<6x64xf32>, tensor<64x2xf32>) outs(%minit : tensor<6x2xf32>) -> tensor<6x2xf32>
  return %mv, %vm, %mm : tensor<6x1xf32>, tensor<1x64xf32>, tensor<6x2xf32>
}
"""


def test_matvecs_read_the_transposed_tensor_in_place_without_unit_dims():
    payload = parse(PAYLOAD)
    apply(payload, lambda root: fold_transposes_into_matvecs(match(root, "func.func")))
    check(payload, """
        CHECK-DAG: #[[AT:.*]] = affine_map<(d0, d1) -> (d1, d0)>
        CHECK-DAG: #[[K:.*]] = affine_map<(d0, d1) -> (d1)>
        CHECK-DAG: #[[OUT:.*]] = affine_map<(d0, d1) -> (d0)>
        CHECK-DAG: #[[A:.*]] = affine_map<(d0, d1) -> (d0, d1)>
        CHECK: func.func @main(%[[AA:.*]]: tensor<64x6xf32>, %[[XX:[^:]*]]: tensor<64x1xf32>, %[[INIT:[^:]*]]: tensor<6x1xf32>
        CHECK-NOT: linalg.transpose
        CHECK-DAG: %[[X:.*]] = tensor.collapse_shape %[[XX]] {{\\[}}[0, 1]] : tensor<64x1xf32> into tensor<64xf32>
        CHECK-DAG: %[[I:.*]] = tensor.collapse_shape %[[INIT]] {{\\[}}[0, 1]] : tensor<6x1xf32> into tensor<6xf32>
        CHECK: %[[G:.*]] = linalg.generic {indexing_maps = [#[[AT]], #[[K]], #[[OUT]]], iterator_types = ["parallel", "reduction"]}
        CHECK-SAME: ins(%[[AA]], %[[X]] : tensor<64x6xf32>, tensor<64xf32>) outs(%[[I]] : tensor<6xf32>)
        CHECK: arith.mulf
        CHECK: arith.addf
        CHECK: %[[MV:.*]] = tensor.expand_shape %[[G]] {{\\[}}[0, 1]] output_shape [6, 1] : tensor<6xf32> into tensor<6x1xf32>
        CHECK: %[[T2:.*]] = linalg.transpose ins(%[[AA]]
        CHECK: %[[VG:.*]] = linalg.generic {indexing_maps = [#[[K]], #[[A]], #[[OUT]]]
        CHECK-SAME: ins(%{{.*}}, %[[AA]] : tensor<6xf32>, tensor<64x6xf32>) outs(%{{.*}} : tensor<64xf32>)
        CHECK: %[[VM:.*]] = tensor.expand_shape %[[VG]] {{\\[}}[0, 1]] output_shape [1, 64]
        CHECK: %[[MM:.*]] = linalg.matmul ins(%[[T2]], %{{.*}} : tensor<6x64xf32>, tensor<64x2xf32>)
        CHECK: return %[[MV]], %[[VM]], %[[MM]]
    """)


def test_a_target_that_is_not_a_function_is_refused():
    payload = parse(PAYLOAD)
    error = apply_expect_failure(
        payload, lambda root: fold_transposes_into_matvecs(match(root, "linalg.matmul")))
    assert "not a func.func" in error
    check(payload, """
        CHECK: linalg.transpose
        CHECK: linalg.matmul
    """)


EDGE = """
func.func @main(%a: tensor<{A}xf32>, %x: tensor<{X}xf32>, %init: tensor<{I}xf32>) -> tensor<{I}xf32> {{
  %e = tensor.empty() : tensor<{T}xf32>
  %t = linalg.transpose ins(%a : tensor<{A}xf32>) outs(%e : tensor<{T}xf32>) permutation = [1, 0]
  %mv = linalg.matmul ins(%t, %x : tensor<{T}xf32>, tensor<{X}xf32>) outs(%init : tensor<{I}xf32>) -> tensor<{I}xf32>
  return %mv : tensor<{I}xf32>
}}
"""


def test_an_operand_of_unit_dims_only_is_read_as_one_element():
    """A^T x with K = 1: x [1, 1] collapsed to rank 0, read by every m."""
    payload = parse(EDGE.format(A="1x37", X="1x1", I="37x1", T="37x1"))
    apply(payload, lambda root: fold_transposes_into_matvecs(match(root, "func.func")))
    check(payload, """
        CHECK-DAG: #[[M:.*]] = affine_map<(d0) -> (d0)>
        CHECK-DAG: #[[ONE:.*]] = affine_map<(d0) -> ()>
        CHECK: %[[X:.*]] = tensor.collapse_shape %arg1 [] : tensor<1x1xf32> into tensor<f32>
        CHECK: linalg.generic {indexing_maps = [#[[M]], #[[ONE]], #[[M]]], iterator_types = ["parallel"]}
        CHECK-SAME: ins(%{{.*}}, %[[X]] : tensor<37xf32>, tensor<f32>) outs(%{{.*}} : tensor<37xf32>)
        CHECK: tensor.expand_shape %{{.*}} {{\\[}}[0, 1]] output_shape [37, 1]
    """)


def test_a_result_of_unit_dims_only_keeps_them():
    """A^T x with M = 1 (a dot product): the generic keeps its unit dims (no rank-0 result)."""
    payload = parse(EDGE.format(A="5x1", X="5x1", I="1x1", T="1x5"))
    apply(payload, lambda root: fold_transposes_into_matvecs(match(root, "func.func")))
    check(payload, """
        CHECK-NOT: linalg.transpose
        CHECK-NOT: collapse_shape
        CHECK: linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "reduction"]
        CHECK-SAME: ins(%arg0, %arg1 : tensor<5x1xf32>, tensor<5x1xf32>) outs(%arg2 : tensor<1x1xf32>)
    """)


SHORT = """
func.func @main(%x: tensor<4x64xf32>, %w: tensor<40x64xf32>, %init: tensor<4x40xf32>,
                %xt: tensor<64x4xf32>, %b: tensor<64x40xf32>) -> (tensor<4x40xf32>, tensor<4x40xf32>) {
  %e = tensor.empty() : tensor<64x40xf32>
  %wt = linalg.transpose ins(%w : tensor<40x64xf32>) outs(%e : tensor<64x40xf32>) permutation = [1, 0]
  %y = linalg.matmul ins(%x, %wt : tensor<4x64xf32>, tensor<64x40xf32>) outs(%init : tensor<4x40xf32>) -> tensor<4x40xf32>
  %e2 = tensor.empty() : tensor<4x64xf32>
  %xtt = linalg.transpose ins(%xt : tensor<64x4xf32>) outs(%e2 : tensor<4x64xf32>) permutation = [1, 0]
  %z = linalg.matmul ins(%xtt, %b : tensor<4x64xf32>, tensor<64x40xf32>) outs(%init : tensor<4x40xf32>) -> tensor<4x40xf32>
  return %y, %z : tensor<4x40xf32>, tensor<4x40xf32>
}
"""


def test_a_short_products_transposed_weight_is_read_in_place():
    """x @ W^T with 4 rows (short_rows = 4): W [N, K] read in place, k innermost in both
    inputs. x^T^T @ B (B [K, N], n innermost) is left alone: folding would not put k
    innermost in B."""
    payload = parse(SHORT)
    apply(payload, lambda root: fold_transposes_into_matvecs(match(root, "func.func"), 4))
    check(payload, """
        CHECK-DAG: #[[X:.*]] = affine_map<(d0, d1, d2) -> (d0, d2)>
        CHECK-DAG: #[[W:.*]] = affine_map<(d0, d1, d2) -> (d1, d2)>
        CHECK: func.func @main(%[[XX:[^:]*]]: tensor<4x64xf32>, %[[WW:[^:]*]]: tensor<40x64xf32>
        CHECK: linalg.generic {indexing_maps = [#[[X]], #[[W]], #{{.*}}], iterator_types = ["parallel", "parallel", "reduction"]}
        CHECK-SAME: ins(%[[XX]], %[[WW]] : tensor<4x64xf32>, tensor<40x64xf32>)
        CHECK: %[[XTT:.*]] = linalg.transpose
        CHECK: linalg.matmul ins(%[[XTT]], %{{.*}} : tensor<4x64xf32>, tensor<64x40xf32>)
    """)


def test_products_of_more_rows_than_short_rows_are_left_alone():
    payload = parse(SHORT)
    apply(payload, lambda root: fold_transposes_into_matvecs(match(root, "func.func"), 3))
    check(payload, """
        CHECK-NOT: linalg.generic
        CHECK: linalg.transpose
        CHECK: linalg.matmul
        CHECK: linalg.transpose
        CHECK: linalg.matmul
        CHECK-NOT: linalg.generic
    """)
