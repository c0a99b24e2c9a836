"""drop_unused_results: IR (FileCheck), numerics before/after on the CPU, rejection."""

import torch

from schedules.common import match
from transform_ext.drop_unused_results import drop_unused_results
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

ARGMAX = """
#map = affine_map<(d0, d1) -> (d0, d1)>
#map1 = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x16xf32>) -> tensor<4xf32> {
  %c0 = arith.constant 0 : i64
  %ninf = arith.constant 0xFF800000 : f32
  %e0 = tensor.empty() : tensor<4xi64>
  %i0 = linalg.fill ins(%c0 : i64) outs(%e0 : tensor<4xi64>) -> tensor<4xi64>
  %e1 = tensor.empty() : tensor<4xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %r:2 = linalg.generic {indexing_maps = [#map, #map1, #map1], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x16xf32>) outs(%m0, %i0 : tensor<4xf32>, tensor<4xi64>) {
  ^bb0(%in: f32, %out: f32, %idx: i64):
    %i = linalg.index 1 : index
    %ii = arith.index_cast %i : index to i64
    %mx = arith.maximumf %in, %out : f32
    %gt = arith.cmpf ogt, %in, %out : f32
    %sel = arith.select %gt, %ii, %idx : i64
    linalg.yield %mx, %sel : f32, i64
  } -> (tensor<4xf32>, tensor<4xi64>)
  return %r#0 : tensor<4xf32>
}
"""


def test_drops_the_unused_argmax():
    payload = parse(ARGMAX)
    apply(payload, lambda root: drop_unused_results(match(root, "func.func")))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: linalg.generic
        CHECK-SAME: iterator_types = ["parallel", "reduction"]
        CHECK-SAME: outs(%{{.*}} : tensor<4xf32>)
        CHECK-NOT: linalg.index
        CHECK-NOT: arith.select
        CHECK: arith.maximumf
        CHECK: linalg.yield %{{.*}} : f32
        CHECK-NOT: tensor<4xi64>
    """)


def test_same_result_before_and_after():
    x = torch.randn(4, 16)
    before = run_module(parse(ARGMAX), [x])
    payload = parse(ARGMAX)
    apply(payload, lambda root: drop_unused_results(match(root, "func.func")))
    after = run_module(payload, [x])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[0], x.amax(dim=1), rtol=0, atol=0)


def test_rejects_a_result_the_kept_ones_depend_on():
    payload = parse("""
        #map = affine_map<(d0) -> (d0)>
        #map1 = affine_map<(d0) -> ()>
        func.func @main(%x: tensor<8xf32>) -> tensor<f32> {
          %z = arith.constant 0.0 : f32
          %e = tensor.empty() : tensor<f32>
          %a = linalg.fill ins(%z : f32) outs(%e : tensor<f32>) -> tensor<f32>
          %r:2 = linalg.generic {indexing_maps = [#map, #map1, #map1], iterator_types = ["reduction"]}
              ins(%x : tensor<8xf32>) outs(%a, %a : tensor<f32>, tensor<f32>) {
          ^bb0(%in: f32, %s: f32, %t: f32):
            %u = arith.addf %in, %t : f32
            %v = arith.addf %u, %s : f32
            linalg.yield %v, %u : f32, f32
          } -> (tensor<f32>, tensor<f32>)
          return %r#0 : tensor<f32>
        }
    """)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: drop_unused_results(match(root, "linalg.generic")))
    assert "transform_ext.drop_unused_results: linalg.generic" in message
    assert "kept results read their body arguments" in message
    assert str(payload) == before
