"""read_reduction_constants: sum_c (-1) over 40 classes is -40 after the generic
vectorization (the vectorizer added the constant once per vector before), the constant
read from a splat over the reduction dim; other reductions are left alone. (The op runs
right before vectorization: the generic fuse stage's elementwise fusion folds splat inputs
back into scalars.)"""

import torch

from schedules.common import match
from transform_ext.read_reduction_constants import read_reduction_constants
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.numeric import run_module

PAYLOAD = """
func.func @main(%x: tensor<8x40xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
  %minus = arith.constant -1.0 : f32
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<8xf32>) -> tensor<8xf32>
  %count = linalg.generic {indexing_maps = [affine_map<(n, c) -> (n, c)>, affine_map<(n, c) -> (n)>], iterator_types = ["parallel", "reduction"]} ins(%x : tensor<8x40xf32>) outs(%f : tensor<8xf32>) {
  ^bb0(%unused: f32, %o: f32):
    %r = arith.addf %o, %minus : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  %sum = linalg.generic {indexing_maps = [affine_map<(n, c) -> (n, c)>, affine_map<(n, c) -> (n)>], iterator_types = ["parallel", "reduction"]} ins(%x : tensor<8x40xf32>) outs(%f : tensor<8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %o, %a : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  return %count, %sum : tensor<8xf32>, tensor<8xf32>
}
"""


def test_a_constant_term_is_read_per_element():
    payload = parse(PAYLOAD)
    apply(payload, lambda root: read_reduction_constants(match(root, "func.func")))
    check(str(payload), """
        CHECK: %[[C:.*]] = arith.constant dense<-1.000000e+00> : tensor<40xf32>
        CHECK: linalg.generic {{.*}} ins(%arg0, %[[C]] : tensor<8x40xf32>, tensor<40xf32>)
        CHECK: ^bb0(%{{.*}}: f32, %[[T:.*]]: f32, %[[O:.*]]: f32):
        CHECK:   arith.addf %[[O]], %[[T]]
        CHECK: linalg.generic {{.*}} ins(%arg0 : tensor<8x40xf32>)
    """)
    x = torch.randn(8, 40)
    # after the generic fuse stage, whose elementwise fusion folds splat inputs into scalars
    count, total = run_module(parse(PAYLOAD), [x], before_vectorize=lambda m: apply(
        m, lambda root: read_reduction_constants(match(root, "func.func"))))
    assert torch.equal(count, torch.full((8,), -40.0))
    torch.testing.assert_close(total, x.sum(1))
