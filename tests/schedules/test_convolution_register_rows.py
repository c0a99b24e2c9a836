"""The register tile's rows when the output channels (or a depthwise convolution's image
rows) are not a multiple of MR: a divisor of them from MR / 2 up (42 channels take 7 rows),
else MR with the last partial tile peeled into a tile of its own rows. A row mask built per
tile was scalarized (each accumulator rebuilt lane by lane per step: an EfficientNet MBConv
block, KernelBench level 3 problem 21, ran 0.37x torch)."""

import pytest

from lighthouse.compile import compile_kernel
from schedules.convolution import (ConvolutionParams, analyze_convolution, convolution_tiles,
                                   register_rows)
from tests.schedules.test_convolution import _parse, assert_matches, conv_kernel
from tests.transform_ext.helpers import check as filecheck


@pytest.mark.parametrize("extent, rows", [(42, 7), (12, 6), (64, 8), (300, 6), (20, 5),
                                          (13, 8), (22, 8), (5, 5), (8, 8), (1, 1)])
def test_register_rows_divide_the_extent_when_a_divisor_is_near_mr(extent, rows):
    assert register_rows(extent, 8) == rows


def _tiles(channels: int):
    payload = _parse(f"""
        func.func @main(%x: tensor<1x6x7x40xf32>, %w: tensor<{channels}x6x3x3xf32>, %y: tensor<1x{channels}x5x38xf32>) -> tensor<1x{channels}x5x38xf32> {{
          %r = linalg.conv_2d_nchw_fchw ins(%x, %w : tensor<1x6x7x40xf32>, tensor<{channels}x6x3x3xf32>) outs(%y : tensor<1x{channels}x5x38xf32>) -> tensor<1x{channels}x5x38xf32>
          return %r : tensor<1x{channels}x5x38xf32>
        }}""")
    op = next(o for o in payload.body.operations[0].regions[0].blocks[0].operations
              if o.operation.name.startswith("linalg.conv")).operation
    return convolution_tiles(analyze_convolution(op), ConvolutionParams(threads=2))


def test_tiles_peel_the_rows_only_without_a_divisor():
    divided, peeled = _tiles(42), _tiles(13)
    assert divided.register[1] == 7 and divided.peel_rows is None
    assert peeled.register[1] == 8 and peeled.peel_rows is not None
    assert peeled.peel is not None  # 38 lanes: 32 and a peeled 6 (in 16)


def test_a_partial_row_tile_is_a_tile_of_its_own_rows(kernel_file):
    """13 output channels x 40 lanes: tiles of 8 and 5 rows times 32 and 16 lanes, each a
    contraction of its own shape; no row is masked (only the lanes past the edge)."""
    path = conv_kernel(kernel_file, "Conv2d(6, 13, 3, padding=1)", "1, 6, 5, 40")
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: scf.forall
        CHECK: vector.contract {{.*}} into vector<8x1x32xf32>
        CHECK: vector.contract {{.*}} into vector<5x1x32xf32>
        CHECK: vector.contract {{.*}} into vector<8x1x16xf32>
        CHECK: vector.contract {{.*}} into vector<5x1x16xf32>
        CHECK: scf.forall.in_parallel
    """)
    assert "vector.create_mask" not in vectorized
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    assert "arith.select" not in bufferized  # a row mask chosen per tile
    filecheck(bufferized, """
        CHECK: scf.for {{.*}} -> (vector<5x1x32xf32>)
        CHECK-COUNT-5: vector.fma {{.*}} : vector<32xf32>
        CHECK: scf.yield
    """)


MBCONV = """
import torch
from torch import nn
DTYPE = torch.{dtype}

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        hidden = {hidden}
        self.block = nn.Sequential(
            nn.Conv2d(5, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 5, stride={stride}, padding=2, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, {out}, 1, bias=False), nn.BatchNorm2d({out}))
        for m in self.block:
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.data.uniform_(0.5, 1.5)
        self.to(DTYPE)

    def forward(self, x):
        return self.block(x)

def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 5, 19, 37, generator=g).to(DTYPE)]

def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("hidden, out, stride, dtype", [
    (30, 12, 2, "float32"),   # 6 rows x 5 and 6 x 2
    (13, 11, 2, "float32"),   # prime: 8 rows and a peeled 5; 8 and a peeled 3
    (22, 13, 1, "float32"),
    (42, 12, 2, "bfloat16"),
])
def test_mbconv_blocks_match_torch(kernel_file, hidden, out, stride, dtype):
    """An EfficientNet MBConv block in eval mode: a pointwise expansion, batch norm, ReLU6, a
    5 x 5 depthwise convolution (strided: its phases read the expansion's padded output),
    then a pointwise projection, at channel counts MR does not divide."""
    path = kernel_file(MBCONV.format(hidden=hidden, out=out, stride=stride, dtype=dtype))
    assert_matches(compile_kernel(path))


def test_a_second_use_of_the_expansion_and_a_transposed_result(kernel_file):
    """The expansion's output also read after the block (a residual of another shape path)
    and the result transposed: the peeled row tiles keep every element."""
    path = conv_kernel(kernel_file, "Conv2d(4, 13, 1, bias=False)", "1, 4, 9, 21",
                       extra="        self.dw = torch.nn.Conv2d(13, 13, 3, padding=1, groups=13)"
                             ".to(DTYPE)\n",
                       forward="(self.dw(torch.relu(self.conv(x))).transpose(2, 3), "
                               "self.conv(x).sum(dim=1))")
    assert_matches(compile_kernel(path))

