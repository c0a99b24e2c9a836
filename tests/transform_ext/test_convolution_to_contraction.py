"""convolution_to_contraction: IR (FileCheck), numerics against torch, rejections; and the
convolution analysis it relies on (transform_ext.analysis.convolution)."""

import torch
import torch.nn.functional as F

from schedules.common import match
from transform_ext.analysis.convolution import NotConvolution, convolution_dims
from transform_ext.convolution_to_contraction import convolution_to_contraction
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# A 1 x 1 window of stride (2, 3): the image read is a strided slice of X.
UNIT_WINDOW = """
func.func @main(%x: tensor<2x3x9x11xf32>, %w: tensor<4x3x1x1xf32>) -> tensor<2x4x5x4xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<2x4x5x4xf32>
  %y = linalg.fill ins(%zero : f32) outs(%e : tensor<2x4x5x4xf32>) -> tensor<2x4x5x4xf32>
  %r = linalg.conv_2d_nchw_fchw {dilations = dense<1> : vector<2xi64>, strides = dense<[2, 3]> : vector<2xi64>}
         ins(%x, %w : tensor<2x3x9x11xf32>, tensor<4x3x1x1xf32>) outs(%y : tensor<2x4x5x4xf32>) -> tensor<2x4x5x4xf32>
  return %r : tensor<2x4x5x4xf32>
}
"""


def test_a_unit_window_reads_a_strided_slice_of_the_image():
    payload = parse(UNIT_WINDOW)
    apply(payload, lambda root: convolution_to_contraction(match(root, "linalg.conv_2d_nchw_fchw")))
    check(payload, """
        CHECK: %[[X:.*]] = tensor.extract_slice %arg0[0, 0, 0, 0] [2, 3, 5, 4] [1, 1, 2, 3]
        CHECK: %[[W:.*]] = tensor.extract_slice %arg1[0, 0, 0, 0] [4, 3, 1, 1] [1, 1, 1, 1] : tensor<4x3x1x1xf32> to tensor<4x3xf32>
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]{{.*}} ins(%[[W]], %[[X]] : tensor<4x3xf32>, tensor<2x3x5x4xf32>)
        CHECK: arith.mulf %in, %in_
    """)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 9, 11, generator=g), torch.randn(4, 3, 1, 1, generator=g)
    (got,) = run_module(payload, [x, w])
    torch.testing.assert_close(got, F.conv2d(x, w, stride=(2, 3)), rtol=1e-5, atol=1e-5)


def test_depthwise_with_a_unit_window():
    payload = parse("""
        func.func @main(%x: tensor<2x5x17xf32>, %w: tensor<5x1xf32>, %y: tensor<2x5x17xf32>) -> tensor<2x5x17xf32> {
          %r = linalg.depthwise_conv_1d_ncw_cw {dilations = dense<1> : vector<1xi64>, strides = dense<1> : vector<1xi64>}
                 ins(%x, %w : tensor<2x5x17xf32>, tensor<5x1xf32>) outs(%y : tensor<2x5x17xf32>) -> tensor<2x5x17xf32>
          return %r : tensor<2x5x17xf32>
        }""")
    apply(payload, lambda root: convolution_to_contraction(match(root, "linalg.depthwise_conv_1d_ncw_cw")))
    check(payload, """
        CHECK-NOT: linalg.depthwise_conv
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel"]
    """)
    g = torch.Generator().manual_seed(1)
    x, w, y = torch.randn(2, 5, 17, generator=g), torch.randn(5, 1, generator=g), torch.randn(2, 5, 17, generator=g)
    (got,) = run_module(payload, [x, w, y])
    torch.testing.assert_close(got, y + F.conv1d(x, w[:, None, :], groups=5), rtol=1e-5, atol=1e-5)


def test_rejects_wide_windows_and_other_ops():
    payload = parse("""
        func.func @main(%x: tensor<1x3x9xf32>, %w: tensor<4x3x3xf32>, %y: tensor<1x4x7xf32>, %a: tensor<4x3xf32>, %b: tensor<3x5xf32>, %c: tensor<4x5xf32>) -> (tensor<1x4x7xf32>, tensor<4x5xf32>) {
          %r = linalg.conv_1d_ncw_fcw {dilations = dense<1> : vector<1xi64>, strides = dense<1> : vector<1xi64>}
                 ins(%x, %w : tensor<1x3x9xf32>, tensor<4x3x3xf32>) outs(%y : tensor<1x4x7xf32>) -> tensor<1x4x7xf32>
          %m = linalg.matmul ins(%a, %b : tensor<4x3xf32>, tensor<3x5xf32>) outs(%c : tensor<4x5xf32>) -> tensor<4x5xf32>
          return %r, %m : tensor<1x4x7xf32>, tensor<4x5xf32>
        }""")
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: convolution_to_contraction(match(root, "linalg.conv_1d_ncw_fcw")))
    assert "transform_ext.convolution_to_contraction: linalg.conv_1d_ncw_fcw" in message
    assert "window dims of extent other than 1 (d4" in message
    message = apply_expect_failure(payload, lambda root: convolution_to_contraction(match(root, "linalg.matmul")))
    assert "is not a convolution (no input has a window expression" in message
    assert str(payload) == before


def test_analysis_names_the_dims():
    payload = parse("""
        func.func @main(%x: tensor<2x4x3x12x12xf32>, %w: tensor<4x5x3x3x2xf32>, %y: tensor<2x4x5x5x11xf32>) -> tensor<2x4x5x5x11xf32> {
          %r = linalg.conv_2d_ngchw_gfchw {dilations = dense<[1, 1]> : vector<2xi64>, strides = dense<[2, 1]> : vector<2xi64>}
                 ins(%x, %w : tensor<2x4x3x12x12xf32>, tensor<4x5x3x3x2xf32>) outs(%y : tensor<2x4x5x5x11xf32>) -> tensor<2x4x5x5x11xf32>
          return %r : tensor<2x4x5x5x11xf32>
        }""")
    op = next(o for o in payload.body.operations[0].regions[0].blocks[0].operations
              if o.operation.name.startswith("linalg.conv")).operation
    d = convolution_dims(op)
    assert (d.batch, d.group, d.out_channel, d.in_channel) == ([0], [1], [2], [5])
    assert (d.image, d.window, d.strides, d.dilations) == ([3, 4], [6, 7], [2, 1], [1, 1])
    assert d.input_index == 0 and d.filter_index == 1
    not_mac = parse("""
        #x = affine_map<(d0, d1) -> (d0 + d1)>
        #w = affine_map<(d0, d1) -> (d1)>
        #y = affine_map<(d0, d1) -> (d0)>
        func.func @main(%x: tensor<10xf32>, %w: tensor<3xf32>, %y: tensor<8xf32>) -> tensor<8xf32> {
          %r = linalg.generic {indexing_maps = [#x, #w, #y], iterator_types = ["parallel", "reduction"]}
                 ins(%x, %w : tensor<10xf32>, tensor<3xf32>) outs(%y : tensor<8xf32>) {
          ^bb0(%a: f32, %b: f32, %o: f32):
            %p = arith.mulf %a, %b : f32
            %s = arith.subf %o, %p : f32
            linalg.yield %s : f32
          } -> tensor<8xf32>
          return %r : tensor<8xf32>
        }""")
    op = next(o for o in not_mac.body.operations[0].regions[0].blocks[0].operations
              if o.operation.name == "linalg.generic").operation
    try:
        convolution_dims(op)
        raise AssertionError("a body computing out - x * w is no convolution")
    except NotConvolution as exc:
        assert "wants out + x * w" in str(exc)
