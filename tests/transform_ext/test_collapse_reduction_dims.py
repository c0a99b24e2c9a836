"""collapse_reduction_dims: a contraction whose reduction loops every operand reads as one
contiguous group (a flatten folded into a linear layer) becomes a contraction over one
reduction loop, a transposed operand collapsed before its transpose."""

import torch

from schedules.common import match
from transform_ext.collapse_reduction_dims import collapse_reduction_dims
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.numeric import run_module

# y = x.flatten(1) @ w.T as linalg-fuse-elementwise-ops leaves it: x [4, 3, 2, 5] read
# whole, w [6, 30] expanded to [6, 3, 2, 5] and transposed to [3, 2, 5, 6]
FLATTENED_LINEAR = """
#x = affine_map<(d0, d1, d2, d3, d4) -> (d0, d2, d3, d4)>
#w = affine_map<(d0, d1, d2, d3, d4) -> ({w_dims})>
#y = affine_map<(d0, d1, d2, d3, d4) -> (d0, d1)>
func.func @main(%x: tensor<4x3x2x5xf32>, %w: tensor<6x30xf32>) -> tensor<4x6xf32> {{
  %zero = arith.constant 0.0 : f32
  %we = tensor.expand_shape %w [[0], [1, 2, 3]] output_shape [6, 3, 2, 5] : tensor<6x30xf32> into tensor<6x3x2x5xf32>
  %t0 = tensor.empty() : tensor<{t_shape}xf32>
  %wt = linalg.transpose ins(%we : tensor<6x3x2x5xf32>) outs(%t0 : tensor<{t_shape}xf32>) permutation = [{perm}]
  %e = tensor.empty() : tensor<4x6xf32>
  %y0 = linalg.fill ins(%zero : f32) outs(%e : tensor<4x6xf32>) -> tensor<4x6xf32>
  %y = linalg.generic {{indexing_maps = [#x, #w, #y], iterator_types = ["parallel", "parallel", "reduction", "reduction", "reduction"]}}
      ins(%x, %wt : tensor<4x3x2x5xf32>, tensor<{t_shape}xf32>) outs(%y0 : tensor<4x6xf32>) {{
  ^bb0(%a: f32, %b: f32, %o: f32):
    %m = arith.mulf %a, %b : f32
    %r = arith.addf %o, %m : f32
    linalg.yield %r : f32
  }} -> tensor<4x6xf32>
  return %y : tensor<4x6xf32>
}}
"""

LINEAR = FLATTENED_LINEAR.format(w_dims="d2, d3, d4, d1", t_shape="3x2x5x6", perm="1, 2, 3, 0")
# the weight's group read in another order (h before c) than x's: not one group
SWAPPED = FLATTENED_LINEAR.format(w_dims="d3, d2, d4, d1", t_shape="2x3x5x6", perm="2, 1, 3, 0")


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, 2, 5, generator=g), torch.randn(6, 30, generator=g)]


def test_a_flattened_linear_becomes_a_matmul_over_the_transposed_weight():
    payload = parse(LINEAR)
    apply(payload, lambda root: collapse_reduction_dims(match(root, "func.func")))
    payload.operation.verify()
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-NOT:   linalg.transpose
        CHECK:       %[[X:.*]] = tensor.collapse_shape %arg0 {{\\[}}[0], [1, 2, 3]] : tensor<4x3x2x5xf32> into tensor<4x30xf32>
        CHECK:       %[[W:.*]] = tensor.collapse_shape {{.*}} {{\\[}}[0], [1, 2, 3]] : tensor<6x3x2x5xf32> into tensor<6x30xf32>
        CHECK:       %[[WT:.*]] = linalg.transpose ins(%[[W]] : tensor<6x30xf32>) outs({{.*}} : tensor<30x6xf32>) permutation = [1, 0]
        CHECK:       linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "reduction"]
        CHECK-SAME:  ins(%[[X]], %[[WT]] : tensor<4x30xf32>, tensor<30x6xf32>)
    """)
    x, w = _inputs()
    (after,) = run_module(payload, [x, w])
    (before,) = run_module(parse(LINEAR), [x, w])
    torch.testing.assert_close(after, x.flatten(1) @ w.T)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_groups_read_in_different_orders_stay():
    payload = parse(SWAPPED)
    apply(payload, lambda root: collapse_reduction_dims(match(root, "func.func")))
    text = str(payload)
    assert "tensor.collapse_shape" not in text
    assert text.count('"reduction"') == 3


def test_a_reduction_of_one_tensor_stays():
    payload = parse("""
#x = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
#y = affine_map<(d0, d1, d2) -> (d0)>
func.func @main(%x: tensor<4x3x5xf32>) -> tensor<4xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4xf32>
  %y0 = linalg.fill ins(%zero : f32) outs(%e : tensor<4xf32>) -> tensor<4xf32>
  %y = linalg.generic {indexing_maps = [#x, #y], iterator_types = ["parallel", "reduction", "reduction"]}
      ins(%x : tensor<4x3x5xf32>) outs(%y0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %o, %a : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %y : tensor<4xf32>
}
""")
    apply(payload, lambda root: collapse_reduction_dims(match(root, "func.func")))
    assert "tensor.collapse_shape" not in str(payload)
