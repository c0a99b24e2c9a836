"""refresh_function_type: IR (FileCheck) after a body was retyped, rejection."""

from torch_mlir import ir

from schedules.common import match
from transform_ext.refresh_function_type import refresh_function_type
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

COPY = """
func.func @main(%x: tensor<4xi1>, %y: tensor<8xf32>) -> (tensor<4xi1>, tensor<8xf32>) {
  return %x, %y : tensor<4xi1>, tensor<8xf32>
}
"""


def test_the_type_follows_retyped_arguments():
    payload = parse(COPY)
    with payload.context, ir.Location.unknown():
        func = payload.body.operations[0].operation
        func.regions[0].blocks[0].arguments[0].set_type(ir.RankedTensorType.get([4], ir.IntegerType.get_signless(8)))
    apply(payload, lambda root: refresh_function_type(match(root, "func.func")))
    payload.operation.verify()
    check(payload, """
        CHECK: func.func @main(%{{.*}}: tensor<4xi8>, %{{.*}}: tensor<8xf32>) -> (tensor<4xi8>, tensor<8xf32>)
    """)


def test_a_function_that_matches_its_body_is_unchanged():
    payload = parse(COPY)
    before = str(payload)
    apply(payload, lambda root: refresh_function_type(match(root, "func.func")))
    assert str(payload) == before


def test_rejects_an_op_that_is_not_a_function():
    payload = parse("""
        func.func @main() -> f32 {
          %c = arith.constant 1.0 : f32
          return %c : f32
        }
    """)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: refresh_function_type(match(root, "arith.constant")))
    assert "transform_ext.refresh_function_type: arith.constant" in message
    assert "not a func.func" in message
    assert str(payload) == before
