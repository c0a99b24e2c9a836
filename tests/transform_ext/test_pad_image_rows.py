"""pad_image_rows: a convolution reads its image from rows `padding` elements longer; a
zero-padded image (x inserted into a fill) is rebuilt longer, any other image copied into
the first elements of longer rows; the result is bit-identical; ops that are not
convolutions are refused with nothing rewritten."""

import torch
import torch.nn.functional as F

from schedules.common import match
from transform_ext.pad_image_rows import pad_image_rows
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# y = conv1d(x, w, stride 2, dilation 2): x [2, 3, 21], w [4, 3, 3], y [2, 4, 9]
STRIDED = """
func.func @main(%x: tensor<2x3x21xf32>, %w: tensor<4x3x3xf32>) -> tensor<2x4x9xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<2x4x9xf32>
  %y0 = linalg.fill ins(%zero : f32) outs(%e : tensor<2x4x9xf32>) -> tensor<2x4x9xf32>
  %y = linalg.conv_1d_ncw_fcw {dilations = dense<2> : vector<1xi64>, strides = dense<2> : vector<1xi64>}
      ins(%x, %w : tensor<2x3x21xf32>, tensor<4x3x3xf32>) outs(%y0 : tensor<2x4x9xf32>) -> tensor<2x4x9xf32>
  return %y : tensor<2x4x9xf32>
}
"""

# y = conv2d(x, w, padding 1) as torch-mlir imports it: x inserted into a zero fill
PADDED = """
func.func @main(%x: tensor<1x2x5x6xf32>, %w: tensor<3x2x3x3xf32>) -> tensor<1x3x5x6xf32> {
  %zero = arith.constant 0.0 : f32
  %p0 = tensor.empty() : tensor<1x2x7x8xf32>
  %p1 = linalg.fill ins(%zero : f32) outs(%p0 : tensor<1x2x7x8xf32>) -> tensor<1x2x7x8xf32>
  %p = tensor.insert_slice %x into %p1[0, 0, 1, 1] [1, 2, 5, 6] [1, 1, 1, 1] : tensor<1x2x5x6xf32> into tensor<1x2x7x8xf32>
  %e = tensor.empty() : tensor<1x3x5x6xf32>
  %y0 = linalg.fill ins(%zero : f32) outs(%e : tensor<1x3x5x6xf32>) -> tensor<1x3x5x6xf32>
  %y = linalg.conv_2d_nchw_fchw {dilations = dense<1> : vector<2xi64>, strides = dense<1> : vector<2xi64>}
      ins(%p, %w : tensor<1x2x7x8xf32>, tensor<3x2x3x3xf32>) outs(%y0 : tensor<1x3x5x6xf32>) -> tensor<1x3x5x6xf32>
  return %y : tensor<1x3x5x6xf32>
}
"""

NOT_A_CONVOLUTION = """
func.func @main(%a: tensor<4x5xf32>, %b: tensor<5x6xf32>) -> tensor<4x6xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4x6xf32>
  %c0 = linalg.fill ins(%zero : f32) outs(%e : tensor<4x6xf32>) -> tensor<4x6xf32>
  %c = linalg.matmul ins(%a, %b : tensor<4x5xf32>, tensor<5x6xf32>) outs(%c0 : tensor<4x6xf32>) -> tensor<4x6xf32>
  return %c : tensor<4x6xf32>
}
"""


def _pad_convolutions(payload, padding):
    apply(payload, lambda root: pad_image_rows(
        match(root, ["linalg.conv_1d_ncw_fcw", "linalg.conv_2d_nchw_fchw"]), padding))
    payload.operation.verify()


def test_an_unpadded_image_is_copied_into_longer_rows():
    payload = parse(STRIDED)
    _pad_convolutions(payload, 16)
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK:       %[[E:.*]] = tensor.empty() : tensor<2x3x37xf32>
        CHECK:       %[[X:.*]] = tensor.insert_slice %arg0 into %[[E]][0, 0, 0] [2, 3, 21] [1, 1, 1]
        CHECK:       linalg.conv_1d_ncw_fcw
        CHECK-SAME:  ins(%[[X]], %arg1 : tensor<2x3x37xf32>, tensor<4x3x3xf32>)
    """)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 21, generator=g), torch.randn(4, 3, 3, generator=g)
    (after,) = run_module(payload, [x, w])
    (before,) = run_module(parse(STRIDED), [x, w])
    torch.testing.assert_close(after, F.conv1d(x, w, stride=2, dilation=2))
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_a_zero_padded_image_is_rebuilt_longer():
    payload = parse(PADDED)
    _pad_convolutions(payload, 16)
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK:       %[[E:.*]] = tensor.empty() : tensor<1x2x7x24xf32>
        CHECK:       %[[F:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%[[E]] : tensor<1x2x7x24xf32>)
        CHECK:       %[[X:.*]] = tensor.insert_slice %arg0 into %[[F]][0, 0, 1, 1] [1, 2, 5, 6] [1, 1, 1, 1]
        CHECK-NOT:   tensor.insert_slice
        CHECK:       linalg.conv_2d_nchw_fchw
        CHECK-SAME:  ins(%[[X]], %arg1 : tensor<1x2x7x24xf32>, tensor<3x2x3x3xf32>)
    """)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 2, 5, 6, generator=g), torch.randn(3, 2, 3, 3, generator=g)
    (after,) = run_module(payload, [x, w])
    torch.testing.assert_close(after, F.conv2d(x, w, padding=1))


def test_an_op_that_is_not_a_convolution_is_refused():
    payload = parse(NOT_A_CONVOLUTION)
    message = apply_expect_failure(payload, lambda root: pad_image_rows(
        match(root, "linalg.matmul"), 16))
    assert "pad_image_rows" in message and "not a convolution" in message
    assert "tensor<4x5xf32>" in str(payload) and "insert_slice" not in str(payload)
