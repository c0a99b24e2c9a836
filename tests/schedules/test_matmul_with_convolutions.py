"""Convolutions in a payload the matmul family takes (its contractions dominate: a SwinMLP
block's grouped 1x1 `Conv1d` mixing the tokens of each window beside its MLP): the
convolutions get the convolution family's schedule (register tiles along the tokens, not
the generic tiling of an "other" op), the contractions the matmul schedule, and the
convolution family's @vectorize takes both. Against torch (the block, odd sizes, a
convolution with a window, bf16, a transposed-view input and a second use) and the fused IR."""

import re

import pytest

from lighthouse.compile import compile_kernel
from lighthouse.families import MATMUL
from tests.schedules.test_matmul_reductions import assert_matches

KERNEL = """
import torch
DTYPE = torch.{dtype}

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm({d}).to(DTYPE)
        self.mix = torch.nn.Conv1d({tokens}, {tokens}, {window}, groups={groups},
                                   padding={window} // 2).to(DTYPE)
        self.fc1 = torch.nn.Linear({d}, {h}).to(DTYPE)
        self.fc2 = torch.nn.Linear({h}, {d}).to(DTYPE)

    def forward(self, x):
        x = x + self.mix(self.norm(x))
        hidden = torch.nn.functional.gelu(self.fc1(x))
        return {result}

def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [{input}]

def get_init_inputs():
    return []
"""


def block_kernel(kernel_file, *, b=4, tokens=49, d=96, h=384, groups=1, window=1,
                 dtype="float32", result="x + self.fc2(hidden)", input=None):
    return kernel_file(KERNEL.format(
        b=b, tokens=tokens, d=d, h=h, groups=groups, window=window, dtype=dtype,
        result=result, input=input or f"torch.randn({b}, {tokens}, {d}, generator=g).to(DTYPE)"))


def _fused(path) -> str:
    compiled = compile_kernel(path, stop_after="fuse")
    assert compiled.family is MATMUL, compiled.notes
    return str(compiled.module)


@pytest.mark.parametrize("b,tokens,d,h,groups", [(4, 49, 96, 384, 1), (2, 147, 32, 128, 3),
                                                 (3, 10, 37, 75, 2)])
def test_the_block_matches_torch_with_every_layer_scheduled(kernel_file, b, tokens, d, h, groups):
    path = block_kernel(kernel_file, b=b, tokens=tokens, d=d, h=h, groups=groups)
    fused = _fused(path)
    assert fused.count("lh.mm_done") == 2                # both linear layers
    assert 'lh.cv_role = "register"' in fused            # the token-mixing convolution
    assert_matches(compile_kernel(path))


def test_a_convolution_with_a_window(kernel_file):
    path = block_kernel(kernel_file, window=3, groups=7)
    assert 'lh.cv_role = "register"' in _fused(path)
    assert_matches(compile_kernel(path))


def test_bf16(kernel_file):
    assert_matches(compile_kernel(block_kernel(kernel_file, dtype="bfloat16")))


def test_a_transposed_view_input_and_a_second_use(kernel_file):
    path = block_kernel(kernel_file, input="torch.randn(4, 96, 49, generator=g).transpose(1, 2)",
                        result="(x + self.fc2(hidden), hidden.transpose(1, 2))")
    assert_matches(compile_kernel(path))


FLATTEN_KERNEL = """
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.patches = torch.nn.Conv2d(3, 8, 4, stride=4)
        self.proj = torch.nn.Linear(8 * 4 * 4, 256)

    def forward(self, x):
        return self.proj(self.patches(x).flatten(1))

def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(10, 3, 16, 16, generator=g)]

def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("batch", [20, 10])
def test_a_flatten_before_a_linear_layer_keeps_the_weight_in_place(kernel_file, batch):
    """CvT's patch embedding: Conv2d -> flatten -> Linear. The flatten stays a reshape of
    the linear layer's input (transform_ext.fold_reshape_ops_by_expansion with
    keep_reduction_loops), so the weight's transpose folds into its packing; split along
    (c, h, w) it was a [8, 4, 4, 256] copy of W transposed per call (CvT 0.63x torch). A
    batch of 10 is a short product: W read in place through its split k, [256, 8, 16]."""
    path = kernel_file(FLATTEN_KERNEL.replace("randn(10,", f"randn({batch},"))
    fused = _fused(path)
    assert "tensor<8x4x4x256xf32>" not in fused and "tensor<8x4x4x1x256xf32>" not in fused
    if batch > 16:
        assert fused.count("lh.mm_done") == 1
    else:
        assert "output_shape [256, 8, 16] : tensor<256x128xf32>" in fused
    assert_matches(compile_kernel(path))


PATCH_HEAD = """
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.patch = torch.nn.Conv2d(3, 64, 4, stride=4)
        self.proj = torch.nn.Linear(256, 64)
        self.head = torch.nn.Linear(64, {classes})

    def forward(self, x):
        x = torch.relu(self.proj(self.patch(x).flatten(1)))
        return {result}

def get_inputs():
    return [torch.randn({b}, 3, 8, 8, generator=torch.Generator().manual_seed(1))]

def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("b,classes,result", [
    (10, 200, "self.head(x)"),
    (7, 75, "(self.head(x).t(), x)"),        # odd sizes, a transposed result, a second use
])
def test_short_products_beside_a_convolution_step_as_fmas(kernel_file, b, classes, result):
    """A patch embedding's convolution puts the payload's @vectorize in the convolution
    family; its short products (x @ W^T of b <= 16 rows, k split into lanes) still step by
    whole-vector FMAs, not a lane-batched vector.contract (unrolled to one scalar FMA per
    lane: KernelBench level 3's CvT head ran 0.94x torch instead of 1.35x)."""
    path = kernel_file(PATCH_HEAD.format(b=b, classes=classes, result=result))
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    lane_steps = re.findall(r"vector\.fma .* : vector<\d+x\d+x16xf32>", vectorized)
    lane_contracts = re.findall(r"vector\.contract .* : vector<\d+x1x16xf32>, vector<\d+x1x16xf32>",
                                vectorized)
    assert lane_steps and not lane_contracts, (lane_steps, lane_contracts)
    assert_matches(compile_kernel(path))
