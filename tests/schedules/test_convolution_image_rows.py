"""Image rows padded against L1 set conflicts (schedules.convolution.image_row_padding,
transform_ext.pad_image_rows): when the rows one register tile reads (its input channels
and window rows) lie a multiple of 4 KiB apart, they share a few L1 sets and are re-read
from L2 by every register tile; where the tile does few multiply-adds per line (each stride
phase of a strided, dilated Conv1d: KernelBench 76) the schedule copies the image into
longer rows. Planned for an AVX2 CPU with 32 KiB of L1 (8 ways of 64 sets); the IR and the
numerics against torch, and the layouts left alone."""

import pytest

from lighthouse.compile import compile_kernel
from lighthouse.targets.description import host_cpu, with_overrides
from schedules.convolution import (ConvolutionParams, convolution_tiles, find_convolutions,
                                   image_row_padding)
from tests.schedules.test_convolution import assert_matches, conv_kernel
from tests.transform_ext.helpers import check as filecheck

AVX2 = {"cpu": with_overrides(host_cpu(), "vector_bits=256,vector_registers=16,l1d=32K,l2=512K")}
STRIDED = "Conv1d(64, 64, 3, stride=3, dilation=4, bias=False)"


def _compile(path, **options):
    return compile_kernel(path, target_options=AVX2, **options)


def _fused(path) -> str:
    return str(_compile(path, stop_after="fuse").module)


def test_strided_phases_are_copied_into_longer_rows(kernel_file):
    """Length 1023: three phases of 341 positions, each channel's phases 1023 f32 (4092
    bytes) after the last; the 64 channel rows of a phase's register tile fill two sets.
    Each phase's 339 read positions copied into rows one line longer."""
    path = conv_kernel(kernel_file, STRIDED, "2, 64, 1023")
    filecheck(_fused(path), """
        CHECK-COUNT-3: tensor.insert_slice {{.*}} [2, 64, 339] [1, 1, 1] : tensor<2x64x339xf32> into tensor<2x64x355xf32>
    """)
    assert_matches(_compile(path))


@pytest.mark.parametrize("length", [1100, 601])
def test_phases_that_spread_are_left(kernel_file, length):
    path = conv_kernel(kernel_file, STRIDED, f"2, 64, {length}")
    positions = (length - 9) // 3 + 1
    fused = _fused(path)
    assert f"tensor<2x64x{positions}xf32>" in fused
    assert f"into tensor<2x64x{positions + 16}xf32>" not in fused
    assert_matches(_compile(path))


def test_a_register_tile_with_many_products_per_line_is_left(kernel_file):
    """Stride 1, rows 4 KiB apart: conflicting, but each line feeds 3 taps x 4 rows x 2
    vectors per channel (12 multiply-adds a line), which L2 keeps up with."""
    path = conv_kernel(kernel_file, "Conv1d(64, 64, 3)", "2, 64, 1024")
    assert "tensor<2x64x1040xf32>" not in _fused(path)


def test_rows_past_l1_are_left(kernel_file):
    """A 4 KiB plane per channel, but a register tile reading more lines than L1 holds
    (channel blocks bound that in the schedule; one block of all 512 channels here): not
    a set conflict, no padding."""
    params = ConvolutionParams(register=(4, 16), tile_rows=64, threads=1,
                               block_bytes=1 << 30, l1_bytes=32 << 10)
    payload = compile_kernel(conv_kernel(kernel_file, "Conv2d(512, 8, 1, stride=(1, 3))",
                                         "1, 512, 32, 32"), stop_after="cleanup").module
    with payload.context:
        (c,) = find_convolutions(payload)
        assert image_row_padding(c, convolution_tiles(c, params), params) == 0


def test_bf16_rows_are_padded_by_a_line_of_bf16(kernel_file):
    """Rows of 2047 bf16 (4094 bytes) per channel: the 680 positions of each phase copied
    into rows of 712 (a line of 32 bf16 more)."""
    path = conv_kernel(kernel_file, STRIDED, "2, 64, 2047", dtype="bfloat16")
    filecheck(_fused(path), """
        CHECK-COUNT-3: tensor.insert_slice {{.*}} : tensor<2x64x680xbf16> into tensor<2x64x712xbf16>
    """)
    assert_matches(_compile(path))


def test_a_transposed_view_input_and_a_second_use(kernel_file):
    path = conv_kernel(kernel_file, STRIDED, None,
                       input="torch.randn(2, 1023, 64, generator=g).transpose(1, 2)",
                       forward="(lambda y: (y, y.transpose(1, 2) * 2))(self.conv(x))")
    assert "into tensor<2x64x355xf32>" in _fused(path)
    assert_matches(_compile(path))
