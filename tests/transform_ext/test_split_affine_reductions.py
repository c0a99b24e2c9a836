"""split_affine_reductions: a label-smoothing class sum affine in m and log l is split into
sums that read neither (FileCheck, numbers against torch); the exp-sum (not affine) and a
non-affine sum are left alone; a target that is not one reduction is refused."""

import torch

from schedules.common import match, run_passes
from transform_ext.filter_ops import filter_reductions
from transform_ext.split_affine_reductions import split_affine_reductions
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

SMOOTHING = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#col = affine_map<(d0, d1) -> (d1)>
#r = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<4x8xf32>, %w: tensor<8xf32>) -> tensor<4xf32> {
  %ninf = arith.constant 0xFF800000 : f32
  %zero = arith.constant 0.0 : f32
  %e1 = tensor.empty() : tensor<4xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %l = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %t = math.exp %d : f32
    %r = arith.addf %t, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %ll = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%l : tensor<4xf32>) outs(%e1 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %g = math.log %a : f32
    linalg.yield %g : f32
  } -> tensor<4xf32>
  %s = linalg.generic {indexing_maps = [#id, #row, #row, #col, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x, %m, %ll, %w : tensor<4x8xf32>, tensor<4xf32>, tensor<4xf32>, tensor<8xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32, %v: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %lp = arith.subf %d, %c : f32
    %t = arith.mulf %lp, %v : f32
    %n = arith.negf %t : f32
    %r = arith.addf %n, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %s : tensor<4xf32>
}
"""


def _split(root):
    split_affine_reductions(filter_reductions(match(root, "linalg.generic"), combiner="max"))


def want(x, w):
    return -(torch.log_softmax(x, 1) * w).sum(1)


def test_the_class_sum_no_longer_reads_the_row_values():
    """-sum_c w_c (x_c - m - ll) = -sum_c w_c x_c + m sum_c w_c + ll sum_c w_c (the two
    coefficient sums are one after CSE; they keep x as an unread input, which bounds the
    class loop as the fused loop needs)."""
    payload = parse(SMOOTHING)
    apply(payload, _split)
    run_passes(payload, "canonicalize, cse")
    check(str(payload), """
        CHECK: func.func @main(%[[X:[^:]*]]: tensor<4x8xf32>, %[[W:[^:]*]]: tensor<8xf32>)
        CHECK: %[[M:.*]] = linalg.generic {{.*}} ins(%[[X]] : tensor<4x8xf32>)
        CHECK: %[[L:.*]] = linalg.generic {{.*}} ins(%[[X]], %[[M]] : tensor<4x8xf32>, tensor<4xf32>)
        CHECK:   math.exp
        CHECK: %[[LL:.*]] = linalg.generic {{.*}} ins(%[[L]] : tensor<4xf32>)
        CHECK: %[[FREE:.*]] = linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]{{.*}} ins(%[[X]], %[[W]] : tensor<4x8xf32>, tensor<8xf32>)
        CHECK:   arith.mulf %{{.*}}, %{{.*}}
        CHECK: %[[CM:.*]] = linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]{{.*}} ins(%[[X]], %[[W]] : tensor<4x8xf32>, tensor<8xf32>)
        CHECK:   arith.mulf %{{.*}}, %cst
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel"]{{.*}} ins(%[[FREE]], %[[CM]], %[[M]], %[[CM]], %[[LL]] :
    """)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g) * 10, torch.rand(8, generator=g)
    (got,) = run_module(payload, [x, w])
    torch.testing.assert_close(got, want(x, w), rtol=1e-5, atol=1e-5)


def test_a_sum_that_is_not_affine_is_left_alone():
    payload = parse(SMOOTHING.replace("%t = arith.mulf %lp, %v : f32", "%t = arith.mulf %lp, %lp : f32"))
    before = str(payload)
    apply(payload, _split)
    assert str(payload) == before


def test_a_target_of_two_ops_is_refused():
    payload = parse(SMOOTHING)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: split_affine_reductions(
        filter_reductions(match(root, "linalg.generic"), combiner="add")))
    assert "transform_ext.split_affine_reductions: linalg.generic at" in message
    assert "the target must be one reduction (the row max), got 2 ops" in message
    assert str(payload) == before
