"""collapse_contraction_parallel_dims: a contraction whose m (or n, or batch) loops its
operands read as one contiguous group (a linear layer over [B, S, D] after reshape
propagation) becomes a contraction over one such loop, its result expanded back; groups read
in different orders, and ops that are not contractions, stay."""

import torch

from schedules.common import match
from transform_ext.collapse_contraction_parallel_dims import (collapse_contraction_parallel_dims,
                                                              parallel_group)
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.numeric import run_module

# y[b, s, n] = sum_k x[b, s, k] w[n, k]: the linear layer's contraction over 4 loops, the
# weight transposed by a single-use transpose
LINEAR_3D = """
#x = affine_map<(b, s, n, k) -> ({x_dims})>
#w = affine_map<(b, s, n, k) -> (k, n)>
#y = affine_map<(b, s, n, k) -> ({y_dims})>
func.func @main(%x: tensor<{x_shape}xf32>, %w: tensor<6x5xf32>) -> tensor<{y_shape}xf32> {{
  %zero = arith.constant 0.0 : f32
  %t0 = tensor.empty() : tensor<5x6xf32>
  %wt = linalg.transpose ins(%w : tensor<6x5xf32>) outs(%t0 : tensor<5x6xf32>) permutation = [1, 0]
  %e = tensor.empty() : tensor<{y_shape}xf32>
  %y0 = linalg.fill ins(%zero : f32) outs(%e : tensor<{y_shape}xf32>) -> tensor<{y_shape}xf32>
  %y = linalg.generic {{indexing_maps = [#x, #w, #y], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
      ins(%x, %wt : tensor<{x_shape}xf32>, tensor<5x6xf32>) outs(%y0 : tensor<{y_shape}xf32>) {{
  ^bb0(%a: f32, %c: f32, %o: f32):
    %m = arith.mulf %a, %c : f32
    %r = arith.addf %o, %m : f32
    linalg.yield %r : f32
  }} -> tensor<{y_shape}xf32>
  return %y : tensor<{y_shape}xf32>
}}
"""

LINEAR = LINEAR_3D.format(x_dims="b, s, k", y_dims="b, s, n", x_shape="2x3x5", y_shape="2x3x6")
# y[s, b, n]: the output reads (s, b), x reads (b, s): no common order
SWAPPED = LINEAR_3D.format(x_dims="b, s, k", y_dims="s, b, n", x_shape="2x3x5", y_shape="3x2x6")


def _inputs(x_shape):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*x_shape, generator=g), torch.randn(6, 5, generator=g)]


def test_a_linear_layer_over_three_dims_becomes_a_matmul():
    payload = parse(LINEAR)
    generic = [op for op in payload.body.operations[0].regions[0].blocks[0].operations
               if op.operation.name == "linalg.generic"][0]
    assert parallel_group(generic.operation) == [0, 1]
    apply(payload, lambda root: collapse_contraction_parallel_dims(match(root, "func.func")))
    payload.operation.verify()
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK:       %[[X:.*]] = tensor.collapse_shape %arg0 {{\\[}}[0, 1], [2]] : tensor<2x3x5xf32> into tensor<6x5xf32>
        CHECK:       %[[Y:.*]] = linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "reduction"]
        CHECK-SAME:  ins(%[[X]], %{{.*}} : tensor<6x5xf32>, tensor<5x6xf32>) outs(%{{.*}} : tensor<6x6xf32>)
        CHECK:       %[[E:.*]] = tensor.expand_shape %[[Y]] {{\\[}}[0, 1], [2]] output_shape [2, 3, 6] : tensor<6x6xf32> into tensor<2x3x6xf32>
        CHECK:       return %[[E]]
    """)
    x, w = _inputs((2, 3, 5))
    (after,) = run_module(payload, [x, w])
    (before,) = run_module(parse(LINEAR), [x, w])
    torch.testing.assert_close(after, x @ w.T)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_groups_read_in_different_orders_stay():
    payload = parse(SWAPPED)
    apply(payload, lambda root: collapse_contraction_parallel_dims(match(root, "func.func")))
    text = str(payload)
    assert "tensor.collapse_shape" not in text and "tensor.expand_shape" not in text
    x, w = _inputs((2, 3, 5))
    (after,) = run_module(payload, [x, w])
    torch.testing.assert_close(after, (x @ w.T).transpose(0, 1))


def test_an_elementwise_op_stays():
    payload = parse("""
#m = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
func.func @main(%x: tensor<2x3x5xf32>) -> tensor<2x3x5xf32> {
  %e = tensor.empty() : tensor<2x3x5xf32>
  %y = linalg.generic {indexing_maps = [#m, #m], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%x : tensor<2x3x5xf32>) outs(%e : tensor<2x3x5xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.mulf %a, %a : f32
    linalg.yield %r : f32
  } -> tensor<2x3x5xf32>
  return %y : tensor<2x3x5xf32>
}
""")
    apply(payload, lambda root: collapse_contraction_parallel_dims(match(root, "func.func")))
    assert "collapse_shape" not in str(payload)
