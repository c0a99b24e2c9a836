"""split_class_reductions: a sum over rows and classes becomes per-row class sums then a sum
over the rows (FileCheck, numbers against torch); a sum over the rows only is left alone;
a target that is not one reduction is refused."""

import torch

from schedules.common import match
from transform_ext.filter_ops import filter_reductions
from transform_ext.split_class_reductions import split_class_reductions
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

ALL_SUM = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#all = affine_map<(d0, d1) -> ()>
#col = affine_map<(d0, d1) -> (d1)>
func.func @main(%x: tensor<4x8xf32>) -> (tensor<4xf32>, tensor<f32>, tensor<8xf32>) {
  %ninf = arith.constant 0xFF800000 : f32
  %init = arith.constant 1.5 : f32
  %zero = arith.constant 0.0 : f32
  %e1 = tensor.empty() : tensor<4xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %e = tensor.empty() : tensor<f32>
  %z = linalg.fill ins(%init : f32) outs(%e : tensor<f32>) -> tensor<f32>
  %s = linalg.generic {indexing_maps = [#id, #all], iterator_types = ["reduction", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%z : tensor<f32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<f32>
  %e8 = tensor.empty() : tensor<8xf32>
  %z8 = linalg.fill ins(%zero : f32) outs(%e8 : tensor<8xf32>) -> tensor<8xf32>
  %cols = linalg.generic {indexing_maps = [#id, #col], iterator_types = ["reduction", "parallel"]}
      ins(%x : tensor<4x8xf32>) outs(%z8 : tensor<8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  return %m, %s, %cols : tensor<4xf32>, tensor<f32>, tensor<8xf32>
}
"""


def _row_max(root):
    return filter_reductions(match(root, "linalg.generic"), combiner="max")


def test_a_sum_over_rows_and_classes_becomes_per_row_class_sums():
    payload = parse(ALL_SUM)
    apply(payload, lambda root: split_class_reductions(_row_max(root)))
    check(str(payload), """
        CHECK: arith.maximumf
        CHECK: %[[Z:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%{{.*}} : tensor<4xf32>)
        CHECK: %[[ROWS:.*]] = linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]{{.*}} ins(%arg0 : tensor<4x8xf32>) outs(%[[Z]] : tensor<4xf32>)
        CHECK: linalg.generic {{.*}}iterator_types = ["reduction"]{{.*}} ins(%[[ROWS]] : tensor<4xf32>) outs(%{{.*}} : tensor<f32>)
        CHECK: iterator_types = ["reduction", "parallel"]
    """)
    x = torch.randn(4, 8)
    m, s, cols = run_module(payload, [x])
    torch.testing.assert_close(m, x.amax(1))
    torch.testing.assert_close(s, x.sum() + 1.5)
    torch.testing.assert_close(cols, x.sum(0))


def test_a_target_of_two_ops_is_refused():
    payload = parse(ALL_SUM)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: split_class_reductions(
        filter_reductions(match(root, "linalg.generic"), combiner="add")))
    assert "transform_ext.split_class_reductions: linalg.generic at" in message
    assert "the target must be one reduction (the row max), got 2 ops" in message
    assert str(payload) == before


def test_a_target_that_is_not_a_reduction_is_refused():
    payload = parse(ALL_SUM)
    message = apply_expect_failure(payload, lambda root: split_class_reductions(
        match(root, "func.func")))
    assert "transform_ext.split_class_reductions: func.func at" in message
    assert "the target is not a reduction over one dim" in message
