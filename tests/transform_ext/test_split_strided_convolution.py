"""split_strided_convolution: the phases (pure function), IR (FileCheck), numerics (the
rewritten payload against the strided one, both run), rejections."""

import pytest
import torch

from schedules.common import canonicalize, match
from transform_ext.split_strided_convolution import lane_phases, split_strided_convolution
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module


@pytest.mark.parametrize("K,d,s", [(11, 1, 4), (3, 4, 3), (5, 2, 2), (2, 3, 6)])
def test_lane_phases_hold_every_tap_once(K, d, s):
    taps = []
    for p, k0, M, t, e in lane_phases(K, d, s):
        for m in range(M):
            k = k0 + t * m
            assert (k * d) % s == p and (k * d - p) // s == (k0 * d - p) // s + m * e
            taps.append(k)
    assert sorted(taps) == list(range(K))


# KernelBench 76's form: a 1-D convolution of stride 3 and dilation 4 (a bias broadcast).
STRIDED = """
#b = affine_map<(d0, d1, d2) -> (d1)>
#y = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
func.func @main(%x: tensor<2x3x40xf32>, %w: tensor<5x3x3xf32>, %bias: tensor<5xf32>) -> tensor<2x5x11xf32> {
  %e = tensor.empty() : tensor<2x5x11xf32>
  %y = linalg.generic {indexing_maps = [#b, #y], iterator_types = ["parallel", "parallel", "parallel"]}
         ins(%bias : tensor<5xf32>) outs(%e : tensor<2x5x11xf32>) {
  ^bb0(%in: f32, %out: f32):
    linalg.yield %in : f32
  } -> tensor<2x5x11xf32>
  %r = linalg.conv_1d_ncw_fcw {dilations = dense<4> : vector<1xi64>, strides = dense<3> : vector<1xi64>}
         ins(%x, %w : tensor<2x3x40xf32>, tensor<5x3x3xf32>) outs(%y : tensor<2x5x11xf32>) -> tensor<2x5x11xf32>
  return %r : tensor<2x5x11xf32>
}
"""


def test_phases_read_a_deinterleaved_image():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 3, 40, generator=g), torch.randn(5, 3, 3, generator=g),
            torch.randn(5, generator=g)]
    want = torch.nn.functional.conv1d(args[0], args[1], args[2], stride=3, dilation=4)
    payload = parse(STRIDED)

    def body(root):
        split_strided_convolution(match(root, "linalg.conv_1d_ncw_fcw"))
        canonicalize(match(root, "func.func"))

    apply(payload, body)
    # x padded to 42 = 3 x 14, deinterleaved to [2, 3, 3, 14]; tap k reads phase 4k mod 3 = k
    # at offset 4k div 3 = k: three phases of one tap, accumulating in turn
    check(payload, """
        CHECK: %[[PAD:.*]] = tensor.pad %arg0 low[0, 0, 0] high[0, 0, 2]
        CHECK: %[[S:.*]] = linalg.generic {{.*}} ins(%[[PAD]] : tensor<2x3x42xf32>) outs(%{{.*}} : tensor<2x3x3x14xf32>)
        CHECK: %[[X0:.*]] = tensor.extract_slice %[[S]][0, 0, 0, 0] [2, 3, 1, 11] [1, 1, 1, 1] : tensor<2x3x3x14xf32> to tensor<2x3x11xf32>
        CHECK: %[[Y0:.*]] = linalg.generic {{.*}} ins(%[[X0]], %{{.*}} : tensor<2x3x11xf32>, tensor<5x3x1xf32>)
        CHECK: %[[X1:.*]] = tensor.extract_slice %[[S]][0, 0, 1, 1] [2, 3, 1, 11]
        CHECK: %[[Y1:.*]] = linalg.generic {{.*}} ins(%[[X1]], %{{.*}} : tensor<2x3x11xf32>, tensor<5x3x1xf32>) outs(%[[Y0]] : tensor<2x5x11xf32>)
        CHECK: %[[X2:.*]] = tensor.extract_slice %[[S]][0, 0, 2, 2] [2, 3, 1, 11]
        CHECK: %[[Y2:.*]] = linalg.generic {{.*}} outs(%[[Y1]] : tensor<2x5x11xf32>)
        CHECK: return %[[Y2]]
    """)
    (got,) = run_module(payload, args, family="convolution")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rejects_unit_stride_lanes():
    payload = parse("""
        func.func @main(%x: tensor<1x3x9x9xf32>, %w: tensor<4x3x3x3xf32>, %y: tensor<1x4x4x7xf32>) -> tensor<1x4x4x7xf32> {
          %r = linalg.conv_2d_nchw_fchw {dilations = dense<1> : vector<2xi64>, strides = dense<[2, 1]> : vector<2xi64>}
                 ins(%x, %w : tensor<1x3x9x9xf32>, tensor<4x3x3x3xf32>) outs(%y : tensor<1x4x4x7xf32>) -> tensor<1x4x4x7xf32>
          return %r : tensor<1x4x4x7xf32>
        }""")
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: split_strided_convolution(match(root, "linalg.conv_2d_nchw_fchw")))
    assert "transform_ext.split_strided_convolution: linalg.conv_2d_nchw_fchw" in message
    assert "its innermost image dim has stride 1" in message
    assert str(payload) == before
