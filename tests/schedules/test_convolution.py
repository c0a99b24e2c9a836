"""The convolution family: numerics against torch for every kind of convolution (1-D, 2-D,
3-D; strided, padded, dilated, grouped, depthwise, pointwise, transposed), odd sizes, f16
and bf16, transposed-view inputs, epilogues and the ops after them, the joint backward
graph; the IR it produces; the family's choice and its refusals."""

import math
import re

import pytest
import torch
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.errors import ScheduleMismatch
from lighthouse.families import CONVOLUTION, choose_family
from schedules.convolution import (Convolution, ConvolutionParams, analyze_convolution,
                                   check, convolution_tiles, recognize, writes_strided_lanes)
from tests.conftest import EXAMPLES
from tests.transform_ext.helpers import check as filecheck

KERNEL = """
import torch
DTYPE = torch.{dtype}

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.{module}.to(DTYPE)
{extra}
    def forward(self, x):
        return {forward}

def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [{input}]

def get_init_inputs():
    return []
"""


def conv_kernel(kernel_file, module, shape, *, dtype="float32", forward="self.conv(x)",
                extra="", input=None):
    source = KERNEL.format(dtype=dtype, module=module, forward=forward, extra=extra,
                           input=input or f"torch.randn({shape}, generator=g).to(DTYPE)")
    return kernel_file(source)


def assert_matches(compiled):
    assert compiled.family is CONVOLUTION, compiled.notes
    assert not compiled.notes, compiled.notes
    reports = compiled.check()
    assert reports
    for r in reports:
        assert r.ok, str(r)


CASES = {
    # 1-D: a tail of lanes after one register tile; strided and dilated (KernelBench 76)
    "conv1d": ("Conv1d(5, 12, 3)", "2, 5, 37"),
    "conv1d_strided_dilated": ("Conv1d(6, 16, 3, stride=3, dilation=4, bias=False)", "2, 6, 101"),
    # 2-D: padded with bias, 37 lanes (a peeled tail of 5); asymmetric kernels
    "conv2d_padded": ("Conv2d(4, 16, 3, padding=1)", "2, 4, 13, 37"),
    "conv2d_asymmetric": ("Conv2d(3, 8, (2, 5), bias=False)", "1, 3, 9, 21"),
    # stride 4 with an 11-wide window (KernelBench 50): lanes deinterleaved into phases
    "conv2d_strided": ("Conv2d(3, 12, 7, stride=4, padding=2)", "2, 3, 31, 45"),
    "conv2d_stride2_odd": ("Conv2d(5, 7, 3, stride=2)", "1, 5, 10, 17"),
    "conv2d_dilated": ("Conv2d(6, 12, (3, 5), dilation=(2, 3), padding=(2, 4), bias=False)",
                       "1, 6, 17, 23"),
    "conv2d_grouped": ("Conv2d(6, 9, 3, groups=3, padding=1)", "2, 6, 11, 12"),
    "conv2d_grouped_strided": ("Conv2d(8, 8, 3, groups=2, stride=(1, 2))", "1, 8, 9, 19"),
    # depthwise: rows along the image rows; a channel multiplier; asymmetric windows
    "depthwise": ("Conv2d(8, 8, 3, groups=8, bias=False)", "2, 8, 14, 19"),
    "depthwise_multiplier": ("Conv2d(4, 12, 3, groups=4)", "2, 4, 10, 33"),
    "depthwise_asymmetric": ("Conv2d(5, 5, (3, 7), groups=5, padding=(1, 0))", "1, 5, 9, 40"),
    "depthwise_1d": ("Conv1d(6, 6, 5, groups=6, padding=2)", "3, 6, 50"),
    "pointwise": ("Conv2d(8, 12, 1, bias=False)", "2, 8, 10, 10"),
    # 3-D: padded, strided
    "conv3d": ("Conv3d(3, 8, (3, 4, 5), padding=1)", "1, 3, 6, 7, 9"),
    "conv3d_strided": ("Conv3d(4, 8, 3, stride=2, bias=False)", "2, 4, 7, 8, 19"),
    # transposed: stride 1 (a padded convolution), strided with output padding, dilated and
    # grouped (KernelBench 75), stride 5 (81), 1-D, 3-D
    "transposed_stride1": ("ConvTranspose2d(4, 6, (3, 5), bias=False)", "2, 4, 7, 11"),
    "transposed_strided": ("ConvTranspose2d(6, 5, 3, stride=2, padding=1, output_padding=1)",
                           "2, 6, 5, 9"),
    "transposed_grouped_dilated": ("ConvTranspose2d(8, 6, (3, 5), stride=(2, 3), padding=(1, 2), "
                                   "dilation=(2, 1), groups=2, bias=False)", "1, 8, 6, 7"),
    "transposed_stride5": ("ConvTranspose2d(3, 4, 3, stride=5, padding=1, dilation=2)",
                           "1, 3, 4, 6"),
    "transposed_1d": ("ConvTranspose1d(6, 4, 3, stride=2, padding=1, output_padding=1, "
                      "dilation=2)", "2, 6, 21"),
    "transposed_3d": ("ConvTranspose3d(4, 4, 3, stride=2, padding=1, output_padding=1)",
                      "1, 4, 3, 4, 5"),
    # stride 1 in 3-D (KernelBench 58, 68): the window loops clamped to the taps that read
    # the input (transform_ext.clamp_window_loops), padded less than k - 1 in some dims
    "transposed_stride1_3d": ("ConvTranspose3d(3, 10, (3, 4, 5), padding=(0, 1, 2))",
                              "2, 3, 4, 6, 19"),
    # a transposed convolution padded beyond its window's reach (computed padded less and
    # cropped: lighthouse.conv_decompositions; torch-mlir sliced out of bounds)
    "transposed_padded_past_window": ("ConvTranspose2d(3, 4, (2, 3), stride=(3, 2), padding=(2, 1), "
                                      "output_padding=(2, 1))", "2, 3, 5, 6"),
    # padding beyond the image: output rows whose every tap reads padding (the bias alone)
    "padded_past_image": ("Conv2d(3, 4, 3, padding=3)", "1, 3, 2, 5"),
    # one input channel per group: torch-mlir's lowering of it is replaced
    # (lighthouse.conv_decompositions)
    "transposed_depthwise": ("ConvTranspose2d(6, 12, 3, stride=2, padding=1, output_padding=1, "
                             "groups=6)", "2, 6, 5, 7"),
    # a narrow innermost dim of one tap merged with the one before it
    # (lighthouse.conv_decompositions; KernelBench 59): padded and dilated there, grouped,
    # 2-D columns, twice (a 1 x 1 over 5 x 6), and a stride before it that stops the merge
    "narrow_inner_3d": ("Conv3d(3, 8, (3, 3, 1), padding=(1, 2, 0), dilation=(1, 2, 1))",
                        "2, 3, 5, 6, 10"),
    "narrow_inner_grouped": ("Conv3d(4, 6, (2, 3, 1), groups=2, bias=False)", "1, 4, 4, 7, 9"),
    "narrow_inner_column": ("Conv2d(4, 8, (3, 1), padding=(1, 0))", "2, 4, 9, 7"),
    "narrow_inner_pointwise": ("Conv2d(5, 12, 1)", "2, 5, 5, 6"),
    "narrow_inner_strided": ("Conv2d(4, 8, (3, 1), stride=(2, 1))", "1, 4, 9, 7"),
    # a stride along a dim of one output element (the fuzzer: a phase's strided insert into
    # the result fell to a memref copy the JIT could not link); a one-row neighbour
    "transposed_one_output": ("ConvTranspose1d(3, 3, 1, stride=2, bias=False)", "3, 3, 1"),
    "transposed_one_row": ("ConvTranspose2d(3, 4, (1, 3), stride=2)", "2, 3, 1, 5"),
    # odd sizes: one output lane, one image row, batch 1
    "one_lane": ("Conv2d(3, 8, (2, 5))", "1, 3, 4, 5"),
    "one_row": ("Conv2d(4, 8, (1, 3), bias=False)", "1, 4, 1, 30"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_convolution_matches_torch(kernel_file, case):
    module, shape = CASES[case]
    assert_matches(compile_kernel(conv_kernel(kernel_file, module, shape)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["conv2d_padded", "transposed_strided", "depthwise",
                                  "conv1d_strided_dilated", "transposed_stride1",
                                  "transposed_stride1_3d"])
def test_half_convolutions_accumulate_in_f32(kernel_file, dtype, case):
    """Also the deinterleaved image of a strided convolution and the zero-stuffed one of a
    transposed convolution of stride 1: bf16 copies LLVM's x86 backend could not select
    (lighthouse.targets.bf16_vectors.bf16_memory_as_i16)."""
    module, shape = CASES[case]
    assert_matches(compile_kernel(conv_kernel(kernel_file, module, shape, dtype=dtype)))


def test_fuzzer_findings(kernel_file):
    """A bf16 grouped transposed 3-D convolution of one channel per group with view
    operands (masked bf16 loads of 8 image rows: LLVM aborted); a strided 1 x 1 grouped
    convolution whose filter slice strode along a dim of one element (bufferization
    refused the layout)."""
    grouped = kernel_file("""
        import torch
        import torch.nn.functional as F
        DTYPE = torch.bfloat16
        class Model(torch.nn.Module):
            def forward(self, x, w):
                return F.relu(F.conv_transpose3d(x, w, None, groups=2))
        def get_inputs():
            g = torch.Generator().manual_seed(0)
            x = torch.randn(2, 2, 2, 1, 8, generator=g).to(DTYPE).transpose(-2, -1)
            w = (torch.randn(2, 2, 3, 4, 5, generator=g) * 0.577).to(DTYPE).transpose(-2, -1)
            return [x, w]
        def get_init_inputs():
            return []
        """)
    assert_matches(compile_kernel(grouped))
    path = conv_kernel(kernel_file, "Conv2d(12, 24, (1, 1), stride=(2, 2), padding=(1, 1), "
                       "dilation=(1, 3), groups=12)", None,
                       input="torch.randn(2, 22, 12, 1, generator=g).transpose(1, 2)")
    assert_matches(compile_kernel(path))


def test_transposed_view_inputs(kernel_file):
    """A non-contiguous input (H and W swapped by a view) and a transpose inside the model."""
    path = conv_kernel(kernel_file, "Conv2d(4, 8, 3, padding=(1, 2))", None,
                       input="torch.randn(2, 4, 19, 11, generator=g).transpose(2, 3)",
                       forward="self.conv(x).transpose(-1, -2) * 2")
    assert_matches(compile_kernel(path))


def test_epilogue_and_a_reduction_after_the_convolution(kernel_file):
    """KernelBench level 2's chains: an elementwise epilogue fused into the output tiles,
    then a GroupNorm tiled as the generic schedule does."""
    path = conv_kernel(kernel_file, "Conv2d(4, 8, 3)", "2, 4, 12, 35",
                       extra="        self.norm = torch.nn.GroupNorm(2, 8)\n",
                       forward="self.norm(torch.relu(self.conv(x)) + 0.5)")
    compiled = compile_kernel(path)
    assert_matches(compiled)
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall
        CHECK: lh.cv_role = "register"
        CHECK: lh.cv_role = "epilogue"
        CHECK: arith.addf
        CHECK: scf.forall.in_parallel
        CHECK: scf.forall
    """)


def _largest_f64_tensor(ir_text: str) -> int:
    """Elements of the largest f64 tensor type in `ir_text` (0 when there is none)."""
    sizes = [math.prod(int(d) for d in shape.split("x"))
             for shape in re.findall(r"tensor<([0-9x]+)xf64>", ir_text)]
    return max(sizes, default=0)


@pytest.mark.parametrize("extra, forward, dtype", [
    ("        self.norm = torch.nn.GroupNorm(2, 8)\n", "self.norm(self.conv(x))", "float32"),
    # the output read by the norm's sums and again by a residual add
    ("        self.norm = torch.nn.GroupNorm(4, 8)\n",
     "(lambda y: self.norm(y) + y)(self.conv(x))", "float32"),
    ("        self.norm = torch.nn.InstanceNorm2d(8, affine=True)\n",
     "torch.tanh(self.norm(self.conv(x)))", "float32"),
    ("", "(lambda y: (y - y.mean((2, 3), keepdim=True)) / (y.var((2, 3), keepdim=True) + 1))"
         "(self.conv(x))", "float32"),
    # KernelBench level 2's 92 at a small size: norm, tanh, hardswish, residual, logsumexp
    ("        self.norm = torch.nn.GroupNorm(4, 8)\n",
     "(lambda y: torch.logsumexp(torch.nn.functional.hardswish(torch.tanh(self.norm(y))) + y, "
     "dim=1, keepdim=True))(self.conv(x))", "float32"),
    ("        self.norm = torch.nn.GroupNorm(2, 8)\n", "self.norm(self.conv(x))", "bfloat16"),
    # KernelBench level 2's 23: a mean of the norm's output (a reshape that cannot fold
    # into the sums stays, and the schedule still takes the payload)
    ("        self.norm = torch.nn.GroupNorm(2, 8)\n", "self.norm(self.conv(x)).mean(dim=[1, 2, 3])",
     "float32"),
])
def test_norms_after_a_convolution_read_its_output_as_it_is(kernel_file, extra, forward, dtype):
    """A group norm's, an instance norm's and a variance's sums over a convolution's output
    (torch-mlir widens it to f64 for them) read the output in place, widening each element
    in their bodies: no f64 copy of the output (a [batch, channels] f64 is the most the
    fused IR holds; before, a tile's [images, groups, channels, pixels] f64 per sum), and
    the sums over one tensor merged into one pass; the results match torch."""
    path = conv_kernel(kernel_file, "Conv2d(4, 8, 3)", "2, 4, 12, 35", dtype=dtype, extra=extra,
                       forward=forward)
    fused = str(compile_kernel(path, stop_after="fuse").module)
    assert 0 < _largest_f64_tensor(fused) <= 2 * 8
    assert re.search(r"%\S+:2 = linalg.generic", fused)  # the sums of x and x^2 in one pass
    compiled = compile_kernel(path)
    assert compiled.family is CONVOLUTION, compiled.notes  # (a logsumexp asks cross-entropy first)
    for r in compiled.check():
        assert r.ok, str(r)


def test_ops_after_a_convolution_of_rows_no_vector_divides_are_vectorized(kernel_file):
    """Rows of 139 outputs (prime: no vector tile divides them) through a sigmoid and a
    group norm after the convolution (KernelBench level 2's 21): the ops outside the
    convolution's tiles are tiled as the generic schedule tiles them, the last partial
    tile of a row peeled into a static tile of its own, and all vectorized (a dynamic
    tile stayed a scalar loop); the printed script, peels included, verifies (its custom
    form) and the results match torch."""
    path = conv_kernel(kernel_file, "Conv2d(4, 8, 3)", "2, 4, 6, 141",
                       extra="        self.norm = torch.nn.GroupNorm(2, 8)\n",
                       forward="self.norm(torch.sigmoid(self.conv(x) * 0.5))")
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    assert "linalg." not in vectorized
    script = compile_kernel(path, stop_after="cleanup").schedule_text()
    assert "transform.loop.peel" in script and "transform.named_sequence @vectorize" in script
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("shape, input, forward, dtype", [
    # a transposed-view input, the norm's result read twice: transposed, and summed
    (None, "torch.randn(2, 4, 35, 12, generator=g).transpose(2, 3)",
     "(lambda z: (z.transpose(-1, -2) * 2, z.sum()))(self.norm(self.conv(x)))", "float32"),
    # rows of 139 (peeled partial tiles) in bf16, a residual of the convolution's output
    ("2, 4, 6, 141", None, "(lambda y: self.norm(y) + y)(self.conv(x))", "bfloat16"),
])
def test_neighbours_of_a_norm_after_a_convolution(kernel_file, shape, input, forward, dtype):
    """Neighbours of the norms above: a transposed-view input with the norm's result used
    twice (a transpose after it and a sum), rows of 139 in bf16 with a residual; the
    convolution family takes each and the results match torch."""
    path = conv_kernel(kernel_file, "Conv2d(4, 8, 3)", shape, dtype=dtype, input=input,
                       extra="        self.norm = torch.nn.GroupNorm(2, 8)\n", forward=forward)
    assert_matches(compile_kernel(path))


def test_a_norm_after_a_convolution_of_no_images(kernel_file):
    """No images: every op's iteration space is empty, so the cleanup leaves no linalg op
    (nothing to schedule, no convolution family), and the empty result matches torch's."""
    path = conv_kernel(kernel_file, "Conv2d(4, 8, 3)", "0, 4, 12, 35",
                       extra="        self.norm = torch.nn.GroupNorm(2, 8)\n",
                       forward="self.norm(self.conv(x))")
    assert "linalg." not in str(compile_kernel(path, stop_after="cleanup").module)
    reports = compile_kernel(path).check()
    assert reports and all(r.ok for r in reports), reports


def test_transposed_convolution_chains(kernel_file):
    """KernelBench level 2's 26 (a 3-D transposed convolution, a residual add, x *
    hardswish(x)) and 60 (swish, GroupNorm, hardswish) at small sizes."""
    add = conv_kernel(kernel_file, "ConvTranspose3d(3, 4, 3, stride=2, padding=1, output_padding=1)",
                      None, input="torch.rand(2, 3, 3, 4, 5, generator=g)",
                      extra="        self.residual = torch.nn.Parameter(torch.rand(2, 4, 6, 8, 10))\n",
                      forward="(lambda y: y * torch.nn.functional.hardswish(y))"
                              "(self.conv(x) + self.residual)")
    assert_matches(compile_kernel(add))
    norm = conv_kernel(kernel_file, "ConvTranspose3d(3, 8, 3, stride=2, padding=1)", None,
                       input="torch.rand(2, 3, 4, 5, 6, generator=g)",
                       extra="        self.norm = torch.nn.GroupNorm(4, 8)\n",
                       forward="torch.nn.functional.hardswish(self.norm("
                               "(lambda y: torch.sigmoid(y) * y)(self.conv(x))))")
    assert_matches(compile_kernel(norm))


def test_depthwise_separable(kernel_file):
    path = conv_kernel(kernel_file, "Conv2d(6, 6, 3, groups=6, padding=1, bias=False)", "2, 6, 13, 20",
                       extra="        self.pointwise = torch.nn.Conv2d(6, 10, 1, bias=False)\n",
                       forward="self.pointwise(self.conv(x))")
    assert_matches(compile_kernel(path))


def test_convolutions_of_one_shape_start_from_zeros_of_their_own(kernel_file):
    """A depthwise separable pair whose outputs have one shape: CSE merges their zero
    inits into one fill; each convolution still starts from zeros per register tile (no
    zero pass over a whole output, no copy of it for the other convolution)."""
    path = conv_kernel(kernel_file, "Conv2d(8, 8, 3, groups=8, padding=1, bias=False)",
                       "1, 8, 16, 64",
                       extra="        self.pointwise = torch.nn.Conv2d(8, 8, 1, bias=False)\n",
                       forward="self.pointwise(self.conv(x))")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK-NOT: linalg.fill {{.*}} -> tensor<1x8x16x64xf32>
        CHECK-COUNT-2: linalg.fill {{.*}}lh.cv_role = "init"
        """)
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    assert "memref.copy %arg1" not in bufferized
    assert_matches(compile_kernel(path))


BACKWARD = {
    # an output padding (below the dilation) beyond the stride: the input gradient, a
    # convolution of the output's, reaches past the input (its forward output is one
    # element: the generic schedule may take that)
    "transposed_output_padding_past_input": ("ConvTranspose1d(5, 15, 4, padding=4, dilation=2, "
                                             "groups=5, output_padding=1, bias=False)", "2, 5, 2"),
    # the fuzzer: a stride above the window, padded past it; the input gradient is a
    # transposed convolution padded beyond its window's reach
    "strided_padded_past_window": ("Conv1d(2, 3, 1, stride=3, padding=1)", "2, 2, 1"),
}


@pytest.mark.parametrize("case", ["conv2d_padded", "conv1d_strided_dilated", "conv3d_strided",
                                  "conv2d_grouped", "depthwise", "transposed_strided",
                                  "transposed_grouped_dilated", "transposed_depthwise",
                                  "transposed_output_padding_past_input", "narrow_inner_3d",
                                  "strided_padded_past_window", "transposed_padded_past_window"])
def test_backward(kernel_file, case):
    """The joint graph: the input gradient is a (transposed) convolution of the output's
    gradient, the weight gradient a convolution of the input with it (torch-mlir lowers
    neither for grouped or transposed convolutions: lighthouse.conv_decompositions)."""
    module, shape = {**CASES, **BACKWARD}[case]
    compiled = compile_kernel(conv_kernel(kernel_file, module, shape), backward=True)
    assert compiled.family is CONVOLUTION, compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)


# ----------------------------------------------------------------------------- IR

def test_register_tile_is_the_matmul_micro_kernel():
    """An 8 x 32 outer product per step of the reduction over channels and window, the
    accumulator in registers across it, plain FMAs after lowering (the edge tile's mask
    dropped from the contraction: its loads and stores keep theirs; its accumulator start,
    the bias, in registers: no buffer allocated and copied per tile)."""
    sizes = {"N": 1, "C": 4, "H": 6, "W": 40, "F": 16}
    path = EXAMPLES / "convolution.py"
    vectorized = str(compile_kernel(path, overrides=sizes, stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: scf.forall
        CHECK: scf.for {{.*}} -> (vector<8x1x32xf32>)
        CHECK: vector.contract {{.*}} : vector<8x1xf32>, vector<1x1x32xf32> into vector<8x1x32xf32>
        CHECK: vector.transfer_write {{.*}} : vector<8x1x32xf32>
        CHECK: scf.for {{.*}} -> (vector<8x1x16xf32>)
        CHECK: vector.contract {{.*}} into vector<8x1x16xf32>
        CHECK: scf.forall.in_parallel
    """)
    assert "vector.mask" not in vectorized
    bufferized = str(compile_kernel(path, overrides=sizes, stop_after="bufferize").module)
    filecheck(bufferized, """
        CHECK: scf.parallel
        CHECK-NOT: memref.alloc
        CHECK: scf.for {{.*}} -> (vector<8x1x32xf32>)
        CHECK-COUNT-8: vector.fma {{.*}} : vector<32xf32>
        CHECK: scf.yield
        CHECK-NOT: memref.alloc
        CHECK: scf.reduce
    """)
    assert "arith.select" not in bufferized


def test_transposed_convolution_reads_no_stuffed_zeros():
    sizes = {"N": 1, "C": 4, "H": 5, "W": 6, "F": 4, "STRIDE": 2, "TRANSPOSED": True,
             "OUTPUT_PADDING": 1}
    fused = str(compile_kernel(EXAMPLES / "convolution.py", overrides=sizes,
                               stop_after="fuse").module)
    assert fused.count('lh.cv_role = "register"') >= 4  # one convolution per output phase
    filecheck(fused, """
        CHECK-NOT: tensor.insert_slice {{.*}} [1, 1, 2, 2] : tensor<1x4x5x6xf32>
        CHECK: scf.forall
    """)


@pytest.mark.parametrize("taps", [5, 8])
def test_a_register_tiles_row_of_taps_is_unrolled(kernel_file, taps):
    """With the image lanes (8 channels x 32 lanes), the innermost window dim's taps (up to
    TAPS_UNROLL_MAX) are unrolled in the loop over the outer window dim: one contraction
    per tap, no loop of its own (`tap_unroll`)."""
    path = conv_kernel(kernel_file, f"Conv2d(8, 16, (3, {taps}), bias=False)",
                       f"1, 8, 6, {31 + taps}")
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    filecheck(vectorized, f"""
        CHECK: scf.for %{{{{.*}}}} = %c0 to %c3 step %c1 iter_args({{{{.*}}}}) -> (vector<8x1x32xf32>)
        CHECK-NOT: scf.for
        CHECK-COUNT-{taps}: vector.contract {{{{.*}}}} into vector<8x1x32xf32>
        CHECK-NEXT: scf.yield
    """)
    assert_matches(compile_kernel(path))


def test_a_depthwise_convolutions_taps_stay_a_loop(kernel_file):
    """Rows along the image rows (a depthwise convolution): the taps stay a loop
    (`tap_unroll`; unrolled, the suite's depthwise ran 0.43 -> 0.58 ms)."""
    path = conv_kernel(kernel_file, "Conv2d(16, 16, 3, groups=16, bias=False)", "1, 16, 12, 34")
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: scf.for %{{.*}} = %c0 to %c3 step %c1 iter_args({{.*}}) -> (vector<5x32xf32>)
        CHECK: scf.for %{{.*}} = %c0 to %c3 step %c1 iter_args({{.*}}) -> (vector<5x32xf32>)
        CHECK-NOT: scf.yield
        CHECK: arith.mulf
        CHECK-NOT: arith.mulf
        CHECK: scf.yield
    """)
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("module, shape", [
    # 9 taps (over TAPS_UNROLL_MAX): a loop of its own
    ("Conv2d(8, 16, (3, 9), bias=False)", "1, 8, 6, 40"),
    # dilated and padded taps, two images, a partial lane tile
    ("Conv2d(6, 16, (2, 3), dilation=(1, 2), padding=(1, 2))", "2, 6, 5, 37"),
    # a 1-D row of 7 taps with a residual add after it, transposed view input
    ("Conv1d(16, 16, 7, padding=3, bias=False)", None),
    # a strided convolution: each phase's taps unrolled
    ("Conv2d(4, 16, (3, 6), stride=(1, 2), bias=False)", "1, 4, 6, 70"),
])
def test_unrolled_taps_match_torch(kernel_file, module, shape):
    """Neighbours of the tap unroll (`tap_unroll`) against torch."""
    if shape is None:
        path = conv_kernel(kernel_file, module, None,
                           input="torch.randn(1, 48, 16, generator=g).transpose(1, 2)",
                           forward="self.conv(x) + x")
    else:
        path = conv_kernel(kernel_file, module, shape)
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("case, imported", [
    ("narrow_inner_3d", "linalg.conv_2d_nchw_fchw {dilations = dense<[1, 20]> : vector<2xi64>"),
    ("narrow_inner_pointwise", "linalg.conv_1d_ncw_fcw"),
    ("narrow_inner_strided", "linalg.conv_2d_nchw_fchw")])
def test_a_narrow_inner_dim_of_one_tap_merges_into_the_one_before(kernel_file, case, imported):
    """[.., H, W, D] with a window (kh, kw, 1) is imported as a convolution over [.., H, W D]
    of dilation d D along W D; a 1 x 1 convolution over 5 x 6 as one over 30 lanes; a
    stride along W keeps both dims."""
    module, shape = CASES[case]
    ir_text = str(compile_kernel(conv_kernel(kernel_file, module, shape),
                                 stop_after="import").module)
    filecheck(ir_text, f"CHECK: {imported}")


# ----------------------------------------------------------------------------- choice

def _parse(text):
    return ir.Module.parse(text, ir.Context())


def test_family_is_chosen_for_convolution_payloads():
    compiled = compile_kernel(EXAMPLES / "convolution.py", overrides={"N": 1, "H": 8, "W": 8},
                              stop_after="cleanup")
    assert compiled.family is CONVOLUTION
    compiled = compile_kernel(EXAMPLES / "matmul.py", overrides={"N": 64}, stop_after="cleanup")
    assert compiled.family.name == "matmul"


def test_check_names_the_reason():
    channels_last = _parse("""
        func.func @main(%x: tensor<1x10x10x4xf32>, %w: tensor<3x3x4x8xf32>, %y: tensor<1x8x8x8xf32>) -> tensor<1x8x8x8xf32> {
          %r = linalg.conv_2d_nhwc_hwcf ins(%x, %w : tensor<1x10x10x4xf32>, tensor<3x3x4x8xf32>) outs(%y : tensor<1x8x8x8xf32>) -> tensor<1x8x8x8xf32>
          return %r : tensor<1x8x8x8xf32>
        }""")
    assert recognize(channels_last)
    assert "channels-first" in check(channels_last)
    notes = []
    assert choose_family(channels_last, notes=notes).name == "generic"
    assert "the convolution schedule does not apply" in notes[0]
    with pytest.raises(ScheduleMismatch, match="channels-first"):
        choose_family(channels_last, strict=True)
    integer = _parse("""
        func.func @main(%x: tensor<1x4x10x10xi32>, %w: tensor<8x4x3x3xi32>, %y: tensor<1x8x8x8xi32>) -> tensor<1x8x8x8xi32> {
          %r = linalg.conv_2d_nchw_fchw ins(%x, %w : tensor<1x4x10x10xi32>, tensor<8x4x3x3xi32>) outs(%y : tensor<1x8x8x8xi32>) -> tensor<1x8x8x8xi32>
          return %r : tensor<1x8x8x8xi32>
        }""")
    assert "element type i32" in check(integer)
    elementwise = _parse("""
        func.func @main(%a: tensor<16xf32>, %c: tensor<16xf32>) -> tensor<16xf32> {
          %r = linalg.add ins(%a, %a : tensor<16xf32>, tensor<16xf32>) outs(%c : tensor<16xf32>) -> tensor<16xf32>
          return %r : tensor<16xf32>
        }""")
    assert not recognize(elementwise)
    assert check(elementwise) == "the payload has no convolution"


def test_tiles_fit_the_shapes():
    conv = _parse("""
        func.func @main(%x: tensor<2x16x34x66xf32>, %w: tensor<64x16x3x3xf32>, %y: tensor<2x64x32x64xf32>) -> tensor<2x64x32x64xf32> {
          %r = linalg.conv_2d_nchw_fchw ins(%x, %w : tensor<2x16x34x66xf32>, tensor<64x16x3x3xf32>) outs(%y : tensor<2x64x32x64xf32>) -> tensor<2x64x32x64xf32>
          return %r : tensor<2x64x32x64xf32>
        }""")
    op = next(o for o in conv.body.operations[0].regions[0].blocks[0].operations
              if o.operation.name.startswith("linalg.conv")).operation
    c = analyze_convolution(op)
    assert isinstance(c, Convolution) and c.rows == 1 and c.lanes == 3
    tiles = convolution_tiles(c, ConvolutionParams(threads=2))
    # (n, f, oh, ow, c, kh, kw): whole rows per forall tile, oh split for 8 tiles
    assert tiles.forall[:2] == [1, 0] and 32 % tiles.forall[2] == 0
    assert 2 * (32 // tiles.forall[2]) >= 8
    assert tiles.register == [1, 8, 1, 32, 0, 0, 0] and tiles.interchange[-2:] == [3, 1]
    assert tiles.reduction == [0, 0, 0, 0, 1, 1, 1] and tiles.peel is None
    assert tiles.channel_block is None
    with pytest.raises(ValueError, match="tile_rows"):
        ConvolutionParams(tile_rows=12)


def test_a_phase_written_strided_along_its_lanes_keeps_its_channels_in_one_block():
    """A transposed convolution's phase writes every other lane of the result: its tile
    starts in registers and is written once (channel blocks would read and write it per
    block, element by element where masked: 5x slower at [8, 64, 28, 28] -> stride 2);
    the same convolution written contiguously is split into blocks."""
    payload = _parse("""
        func.func @main(%x: tensor<1x16x9x30xf32>, %w: tensor<8x16x3x3xf32>, %y: tensor<1x8x7x28xf32>, %big: tensor<1x8x14x56xf32>) -> (tensor<1x8x14x56xf32>, tensor<1x8x14x56xf32>) {
          %a = linalg.conv_2d_nchw_fchw ins(%x, %w : tensor<1x16x9x30xf32>, tensor<8x16x3x3xf32>) outs(%y : tensor<1x8x7x28xf32>) -> tensor<1x8x7x28xf32>
          %b = linalg.conv_2d_nchw_fchw ins(%x, %w : tensor<1x16x9x30xf32>, tensor<8x16x3x3xf32>) outs(%y : tensor<1x8x7x28xf32>) -> tensor<1x8x7x28xf32>
          %s = tensor.insert_slice %a into %big[0, 0, 0, 1] [1, 8, 7, 28] [1, 1, 2, 2] : tensor<1x8x7x28xf32> into tensor<1x8x14x56xf32>
          %c = tensor.insert_slice %b into %big[0, 0, 0, 0] [1, 8, 7, 28] [1, 1, 1, 1] : tensor<1x8x7x28xf32> into tensor<1x8x14x56xf32>
          return %s, %c : tensor<1x8x14x56xf32>, tensor<1x8x14x56xf32>
        }""")
    convs = [o.operation for o in payload.body.operations[0].regions[0].blocks[0].operations
             if o.operation.name.startswith("linalg.conv")]
    strided, contiguous = (analyze_convolution(op) for op in convs)
    assert writes_strided_lanes(strided) and not writes_strided_lanes(contiguous)
    params = ConvolutionParams(threads=2, block_bytes=1024)
    assert convolution_tiles(strided, params).channel_block is None
    assert convolution_tiles(contiguous, params).channel_block is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_classifier_head_after_the_convolutions(kernel_file, dtype):
    """A CNN's head (KernelBench level 3's AlexNet, VGG): a flatten (folded into the first
    linear layer by the elementwise fusion, collapsed back by
    transform_ext.collapse_reduction_dims) and linear layers, their weights transposed,
    each scheduled as the matmul family does (a second use of the first layer's output,
    odd sizes)."""
    path = conv_kernel(kernel_file, "Conv2d(3, 10, 3, padding=1)", "3, 3, 11, 9", dtype=dtype,
                       extra="        self.fc1 = torch.nn.Linear(10 * 5 * 4, 37).to(DTYPE)\n"
                             "        self.fc2 = torch.nn.Linear(37, 7).to(DTYPE)\n",
                       forward="(lambda h: self.fc2(h) + h[:, :7])(torch.relu(self.fc1(torch.flatten("
                               "torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2), 1))))")
    compiled = compile_kernel(path)
    assert_matches(compiled)
    fused = str(compile_kernel(path, stop_after="fuse").module)
    assert fused.count('lh.mm_role = "kernel"') + fused.count('lh.mm_role = "register"') == 2
    assert "reduction\", \"reduction" not in fused.split("lh.mm_role", 1)[1]


POOLINGS = {
    # KernelBench level 2's 67: GELU folded into the pool's body; 37 lanes (a masked tail)
    "gelu_global_average": ("Conv2d(5, 12, 3)", "2, 5, 13, 39",
                            "torch.nn.functional.adaptive_avg_pool2d(torch.nn.functional.gelu("
                            "self.conv(x)), 1).squeeze(-1).squeeze(-1)"),
    # keepdim, a max, a bias-free strided convolution (phases accumulating in the tile)
    "max_keepdim_strided": ("Conv2d(4, 9, 3, stride=(1, 2), bias=False)", "3, 4, 10, 41",
                            "torch.amax(torch.relu(self.conv(x)), dim=(2, 3), keepdim=True)"),
    # a sum over the lanes only (the rows kept), then a second use of the pooled result
    "row_sum_second_use": ("Conv2d(3, 10, (2, 3), padding=1)", "2, 3, 7, 20",
                           "(lambda p: p * p.sum(-1, keepdim=True))(self.conv(x).sum(-1))"),
    # 3-D, mean over D x H x W
    "mean_3d": ("Conv3d(3, 8, 3)", "2, 3, 5, 6, 19", "self.conv(x).mean(dim=(2, 3, 4))"),
    # depthwise (the register tile's rows are output rows, reduced here): 16 rows in
    # register tiles of 8, 19 rows one by one
    "depthwise_mean": ("Conv2d(6, 6, 3, groups=6, padding=1)", "2, 6, 16, 23",
                       "self.conv(x).mean(dim=(2, 3))"),
    "depthwise_odd_rows_max": ("Conv2d(6, 12, 3, groups=6, padding=1)", "2, 6, 19, 23",
                               "torch.amax(self.conv(x), dim=(2, 3))"),
    # the epilogue read twice: stored, pooled apart (no fusion)
    "epilogue_read_twice": ("Conv2d(3, 8, 3)", "2, 3, 9, 21",
                            "(lambda y: y.mean(dim=(2, 3)) + y[:, :, 0, 0])(torch.tanh(self.conv(x)))"),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(POOLINGS))
def test_a_pooling_after_the_convolution(kernel_file, case, dtype):
    module, shape, forward = POOLINGS[case]
    path = conv_kernel(kernel_file, module, shape, dtype=dtype, forward=forward)
    assert_matches(compile_kernel(path))


def test_a_global_pooling_is_computed_on_the_output_tiles(kernel_file):
    """The pool is the root: the threads split (batch, channels), a loop walks the output
    rows, each register tile of the convolution (GELU folded in) reduced as it is made;
    no [N, C, H, W] result is stored."""
    path = conv_kernel(kernel_file, "Conv2d(5, 16, 3)", "2, 5, 12, 40",
                       forward="torch.nn.functional.adaptive_avg_pool2d("
                               "torch.nn.functional.gelu(self.conv(x)), 1)")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK:      scf.forall {{.*}} -> (tensor<2x16xf32>)
        CHECK:      scf.for {{.*}} -> (tensor<1x16xf32>)
        CHECK:      lh.cv_role = "register"
        CHECK:      linalg.generic {{.*}}"reduction", "reduction"{{.*}} ins({{.*}} : tensor<1x8x1x?xf32>) {{.*}} lh.cv_role = "pooling"
        CHECK:      math.erf
        CHECK:      scf.forall.in_parallel
    """)
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    assert "memref<2x16x10x38xf32>" not in bufferized


def test_whole_images_are_padded_per_forall_tile(kernel_file):
    """A padded depthwise convolution whose forall tiles take whole images (one channel
    each): the padding is built per tile, from the tile's slice of the image (in cache),
    not as a padded copy of the whole image before the convolution; with tiles of image
    rows the padded image stays whole (a tile would copy its halo again)."""
    path = conv_kernel(kernel_file, "Conv2d(8, 8, 3, groups=8, padding=1, bias=False)",
                       "1, 8, 16, 64")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall
        CHECK: tensor.extract_slice %arg0{{.*}} to tensor<1x1x16x64xf32>
        CHECK: tensor.pad {{.*}} low[0, 0, 1, 1] high[0, 0, 1, 1]
        CHECK: } : tensor<1x1x16x64xf32> to tensor<1x1x18x66xf32>
        CHECK: lh.cv_role = "register"
        CHECK: scf.forall.in_parallel
        """)
    assert_matches(compile_kernel(path))
    rows = conv_kernel(kernel_file, "Conv2d(4, 16, 3, padding=1, bias=False)", "1, 4, 6, 40")
    fused = str(compile_kernel(rows, stop_after="fuse").module)
    assert fused.index("tensor.pad") < fused.index("scf.forall")
    assert_matches(compile_kernel(rows))


def test_window_loops_skip_the_taps_that_read_padding(kernel_file):
    """A transposed convolution of stride 1 (x padded by k - 1 - p): the loops over the
    taps of the outer image dims start and stop where the output row's window meets x; an
    unpadded convolution keeps its constant bounds."""
    path = conv_kernel(kernel_file, "ConvTranspose2d(4, 8, (3, 5), bias=False)", "1, 4, 6, 40")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK:      %[[LO:.*]] = arith.maxsi {{.*}}, %c0 : index
        CHECK:      %[[HI:.*]] = arith.minsi {{.*}}, %c3 : index
        CHECK:      scf.for %{{.*}} = %[[LO]] to %[[HI]] step %c1
        CHECK:      scf.for %{{.*}} = %c0 to %c5 step %c1
        CHECK:      lh.cv_role = "register"
    """)
    plain = conv_kernel(kernel_file, "Conv2d(4, 8, (3, 5), bias=False)", "1, 4, 6, 40")
    assert "arith.maxsi" not in str(compile_kernel(plain, stop_after="fuse").module)


def test_a_blocked_convolutions_start_is_written_in_static_tiles(kernel_file):
    """64 input channels in blocks: each forall tile's output starts as zeros in register
    tiles, then every block adds to it. Output rows of 66 lanes: the last partial tile of
    the start is peeled like the convolution's (2 lanes), never a dynamic tile that masks
    every store (AMD's vmaskmovps: 9% of KernelBench 57 on an AVX2 host). 56 output
    channels, not whole vectors: the last lanes are not split off with channel lanes
    (tests/schedules/test_convolution_lane_tails.py)."""
    path = conv_kernel(kernel_file, "ConvTranspose2d(64, 56, 3, bias=False)", "1, 64, 6, 64")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK-DAG: linalg.fill {{.*}}lh.cv_role = "init"{{.*}} outs(%{{.*}} : tensor<1x8x1x32xf32>)
        CHECK-DAG: linalg.fill {{.*}}lh.cv_role = "init"{{.*}} outs(%{{.*}} : tensor<1x8x1x2xf32>)
    """)
    assert "tensor<1x8x1x?xf32>" not in fused
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("channels,mr,rows", [(56, 8, 14), (20, 5, 10), (17, 8, 16)])
def test_the_last_lanes_of_a_blocked_convolution_take_taller_register_tiles(
        kernel_file, channels, mr, rows):
    """Output rows of 66 lanes in register tiles of MR x 32: the last 2 lanes are split off
    and tiled with MR x 32 / lanes rows of one vector (16 for MR 8), not MR rows (MR
    one-vector accumulators wait on the FMA latency: a third of KernelBench 61's time on an
    AVX2 host); the rows a divisor of the channels when one is at least half that (56
    channels: 14; 20: MR 5, then 10), else the last row tile peeled (17: 16 + 1). Channels
    that fill whole vectors split their last lanes off with channel lanes instead
    (tests/schedules/test_convolution_lane_tails.py)."""
    path = conv_kernel(kernel_file, f"ConvTranspose2d(64, {channels}, 3, bias=False)", "1, 64, 6, 64")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, f"""
        CHECK-DAG: lh.cv_role = "register", lh.cv_vector = array<i64: 1, {mr}, 1, 32, 1>
        CHECK-DAG: lh.cv_role = "register", lh.cv_vector = array<i64: 1, {rows}, 1, 32, 1>
        CHECK-DAG: outs(%{{{{.*}}}} : tensor<1x{rows}x1x2xf32>)
    """)
    assert_matches(compile_kernel(path))


def test_taller_last_lanes_tiles_in_bf16_with_a_transposed_view_and_a_second_use(kernel_file):
    """The split-off last lanes (66 = 2 x 32 + 2) on a bf16 convolution reading a
    transposed view, its result used twice."""
    path = conv_kernel(kernel_file, "ConvTranspose2d(64, 24, 3, bias=False)", None,
                       dtype="bfloat16", forward="(lambda y: (y, y.sum(1)))(self.conv(x.transpose(2, 3)))",
                       input="torch.randn(1, 64, 64, 6, generator=g).to(DTYPE)")
    compiled = compile_kernel(path)
    assert 'lh.cv_vector = array<i64: 1, 12, 1, 32, 1>' in str(compile_kernel(path, stop_after="fuse").module)
    assert_matches(compiled)


def test_an_unblocked_convolution_splits_its_last_lanes_when_the_reduction_is_long(kernel_file):
    """16 input channels x 9 taps (144 multiply-adds per output, in one channel block): the
    last 2 of 130 lanes take 16-row tiles and the start, the bias, is written per forall
    tile before the register tiles; with 4 channels (36 per output) the start stays in the
    register tiles (a pass writing it would cost more than the taller tiles save). (At 66
    lanes the output channels are the lanes: `wants_channel_lanes`.)"""
    long = conv_kernel(kernel_file, "ConvTranspose2d(16, 16, 3)", "2, 16, 5, 128")
    fused = str(compile_kernel(long, stop_after="fuse").module)
    assert 'lh.cv_vector = array<i64: 1, 16, 1, 32, 1>' in fused
    filecheck(fused, """
        CHECK: lh.cv_role = "init"
        CHECK: lh.cv_role = "register", lh.cv_vector = array<i64: 1, 8, 1, 32, 1>
    """)
    assert_matches(compile_kernel(long))
    short = conv_kernel(kernel_file, "ConvTranspose2d(4, 16, 3)", "2, 4, 5, 128")
    fused = str(compile_kernel(short, stop_after="fuse").module)
    assert 'lh.cv_vector = array<i64: 1, 16, 1, 32, 1>' not in fused
    assert_matches(compile_kernel(short))


def test_a_channel_lanes_tile_of_11_rows_is_transposed_in_16x16_blocks(kernel_file):
    """KernelBench 50's form: 11 x 11 windows of stride 4, output channels as lanes, register
    tiles of 11 output columns x 32 channels transposed back to channels-first. The 11 x 32
    transpose is lowered as two 16 x 16 blocks of register shuffles (lighthouse/targets/
    transpose_blocks.py), not as one 352-lane shuffle LLVM emitted as 32 scatters."""
    path = conv_kernel(kernel_file, "Conv2d(3, 32, 11, stride=4, padding=2)", "2, 3, 47, 47")
    assert_matches(compile_kernel(path))
    lowered = str(compile_kernel(path, stop_after="bufferize").module)
    widths = [int(w) for w in re.findall(r"vector\.shuffle [^\n]*: vector<(\d+)xf32>", lowered)]
    assert widths and max(widths) <= 32, sorted(set(widths))


def test_a_channel_lanes_convolution_starts_from_its_bias_per_register_tile(kernel_file):
    """Output channels as lanes with a bias: the start is the bias broadcast written
    channels-last per register tile (transform_ext.move_output_channels_innermost rebuilds
    it), not a transposed copy of the broadcast over the whole output, read per tile."""
    path = conv_kernel(kernel_file, "Conv2d(3, 32, 11, stride=4, padding=2)", "2, 3, 47, 47")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<32xf32>) outs(%{{.*}} : tensor<1x1x11x32xf32>) attrs = {{{.*}}lh.cv_role = "init"
        CHECK: lh.cv_role = "register"
        """)
    assert len(re.findall(r"linalg.transpose", fused)) == 1  # the filter's
    assert_matches(compile_kernel(path))
