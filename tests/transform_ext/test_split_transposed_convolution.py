"""split_transposed_convolution: the phases (pure function against a brute force), IR
(FileCheck), numerics (the rewritten payload against the stuffed one, both run), rejections."""

import itertools

import pytest
import torch

from schedules.common import canonicalize, match
from transform_ext.split_transposed_convolution import phases_of_dim, split_transposed_convolution
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module


@pytest.mark.parametrize("O,K,d,s,off", [(10, 3, 1, 2, 1), (13, 5, 2, 3, 2), (9, 3, 2, 5, 3),
                                          (4, 4, 3, 2, 0), (3, 3, 1, 5, 2)])
def test_phases_cover_every_tap_that_reads_x(O, K, d, s, off):
    """Y[o] = sum_k Z[o + k d] W[k], Z[off + i s] = x[i]: each phase's taps and x rows are
    exactly the (k, i) pairs of nonzero terms."""
    expected = {(o, k, (o + k * d - off) // s) for o in range(O) for k in range(K)
                if (o + k * d - off) % s == 0}
    found = set()
    for ph in phases_of_dim(O, K, d, s, off):
        for j, m in itertools.product(range(ph.J), range(ph.M)):
            found.add((ph.q + s * j, ph.k0 + ph.t * m, ph.lo + j + m * ph.e))
        assert ph.hi == ph.lo + ph.J - 1 + (ph.M - 1) * ph.e or ph.M == 0
    assert found == expected


# A 2-D transposed convolution (stride (2, 3), dilation (1, 2)) as torch-mlir imports it:
# x [1, 2, 3, 4] stuffed into zeros [1, 2, 9, 14] at offset (2, 3), a bias broadcast.
STUFFED = """
#b = affine_map<(d0, d1, d2, d3) -> (d1)>
#y = affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>
func.func @main(%x: tensor<1x2x3x4xf32>, %w: tensor<3x2x3x2xf32>, %bias: tensor<3xf32>) -> tensor<1x3x7x12xf32> {
  %zero = arith.constant 0.0 : f32
  %ez = tensor.empty() : tensor<1x2x9x14xf32>
  %z0 = linalg.fill ins(%zero : f32) outs(%ez : tensor<1x2x9x14xf32>) -> tensor<1x2x9x14xf32>
  %z = tensor.insert_slice %x into %z0[0, 0, 2, 3] [1, 2, 3, 4] [1, 1, 2, 3] : tensor<1x2x3x4xf32> into tensor<1x2x9x14xf32>
  %ey = tensor.empty() : tensor<1x3x7x12xf32>
  %y0 = linalg.generic {indexing_maps = [#b, #y], iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
          ins(%bias : tensor<3xf32>) outs(%ey : tensor<1x3x7x12xf32>) {
  ^bb0(%in: f32, %out: f32):
    linalg.yield %in : f32
  } -> tensor<1x3x7x12xf32>
  %r = linalg.conv_2d_nchw_fchw {dilations = dense<[1, 2]> : vector<2xi64>, strides = dense<1> : vector<2xi64>}
         ins(%z, %w : tensor<1x2x9x14xf32>, tensor<3x2x3x2xf32>) outs(%y0 : tensor<1x3x7x12xf32>) -> tensor<1x3x7x12xf32>
  return %r : tensor<1x3x7x12xf32>
}
"""


def test_phases_match_the_stuffed_convolution():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(1, 2, 3, 4, generator=g), torch.randn(3, 2, 3, 2, generator=g),
            torch.randn(3, generator=g)]
    (want,) = run_module(parse(STUFFED), args)  # the stuffed convolution, generic schedule
    payload = parse(STUFFED)

    def body(root):
        split_transposed_convolution(match(root, "linalg.conv_2d_nchw_fchw"))
        canonicalize(match(root, "func.func"))

    apply(payload, body)
    check(payload, """
        CHECK-NOT: tensor.insert_slice %arg0
        CHECK: %[[BIAS:.*]] = linalg.generic {{.*}}ins(%arg2 : tensor<3xf32>) outs(%{{.*}} : tensor<1x3x7x12xf32>)
        CHECK: %[[DEST:.*]] = tensor.extract_slice %[[BIAS]][0, 0, 0, 0] [1, 3, 4, 4] [1, 1, 2, 3]
        CHECK: %[[INIT:.*]] = linalg.generic {{.*}}ins(%arg2 : tensor<3xf32>) outs(%[[DEST]] : tensor<1x3x4x4xf32>)
        CHECK: %[[ZEROS:.*]] = linalg.fill {{.*}} -> tensor<1x2x5x5xf32>
        CHECK: %[[X:.*]] = linalg.copy {{.*}}ins(%arg0 : tensor<1x2x3x4xf32>)
        CHECK: %[[UNION:.*]] = tensor.insert_slice %[[X]] into %[[ZEROS]][0, 0, 1, 1] [1, 2, 3, 4] [1, 1, 1, 1]
        CHECK: %[[IMAGE:.*]] = tensor.extract_slice %[[UNION]][0, 0, 0, 0] [1, 2, 5, 4] [1, 1, 1, 1]
        CHECK: %[[PHASE:.*]] = linalg.generic
        CHECK-SAME: ins(%[[IMAGE]], %{{.*}} : tensor<1x2x5x4xf32>, tensor<3x2x2x1xf32>) outs(%[[INIT]] : tensor<1x3x4x4xf32>)
        CHECK: tensor.insert_slice %[[PHASE]] into %{{.*}}[0, 0, 0, 0] [1, 3, 4, 4] [1, 1, 2, 3] : tensor<1x3x4x4xf32> into tensor<1x3x7x12xf32>
        CHECK-NOT: linalg.copy
        CHECK: tensor.extract_slice %[[UNION]][0, 0, 0, 1] [1, 2, 5, 4] [1, 1, 1, 1]
        CHECK-NOT: linalg.copy
        CHECK: linalg.generic {{.*}}ins(%[[X]], %{{.*}} : tensor<1x2x3x4xf32>, tensor<3x2x1x1xf32>)
    """)
    # 2 x 3 phases; along W the third has no taps (dilation 2 and stride 3: only its bias,
    # which the bias over all of Y wrote): four phases write their slices over it (and x
    # is inserted once into the zeros they read)
    text = str(payload)
    assert text.count("tensor.insert_slice") == 5 and text.count('"reduction"]') == 4
    (got,) = run_module(payload, args, family="convolution")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rejects_convolutions_over_other_images():
    payload = parse("""
        func.func @main(%x: tensor<1x2x9xf32>, %w: tensor<3x2x3xf32>, %y: tensor<1x3x4xf32>, %p: tensor<1x2x9xf32>) -> (tensor<1x3x4xf32>, tensor<1x3x7xf32>, tensor<1x3x7xf32>) {
          %strided = linalg.conv_1d_ncw_fcw {dilations = dense<1> : vector<1xi64>, strides = dense<2> : vector<1xi64>}
                 ins(%x, %w : tensor<1x2x9xf32>, tensor<3x2x3xf32>) outs(%y : tensor<1x3x4xf32>) -> tensor<1x3x4xf32>
          %e = tensor.empty() : tensor<1x3x7xf32>
          %plain = linalg.conv_1d_ncw_fcw {dilations = dense<1> : vector<1xi64>, strides = dense<1> : vector<1xi64>}
                 ins(%x, %w : tensor<1x2x9xf32>, tensor<3x2x3xf32>) outs(%e : tensor<1x3x7xf32>) -> tensor<1x3x7xf32>
          %small = tensor.extract_slice %x[0, 0, 0] [1, 2, 5] [1, 1, 1] : tensor<1x2x9xf32> to tensor<1x2x5xf32>
          %z = tensor.insert_slice %small into %p[0, 0, 0] [1, 2, 5] [1, 1, 2] : tensor<1x2x5xf32> into tensor<1x2x9xf32>
          %dirty = linalg.conv_1d_ncw_fcw {dilations = dense<1> : vector<1xi64>, strides = dense<1> : vector<1xi64>}
                 ins(%z, %w : tensor<1x2x9xf32>, tensor<3x2x3xf32>) outs(%e : tensor<1x3x7xf32>) -> tensor<1x3x7xf32>
          return %strided, %plain, %dirty : tensor<1x3x4xf32>, tensor<1x3x7xf32>, tensor<1x3x7xf32>
        }""")
    before = str(payload)
    for index, reason in [(0, "has strides [2]"), (1, "its image is not a tensor.insert_slice"),
                          (2, "writes into a tensor that is not zero")]:
        def body(root, index=index):
            from torch_mlir.dialects import transform
            from schedules.common import any_op
            convs = transform.SplitHandleOp([any_op()] * 3, match(root, "linalg.conv_1d_ncw_fcw")).results
            split_transposed_convolution(convs[index])
        message = apply_expect_failure(payload, body)
        assert "transform_ext.split_transposed_convolution: linalg.conv_1d_ncw_fcw" in message
        assert reason in message, message
    assert str(payload) == before
