"""forward_reshaped_writes: IR (FileCheck), numerics before/after on the CPU, reads left
alone, rejection (message and unchanged payload)."""

import torch

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module
from transform_ext.forward_reshaped_writes import forward_reshaped_writes

# exp(x) written as a [1, 8] tile, read back through a unit-dim expand_shape
EXPANDED = """
func.func @main(%x: tensor<1x8xf32>) -> tensor<1x8xf32> {
  %c0 = arith.constant 0 : index
  %p = arith.constant 0.0 : f32
  %v = vector.transfer_read %x[%c0, %c0], %p {in_bounds = [true, true]} : tensor<1x8xf32>, vector<1x8xf32>
  %ev = math.exp %v : vector<1x8xf32>
  %e = tensor.empty() : tensor<1x8xf32>
  %t = vector.transfer_write %ev, %e[%c0, %c0] {in_bounds = [true, true]} : vector<1x8xf32>, tensor<1x8xf32>
  %r = tensor.expand_shape %t [[0, 1], [2]] output_shape [1, 1, 8] : tensor<1x8xf32> into tensor<1x1x8xf32>
  %y = vector.transfer_read %r[%c0, %c0, %c0], %p {in_bounds = [true, true]} : tensor<1x1x8xf32>, vector<1x8xf32>
  %s = arith.addf %y, %v : vector<1x8xf32>
  %o = tensor.empty() : tensor<1x8xf32>
  %w = vector.transfer_write %s, %o[%c0, %c0] {in_bounds = [true, true]} : vector<1x8xf32>, tensor<1x8xf32>
  return %w : tensor<1x8xf32>
}
"""


def _forward(payload, names="func.func"):
    apply(payload, lambda root: forward_reshaped_writes(match(root, names)))


def test_the_read_through_the_reshape_is_the_written_vector():
    payload = parse(EXPANDED)
    _forward(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: %[[V:.*]] = vector.transfer_read %arg0
        CHECK: %[[EV:.*]] = math.exp %[[V]]
        CHECK: tensor.expand_shape
        CHECK-NOT: vector.transfer_read
        CHECK: arith.addf %[[EV]], %[[V]] : vector<1x8xf32>
    """)


def test_same_result_before_and_after():
    x = torch.randn(1, 8)
    before = run_module(parse(EXPANDED), [x])
    payload = parse(EXPANDED)
    _forward(payload)
    after = run_module(payload, [x])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[0], torch.exp(x) + x)


def test_a_partial_read_and_a_read_without_reshape_are_left_alone():
    text = EXPANDED.replace(
        "%y = vector.transfer_read %r[%c0, %c0, %c0], %p {in_bounds = [true, true]} : tensor<1x1x8xf32>, vector<1x8xf32>",
        "%y4 = vector.transfer_read %r[%c0, %c0, %c0], %p {in_bounds = [true, true]} : tensor<1x1x8xf32>, vector<1x4xf32>\n"
        "  %y = vector.broadcast %p : f32 to vector<1x8xf32>")
    payload = parse(text)
    before = str(payload)
    _forward(payload)
    assert str(payload) == before


def test_rejects_a_target_read_of_another_type():
    payload = parse("""
        func.func @main(%v: vector<1x8xf32>) -> vector<1x4xf32> {
          %c0 = arith.constant 0 : index
          %p = arith.constant 0.0 : f32
          %e = tensor.empty() : tensor<1x8xf32>
          %t = vector.transfer_write %v, %e[%c0, %c0] {in_bounds = [true, true]} : vector<1x8xf32>, tensor<1x8xf32>
          %r = tensor.collapse_shape %t [[0, 1]] : tensor<1x8xf32> into tensor<8xf32>
          %y = vector.transfer_read %r[%c0], %p {in_bounds = [true]} : tensor<8xf32>, vector<4xf32>
          %z = vector.shape_cast %y : vector<4xf32> to vector<1x4xf32>
          return %z : vector<1x4xf32>
        }
    """)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: forward_reshaped_writes(match(root, "vector.transfer_read")))
    assert "transform_ext.forward_reshaped_writes: vector.transfer_read" in message
    assert "it reads vector<4xf32>, the write wrote vector<1x8xf32>" in message
    assert str(payload) == before
