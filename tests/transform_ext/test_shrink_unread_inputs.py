"""shrink_unread_inputs: an [N, V] input read by no body op becomes an empty [V] bound of the
loop only it bounds, or goes when every loop is bounded elsewhere; read inputs stay."""

from schedules.common import match
from transform_ext.shrink_unread_inputs import shrink_unread_inputs
from tests.transform_ext.helpers import apply, check, parse

PAYLOAD = """
func.func @main(%s: tensor<8x40xf32>, %y: tensor<8xi64>, %v: tensor<8x40xf32>) -> (tensor<8xf32>, tensor<8x40xf32>) {
  %zero = arith.constant 0.0 : f32
  %one = arith.constant 1.0 : f32
  %e = tensor.empty() : tensor<8xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<8xf32>) -> tensor<8xf32>
  %onehot = linalg.generic {indexing_maps = [affine_map<(n, c) -> (n)>, affine_map<(n, c) -> (n, c)>, affine_map<(n, c) -> (n)>], iterator_types = ["parallel", "reduction"]} ins(%y, %s : tensor<8xi64>, tensor<8x40xf32>) outs(%f : tensor<8xf32>) {
  ^bb0(%t: i64, %unused: f32, %o: f32):
    %c = linalg.index 1 : index
    %ti = arith.index_cast %t : i64 to index
    %eq = arith.cmpi eq, %c, %ti : index
    %x = arith.select %eq, %one, %zero : f32
    %r = arith.addf %o, %x : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  %e2 = tensor.empty() : tensor<8x40xf32>
  %copy = linalg.generic {indexing_maps = [affine_map<(n, c) -> (n, c)>, affine_map<(n, c) -> (n, c)>, affine_map<(n, c) -> (n, c)>], iterator_types = ["parallel", "parallel"]} ins(%v, %s : tensor<8x40xf32>, tensor<8x40xf32>) outs(%e2 : tensor<8x40xf32>) {
  ^bb0(%a: f32, %unused: f32, %o: f32):
    linalg.yield %a : f32
  } -> tensor<8x40xf32>
  return %onehot, %copy : tensor<8xf32>, tensor<8x40xf32>
}
"""


def test_unread_inputs_keep_only_the_bounds_they_give():
    payload = parse(PAYLOAD)
    apply(payload, lambda root: shrink_unread_inputs(match(root, "func.func")))
    check(str(payload), """
        CHECK: %[[B:.*]] = tensor.empty() : tensor<40xf32>
        CHECK: linalg.generic {{.*}} ins(%arg1, %[[B]] : tensor<8xi64>, tensor<40xf32>)
        CHECK:   linalg.index 1
        CHECK: linalg.generic {{.*}} ins(%arg2 : tensor<8x40xf32>)
    """)
