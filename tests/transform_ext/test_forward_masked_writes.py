"""forward_masked_writes: IR (FileCheck), numerics before/after on the CPU, reads left
alone, rejection (message and unchanged payload)."""

import torch

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module
from transform_ext.forward_masked_writes import forward_masked_writes

# exp(x) on the first r = 5 rows and c = 11 columns of an [8, 16] tile, written masked into a fresh
# [r, c] tensor and read back under the same mask; the row sums of what was read (padding 0
# elsewhere) are the result.
MASKED = """
func.func @main(%x: tensor<8x16xf32>) -> tensor<8xf32> {
  %c0 = arith.constant 0 : index
  %r = arith.constant 5 : index
  %c = arith.constant 11 : index
  %p = arith.constant 0.0 : f32
  %v = vector.transfer_read %x[%c0, %c0], %p {in_bounds = [true, true]} : tensor<8x16xf32>, vector<8x16xf32>
  %ev = math.exp %v : vector<8x16xf32>
  %m = vector.create_mask %r, %c : vector<8x16xi1>
  %e = tensor.empty(%r, %c) : tensor<?x?xf32>
  %t = vector.transfer_write %ev, %e[%c0, %c0], %m {in_bounds = [true, true]} : vector<8x16xf32>, tensor<?x?xf32>
  %y = vector.transfer_read %t[%c0, %c0], %p, %m {in_bounds = [true, true]} : tensor<?x?xf32>, vector<8x16xf32>
  %zero = arith.constant dense<0.0> : vector<8xf32>
  %s = vector.multi_reduction <add>, %y, %zero [1] : vector<8x16xf32> to vector<8xf32>
  %o = tensor.empty() : tensor<8xf32>
  %w = vector.transfer_write %s, %o[%c0] {in_bounds = [true]} : vector<8xf32>, tensor<8xf32>
  return %w : tensor<8xf32>
}
"""


def _forward(payload, names="func.func"):
    apply(payload, lambda root: forward_masked_writes(match(root, names)))


def test_the_read_back_is_a_select_of_the_written_vector():
    payload = parse(MASKED)
    _forward(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: %[[EV:.*]] = math.exp
        CHECK: %[[M:.*]] = vector.create_mask
        CHECK: vector.transfer_write %[[EV]]
        CHECK-NOT: vector.transfer_read
        CHECK: %[[PAD:.*]] = vector.broadcast %{{.*}} : f32 to vector<8x16xf32>
        CHECK: %[[Y:.*]] = arith.select %[[M]], %[[EV]], %[[PAD]] : vector<8x16xi1>, vector<8x16xf32>
        CHECK: vector.multi_reduction <add>, %[[Y]]
    """)


def test_same_result_before_and_after():
    x = torch.randn(8, 16)
    want = torch.zeros(8)
    want[:5] = torch.exp(x[:5, :11]).sum(1)
    before = run_module(parse(MASKED), [x])
    payload = parse(MASKED)
    _forward(payload)
    after = run_module(payload, [x])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[0], want)


def test_a_read_under_another_mask_or_unmasked_is_left_alone():
    other_mask = MASKED.replace(
        "%y = vector.transfer_read %t[%c0, %c0], %p, %m",
        "%m2 = vector.create_mask %c, %r : vector<8x16xi1>\n"
        "  %y = vector.transfer_read %t[%c0, %c0], %p, %m2")
    unmasked = MASKED.replace("%y = vector.transfer_read %t[%c0, %c0], %p, %m",
                              "%y = vector.transfer_read %t[%c0, %c0], %p")
    for text in (other_mask, unmasked):
        payload = parse(text)
        before = str(payload)
        _forward(payload)
        assert str(payload) == before


def test_rejects_a_target_read_at_another_index():
    payload = parse("""
        func.func @main(%v: vector<8x16xf32>, %r: index, %c: index) -> vector<8x16xf32> {
          %c0 = arith.constant 0 : index
          %c1 = arith.constant 1 : index
          %p = arith.constant 0.0 : f32
          %m = vector.create_mask %r, %c : vector<8x16xi1>
          %e = tensor.empty(%r, %c) : tensor<?x?xf32>
          %t = vector.transfer_write %v, %e[%c0, %c0], %m {in_bounds = [true, true]} : vector<8x16xf32>, tensor<?x?xf32>
          %y = vector.transfer_read %t[%c1, %c0], %p, %m {in_bounds = [true, true]} : tensor<?x?xf32>, vector<8x16xf32>
          return %y : vector<8x16xf32>
        }
    """)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: forward_masked_writes(match(root, "vector.transfer_read")))
    assert "transform_ext.forward_masked_writes: vector.transfer_read" in message
    assert "the read and the write are at different indices" in message
    assert str(payload) == before
