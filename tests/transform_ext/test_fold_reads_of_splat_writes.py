"""fold_reads_of_splat_writes: IR (FileCheck), numerics before/after on the CPU, reads left
alone, rejection (message and unchanged payload)."""

import torch

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module
from transform_ext.fold_reads_of_splat_writes import fold_reads_of_splat_writes

# a -inf [1, 8] tile (a row maximum's initial value) read back as [8] through a collapse
SPLAT_MAX = """
func.func @main(%x: tensor<8xf32>) -> tensor<8xf32> {
  %c0 = arith.constant 0 : index
  %p = arith.constant 0.0 : f32
  %ninf = arith.constant dense<0xFF800000> : vector<1x8xf32>
  %e = tensor.empty() : tensor<1x8xf32>
  %t = vector.transfer_write %ninf, %e[%c0, %c0] {in_bounds = [true, true]} : vector<1x8xf32>, tensor<1x8xf32>
  %r = tensor.collapse_shape %t [[0, 1]] : tensor<1x8xf32> into tensor<8xf32>
  %m = vector.transfer_read %r[%c0], %p {in_bounds = [true]} : tensor<8xf32>, vector<8xf32>
  %v = vector.transfer_read %x[%c0], %p {in_bounds = [true]} : tensor<8xf32>, vector<8xf32>
  %mx = arith.maximumf %m, %v : vector<8xf32>
  %o = tensor.empty() : tensor<8xf32>
  %w = vector.transfer_write %mx, %o[%c0] {in_bounds = [true]} : vector<8xf32>, tensor<8xf32>
  return %w : tensor<8xf32>
}
"""


def _fold(payload, names="func.func"):
    apply(payload, lambda root: fold_reads_of_splat_writes(match(root, names)))


def test_the_read_of_the_splat_tile_is_the_splat():
    payload = parse(SPLAT_MAX)
    _fold(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: tensor.collapse_shape
        CHECK-NEXT: %[[C:.*]] = arith.constant dense<0xFF800000> : vector<8xf32>
        CHECK-NEXT: %[[V:.*]] = vector.transfer_read %arg0
        CHECK-NEXT: arith.maximumf %[[C]], %[[V]] : vector<8xf32>
    """)


def test_same_result_before_and_after():
    x = torch.randn(8)
    before = run_module(parse(SPLAT_MAX), [x])
    payload = parse(SPLAT_MAX)
    _fold(payload)
    after = run_module(payload, [x])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[0], x)


def test_a_partial_write_is_left_alone():
    text = SPLAT_MAX.replace("%ninf = arith.constant dense<0xFF800000> : vector<1x8xf32>",
                             "%ninf = arith.constant dense<0xFF800000> : vector<1x4xf32>").replace(
        "vector<1x8xf32>, tensor<1x8xf32>", "vector<1x4xf32>, tensor<1x8xf32>")
    payload = parse(text)
    before = str(payload)
    _fold(payload)
    assert str(payload) == before


def test_rejects_a_target_read_out_of_bounds():
    payload = parse(SPLAT_MAX.replace("%m = vector.transfer_read %r[%c0], %p {in_bounds = [true]}",
                                      "%m = vector.transfer_read %r[%c0], %p {in_bounds = [false]}"))
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: fold_reads_of_splat_writes(match(root, "vector.transfer_read")))
    assert "transform_ext.fold_reads_of_splat_writes: vector.transfer_read" in message
    assert "the read is masked or not in bounds" in message
    assert str(payload) == before
