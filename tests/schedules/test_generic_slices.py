"""Kernels whose import holds tensor.insert_slice ops (transposed convolutions: the
zero-stuffed, padded input; padded convolutions and pooling; torch.cat, slice_scatter),
compiled with the generic schedule and compared with torch. Before the insert_slices were
tiled, a strided one was vectorized as a contiguous write (wrong answers: KernelBench 79 and
81, strided slice_scatter) and a large one as a single vector as large as its source (LLVM
IR of megabytes)."""

import re

import pytest

from lighthouse.compile import compile_kernel

KERNEL = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = {layer}
    def forward(self, x):
        return self.layer(x)
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({shape}, generator=g)]
def get_init_inputs():
    return []
"""

LAYERS = {
    # KernelBench 79's smallest failing case, then its neighbours
    "transposed_1d_stride2": ("torch.nn.ConvTranspose1d(4, 4, 3, stride=2, bias=False)", "1, 4, 16"),
    "transposed_1d_kb79": ("torch.nn.ConvTranspose1d(5, 6, 3, stride=2, padding=1, dilation=2)",
                           "2, 5, 19"),
    "transposed_2d_kb81": ("torch.nn.ConvTranspose2d(4, 6, 3, stride=5, padding=1, dilation=2, "
                           "bias=False)", "2, 4, 5, 7"),
    "transposed_2d_asym_groups": ("torch.nn.ConvTranspose2d(8, 4, (3, 5), stride=(2, 3), "
                                  "padding=(1, 2), dilation=(2, 1), groups=4)", "1, 8, 6, 9"),
    "transposed_3d_output_padding": ("torch.nn.ConvTranspose3d(4, 4, (3, 3, 2), stride=2, "
                                     "padding=1, output_padding=1, groups=2)", "1, 4, 3, 5, 4"),
    "transposed_2d_stride1_padded": ("torch.nn.ConvTranspose2d(3, 5, 3, padding=1)", "2, 3, 9, 11"),
    "padded_conv_2d": ("torch.nn.Conv2d(3, 4, 3, padding=2, dilation=2)", "2, 3, 13, 10"),
    "padded_max_pool_2d": ("torch.nn.MaxPool2d(3, stride=2, padding=1)", "2, 3, 13, 10"),
    "padded_avg_pool_1d": ("torch.nn.AvgPool1d(4, stride=1, padding=2)", "2, 3, 37"),
}


def _compile(kernel_file, layer, shape, **kw):
    return compile_kernel(kernel_file(KERNEL.format(layer=layer, shape=shape)), **kw)


@pytest.mark.parametrize("name", LAYERS)
def test_matches_torch(kernel_file, name):
    """The generic schedule, chosen by name (the convolution family takes the convolutions
    by default; tests/schedules/test_convolution.py checks it on these shapes' kinds)."""
    layer, shape = LAYERS[name]
    compiled = _compile(kernel_file, layer, shape, schedule="generic")
    assert compiled.family.name == "generic"
    for report in compiled.check():
        assert report.ok, str(report)


@pytest.mark.parametrize("name", ["transposed_1d_kb79", "transposed_2d_kb81", "padded_conv_2d"])
def test_the_default_family_matches_torch(kernel_file, name):
    layer, shape = LAYERS[name]
    compiled = _compile(kernel_file, layer, shape)
    assert compiled.family.name == "convolution"
    for report in compiled.check():
        assert report.ok, str(report)


TWO_INPUTS = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, y):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({x}, generator=g), torch.randn({y}, generator=g)]
def get_init_inputs():
    return []
"""

INSERTS = {
    # strided writes into a copy of y (slice_scatter is x[:, 1::3] = ... functionalized)
    "slice_scatter_inner_step": ("torch.slice_scatter(y, x, dim=1, start=1, step=3)", "6, 100", "6, 300"),
    "slice_scatter_outer_step": ("torch.slice_scatter(y, x, dim=0, start=0, step=2) * 2",
                                 "3, 70", "6, 70"),
    "select_scatter_middle": ("torch.select_scatter(y, x, 1, 3)", "6, 70", "6, 5, 70"),
    "select_scatter_last": ("torch.select_scatter(y, x, 2, 3).transpose(0, 2)", "6, 70", "6, 70, 5"),
    "cat": ("torch.cat((x, 2 * y, x[:, ::3]), dim=1), torch.cat((y, x[:5]), dim=0)", "7, 300", "7, 300"),
    "cat_of_bools": ("torch.cat((x > 0, y > 0), 1)", "5, 300", "5, 7"),
    "pad_then_use": ("torch.nn.functional.pad(x, (3, 2, 1, 0)) * y", "40, 300", "41, 305"),
}


@pytest.mark.parametrize("name", INSERTS)
def test_inserts_match_torch(kernel_file, name):
    expr, x, y = INSERTS[name]
    for report in compile_kernel(kernel_file(TWO_INPUTS.format(expr=expr, x=x, y=y))).check():
        assert report.ok, str(report)


@pytest.mark.parametrize("layer", ["torch.nn.ConvTranspose2d(8, 8, 3)",
                                   "torch.nn.ConvTranspose2d(8, 8, 3, stride=2, padding=1)"])
def test_padding_stays_in_vector_tiles(kernel_file, layer):
    """The input of a [1, 8, 128, 128] transposed convolution is inserted into a zero
    padded (and, with a stride, zero-stuffed) buffer outside the threads' tiles; it is copied
    in vector tiles, not as one vector<8x128x128xf32> (which made LLVM IR of megabytes): the
    largest vector of the vectorized IR holds a register tile at most."""
    compiled = _compile(kernel_file, layer, "1, 8, 128, 128", stop_after="vectorize")
    text = str(compiled.module)
    largest = max(_elements(shape) for shape in re.findall(r"vector<([0-9x]+)x[a-z]+[0-9]*>", text))
    assert largest <= 8 * 32, largest


def _elements(shape: str) -> int:
    n = 1
    for d in shape.split("x"):
        n *= int(d)
    return n
