"""Pooling with the generic schedule: lanes along the outputs of a row, the window taps in
loops inside, each tap one shifted vector load (the 2-D pooling op decomposed to 1-D per
tile); compared with torch at odd sizes, strides, dilations, paddings, ceil mode, bf16."""

import pytest

from lighthouse.compile import compile_kernel
from tests.transform_ext.helpers import check

KERNEL = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, x):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({shape}, generator=g){cast}]
def get_init_inputs():
    return []
"""

POOLS = {
    # KernelBench 41's window (8 taps, dilation 3, padding 4) on a row of 131 outputs
    "max_1d_dilated": ("F.max_pool1d(x, 8, 1, 4, 3)", "2, 3, 150", ""),
    "max_1d_strided_ceil": ("F.max_pool1d(x, 3, 2, ceil_mode=True)", "2, 5, 40", ""),
    "avg_1d_padded": ("F.avg_pool1d(x, 4, 1, 2)", "3, 2, 97", ""),
    "max_2d_dilated": ("F.max_pool2d(x, 3, 1, 1, 2)", "2, 3, 11, 75", ""),
    "avg_2d_strided": ("F.avg_pool2d(x, 3, 2, 1, count_include_pad=False)", "2, 3, 13, 70", ""),
    "max_2d_bf16": ("F.max_pool2d(x, 2)", "2, 2, 8, 66", ".to(torch.bfloat16)"),
    "max_2d_one_output": ("F.max_pool2d(x, 5)", "1, 2, 5, 5", ""),
    # strided windows: each tap one contiguous load and a shuffle of every s-th lane
    "max_1d_stride3_padded": ("F.max_pool1d(x, 4, 3, 1)", "2, 3, 71", ""),
    "avg_2d_window_is_stride": ("F.avg_pool2d(x, 7)", "2, 2, 23, 59", ""),
    # 3-D pooling (a linalg.generic with the window in its maps), strided and dilated
    "max_3d_strided_dilated": ("F.max_pool3d(x, 3, 2, 1, 3)", "2, 3, 9, 20, 21", ""),
    "avg_3d_strided": ("F.avg_pool3d(x, 3, 2, 1)", "2, 3, 7, 9, 20", ""),
    "max_3d_bf16": ("F.max_pool3d(x, 2, 1)", "1, 2, 5, 6, 35", ".to(torch.bfloat16)"),
    # f16/bf16 poolings accumulate in f32 as named poolings (a generalized one with its
    # strided window map does not vectorize); a stride-16 window reads one-lane bf16 taps
    "max_1d_f16_strided": ("F.max_pool1d(x, 16, 16)", "3, 10, 130", ".half()"),
    "max_1d_bf16_strided": ("F.max_pool1d(x, 16, 16)", "3, 10, 130", ".to(torch.bfloat16)"),
    "avg_1d_bf16": ("F.avg_pool1d(x, 4, 3)", "2, 16, 67", ".to(torch.bfloat16)"),
    "avg_2d_f16_padded": ("F.avg_pool2d(x, 3, 2, 1, count_include_pad=False)", "2, 3, 13, 35",
                          ".half()"),
    # stride-1 max windows, doubled (transform_ext.sliding_window_extrema): rows long
    # enough for a loop of chunks inside the input, both edges padded, windows of 2, of a
    # power of two and not, a min through negation, a window along W of a 2-D pooling
    "max_1d_long_rows": ("F.max_pool1d(x, 7, 1, 3, 2)", "2, 3, 601", ""),
    "max_1d_window_2": ("F.max_pool1d(x, 2, 1, 1)", "2, 2, 300", ""),
    "max_1d_power_of_two": ("F.max_pool1d(x, 16, 1, 8)", "1, 3, 410", ""),
    "min_1d_by_negation": ("-F.max_pool1d(-x, 5, 1, 2, 4)", "2, 2, 333", ""),
    "max_2d_row_window": ("F.max_pool2d(x, (1, 6), 1, (0, 3), (1, 2))", "1, 2, 3, 270", ""),
    "max_1d_f16_long": ("F.max_pool1d(x, 8, 1, 4, 3)", "2, 3, 500", ".half()"),
    "max_1d_bf16_odd": ("F.max_pool1d(x, 12, 1, 5, 2)", "2, 2, 420", ".to(torch.bfloat16)"),
    # windows of 2 or 3 dims separated (transform_ext.separate_pooling_windows): whole
    # rows pooled over the outer windows, then the innermost window on them; rows and
    # columns past the last window, padding without counting it, ceil mode, a stride-1
    # max doubled after separation, f16/bf16 widened once, a min through negation
    "avg_2d_window_11_odd": ("F.avg_pool2d(x, 11)", "2, 3, 60, 59", ""),
    "avg_2d_separated_padded": ("F.avg_pool2d(x, 5, 3, 2, count_include_pad=False)", "2, 3, 31, 40", ""),
    "max_2d_separated_ceil": ("F.max_pool2d(x, 4, 3, ceil_mode=True)", "2, 3, 20, 41", ""),
    "max_2d_separated_stride_1": ("F.max_pool2d(x, 4, 1, 1)", "2, 2, 17, 150", ""),
    "max_3d_separated_f16": ("F.max_pool3d(x, 3, 2, 1, 2)", "1, 2, 9, 11, 37", ".half()"),
    "max_3d_separated_bf16": ("F.max_pool3d(x, (2, 3, 4), (2, 3, 4))", "1, 3, 9, 10, 35",
                              ".to(torch.bfloat16)"),
    "min_2d_separated": ("-F.max_pool2d(-x, (4, 5), 1, (2, 1))", "2, 2, 13, 150", ""),
    "avg_2d_separated_second_use": ("(lambda p: (p, p.amax(-1)))(F.avg_pool2d(x, 6))", "2, 3, 25, 37", ""),
    "avg_2d_separated_transposed": ("F.avg_pool2d(x.transpose(2, 3), 4, 2)", "2, 3, 40, 21", ""),
    # one window along padded H and W (a fuzz case: unit dims folded to a plain dim of 12
    # on an input of 20 were an invalid op, and the schedule fell back to loops)
    "min_3d_one_window_in_padded_dims": ("-F.max_pool3d(-x, (8, 12, 5), (4, 10, 3), (4, 4, 0), (3, 1, 1))",
                                         "1, 4, 35, 12, 5", ""),
    # a second use of the pooled tensor, and a transposed view as input
    "max_1d_second_use": ("(lambda p: (p, p.sum(-1)))(F.max_pool1d(x, 3, 1))", "2, 4, 70", ""),
    "max_1d_transposed": ("F.max_pool1d(x.transpose(1, 2), 3, 1)", "2, 70, 4", ""),
}


def _compile(kernel_file, expr, shape, cast="", **kw):
    source = KERNEL.format(expr=expr, shape=shape, cast=cast)
    return compile_kernel(kernel_file(source), schedule="generic", strict=True, **kw)


@pytest.mark.parametrize("name", POOLS)
def test_pooling_matches_torch(kernel_file, name):
    compiled = _compile(kernel_file, *POOLS[name])
    reports = compiled.check()
    assert reports
    for report in reports:
        assert report.ok, str(report)


def test_each_window_tap_is_a_vector_load_of_the_outputs_lanes(kernel_file):
    compiled = _compile(kernel_file, "F.avg_pool1d(x, 8, 1, 4)", "2, 3, 150",
                        stop_after="vectorize")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main
        CHECK: scf.for %[[TAP:.*]] = %c0 to %c8 step %c1
        CHECK: %[[AT:.*]] = affine.apply {{.*}}(%{{.*}}, %[[TAP]])
        CHECK: %[[X:.*]] = vector.transfer_read %{{.*}}[%{{.*}}, %{{.*}}, %c0, %[[AT]]]{{.*}} vector<1x1x{{[0-9]+}}xf32>
        CHECK: arith.addf %[[X]], %{{.*}} : vector<1x1x{{[0-9]+}}xf32>
    """)
    assert "linalg.pooling" not in text


def test_a_stride_1_max_window_is_doubled_on_the_unpadded_input(kernel_file):
    """KernelBench 41's window (8 taps, dilation 3, padding 4) on rows of 150: 137 outputs,
    a chunk of 128 (window_lanes on the tests' 512-bit CPU) and one of 9, each the max of
    maxima over 1, 2 and 4 taps; the padding is spliced into the rows read from x."""
    compiled = _compile(kernel_file, "F.max_pool1d(x, 8, 1, 4, 3)", "2, 3, 150",
                        stop_after="vectorize")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main(%[[X:.*]]: tensor<2x3x150xf32>)
        CHECK: vector.transfer_read {{.*}} vector<1x1x1x145xf32>
        CHECK: vector.insert_strided_slice %{{.*}}, %{{.*}} {offsets = [4], strides = [1]} : vector<145xf32> into vector<149xf32>
        CHECK: vector.extract_strided_slice %{{.*}} {offsets = [3], sizes = [146], strides = [1]}
        CHECK: arith.maximumf {{.*}} : vector<146xf32>
        CHECK: vector.extract_strided_slice %{{.*}} {offsets = [6], sizes = [140], strides = [1]}
        CHECK: arith.maximumf {{.*}} : vector<140xf32>
        CHECK: vector.extract_strided_slice %{{.*}} {offsets = [12], sizes = [128], strides = [1]}
        CHECK: arith.maximumf {{.*}} : vector<128xf32>
        CHECK: vector.transfer_write {{.*}} vector<1x1x1x128xf32>
        CHECK: vector.transfer_read {{.*}} vector<1x1x1x26xf32>
        CHECK: arith.maximumf {{.*}} : vector<9xf32>
        CHECK: vector.transfer_write {{.*}} vector<1x1x1x9xf32>
    """)
    for gone in ("linalg.pooling", "tensor.pad", "linalg.fill"):
        assert gone not in text


def test_a_strided_tap_is_one_load_and_a_shuffle(kernel_file):
    compiled = _compile(kernel_file, "F.max_pool1d(x, 3, 2)", "2, 3, 150", stop_after="vectorize")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main
        CHECK: scf.for %[[TAP:.*]] = %c0 to %c3 step %c1
        CHECK: %[[X:.*]] = vector.transfer_read {{.*}} vector<1x1x[[SPAN:[0-9]+]]xf32>
        CHECK: %[[ROW:.*]] = vector.shape_cast %[[X]] : vector<1x1x[[SPAN]]xf32> to vector<[[SPAN]]xf32>
        CHECK: %[[LANES:.*]] = vector.shuffle %[[ROW]], %{{.*}} [0, 2, 4, 6,
        CHECK: arith.maximumf %{{.*}}, %[[LANES]]
    """)
    assert "vector<1xf32>" not in text


def test_a_3d_pooling_tap_is_vector_code(kernel_file):
    compiled = _compile(kernel_file, "F.max_pool3d(x, 3, 2, 1, 3)", "2, 3, 9, 20, 40",
                        stop_after="vectorize")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main
        CHECK: vector.transfer_read {{.*}} vector<1x1x1x1x{{[0-9]+}}xf32>
        CHECK: vector.shuffle
        CHECK: arith.maximumf {{.*}} : vector<{{[0-9]+}}xf32>
    """)
    assert "linalg.generic" not in text


def test_a_window_of_stride_11_pools_whole_rows_then_strided_lanes(kernel_file):
    """KernelBench 45's 11 x 11 windows of stride 11: the 11 taps down the columns read whole
    rows of the 55 columns the windows cover (accumulated in registers), then 11 taps of
    every 11th lane of that sum; no tap reads a strided lane of x."""
    compiled = _compile(kernel_file, "F.avg_pool2d(x, 11)", "2, 3, 60, 59", stop_after="vectorize")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main
        CHECK: scf.for %{{.*}} = %c0 to %c11 step %c1 iter_args(%[[COLS:.*]] = %{{.*}}) -> (vector<1x1x1x55xf32>)
        CHECK: vector.transfer_read %arg0{{.*}} : tensor<2x3x60x59xf32>, vector<1x1x1x55xf32>
        CHECK: arith.addf %{{.*}}, %{{.*}} : vector<55xf32>
        CHECK: scf.for %{{.*}} = %c0 to %c11 step %c1 iter_args(%{{.*}}) -> (vector<1x1x1x5xf32>)
        CHECK: vector.transfer_read {{.*}} : tensor<{{.*}}x55xf32>, vector<1x1x1x45xf32>
        CHECK: vector.shuffle %{{.*}}, %{{.*}} [0, 11, 22, 33, 44] : vector<45xf32>, vector<45xf32>
        CHECK: arith.addf %{{.*}}, %{{.*}} : vector<5xf32>
    """)
    assert "linalg.pooling" not in text and "linalg.generic" not in text


def test_narrow_pooling_stays_a_named_pooling_accumulating_in_f32(kernel_file):
    compiled = _compile(kernel_file, "F.max_pool1d(x, 16, 16)", "3, 10, 130", ".half()",
                        stop_after="cleanup")
    check(str(compiled.module), """
        CHECK-LABEL: func.func @main
        CHECK: %[[INIT:.*]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<3x10x1x8xf32>)
        CHECK: arith.extf %{{.*}} : f16 to f32
        CHECK: %[[POOL:.*]] = linalg.pooling_nchw_max {{.*}} ins(%{{.*}}, %{{.*}} : tensor<3x10x1x130xf16>, tensor<1x16xf16>) outs(%[[INIT]] : tensor<3x10x1x8xf32>)
        CHECK: linalg.generic {{.*}} ins(%[[POOL]] : tensor<3x10x1x8xf32>)
        CHECK: arith.truncf %{{.*}} : f32 to f16
    """)


SPECIALS = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, x):
        return {expr}
def get_inputs():
    x = torch.randn(2, 3, 150, generator=torch.Generator().manual_seed(0))
    x[0, 0, 10:30] = -0.0
    x[0, 0, 20:40:2] = 0.0
    x[0, 1, 50] = float("nan")
    x[0, 1, 100:] = float("-inf")
    x[1, 2, 7] = float("inf")
    return [x]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("expr", ["F.max_pool1d(x, 8, 1, 4, 3)", "F.relu(F.max_pool1d(x, 3, 1, 1))",
                                  "F.max_pool1d(x, 3, 1, 1) - x.amax(-1, keepdim=True)",
                                  "F.max_pool2d(x.unsqueeze(0), 3, 1, 1, 2).squeeze(0)",
                                  "F.max_pool2d(x.unsqueeze(0), (4, 5), (1, 2), (1, 2)).squeeze(0)",
                                  "F.max_pool1d(torch.cat([x, x.flip(-1), x, x], -1), 5, 1, 2, 2)"])
def test_window_maxima_without_zero_order_match_torch(kernel_file, expr):
    """Signed zeros, NaN (propagated through every window holding it), infinities and
    windows of -inf alone, padded: the same values as torch's."""
    compiled = compile_kernel(kernel_file(SPECIALS.format(expr=expr)), schedule="generic",
                              strict=True)
    for report in compiled.check():
        assert report.ok, str(report)
    got, want = compiled.run()[0], compiled.expected()[0]
    assert got.isnan().equal(want.isnan()) and got.isnan().any()


def test_maxima_drop_the_zero_order(kernel_file):
    """The maxima of the doubled windows carry nsz: three x86 instructions per vector, not
    five."""
    expr = "F.max_pool1d(x, 3, 1, 1) - x.amax(-1, keepdim=True)"
    compiled = compile_kernel(kernel_file(SPECIALS.format(expr=expr)), schedule="generic",
                              strict=True, stop_after="vectorize")
    text = str(compiled.module)
    check(text, """
        CHECK:     arith.maximumf %{{.*}}, %{{.*}} fastmath<nsz> : vector<129xf32>
        CHECK:     arith.maximumf %{{.*}}, %{{.*}} fastmath<nsz> : vector<128xf32>
        CHECK:     arith.maximumf %{{.*}}, %{{.*}} fastmath<nsz> : vector<23xf32>
        CHECK:     arith.maximumf %{{.*}}, %{{.*}} fastmath<nsz> : vector<22xf32>
    """)
    maxima = [line for line in text.splitlines() if "arith.maximumf" in line]
    assert maxima and all("fastmath<nsz>" in line for line in maxima)
    maxima = [line for line in text.splitlines() if "arith.maximumf" in line]
    assert len(maxima) >= 2 and all("fastmath<nsz>" in line for line in maxima)
