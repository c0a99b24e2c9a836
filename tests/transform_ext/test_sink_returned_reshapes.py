"""sink_returned_reshapes: a reshape only the return reads moves right before it, one with
another reader stays (FileCheck, numbers against torch); a target that is not a function is
refused."""

import torch

from schedules.common import match
from transform_ext.sink_returned_reshapes import sink_returned_reshapes
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

RESHAPES = """
#r = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%x: tensor<4x2xf32>) -> (tensor<8xf32>, tensor<2x2x2xf32>, tensor<4x2xf32>) {
  %e = tensor.empty() : tensor<4x2xf32>
  %a = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<4x2xf32>) outs(%e : tensor<4x2xf32>) {
  ^bb0(%v: f32, %o: f32):
    %n = arith.negf %v : f32
    linalg.yield %n : f32
  } -> tensor<4x2xf32>
  %flat = tensor.collapse_shape %a [[0, 1]] : tensor<4x2xf32> into tensor<8xf32>
  %cube = tensor.expand_shape %a [[0, 1], [2]] output_shape [2, 2, 2] : tensor<4x2xf32> into tensor<2x2x2xf32>
  %b = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel", "parallel"]}
      ins(%a : tensor<4x2xf32>) outs(%e : tensor<4x2xf32>) {
  ^bb0(%v: f32, %o: f32):
    %n = math.exp %v : f32
    linalg.yield %n : f32
  } -> tensor<4x2xf32>
  %read = tensor.collapse_shape %b [[0, 1]] : tensor<4x2xf32> into tensor<8xf32>
  %c = tensor.expand_shape %read [[0, 1]] output_shape [4, 2] : tensor<8xf32> into tensor<4x2xf32>
  return %flat, %cube, %c : tensor<8xf32>, tensor<2x2x2xf32>, tensor<4x2xf32>
}
"""


def test_the_returned_reshapes_move_before_the_return():
    payload = parse(RESHAPES)
    apply(payload, lambda root: sink_returned_reshapes(match(root, "func.func")))
    check(str(payload), """
        CHECK: %[[A:.*]] = linalg.generic
        CHECK:   arith.negf
        CHECK: %[[B:.*]] = linalg.generic
        CHECK:   math.exp
        CHECK: %[[READ:.*]] = tensor.collapse_shape %[[B]]
        CHECK: %[[FLAT:.*]] = tensor.collapse_shape %[[A]]
        CHECK: %[[CUBE:.*]] = tensor.expand_shape %[[A]]
        CHECK: %[[C:.*]] = tensor.expand_shape %[[READ]]
        CHECK: return %[[FLAT]], %[[CUBE]], %[[C]]
    """)
    x = torch.randn(4, 2)
    flat, cube, c = run_module(payload, [x])
    torch.testing.assert_close(flat, -x.reshape(8))
    torch.testing.assert_close(cube, -x.reshape(2, 2, 2))
    torch.testing.assert_close(c, torch.exp(-x))


def test_a_target_that_is_not_a_function_is_refused():
    payload = parse(RESHAPES)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: sink_returned_reshapes(
        match(root, "linalg.generic")))
    assert "transform_ext.sink_returned_reshapes: linalg.generic at" in message
    assert "not a func.func with a body" in message
    assert str(payload) == before
