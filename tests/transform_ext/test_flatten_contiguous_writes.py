"""flatten_contiguous_writes: the IR (FileCheck) of the writes it flattens (a packing step's
[NR, 2] pairs into a fresh panel, a partial outer dim at an offset) and of those it leaves
(a slice of a wider row, half rows, a masked or out-of-bounds write). The numerics of the
flattened writes: the bf16 matmul tests (tests/schedules/test_bf16_dot_products.py), whose
packing steps write this way."""

import pytest
from torch_mlir import ir

from schedules.common import match
from transform_ext.flatten_contiguous_writes import flatten_contiguous_writes
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

# A packing step: rows [2k, 2k+1] of B interleaved into the panel slice [n1, k, :, :].
PANEL = """
func.func @pack(%v: vector<{rows}x2xf32>, %n1: index, %k: index) -> tensor<4x8x16x2xf32> {{
  %c0 = arith.constant 0 : index
  %panel = tensor.empty() : tensor<4x8x16x2xf32>
  %slice = tensor.extract_slice %panel[%n1, %k, {row}, 0] [1, 1, {rows}, 2] [1, 1, 1, 1]
      : tensor<4x8x16x2xf32> to tensor<1x1x{rows}x2xf32>
  %w = vector.transfer_write %v, %slice[%c0, %c0, %c0, %c0] {{in_bounds = [true, true]}}
      : vector<{rows}x2xf32>, tensor<1x1x{rows}x2xf32>
  %r = tensor.insert_slice %w into %panel[%n1, %k, {row}, 0] [1, 1, {rows}, 2] [1, 1, 1, 1]
      : tensor<1x1x{rows}x2xf32> into tensor<4x8x16x2xf32>
  return %r : tensor<4x8x16x2xf32>
}}
"""


def flattened(text: str) -> ir.Module:
    payload = parse(text)
    apply(payload, lambda root: flatten_contiguous_writes(match(root, "func.func")))
    return payload


@pytest.mark.parametrize("rows,row", [(16, 0), (8, 4)], ids=["whole", "rows_4_to_11"])
def test_pairs_of_a_panel_slice_are_one_write(rows, row):
    check(flattened(PANEL.format(rows=rows, row=row)), f"""
        CHECK: %[[FLAT:.*]] = tensor.collapse_shape %{{{{.*}}}} {{{{\\[}}}}[0], [1], [2, 3]] : tensor<1x1x{rows}x2xf32> into tensor<1x1x{2 * rows}xf32>
        CHECK: %[[V:.*]] = vector.shape_cast %arg0 : vector<{rows}x2xf32> to vector<{2 * rows}xf32>
        CHECK: %[[W:.*]] = vector.transfer_write %[[V]], %[[FLAT]][%c0, %c0, %c0] {{in_bounds = [true]}} : vector<{2 * rows}xf32>, tensor<1x1x{2 * rows}xf32>
        CHECK: tensor.expand_shape %[[W]] {{{{\\[}}}}[0], [1], [2, 3]] output_shape [1, 1, {rows}, 2]
        CHECK-NOT: vector.transfer_write
    """)


def test_a_partial_outer_dim_at_an_offset_is_scaled():
    text = """
    func.func @f(%v: vector<3x4x2xf32>, %i: index) -> tensor<8x4x2xf32> {
      %c0 = arith.constant 0 : index
      %t = tensor.empty() : tensor<8x4x2xf32>
      %w = vector.transfer_write %v, %t[%i, %c0, %c0] {in_bounds = [true, true, true]}
          : vector<3x4x2xf32>, tensor<8x4x2xf32>
      return %w : tensor<8x4x2xf32>
    }
    """
    check(flattened(text), """
        CHECK: %[[FLAT:.*]] = tensor.collapse_shape {{.*}} : tensor<8x4x2xf32> into tensor<64xf32>
        CHECK: %[[I:.*]] = arith.muli %arg1, %c8
        CHECK: vector.transfer_write {{.*}}, %[[FLAT]][%[[I]]] {in_bounds = [true]} : vector<24xf32>, tensor<64xf32>
    """)


@pytest.mark.parametrize("text", [
    PANEL.format(rows=16, row=0).replace("4x8x16x2xf32>", "4x8x16x4xf32>"),  # half rows
    PANEL.format(rows=16, row=0).replace("{in_bounds = [true, true]}", "{in_bounds = [true, false]}"),
    # a [2, 16] tile of a [4, 64] matrix: its rows are 64 apart
    """
    func.func @f(%v: vector<2x16xf32>, %t: tensor<4x64xf32>) -> tensor<2x16xf32> {
      %c0 = arith.constant 0 : index
      %s = tensor.extract_slice %t[0, 16] [2, 16] [1, 1] : tensor<4x64xf32> to tensor<2x16xf32>
      %w = vector.transfer_write %v, %s[%c0, %c0] {in_bounds = [true, true]} : vector<2x16xf32>, tensor<2x16xf32>
      return %w : tensor<2x16xf32>
    }
    """,
    """
    func.func @f(%v: vector<4x2xf32>, %m: vector<4x2xi1>) -> tensor<4x2xf32> {
      %c0 = arith.constant 0 : index
      %t = tensor.empty() : tensor<4x2xf32>
      %w = vector.transfer_write %v, %t[%c0, %c0], %m {in_bounds = [true, true]} : vector<4x2xf32>, tensor<4x2xf32>
      return %w : tensor<4x2xf32>
    }
    """,
], ids=["half_rows", "out_of_bounds", "wider_rows", "masked"])
def test_other_writes_are_left_alone(text):
    payload = parse(text)
    before = str(payload)
    apply(payload, lambda root: flatten_contiguous_writes(match(root, "func.func")))
    assert str(payload) == before


def test_a_target_that_is_not_a_function_fails():
    payload = parse(PANEL.format(rows=16, row=0))
    message = apply_expect_failure(payload, lambda root: flatten_contiguous_writes(
        match(root, "vector.transfer_write")))
    assert "not a func.func" in message
