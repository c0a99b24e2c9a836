"""drop_unpack_destination_fill: IR (FileCheck), rejections. The numerics: every packed
matmul of tests/schedules/test_matmul.py unpacks its accumulator into C's zero fill, which
the schedule drops with this op, and is compared with torch."""

from schedules.common import canonicalize, match
from transform_ext.drop_unpack_destination_fill import drop_unpack_destination_fill
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

UNPACK = """
func.func @main(%p: tensor<2x3x8x4xf32>) -> tensor<13x10xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<13x10xf32>
  %d = linalg.fill ins(%zero : f32) outs(%e : tensor<13x10xf32>) -> tensor<13x10xf32>
  %r = linalg.unpack %p inner_dims_pos = [0, 1] inner_tiles = [8, 4] into %d : tensor<2x3x8x4xf32> -> tensor<13x10xf32>
  return %r : tensor<13x10xf32>
}
"""


def test_the_unpack_writes_into_the_fills_init():
    payload = parse(UNPACK)

    def body(root):
        drop_unpack_destination_fill(match(root, "linalg.unpack"))
        canonicalize(match(root, "func.func"))

    apply(payload, body)
    check(payload, """
        CHECK: %[[E:.*]] = tensor.empty() : tensor<13x10xf32>
        CHECK-NOT: linalg.fill
        CHECK: linalg.unpack %{{.*}} inner_dims_pos = [0, 1] inner_tiles = [8, 4] into %[[E]]
    """)


def test_rejects_an_unpack_into_another_destination_and_other_ops():
    payload = parse("""
        func.func @main(%p: tensor<2x3x8x4xf32>, %d: tensor<13x10xf32>) -> tensor<13x10xf32> {
          %r = linalg.unpack %p inner_dims_pos = [0, 1] inner_tiles = [8, 4] into %d : tensor<2x3x8x4xf32> -> tensor<13x10xf32>
          return %r : tensor<13x10xf32>
        }
    """)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: drop_unpack_destination_fill(match(root, "linalg.unpack")))
    assert "transform_ext.drop_unpack_destination_fill: linalg.unpack" in message
    assert "its destination is not the result of a linalg.fill" in message
    assert str(payload) == before
    payload = parse(UNPACK)
    message = apply_expect_failure(payload, lambda root: drop_unpack_destination_fill(match(root, "linalg.fill")))
    assert "transform_ext.drop_unpack_destination_fill: linalg.fill" in message
    assert "not a linalg.unpack" in message
