"""Transposed convolutions split into output phases (transform_ext.split_transposed_convolution
in the convolution family): the phases read one padded copy of the input, a masked register
tile starts from its accumulator in registers (no buffer per tile), the phases without taps
are the bias written once over the whole output; numerics against torch for their
neighbours (strides 2 and 3, odd sizes, padding, output padding, dilation, groups, bf16, a
transposed-view input, an epilogue and a second use of the result)."""

import pytest

from lighthouse.compile import compile_kernel
from tests.conftest import EXAMPLES
from tests.schedules.test_convolution import assert_matches, conv_kernel
from tests.transform_ext.helpers import check as filecheck

# The default suite's conv_transpose2d at a small size: 4 x 4 window, stride 2, padding 1;
# 13 lanes per phase (a masked register tile), 4 phases with 2 x 2 taps each.
SUITE_LIKE = {"N": 2, "C": 8, "H": 7, "W": 13, "F": 8, "KH": 4, "KW": 4, "STRIDE": 2,
              "PADDING": 1, "TRANSPOSED": True}


def test_phases_share_one_padded_input_and_start_in_registers():
    """One zero-padded copy of x for the four phases (zeros, x copied into their interior by
    a linalg.copy; each phase reads a slice of it); after bufferization no phase allocates or
    copies inside its parallel loop: the bias starts the accumulators in registers (the
    masked tile's write and read back forwarded), stored once."""
    fused = str(compile_kernel(EXAMPLES / "convolution.py", overrides=SUITE_LIKE,
                               stop_after="fuse").module)
    assert "tensor.pad" not in fused
    assert fused.count("linalg.copy") == 1 and fused.count('lh.cv_role = "register"') == 4
    filecheck(fused, """
        CHECK: %[[ZEROS:.*]] = linalg.fill
        CHECK: %[[X:.*]] = linalg.copy {{.*}}ins(%arg0 : tensor<2x8x7x13xf32>)
        CHECK: %[[PADDED:.*]] = tensor.insert_slice %[[X]] into %[[ZEROS]][0, 0, 1, 1] [2, 8, 7, 13] [1, 1, 1, 1]
        CHECK-COUNT-4: tensor.extract_slice %[[PADDED]]
    """)
    bufferized = str(compile_kernel(EXAMPLES / "convolution.py", overrides=SUITE_LIKE,
                                    stop_after="bufferize").module)
    filecheck(bufferized, "\n".join(["""
        CHECK: scf.parallel
        CHECK-NOT: memref.alloc
        CHECK-NOT: memref.copy
        CHECK: vector.fma
        CHECK: scf.reduce"""] * 4) + """
        CHECK-NOT: scf.parallel
    """)
    assert_matches(compile_kernel(EXAMPLES / "convolution.py", overrides=SUITE_LIKE))


def test_the_padded_input_is_copied_by_the_threads():
    """At the default suite's size the zeros and the copy of x are each an scf.forall (split
    over batch and channels) before the phases' foralls, not one thread's copy."""
    sizes = dict(SUITE_LIKE, N=8, C=64, H=28, W=28, F=32)
    fused = str(compile_kernel(EXAMPLES / "convolution.py", overrides=sizes,
                               stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall ({{.*}}) -> (tensor<8x64x30x30xf32>)
        CHECK: linalg.fill
        CHECK: scf.forall ({{.*}}) -> (tensor<8x64x28x28xf32>)
        CHECK: linalg.copy
        CHECK: tensor.insert_slice {{.*}}[0, 0, 1, 1] [8, 64, 28, 28] [1, 1, 1, 1]
        CHECK-COUNT-4: lh.cv_role = "register"
    """)


def test_phases_without_taps_are_the_bias_over_the_whole_output(kernel_file):
    """Stride 5, window 3, dilation 2 (KernelBench 81): 9 of the 25 phases have taps; the bias
    is computed once over the whole [1, 4, 18, 28] output and only those 9 phases are written
    over it (strided), none of the 16 others."""
    path = conv_kernel(kernel_file, "ConvTranspose2d(3, 4, 3, stride=5, padding=1, dilation=2)",
                       "1, 3, 4, 6")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: %[[BIAS:.*]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<1x4x18x28xf32>)
        CHECK: tensor.extract_slice %[[BIAS]][0, 0, 1, 1] [1, 4, 4, 6] [1, 1, 5, 5]
        CHECK: lh.cv_role = "register"
    """)
    assert fused.count('lh.cv_role = "register"') == 9
    assert fused.count("[1, 1, 5, 5] : tensor<") == 2 * 9  # each phase's slice and insert
    assert_matches(compile_kernel(path))


NEIGHBOURS = {
    # strides 2 and 3 at odd sizes, with padding and output padding
    "stride2_odd": ("ConvTranspose2d(5, 7, 4, stride=2, padding=1)", "2, 5, 9, 13"),
    "stride3_output_padding": ("ConvTranspose2d(4, 6, (3, 5), stride=3, padding=(1, 2), "
                               "output_padding=(2, 1))", "1, 4, 5, 11"),
    # dilation sharing a factor with the stride: one phase per dim has no taps
    "stride2_dilation2_tapless": ("ConvTranspose2d(6, 4, 3, stride=2, padding=2, dilation=2, "
                                  "groups=2)", "2, 6, 7, 9"),
    # a 2-tap window along H with stride 3: one H phase of bias alone; no bias at all
    "stride3_short_window": ("ConvTranspose2d(3, 5, (2, 4), stride=3, padding=1, "
                             "output_padding=2, dilation=(3, 2), bias=False)", "1, 3, 6, 7"),
    # stride 2 along one dim only (1 phase along the other), grouped
    "stride_2x1_grouped": ("ConvTranspose2d(8, 8, (3, 2), stride=(2, 1), padding=(1, 0), "
                           "groups=4)", "1, 8, 5, 33"),
    # 1-D and 3-D with a phase of no taps
    "1d_tapless": ("ConvTranspose1d(4, 6, 2, stride=3, padding=1, dilation=3)", "2, 4, 17"),
    "3d_stride2": ("ConvTranspose3d(3, 4, (2, 3, 4), stride=2, padding=(0, 1, 1), "
                   "dilation=(2, 1, 1))", "1, 3, 3, 4, 7"),
}


@pytest.mark.parametrize("case", sorted(NEIGHBOURS))
def test_neighbours_match_torch(kernel_file, case):
    module, shape = NEIGHBOURS[case]
    assert_matches(compile_kernel(conv_kernel(kernel_file, module, shape)))


@pytest.mark.parametrize("case", ["stride2_odd", "stride2_dilation2_tapless", "1d_tapless"])
def test_bf16_neighbours_match_torch(kernel_file, case):
    module, shape = NEIGHBOURS[case]
    assert_matches(compile_kernel(conv_kernel(kernel_file, module, shape, dtype="bfloat16")))


def test_a_transposed_view_input_an_epilogue_and_a_second_use(kernel_file):
    """A non-contiguous input (H and W swapped by a view), ReLU after the phases (the result
    written over the bias-only phases), the result used twice."""
    path = conv_kernel(kernel_file, "ConvTranspose2d(4, 6, 3, stride=3, padding=1, dilation=2)",
                       None, input="torch.randn(2, 4, 9, 7, generator=g).transpose(2, 3)",
                       forward="(lambda y: torch.relu(y) + y.sum(dim=1, keepdim=True))"
                               "(self.conv(x))")
    assert_matches(compile_kernel(path))


STRIDED_ONE_ELEMENT = """
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 1, 1, stride=(1, 2), padding=(1, 0), bias=False)
        self.fc = torch.nn.Linear(3, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(x), 1))

def get_inputs():
    return [torch.randn(3, 1, 1, 1, generator=torch.Generator().manual_seed(1))]

def get_init_inputs():
    return []
"""


def test_a_stride_along_a_one_element_dim(kernel_file):
    """The input gradient of a convolution strided along an image dim of one output (found
    by the fuzzer): the output's gradient reaches the stuffing insert through an insert
    that reshapes it, which ended no chain of stuffing inserts; split_transposed_convolution
    then failed on an index (the matmul family fell back to the generic schedule)."""
    compiled = compile_kernel(kernel_file(STRIDED_ONE_ELEMENT), backward=True)
    assert not compiled.notes, compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)


POOLED_LINEAR = """
import torch
import torch.nn.functional as F

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(30, 20)

    def forward(self, x, r, b):
        return (F.avg_pool1d(self.fc(x) + r, 2, 2) + b).transpose(1, 2)

def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 13, 30, generator=g), torch.randn(1, 13, 20, generator=g),
            torch.randn(10, generator=g)]

def get_init_inputs():
    return []
"""


def test_a_stuffed_input_reshaped_by_an_insert(kernel_file):
    """The input gradient of an average pooling of stride 2 (found by the fuzzer): the
    output's gradient [13, 10] is inserted into [1, 13, 1, 10] (a reshape) and that into
    zeros at stride 2; the stuffed input is the [1, 13, 1, 10] tensor, not the [13, 10]
    one before the reshape (an IndexError, and the matmul family fell back)."""
    compiled = compile_kernel(kernel_file(POOLED_LINEAR), backward=True)
    assert not compiled.notes, compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)
