"""constants_to_arguments: IR (FileCheck), what stays a constant, rejection (message and
unchanged payload). The values are the caller's to pass: tests/lighthouse/
test_xegpu_cross_entropy.py runs a kernel program with its weights so passed on the CPU and
compares with torch."""

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from transform_ext.constants_to_arguments import constants_to_arguments

WEIGHTS = """
func.func @main(%x: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
  %w = arith.constant dense<[1.0, 2.0, 3.0, 4.0]> : tensor<4xf32>
  %b = arith.constant dense<[0.5, 0.25]> : tensor<2xf16>
  %z = arith.constant dense<0.0> : tensor<4xf32>
  %s = arith.constant dense<7.0> : tensor<f32>
  %e = tensor.empty() : tensor<4xf32>
  %y = linalg.add ins(%x, %w : tensor<4xf32>, tensor<4xf32>) outs(%e : tensor<4xf32>) -> tensor<4xf32>
  %u = linalg.add ins(%y, %z : tensor<4xf32>, tensor<4xf32>) outs(%e : tensor<4xf32>) -> tensor<4xf32>
  %t = tensor.empty() : tensor<4xf16>
  %i = tensor.insert_slice %b into %t[0] [2] [1] : tensor<2xf16> into tensor<4xf16>
  %f = tensor.insert_slice %s into %e[0] [1] [1] : tensor<f32> into tensor<4xf32>
  return %y, %u : tensor<4xf32>, tensor<4xf32>
}
"""


def test_weights_become_trailing_arguments_in_their_order():
    payload = parse(WEIGHTS)
    apply(payload, lambda root: constants_to_arguments(match(root, "func.func")))
    check(payload, """
        CHECK: func.func @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>, %arg2: tensor<2xf16>) -> (tensor<4xf32>, tensor<4xf32>)
        CHECK-NEXT: %[[Z:.*]] = arith.constant dense<0.000000e+00> : tensor<4xf32>
        CHECK-NEXT: arith.constant dense<7.000000e+00> : tensor<f32>
        CHECK: linalg.add ins(%arg0, %arg1 :
        CHECK: linalg.add ins(%{{.*}}, %[[Z]] :
        CHECK: tensor.insert_slice %arg2 into
    """)



def test_a_function_without_weights_is_left_as_it_is():
    payload = parse("""
        func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
          %z = arith.constant dense<0.0> : tensor<4xf32>
          return %z : tensor<4xf32>
        }
    """)
    before = str(payload)
    apply(payload, lambda root: constants_to_arguments(match(root, "func.func")))
    assert str(payload) == before


def test_rejects_a_called_function():
    payload = parse("""
        func.func @weights() -> tensor<2xf32> {
          %w = arith.constant dense<[1.0, 2.0]> : tensor<2xf32>
          return %w : tensor<2xf32>
        }
        func.func @main() -> tensor<2xf32> {
          %r = func.call @weights() : () -> tensor<2xf32>
          return %r : tensor<2xf32>
        }
    """)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: constants_to_arguments(match(root, "func.func")))
    assert "transform_ext.constants_to_arguments: func.func" in message
    assert "the call would lack the weights" in message
    assert str(payload) == before


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(WEIGHTS)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: constants_to_arguments(match(root, "linalg.add")))
    assert "transform_ext.constants_to_arguments: linalg.add" in message
    assert "not a func.func with a body" in message
    assert str(payload) == before
