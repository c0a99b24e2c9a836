"""sink_sibling_readers: a reader of the root's producer and the op reading it move after the
root, a result-less check stays (FileCheck, numbers against torch); a target of several ops
is refused."""

import torch
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.sink_sibling_readers import sink_sibling_readers
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

SIBLINGS = """
#r = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
  %e = tensor.empty() : tensor<4xf32>
  %a = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%x : tensor<4xf32>) outs(%e : tensor<4xf32>) {
  ^bb0(%v: f32, %o: f32):
    %n = arith.negf %v : f32
    linalg.yield %n : f32
  } -> tensor<4xf32>
  %b = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%a : tensor<4xf32>) outs(%e : tensor<4xf32>) {
  ^bb0(%v: f32, %o: f32):
    %n = math.exp %v : f32
    linalg.yield %n : f32
  } -> tensor<4xf32>
  linalg.generic {indexing_maps = [#r], iterator_types = ["parallel"]} ins(%a : tensor<4xf32>) {
  ^bb0(%v: f32):
    %big = arith.constant 1.0e30 : f32
    %ok = arith.cmpf olt, %v, %big : f32
    cf.assert %ok, "finite"
    linalg.yield
  }
  %c = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%b : tensor<4xf32>) outs(%e : tensor<4xf32>) {
  ^bb0(%v: f32, %o: f32):
    %n = arith.addf %v, %v : f32
    linalg.yield %n : f32
  } -> tensor<4xf32>
  %root = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%a : tensor<4xf32>) outs(%e : tensor<4xf32>) {
  ^bb0(%v: f32, %o: f32):
    %n = arith.mulf %v, %v : f32
    linalg.yield %n : f32
  } -> tensor<4xf32>
  return %root, %c : tensor<4xf32>, tensor<4xf32>
}
"""


def _root(root):
    return transform.SplitHandleOp([transform.AnyOpType.get()] * 5,
                                   match(root, "linalg.generic")).results[4]


def test_the_sibling_readers_move_after_the_root():
    payload = parse(SIBLINGS)
    apply(payload, lambda root: sink_sibling_readers(_root(root)))
    check(str(payload), """
        CHECK: %[[A:.*]] = linalg.generic
        CHECK:   arith.negf
        CHECK: linalg.generic {{.*}} ins(%[[A]] : tensor<4xf32>) {
        CHECK:   cf.assert
        CHECK: %[[ROOT:.*]] = linalg.generic {{.*}} ins(%[[A]]
        CHECK:   arith.mulf
        CHECK: %[[B:.*]] = linalg.generic {{.*}} ins(%[[A]]
        CHECK:   math.exp
        CHECK: %[[C:.*]] = linalg.generic {{.*}} ins(%[[B]]
        CHECK:   arith.addf
        CHECK: return %[[ROOT]], %[[C]]
    """)
    x = torch.randn(4)
    root, c = run_module(payload, [x])
    torch.testing.assert_close(root, x * x)
    torch.testing.assert_close(c, 2 * torch.exp(-x))


def test_a_target_of_several_ops_is_refused():
    payload = parse(SIBLINGS)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: sink_sibling_readers(
        match(root, "linalg.generic")))
    assert "transform_ext.sink_sibling_readers: linalg.generic at" in message
    assert "the target must be one op, got 5" in message
    assert str(payload) == before
