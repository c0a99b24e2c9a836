"""separate_pooling_windows: a pooling over a window of 2 or 3 dims becomes the pooling of
its outer windows over whole rows, then the pooling of its innermost window (FileCheck on
the rewritten IR; numerics against torch are in tests/schedules/test_generic_pooling.py);
other poolings stay."""

import pytest

from schedules.common import match
from transform_ext.separate_pooling_windows import separate_pooling_windows
from tests.transform_ext.helpers import apply, check, parse

# KernelBench 45's sum pooling: 11 x 11 windows of stride 11; rows 55-60 and columns 55-58
# are in no window
SUM_2D = """
func.func @main(%x: tensor<2x3x61x59xf32>, %win: tensor<WINDOWxf32>) -> tensor<2x3x5x5xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<2x3x5x5xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<2x3x5x5xf32>) -> tensor<2x3x5x5xf32>
  %p = linalg.pooling_nchw_sum {dilations = dense<1> : vector<2xi64>, strides = dense<11> : vector<2xi64>}
         ins(%x, %win : tensor<2x3x61x59xf32>, tensor<WINDOWxf32>) outs(%f : tensor<2x3x5x5xf32>) -> tensor<2x3x5x5xf32>
  return %p : tensor<2x3x5x5xf32>
}
"""


def test_a_sum_window_is_its_columns_then_its_rows():
    payload = parse(SUM_2D.replace("WINDOW", "11x11"))
    apply(payload, lambda root: separate_pooling_windows(match(root, "func.func")))
    check(str(payload), """
        CHECK-DAG: #[[X:.*]] = affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2 * 11 + d4, d3)>
        CHECK-DAG: #[[KH:.*]] = affine_map<(d0, d1, d2, d3, d4) -> (d4)>
        CHECK-DAG: #[[TM:.*]] = affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2, d3)>
        CHECK-DAG: #[[TW:.*]] = affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2, d3 * 11 + d4)>
        CHECK-LABEL: func.func @main
        CHECK: %[[Y0:.*]] = linalg.fill
        CHECK: %[[ROWS:.*]] = tensor.extract_slice %arg0[0, 0, 0, 0] [2, 3, 61, 55] [1, 1, 1, 1]
        CHECK: %[[WH:.*]] = tensor.empty() : tensor<11xf32>
        CHECK: %[[TE:.*]] = tensor.empty() : tensor<2x3x5x55xf32>
        CHECK: %[[ID:.*]] = arith.constant -0.000000e+00 : f32
        CHECK: %[[T0:.*]] = linalg.fill ins(%[[ID]] : f32) outs(%[[TE]] : tensor<2x3x5x55xf32>)
        CHECK: %[[T:.*]] = linalg.generic {indexing_maps = [#[[X]], #[[KH]], #[[TM]]], iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
        CHECK-SAME: ins(%[[ROWS]], %[[WH]] : tensor<2x3x61x55xf32>, tensor<11xf32>) outs(%[[T0]] : tensor<2x3x5x55xf32>)
        CHECK: arith.addf %{{.*}}, %{{.*}} : f32
        CHECK: %[[WW:.*]] = tensor.empty() : tensor<11xf32>
        CHECK: %[[Y:.*]] = linalg.generic {indexing_maps = [#[[TW]], #[[KH]], #[[TM]]], iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
        CHECK-SAME: ins(%[[T]], %[[WW]] : tensor<2x3x5x55xf32>, tensor<11xf32>) outs(%[[Y0]] : tensor<2x3x5x5xf32>)
        CHECK: return %[[Y]]
    """)
    assert "linalg.pooling" not in str(payload)


# a 3-D max pooling as torch-mlir imports it: f16 widened in the body, 3 x 3 x 3 windows of
# stride 2 and dilation 3 (KernelBench 43)
MAX_3D = """
#x = affine_map<(d0, d1, d2, d3, d4, d5, d6, d7) -> (d0, d1, d2 * 2 + d5 * 3, d3 * 2 + d6 * 3, d4 * 2 + d7 * 3)>
#w = affine_map<(d0, d1, d2, d3, d4, d5, d6, d7) -> (d5, d6, d7)>
#y = affine_map<(d0, d1, d2, d3, d4, d5, d6, d7) -> (d0, d1, d2, d3, d4)>
func.func @main(%x: tensor<1x2x11x12x30xf16>, %win: tensor<3x3x3xf32>, %init: tensor<1x2x3x3x12xf32>) -> tensor<1x2x3x3x12xf32> {
  %p = linalg.generic {indexing_maps = [#x, #w, #y],
         iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "reduction", "reduction", "reduction"]}
         ins(%x, %win : tensor<1x2x11x12x30xf16>, tensor<3x3x3xf32>) outs(%init : tensor<1x2x3x3x12xf32>) {
  ^bb0(%in: f16, %w: f32, %out: f32):
    %v = arith.extf %in : f16 to f32
    %m = arith.maximumf %v, %out : f32
    linalg.yield %m : f32
  } -> tensor<1x2x3x3x12xf32>
  return %p : tensor<1x2x3x3x12xf32>
}
"""


def test_a_3d_max_window_widens_once_and_keeps_its_operand_order():
    payload = parse(MAX_3D)
    apply(payload, lambda root: separate_pooling_windows(match(root, "func.func")))
    check(str(payload), """
        CHECK-DAG: #[[X:.*]] = affine_map<(d0, d1, d2, d3, d4, d5, d6) -> (d0, d1, d2 * 2 + d5 * 3, d3 * 2 + d6 * 3, d4)>
        CHECK-DAG: #[[TW:.*]] = affine_map<(d0, d1, d2, d3, d4, d5) -> (d0, d1, d2, d3, d4 * 2 + d5 * 3)>
        CHECK-LABEL: func.func @main
        CHECK: %[[ROWS:.*]] = tensor.extract_slice %arg0[0, 0, 0, 0, 0] [1, 2, 11, 12, 29] [1, 1, 1, 1, 1]
        CHECK: %[[WIN:.*]] = tensor.empty() : tensor<3x3xf32>
        CHECK: %[[ID:.*]] = arith.constant 0xFF800000 : f32
        CHECK: %[[T0:.*]] = linalg.fill ins(%[[ID]] : f32) outs(%{{.*}} : tensor<1x2x3x3x29xf32>)
        CHECK: %[[T:.*]] = linalg.generic {indexing_maps = [#[[X]], {{.*}}], iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "reduction", "reduction"]}
        CHECK-SAME: ins(%[[ROWS]], %[[WIN]] : tensor<1x2x11x12x29xf16>, tensor<3x3xf32>) outs(%[[T0]] : tensor<1x2x3x3x29xf32>)
        CHECK: ^bb0(%[[IN:.*]]: f16, %{{.*}}: f32, %[[OUT:.*]]: f32):
        CHECK: %[[V:.*]] = arith.extf %[[IN]] : f16 to f32
        CHECK: arith.maximumf %[[V]], %[[OUT]] : f32
        CHECK: %[[Y:.*]] = linalg.generic {indexing_maps = [#[[TW]], {{.*}}], iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "reduction"]}
        CHECK-SAME: ins(%[[T]], %{{.*}} : tensor<1x2x3x3x29xf32>, tensor<3xf32>) outs(%arg2 : tensor<1x2x3x3x12xf32>)
        CHECK: ^bb0(%[[IN2:.*]]: f32, %{{.*}}: f32, %[[OUT2:.*]]: f32):
        CHECK-NOT: arith.extf
        CHECK: arith.maximumf %[[IN2]], %[[OUT2]] : f32
        CHECK: return %[[Y]]
    """)


@pytest.mark.parametrize("window, why", [
    ("3x3", "3 x 3 taps: 9 < 2 (3 + 3), t's round trip costs more than the taps it saves"),
    ("11x1", "a window of one tap along the rows: nothing to separate"),
])
def test_poolings_that_do_not_pay_stay(window, why):
    payload = parse(SUM_2D.replace("WINDOW", window))
    apply(payload, lambda root: separate_pooling_windows(match(root, "func.func")))
    assert "linalg.pooling_nchw_sum" in str(payload), why


@pytest.mark.parametrize("body, why", [
    ("%m = arith.mulf %v, %out : f32", "a product is not a pooling's combine"),
    ("%m = arith.maximumf %w, %out : f32", "a body reading the window operand"),
])
def test_other_bodies_stay(body, why):
    payload = parse(MAX_3D.replace("%m = arith.maximumf %v, %out : f32", body))
    apply(payload, lambda root: separate_pooling_windows(match(root, "func.func")))
    assert str(payload).count("linalg.generic") == 1, why


# an elementwise op whose first input is a scalar (cross entropy's backward: a rank-0 map,
# no reduction dims)
SCALAR_FIRST = """
func.func @main(%s: tensor<f32>, %v: tensor<8xf32>, %init: tensor<8xf32>) -> tensor<8xf32> {
  %r = linalg.generic {indexing_maps = [affine_map<(d0) -> ()>, affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>],
         iterator_types = ["parallel"]}
         ins(%s, %v : tensor<f32>, tensor<8xf32>) outs(%init : tensor<8xf32>) {
  ^bb0(%a: f32, %b: f32, %out: f32):
    %m = arith.mulf %a, %b : f32
    linalg.yield %m : f32
  } -> tensor<8xf32>
  return %r : tensor<8xf32>
}
"""


def test_an_op_with_a_scalar_first_input_stays():
    payload = parse(SCALAR_FIRST)
    apply(payload, lambda root: separate_pooling_windows(match(root, "func.func")))
    assert str(payload).count("linalg.generic") == 1
