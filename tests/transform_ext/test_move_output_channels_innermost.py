"""move_output_channels_innermost: IR (FileCheck), numerics against torch, rejections; and
convolution_to_contraction's operand order on its result (the image broadcast, the filter
along the lanes)."""

import torch
import torch.nn.functional as F

from schedules.common import match
from transform_ext.convolution_to_contraction import convolution_to_contraction
from transform_ext.move_output_channels_innermost import move_output_channels_innermost
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# A padded 2-D convolution of stride (1, 2) accumulating onto a given start.
CONV_2D = """
func.func @main(%x: tensor<2x3x9x11xf32>, %w: tensor<5x3x2x3xf32>, %y: tensor<2x5x8x5xf32>) -> tensor<2x5x8x5xf32> {
  %r = linalg.conv_2d_nchw_fchw {dilations = dense<1> : vector<2xi64>, strides = dense<[1, 2]> : vector<2xi64>}
         ins(%x, %w : tensor<2x3x9x11xf32>, tensor<5x3x2x3xf32>) outs(%y : tensor<2x5x8x5xf32>) -> tensor<2x5x8x5xf32>
  return %r : tensor<2x5x8x5xf32>
}
"""


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, 9, 11, generator=g), torch.randn(5, 3, 2, 3, generator=g),
            torch.randn(2, 5, 8, 5, generator=g))


def test_filter_and_result_get_the_channels_innermost():
    payload = parse(CONV_2D)
    apply(payload, lambda root: move_output_channels_innermost(match(root, "linalg.conv_2d_nchw_fchw")))
    check(payload, """
        CHECK: %[[W2:.*]] = tensor.collapse_shape %arg1 {{\[}}[0], [1, 2, 3]] : tensor<5x3x2x3xf32> into tensor<5x18xf32>
        CHECK: %[[W2T:.*]] = linalg.transpose ins(%[[W2]] : tensor<5x18xf32>) outs({{.*}} : tensor<18x5xf32>) permutation = [1, 0]
        CHECK: %[[WT:.*]] = tensor.expand_shape %[[W2T]] {{\[}}[0, 1, 2], [3]] output_shape [3, 2, 3, 5]
        CHECK: %[[I3:.*]] = tensor.collapse_shape %arg2 {{\[}}[0], [1], [2, 3]] : tensor<2x5x8x5xf32> into tensor<2x5x40xf32>
        CHECK: %[[I3T:.*]] = linalg.transpose ins(%[[I3]] : tensor<2x5x40xf32>) outs({{.*}} : tensor<2x40x5xf32>) permutation = [0, 2, 1]
        CHECK: %[[IT:.*]] = tensor.expand_shape %[[I3T]] {{\[}}[0], [1, 2], [3]] output_shape [2, 8, 5, 5]
        CHECK: %[[Y:.*]] = linalg.generic {indexing_maps = [#[[XMAP:.*]], #[[WMAP:.*]], #[[YMAP:.*]]], iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction", "reduction", "reduction"]} ins(%arg0, %[[WT]] : {{.*}}) outs(%[[IT]] : tensor<2x8x5x5xf32>)
        CHECK: linalg.generic {indexing_maps = [#[[ID:.*]], #[[BACK:.*]]], iterator_types = ["parallel", "parallel", "parallel", "parallel"]} ins(%[[Y]] : tensor<2x8x5x5xf32>) outs({{.*}} : tensor<2x5x8x5xf32>)
        CHECK-NEXT: ^bb0(%[[IN:.*]]: f32, %{{.*}}: f32):
        CHECK-NEXT: linalg.yield %[[IN]] : f32
    """)
    text = str(payload)
    # loops (n, oh, ow, f, c, kh, kw): the image read at (oh + kh, ow * 2 + kw), f innermost
    assert "(d0, d1, d2, d3, d4, d5, d6) -> (d0, d4, d1 + d5, d2 * 2 + d6)" in text
    assert "(d0, d1, d2, d3, d4, d5, d6) -> (d4, d5, d6, d3)" in text
    assert "(d0, d1, d2, d3, d4, d5, d6) -> (d0, d1, d2, d3)" in text
    # the copy back: Y[n, f, oh, ow] = Y_t[n, oh, ow, f] over Y_t's dims
    assert "(d0, d1, d2, d3) -> (d0, d3, d1, d2)" in text
    x, w, y = _inputs()
    (got,) = run_module(payload, [x, w, y])
    torch.testing.assert_close(got, y + F.conv2d(x, w, stride=(1, 2)), rtol=1e-5, atol=1e-5)


def test_a_bias_start_and_a_zero_start_are_rebuilt_in_the_new_layout():
    """I = the bias broadcast over the image (a generic read by the convolution alone): I_t is
    that broadcast written channels-last, not a transpose of it (the schedule computes it per
    register tile); a zero fill likewise becomes a fill of the transposed shape. A start
    read by something else too stays a transpose."""
    payload = parse("""
        func.func @main(%x: tensor<2x3x9x11xf32>, %w: tensor<5x3x2x3xf32>, %b: tensor<5xf32>) -> (tensor<2x5x8x5xf32>, tensor<2x5x8x5xf32>) {
          %e = tensor.empty() : tensor<2x5x8x5xf32>
          %i = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d1)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>],
                               iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
                 ins(%b : tensor<5xf32>) outs(%e : tensor<2x5x8x5xf32>) {
          ^bb0(%in: f32, %out: f32):
            linalg.yield %in : f32
          } -> tensor<2x5x8x5xf32>
          %r = linalg.conv_2d_nchw_fchw {dilations = dense<1> : vector<2xi64>, strides = dense<[1, 2]> : vector<2xi64>}
                 ins(%x, %w : tensor<2x3x9x11xf32>, tensor<5x3x2x3xf32>) outs(%i : tensor<2x5x8x5xf32>) -> tensor<2x5x8x5xf32>
          %c = arith.constant 0.0 : f32
          %e2 = tensor.empty() : tensor<2x5x8x5xf32>
          %z = linalg.fill ins(%c : f32) outs(%e2 : tensor<2x5x8x5xf32>) -> tensor<2x5x8x5xf32>
          %r2 = linalg.conv_2d_nchw_fchw {dilations = dense<1> : vector<2xi64>, strides = dense<[1, 2]> : vector<2xi64>}
                 ins(%x, %w : tensor<2x3x9x11xf32>, tensor<5x3x2x3xf32>) outs(%z : tensor<2x5x8x5xf32>) -> tensor<2x5x8x5xf32>
          return %r, %r2 : tensor<2x5x8x5xf32>, tensor<2x5x8x5xf32>
        }""")
    apply(payload, lambda root: move_output_channels_innermost(match(root, "linalg.conv_2d_nchw_fchw")))
    check(payload, """
        CHECK: %[[IT:.*]] = linalg.generic {indexing_maps = [#[[BMAP:.*]], #{{.*}}], iterator_types = ["parallel", "parallel", "parallel", "parallel"]} ins(%arg2 : tensor<5xf32>) outs(%{{.*}} : tensor<2x8x5x5xf32>)
        CHECK: linalg.generic {{.*}} outs(%[[IT]] : tensor<2x8x5x5xf32>)
        CHECK: %[[ZT:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%{{.*}} : tensor<2x8x5x5xf32>)
        CHECK: linalg.generic {{.*}} outs(%[[ZT]] : tensor<2x8x5x5xf32>)
    """)
    text = str(payload)
    assert "(d0, d1, d2, d3) -> (d3)" in text  # the bias read along the channels, now last
    assert text.count("linalg.transpose") == 2  # the filters only
    x, w, _ = _inputs()
    b = torch.randn(5, generator=torch.Generator().manual_seed(3))
    got, got_zero = run_module(payload, [x, w, b])
    torch.testing.assert_close(got, F.conv2d(x, w, b, stride=(1, 2)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_zero, F.conv2d(x, w, stride=(1, 2)), rtol=1e-5, atol=1e-5)


def test_the_contraction_broadcasts_the_image_and_reads_the_filter_along_the_lanes():
    payload = parse("""
        func.func @main(%x: tensor<1x3x9xf32>, %w: tensor<16x3x1xf32>, %y: tensor<1x16x9xf32>) -> tensor<1x16x9xf32> {
          %r = linalg.conv_1d_ncw_fcw {dilations = dense<1> : vector<1xi64>, strides = dense<1> : vector<1xi64>}
                 ins(%x, %w : tensor<1x3x9xf32>, tensor<16x3x1xf32>) outs(%y : tensor<1x16x9xf32>) -> tensor<1x16x9xf32>
          return %r : tensor<1x16x9xf32>
        }""")

    def script(root):
        moved = move_output_channels_innermost(match(root, "linalg.conv_1d_ncw_fcw"))
        convolution_to_contraction(moved)

    apply(payload, script)
    check(payload, """
        CHECK: %[[W2:.*]] = tensor.collapse_shape %arg1 {{\[}}[0], [1, 2]] : tensor<16x3x1xf32> into tensor<16x3xf32>
        CHECK: %[[W2T:.*]] = linalg.transpose ins(%[[W2]] : tensor<16x3xf32>)
        CHECK: %[[WT:.*]] = tensor.expand_shape %[[W2T]] {{\[}}[0, 1], [2]] output_shape [3, 1, 16]
        CHECK: %[[X:.*]] = tensor.extract_slice %arg0[0, 0, 0] [1, 3, 9] [1, 1, 1]
        CHECK: %[[W:.*]] = tensor.extract_slice %[[WT]][0, 0, 0] [3, 1, 16] [1, 1, 1] : tensor<3x1x16xf32> to tensor<3x16xf32>
        CHECK: linalg.generic {{.*}} ins(%[[X]], %[[W]] : tensor<1x3x9xf32>, tensor<3x16xf32>)
        CHECK: ^bb0(%[[IX:.*]]: f32, %[[IW:.*]]: f32, %{{.*}}: f32):
        CHECK: arith.mulf %[[IX]], %[[IW]]
    """)
    g = torch.Generator().manual_seed(2)
    x, w, y = torch.randn(1, 3, 9, generator=g), torch.randn(16, 3, 1, generator=g), torch.randn(1, 16, 9, generator=g)
    (got,) = run_module(payload, [x, w, y])
    torch.testing.assert_close(got, y + F.conv1d(x, w), rtol=1e-5, atol=1e-5)


def test_rejects_channels_innermost_already_and_other_ops():
    payload = parse("""
        func.func @main(%x: tensor<1x9x3xf32>, %w: tensor<3x3x4xf32>, %y: tensor<1x7x4xf32>, %a: tensor<4x3xf32>, %b: tensor<3x5xf32>, %c: tensor<4x5xf32>) -> (tensor<1x7x4xf32>, tensor<4x5xf32>) {
          %r = linalg.conv_1d_nwc_wcf {dilations = dense<1> : vector<1xi64>, strides = dense<1> : vector<1xi64>}
                 ins(%x, %w : tensor<1x9x3xf32>, tensor<3x3x4xf32>) outs(%y : tensor<1x7x4xf32>) -> tensor<1x7x4xf32>
          %m = linalg.matmul ins(%a, %b : tensor<4x3xf32>, tensor<3x5xf32>) outs(%c : tensor<4x5xf32>) -> tensor<4x5xf32>
          return %r, %m : tensor<1x7x4xf32>, tensor<4x5xf32>
        }""")
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: move_output_channels_innermost(match(root, "linalg.conv_1d_nwc_wcf")))
    assert "transform_ext.move_output_channels_innermost: linalg.conv_1d_nwc_wcf" in message
    assert "has its output channel dim d2 innermost already" in message
    message = apply_expect_failure(payload, lambda root: move_output_channels_innermost(match(root, "linalg.matmul")))
    assert "is not a convolution" in message
    assert str(payload) == before


def test_rejects_depthwise_convolutions():
    payload = parse("""
        func.func @main(%x: tensor<2x5x17xf32>, %w: tensor<5x3xf32>, %y: tensor<2x5x15xf32>) -> tensor<2x5x15xf32> {
          %r = linalg.depthwise_conv_1d_ncw_cw {dilations = dense<1> : vector<1xi64>, strides = dense<1> : vector<1xi64>}
                 ins(%x, %w : tensor<2x5x17xf32>, tensor<5x3xf32>) outs(%y : tensor<2x5x15xf32>) -> tensor<2x5x15xf32>
          return %r : tensor<2x5x15xf32>
        }""")
    message = apply_expect_failure(payload, lambda root: move_output_channels_innermost(match(root, "linalg.depthwise_conv_1d_ncw_cw")))
    assert "has 0 output channel dims (wants one)" in message
