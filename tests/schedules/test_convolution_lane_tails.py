"""The convolution family's lane tails (schedules.convolution.lane_tail_start): a
convolution whose innermost output dim ends in at most half a vector past its last whole
vector (16 lanes in the tests' CPU description) computes those lanes apart with its output
channels as lanes (KernelBench 57, 61, 68, 71: stride-1 transposed convolutions, 2 lanes
past 64 or 128). Numerics against torch (2-D and 3-D transposed, a 4- and an 8-lane tail,
two vectors of channels, f16 and bf16, a transposed-view input, a second use of the
result), the convolutions it leaves whole (a bias, 1-D, a 9-lane tail, few products), and the
IR: the tail's filter transposed, one fill per part and none of the whole result. Rows of
36 and 38 lanes (KernelBench 68, 58) split rather than take the channel lanes
(`split_lane_share`)."""

import re

import pytest

from lighthouse.compile import compile_kernel
from tests.schedules.test_convolution import assert_matches, conv_kernel
from tests.transform_ext.helpers import check as filecheck

SPLIT = {
    # 66 output lanes: 64 + a tail of 2 (KernelBench 57)
    "transposed_2d": ("ConvTranspose2d(16, 16, 3, bias=False)", "1, 16, 4, 64", 64),
    # 66 lanes of 4 x 5 rows (KernelBench 61, 70)
    "transposed_3d": ("ConvTranspose3d(8, 16, 3, bias=False)", "1, 8, 2, 3, 64", 64),
    # 68 lanes: a tail of 4, two vectors of output channels, two images
    "conv2d_tail4": ("Conv2d(16, 32, 3, bias=False)", "2, 16, 5, 70", 64),
    # 72 lanes: a tail of 8 (half a vector), padded
    "conv2d_tail8_padded": ("Conv2d(16, 16, 3, padding=1, bias=False)", "1, 16, 4, 72", 64),
    # 36 lanes (KernelBench 68): the channel lanes' 18-row tiles would use every lane, but
    # two whole vectors and a tail of 4 lose less than the gain they need over the split
    "transposed_3d_tail4": ("ConvTranspose3d(8, 16, (3, 5, 5), bias=False)", "1, 8, 2, 3, 32", 32),
    # 38 lanes, 7 taps (KernelBench 58), two images
    "transposed_3d_tail6": ("ConvTranspose3d(8, 16, (3, 5, 7), bias=False)", "2, 8, 2, 3, 32", 32),
}

WHOLE = {
    # a bias: the accumulator starts from its broadcast, not a fill
    "bias": ("ConvTranspose2d(16, 16, 3)", "1, 16, 4, 64"),
    # 1-D: no image dim for the tail's rows
    "conv1d": ("Conv1d(16, 16, 9, bias=False)", "2, 16, 74"),
    # a tail of 9 lanes (more than half a vector)
    "tail9": ("Conv2d(16, 16, 3, bias=False)", "1, 16, 5, 75"),
    # 8 x 9 products per output (under CHANNEL_LANES_TERMS)
    "few_terms": ("ConvTranspose2d(8, 16, 3, bias=False)", "1, 8, 4, 64"),
}


def _splits(path) -> list[int]:
    """Where the script's split_lane_tails step splits the convolutions."""
    text = compile_kernel(path, stop_after="cleanup").schedule_text()
    if "@split_lane_tails" not in text:
        return []
    step = text.split("@split_lane_tails")[1].split("transform.named_sequence")[0]
    assert step.count("move_output_channels_innermost") == step.count("structured.split")
    return [int(x) for x in re.findall(r"structured.split %\S+ after (\d+)", step)]


@pytest.mark.parametrize("case", sorted(SPLIT))
def test_lane_tails_match_torch(kernel_file, case):
    module, shape, start = SPLIT[case]
    path = conv_kernel(kernel_file, module, shape)
    assert _splits(path) == [start]
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("case", sorted(WHOLE))
def test_convolutions_left_whole_match_torch(kernel_file, case):
    module, shape = WHOLE[case]
    path = conv_kernel(kernel_file, module, shape)
    assert _splits(path) == []
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_lane_tails_accumulate_in_f32(kernel_file, dtype):
    module, shape, _ = SPLIT["transposed_3d"]
    assert_matches(compile_kernel(conv_kernel(kernel_file, module, shape, dtype=dtype)))


def test_a_transposed_view_input_and_a_second_use(kernel_file):
    """H and W swapped by a view (66 output lanes); the result returned and read again
    transposed."""
    path = conv_kernel(kernel_file, "ConvTranspose2d(16, 16, 3, bias=False)", None,
                       input="torch.randn(1, 16, 64, 4, generator=g).transpose(2, 3)",
                       forward="(lambda y: (y, y.transpose(-1, -2) * 2))(self.conv(x))")
    assert_matches(compile_kernel(path))


def test_each_part_starts_from_its_own_fill(kernel_file):
    """The main part's 64 lanes start per register tile (8 channels x 32 lanes) and so do
    the tail's 2 columns (6 rows x 16 channels, in [N, H, W, C], its filter transposed);
    the [1, 16, 6, 66] result is never filled whole."""
    module, shape, _ = SPLIT["transposed_2d"]
    path = conv_kernel(kernel_file, module, shape)
    text = str(compile_kernel(path, stop_after="fuse").module).split("{-#")[0]
    filecheck(text, """
        CHECK: scf.forall {{.*}} -> (tensor<1x16x6x64xf32>)
        CHECK: linalg.fill {{.*}}lh.cv_role = "init"{{.*}} -> tensor<1x8x1x32xf32>
        CHECK: linalg.transpose {{.*}} permutation = [1, 0]
        CHECK: scf.forall {{.*}} -> (tensor<1x16x6x2xf32>)
        CHECK: linalg.fill {{.*}}lh.cv_role = "init"{{.*}} -> tensor<1x6x1x16xf32>
    """)
    assert not re.search(r"linalg.fill .*-> tensor<1x16x6x66xf32>", text)
