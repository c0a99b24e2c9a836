"""The convolution family with the output channels as the register tile's lanes (a narrow
innermost image dim: KernelBench 58, 68): numerics against torch (3-D transposed, padded,
strided, dilated, 1-D, two vectors of channels, a partial last row tile, f16 and bf16, a
transposed-view input, a second use of the result), the lane choice and its refusals, and
the IR it produces."""

import pytest

from lighthouse.compile import compile_kernel
from lighthouse.families import CONVOLUTION
from schedules.convolution import (ConvolutionParams, analyze_convolution, channel_lane_tile,
                                   convolution_tiles, find_convolutions, wants_channel_lanes)
from tests.schedules.test_convolution import _parse, assert_matches, conv_kernel
from tests.transform_ext.helpers import check as filecheck

CASES = {
    # stride 1 transposed (KernelBench 58, 68): 20 output lanes, 16 channels
    "transposed_3d": ("ConvTranspose3d(8, 16, (3, 3, 5), padding=(0, 1, 1), bias=False)",
                      "1, 8, 3, 4, 18"),
    # padded with a bias (the accumulator's start transposed too); 18 output lanes
    "conv3d_bias": ("Conv3d(6, 16, 3, padding=1)", "2, 6, 4, 5, 18"),
    # two vectors of channels, dilated and padded; 20 lanes
    "conv2d_32_channels": ("Conv2d(9, 32, (3, 5), dilation=(2, 1), padding=(2, 2))", "1, 9, 7, 20"),
    # 37 output lanes (prime): row tiles of 16, 16 and 5
    "conv1d_partial_rows": ("Conv1d(40, 16, 5)", "2, 40, 41"),
    # a stride along an outer dim
    "conv2d_strided_rows": ("Conv2d(16, 16, 3, stride=(2, 1), bias=False)", "1, 16, 9, 22"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_channel_lanes_match_torch(kernel_file, case):
    module, shape = CASES[case]
    path = conv_kernel(kernel_file, module, shape)
    assert_matches(compile_kernel(path))
    # the filter transposed: the channels are the lanes
    assert "linalg.transpose" in str(compile_kernel(path, stop_after="fuse").module)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["transposed_3d", "conv3d_bias"])
def test_half_channel_lanes_accumulate_in_f32(kernel_file, dtype, case):
    module, shape = CASES[case]
    assert_matches(compile_kernel(conv_kernel(kernel_file, module, shape, dtype=dtype)))


def test_a_transposed_view_input_and_a_second_use(kernel_file):
    """H and W swapped by a view (7 output lanes); the result returned and read again
    transposed."""
    path = conv_kernel(kernel_file, "Conv2d(16, 16, 3)", None,
                       input="torch.randn(1, 16, 22, 9, generator=g).transpose(2, 3)",
                       forward="(lambda y: (y, y.transpose(-1, -2) * 2))(self.conv(x))")
    assert_matches(compile_kernel(path))


def test_backward_weight_gradient(kernel_file):
    """The weight gradient of a 3 x 3 convolution is a convolution with a 3 x 3 output and
    a window of the image's size (lighthouse.conv_decompositions): 3 rows of 32 channel
    lanes; the input gradient, 20 lanes wide, takes its 16 channels as lanes too (two
    convolutions rewritten in one step: their places were read before either rewrite)."""
    path = conv_kernel(kernel_file, "Conv2d(16, 32, 3, padding=1)", "2, 16, 6, 20")
    compiled = compile_kernel(path, backward=True)
    assert compiled.family is CONVOLUTION, compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)
    fused = str(compile_kernel(path, backward=True, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: outs(%{{.*}} : tensor<1x1x3x32xf32>) attrs = {{{.*}}lh.cv_role = "register", lh.cv_vector = array<i64: 1, 1, 3, 32, 1>}
    """)
    assert fused.count('lh.cv_role = "epilogue"') >= 2


def test_the_register_tile_runs_along_the_channels(kernel_file):
    """20 image rows x 16 channel lanes: per step one filter vector, 20 broadcast image
    elements, 20 FMAs; the filter transposed before the convolution (its [F, C K] as a
    2-D transpose in tiles of 16 x 24, the lanes not gathered one element per C K), each
    register tile of the result transposed back in the convolution's output tiles (an
    epilogue)."""
    module, shape = CASES["transposed_3d"]
    path = conv_kernel(kernel_file, module, shape)
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, r"""
        CHECK: tensor.collapse_shape %{{.*}} {{\[}}[0], [1, 2, 3, 4]] : tensor<16x8x3x3x5xf32> into tensor<16x360xf32>
        CHECK: linalg.transpose ins(%{{.*}} : tensor<16x24xf32>) outs(%{{.*}} : tensor<24x16xf32>) permutation = [1, 0]
        CHECK: tensor.expand_shape %{{.*}} {{\[}}[0, 1, 2, 3], [4]] output_shape [8, 3, 3, 5, 16]
        CHECK: scf.forall
        CHECK: linalg.generic {{.*}} ins({{.*}} : tensor<1x1x1x1x20xf32>, tensor<1x16xf32>) outs(%{{.*}} : tensor<1x1x1x20x16xf32>) attrs = {{{.*}}lh.cv_lanes = 4 : i64, lh.cv_role = "register", lh.cv_vector = array<i64: 1, 1, 1, 20, 16, 1>}
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<1x1x1x20x16xf32>) outs(%{{.*}} : tensor<1x16x1x1x20xf32>) attrs = {{{.*}}lh.cv_role = "epilogue"
        CHECK: scf.forall.in_parallel
    """)
    # the 5 taps along the rows stay a loop (`tap_unroll`): unrolled, LLVM would load each
    # image element once for the taps that read it and spill them beside 20 accumulators
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: scf.for %{{.*}} = %c0 to %c5 step %c1 iter_args({{.*}}) -> (vector<20x16xf32>)
        CHECK-NOT: scf.yield
        CHECK: vector.contract {{.*}} : vector<1x20xf32>, vector<1x16xf32> into vector<20x16xf32>
        CHECK-NOT: vector.contract
        CHECK: scf.yield
    """)
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    filecheck(bufferized, """
        CHECK: scf.for {{.*}} -> (vector<20x16xf32>)
        CHECK-COUNT-20: vector.fma {{.*}} : vector<16xf32>
        CHECK: scf.yield
    """)


_PAYLOADS = []  # the parsed modules outlive the ops found in them


def _convolution(text):
    payload = _parse(text)
    _PAYLOADS.append(payload)
    found = find_convolutions(payload)
    return found[0], found


NARROW = """
func.func @main(%x: tensor<1x16x9x22xf32>, %w: tensor<{f}x16x3x3xf32>, %y: tensor<1x{f}x7x{ow}xf32>) -> tensor<1x{f}x7x{ow}xf32> {{
  %r = linalg.conv_2d_nchw_fchw {{dilations = dense<1> : vector<2xi64>, strides = dense<[1, {s}]> : vector<2xi64>}}
         ins(%x, %w : tensor<1x16x9x22xf32>, tensor<{f}x16x3x3xf32>) outs(%y : tensor<1x{f}x7x{ow}xf32>) -> tensor<1x{f}x7x{ow}xf32>
  return %r : tensor<1x{f}x7x{ow}xf32>
}}
"""


def test_the_lane_choice():
    """Channel lanes for 20 output lanes and 16 channels; not for 12 channels (a partial
    vector), nor few terms per output, nor wide rows; with a stride along the lanes on 16
    accumulators, not on AVX2's 8, nor when the image lanes fill their tile."""
    params = ConvolutionParams()
    c, found = _convolution(NARROW.format(f=16, ow=20, s=1))
    assert wants_channel_lanes(c, found, params)
    c, found = _convolution(NARROW.format(f=12, ow=20, s=1))
    assert not wants_channel_lanes(c, found, params)
    c, found = _convolution(NARROW.format(f=16, ow=10, s=2))
    assert wants_channel_lanes(c, found, params)
    assert not wants_channel_lanes(c, found, ConvolutionParams(register=(4, 16)))
    c, found = _convolution(NARROW.replace("9x22", "9x65").format(f=16, ow=32, s=2))
    assert not wants_channel_lanes(c, found, params)
    few = NARROW.replace("1x16x9x22", "1x4x9x22").replace("x16x3x3", "x4x3x3")
    c, found = _convolution(few.format(f=16, ow=20, s=1))
    assert not wants_channel_lanes(c, found, params)
    wide = NARROW.replace("9x22", "9x66")
    c, found = _convolution(wide.format(f=16, ow=64, s=1))
    assert not wants_channel_lanes(c, found, params)


def test_tiles_of_channel_lanes():
    """Once channels are innermost: lanes along them (one vector), rows along the image's
    innermost dim by a divisor of it (19 of 38)."""
    c, _ = _convolution("""
        func.func @main(%x: tensor<1x16x9x40xf32>, %w: tensor<16x3x3x16xf32>, %y: tensor<1x7x38x16xf32>) -> tensor<1x7x38x16xf32> {
          %r = linalg.generic {indexing_maps = [affine_map<(n, oh, ow, f, c, kh, kw) -> (n, c, oh + kh, ow + kw)>,
                                                affine_map<(n, oh, ow, f, c, kh, kw) -> (c, kh, kw, f)>,
                                                affine_map<(n, oh, ow, f, c, kh, kw) -> (n, oh, ow, f)>],
                               iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction", "reduction", "reduction"]}
                 ins(%x, %w : tensor<1x16x9x40xf32>, tensor<16x3x3x16xf32>) outs(%y : tensor<1x7x38x16xf32>) {
          ^bb0(%a: f32, %b: f32, %o: f32):
            %m = arith.mulf %a, %b : f32
            %s = arith.addf %o, %m : f32
            linalg.yield %s : f32
          } -> tensor<1x7x38x16xf32>
          return %r : tensor<1x7x38x16xf32>
        }""")
    assert (c.lanes, c.rows) == (3, 2)
    tiles = convolution_tiles(c, ConvolutionParams(register=(8, 32)))
    assert tiles.register[:4] == [1, 1, 19, 16] and tiles.interchange[-2:] == [3, 2]
    assert tiles.peel is None and tiles.output_lanes == 3


def test_few_rows_take_more_channel_vectors():
    """3 image rows of 64 channels: 4 vectors of lanes (12 accumulators), not 2."""
    c, _ = _convolution("""
        func.func @main(%x: tensor<64x8x58x58xf32>, %w: tensor<8x56x56x64xf32>, %y: tensor<64x3x3x64xf32>) -> tensor<64x3x3x64xf32> {
          %r = linalg.generic {indexing_maps = [affine_map<(n, oh, ow, f, c, kh, kw) -> (n, c, oh + kh, ow + kw)>,
                                                affine_map<(n, oh, ow, f, c, kh, kw) -> (c, kh, kw, f)>,
                                                affine_map<(n, oh, ow, f, c, kh, kw) -> (n, oh, ow, f)>],
                               iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction", "reduction", "reduction"]}
                 ins(%x, %w : tensor<64x8x58x58xf32>, tensor<8x56x56x64xf32>) outs(%y : tensor<64x3x3x64xf32>) {
          ^bb0(%a: f32, %b: f32, %o: f32):
            %m = arith.mulf %a, %b : f32
            %s = arith.addf %o, %m : f32
            linalg.yield %s : f32
          } -> tensor<64x3x3x64xf32>
          return %r : tensor<64x3x3x64xf32>
        }""")
    tiles = convolution_tiles(c, ConvolutionParams(register=(8, 32)))
    assert tiles.register[:4] == [1, 1, 3, 64]


@pytest.mark.parametrize("channels, rows, nr", [(1152, 49, 32), (48, 49, 16), (192, 7, 64),
                                                (96, 3, 32)])
def test_channel_vectors_are_a_power_of_two(channels, rows, nr):
    """NR of 1, 2 or 4 vectors, never 3: LLVM widens a 48-lane vector to 64 and rebuilt the
    accumulators lane by lane per step (a 1 x 1 convolution to 1152 channels at 7 x 7,
    EfficientNet-B0's last blocks: 25x slower than with 32 lanes)."""
    mr, got, _ = channel_lane_tile(channels, rows, ConvolutionParams(register=(8, 32)))
    assert got == nr and channels % got == 0 and mr >= 1


def test_a_pointwise_convolution_at_7x7_takes_whole_power_of_two_lanes(kernel_file):
    """96 output channels over 7 x 7 images (49 lanes merged): the lanes run along the
    channels, 32 per register tile (3 vectors of 48 did before); no 48-lane vector."""
    path = conv_kernel(kernel_file, "Conv2d(24, 96, 1, bias=False)", "2, 24, 7, 7")
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    assert "x48xf32>" not in vectorized
    filecheck(vectorized, """
        CHECK: vector.contract {{.*}} into vector<{{[0-9]+}}x32xf32>
    """)
    assert_matches(compile_kernel(path))


def test_a_pointwise_filter_is_transposed_in_square_blocks(kernel_file):
    """A 1 x 1 filter [F, C, 1] moved to [C, 1, F] for the channel lanes: as [F, C] ->
    [C, F], tiled in 16 x 16 blocks read along C and transposed in registers, not in runs
    of F lanes that gathered one element per cache line (ResNet's 512 -> 2048 pointwise
    convolution at 7 x 7 spent 40% of its time there: 18.1 -> 11.4 ms, torch 9.3 ms)."""
    path = conv_kernel(kernel_file, "Conv2d(128, 256, 1, bias=False)", "2, 128, 7, 7")
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: tensor.collapse_shape {{.*}} : tensor<64x64x1x1xf32> into tensor<64x64xf32>
        CHECK: vector.transfer_read {{.*}} : tensor<16x16xf32>, vector<16x16xf32>
        CHECK: vector.transpose %{{.*}}, [1, 0] : vector<16x16xf32> to vector<16x16xf32>
        CHECK: tensor.expand_shape {{.*}} output_shape [128, 1, 256] : tensor<128x256xf32> into tensor<128x1x256xf32>
    """)
    assert_matches(compile_kernel(path, runtime_checks=True))


@pytest.mark.parametrize("register, registers", [((8, 32), 32), ((4, 16), 16)])
def test_channel_lane_tiles_fit_the_vector_registers(register, registers):
    """The accumulators, the step's filter vectors and a broadcast fit the vector registers
    (3 x 8 accumulators with 8 filter vectors spilled to the stack every step); a tile of
    as many accumulators with fewer filter vectors is taken where both fit."""
    params = ConvolutionParams(register=register)
    lanes = register[1] // 2
    for channels in (16, 32, 48, 64, 96, 128, 256, 512, 1152):
        for rows in (1, 2, 3, 7, 13, 14, 28, 49, 55, 56, 112, 339):
            mr, nr, _ = channel_lane_tile(channels, rows, params)
            v = nr // lanes
            assert mr * v + v + 1 <= registers, (channels, rows, mr, nr)
    assert channel_lane_tile(128, 339, ConvolutionParams(register=(8, 32)))[:2] == (10, 32)
    assert channel_lane_tile(128, 14, ConvolutionParams(register=(8, 32)))[:2] == (5, 64)
    assert channel_lane_tile(512, 7, ConvolutionParams(register=(8, 32)))[:2] == (4, 64)


def test_many_channel_lanes_do_not_spill(kernel_file):
    """KernelBench 76's convolution (a stride-3, dilation-4 Conv1d) to 128 channels: its
    channel-lane register tile took 3 rows x 128 lanes (24 accumulators and 8 filter
    vectors, spilled each step); now 10 x 32 (339 rows: a last tile of 9), against torch."""
    path = conv_kernel(kernel_file, "Conv1d(64, 128, 3, stride=3, dilation=4, bias=False)",
                       "1, 64, 1023")
    compiled = compile_kernel(path)
    assert compiled.family is CONVOLUTION, compiled.notes
    assert_matches(compiled)
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    assert "into vector<3x128xf32>" not in vectorized
    filecheck(vectorized, """
        CHECK-DAG: vector.contract {{.*}} into vector<10x32xf32>
        CHECK-DAG: vector.contract {{.*}} into vector<9x32xf32>
    """)


def test_channel_lane_blocks_fill_l1(kernel_file):
    """A stride-2 3 x 3 convolution to 64 channels (a ResNet stage's first): its 64 input
    channels in blocks of 32 (their filter values, 36 KiB per 32-lane tile, fill L1; blocks
    of 16 for half of L1 ran 8% slower), against torch."""
    path = conv_kernel(kernel_file, "Conv2d(64, 64, 3, stride=2, padding=1, bias=False)",
                       "1, 64, 32, 32")
    compiled = compile_kernel(path)
    assert compiled.family is CONVOLUTION, compiled.notes
    assert_matches(compiled)
    filecheck(compiled.schedule_text(), """
        CHECK: move_output_channels_innermost
        CHECK: tile_using_for {{.*}} tile_sizes [0, 0, 0, 0, 32, 0, 0]
    """)


@pytest.mark.parametrize("module, shape", [
    # 56 lanes: 32 + 24 as image lanes (7 of 8 used); a lane tail would leave 32 + 16 + 8
    ("Conv2d(16, 16, 3, padding=1, bias=False)", "1, 16, 4, 56"),
    # 28 lanes of 128 channels (a ResNet stage's 28 x 28)
    ("Conv2d(32, 128, 3, padding=1, bias=False)", "1, 32, 3, 28"),
])
def test_rows_of_seven_eighths_of_a_tile_take_the_channel_lanes(kernel_file, module, shape):
    """An image row that fills 7 of 8 lanes of its last tile gains 0.125 of useful share
    with the output channels as lanes (`CHANNEL_LANES_GAIN`): the whole convolution takes
    them, no lane tail split off; against torch."""
    compiled = compile_kernel(conv_kernel(kernel_file, module, shape))
    assert compiled.family is CONVOLUTION, compiled.notes
    assert_matches(compiled)
    script = compiled.schedule_text()
    assert "move_output_channels_innermost" in script
    assert "@split_lane_tails" not in script


# Lanes of stride > 1 (`strided_lanes`): the channel lanes on any gain of the tile's useful
# share, the convolution left whole (no stride phases, each adding onto the output).
STRIDED = {
    # AlexNet's conv1 along W (KernelBench 50): 55 lanes use 0.86 of an image-lanes tile
    "conv2d_stride4_11x11": ("Conv2d(3, 32, 11, stride=4, padding=2)", "1, 3, 20, 224"),
    # KernelBench 76: stride 3, dilation 4, 98 lanes
    "conv1d_stride3_dilated": ("Conv1d(64, 32, 3, stride=3, dilation=4, bias=False)", "2, 64, 301"),
    # stride 2, padded, an odd image: 21 lanes
    "conv2d_stride2_odd": ("Conv2d(16, 16, 3, stride=2, padding=1)", "1, 16, 13, 41"),
}


@pytest.mark.parametrize("case", sorted(STRIDED))
def test_strided_lanes_take_the_channel_lanes_without_phases(kernel_file, case):
    module, shape = STRIDED[case]
    compiled = compile_kernel(conv_kernel(kernel_file, module, shape))
    assert compiled.family is CONVOLUTION, compiled.notes
    assert_matches(compiled)
    script = compiled.schedule_text()
    assert "move_output_channels_innermost" in script
    assert "split_strided_convolution" not in script


def test_strided_lanes_in_bf16(kernel_file):
    module, shape = STRIDED["conv2d_stride4_11x11"]
    assert_matches(compile_kernel(conv_kernel(kernel_file, module, shape, dtype="bfloat16")))


def test_strided_lanes_with_an_epilogue_keep_their_phases(kernel_file):
    """A ReLU fused onto the result: the transpose back would stand between them; the
    stride phases stay."""
    module, shape = STRIDED["conv2d_stride4_11x11"]
    path = conv_kernel(kernel_file, module, shape, forward="torch.relu(self.conv(x))")
    compiled = compile_kernel(path)
    assert_matches(compiled)
    assert "split_strided_convolution" in compiled.schedule_text()


def test_lane_tiles_take_the_whole_batch_and_the_image_is_padded_once(kernel_file):
    """512 output channels as lanes at 7 x 7, batch 3: the forall splits the channels
    alone, 8 tiles of 64 (the threads' tiles_per_thread), each over every image, so that a
    tile reads its columns of the filter once for all of them; the image is padded once
    before the forall, not again by each tile."""
    path = conv_kernel(kernel_file, "Conv2d(16, 512, 3, padding=1, bias=False)", "3, 16, 7, 7")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: tensor.pad %arg0 low[0, 0, 1, 1] high[0, 0, 1, 1]
        CHECK: scf.forall (%{{.*}}) in (8) shared_outs(%{{.*}}) -> (tensor<3x512x7x7xf32>)
        CHECK-NOT: tensor.pad
        CHECK: lh.cv_role = "register"
        CHECK: scf.forall.in_parallel
    """)
    assert_matches(compile_kernel(path, runtime_checks=True))


def test_a_batch_too_large_for_one_tile_keeps_a_tile_per_image(kernel_file):
    """The same convolution over 48 images: a tile of 64 channels of every image would
    hold 602 KB of output (over tile_bytes), so each image has its tiles (of 128 channels)
    and pads its own image inside them."""
    path = conv_kernel(kernel_file, "Conv2d(16, 512, 3, padding=1, bias=False)", "48, 16, 7, 7")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall (%{{.*}}, %{{.*}}) in (48, 4) shared_outs(%{{.*}}) -> (tensor<48x512x7x7xf32>)
        CHECK: tensor.pad %{{.*}} low[0, 0, 1, 1] high[0, 0, 1, 1]
    """)
