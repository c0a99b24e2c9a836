"""Grouped convolutions of one image dim (SwinMLP's spatial MLP: a grouped 1x1 `Conv1d`),
which torch-mlir lowers over [N, C, L, 1] with a unit innermost dim: imported over
[N, C, 1, L] instead (lighthouse.conv_decompositions), their lanes along L. Numerics
against torch (1x1 and wider windows, strided, padded, dilated, depthwise, a grouped 1x1
`Conv2d` over a narrow image merged to one dim, bf16, a transposed-view input and a second
use, the joint backward graph) and the IR."""

import pytest

from lighthouse.compile import compile_kernel
from tests.schedules.test_convolution import assert_matches, conv_kernel
from tests.transform_ext.helpers import check as filecheck

CASES = {
    # SwinMLP's spatial MLP, small: 3 heads of 7 x 7 window positions, 19 channels per head
    "pointwise": ("Conv1d(147, 147, 1, groups=3)", "4, 147, 19"),
    "pointwise_no_bias": ("Conv1d(12, 8, 1, groups=4, bias=False)", "2, 12, 37"),
    "window": ("Conv1d(6, 9, 3, groups=3)", "2, 6, 41"),
    "strided_padded_dilated": ("Conv1d(8, 8, 3, groups=2, stride=2, padding=2, dilation=2)",
                               "1, 8, 45"),
    "depthwise": ("Conv1d(8, 8, 5, groups=8, padding=2)", "2, 8, 33"),
    # a grouped 1x1 convolution over 7 x 5 images: merged to one dim of 35 lanes
    "pointwise_2d_narrow": ("Conv2d(12, 12, 1, groups=3)", "2, 12, 7, 5"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_one_dim_matches_torch(kernel_file, case):
    module, shape = CASES[case]
    assert_matches(compile_kernel(conv_kernel(kernel_file, module, shape)))


def test_bf16(kernel_file):
    module, shape = CASES["pointwise"]
    assert_matches(compile_kernel(conv_kernel(kernel_file, module, shape, dtype="bfloat16")))


def test_a_transposed_view_input_and_a_second_use(kernel_file):
    """The input a transposed view ([N, L, C] seen as [N, C, L]); the result returned and
    read again transposed."""
    path = conv_kernel(kernel_file, "Conv1d(12, 12, 1, groups=3)", None,
                       input="torch.randn(2, 21, 12, generator=g).transpose(1, 2)",
                       forward="(lambda y: (y, y.transpose(1, 2) + 1))(self.conv(x))")
    assert_matches(compile_kernel(path))


def test_backward(kernel_file):
    """The joint graph: the input and weight gradients are grouped convolutions of one
    image dim too."""
    path = conv_kernel(kernel_file, "Conv1d(12, 12, 3, groups=3, padding=1)", "2, 12, 23")
    compiled = compile_kernel(path, backward=True)
    for r in compiled.check():
        assert r.ok, str(r)


def test_float16_strided_padded_backward(kernel_file):
    """A fuzz finding: the weight gradient of this float16 depthwise-by-two Conv1d on one
    position (a grouped, strided, padded convolution of a 1 x 1 image) crashed torch's CPU
    kernel while the joint graph was traced; it is traced over f32 operands, and the
    gradients match torch."""
    path = conv_kernel(kernel_file, "Conv1d(16, 32, 4, stride=2, padding=3, dilation=2, groups=16, bias=False)",
                       None, dtype="float16", input="torch.randn(5, 16, 1, generator=g).to(DTYPE)[3:]")
    for r in compile_kernel(path, backward=True).check():
        assert r.ok, str(r)


def test_the_lanes_run_along_the_image(kernel_file):
    """Imported over [N, G, C, 1, L]: the register tile's lanes run along L (32 wide), its
    rows along the group's 49 output channels, not one lane of a unit dim."""
    path = conv_kernel(kernel_file, "Conv1d(147, 147, 1, groups=3)", "2, 147, 32")
    cleaned = str(compile_kernel(path, stop_after="cleanup").module)
    filecheck(cleaned, """
        CHECK: linalg.conv_2d_ngchw_gfchw
        CHECK-SAME: tensor<2x3x49x1x32xf32>, tensor<3x49x49x1x1xf32>
    """)
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: vector.contract {{.*}} : vector<7x1xf32>, vector<1x1x32xf32> into vector<7x1x32xf32>
    """)
    assert "x1x1xf32> into" not in vectorized
