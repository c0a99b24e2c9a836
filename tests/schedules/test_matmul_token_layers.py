"""The matmul family on a transformer's layers over [B, S, D] tokens (SwinMLP's and ViT's
LayerNorm -> Linear -> GELU -> Linear + residual): reshape propagation makes each linear
layer a contraction over (b, s, n, k); its m loops are collapsed back
(transform_ext.collapse_contraction_parallel_dims) and no layer norm or GELU is fused into
it (recomputed per output column, no contraction left for the schedule: 0.15x torch).
Against torch (odd sizes, bf16, a transposed-view input, a second use of the hidden layer)
and the scheduled kernels in the fused IR."""

import pytest

from lighthouse.compile import compile_kernel
from tests.schedules.test_matmul_reductions import assert_matches

KERNEL = """
import torch
DTYPE = torch.{dtype}

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm({d}).to(DTYPE)
        self.fc1 = torch.nn.Linear({d}, {h}).to(DTYPE)
        self.fc2 = torch.nn.Linear({h}, {d}).to(DTYPE)

    def forward(self, x):
        hidden = torch.nn.functional.gelu(self.fc1(self.norm(x)))
        return {result}

def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [{input}]

def get_init_inputs():
    return []
"""


def mlp_kernel(kernel_file, *, b=2, s=37, d=24, h=96, dtype="float32",
               result="x + self.fc2(hidden)", input=None):
    return kernel_file(KERNEL.format(
        b=b, s=s, d=d, h=h, dtype=dtype, result=result,
        input=input or f"torch.randn({b}, {s}, {d}, generator=g).to(DTYPE)"))


def _kernels(path) -> int:
    """The contractions the matmul schedule took (packed or in place)."""
    return str(compile_kernel(path, stop_after="fuse").module).count("lh.mm_done")


@pytest.mark.parametrize("b,s,d,h", [(2, 37, 24, 96), (3, 49, 96, 384), (1, 5, 7, 13)])
def test_the_mlp_block_matches_torch_with_both_layers_scheduled(kernel_file, b, s, d, h):
    path = mlp_kernel(kernel_file, b=b, s=s, d=d, h=h)
    assert _kernels(path) == 2
    assert_matches(compile_kernel(path))


def test_bf16(kernel_file):
    assert_matches(compile_kernel(mlp_kernel(kernel_file, dtype="bfloat16")))


def test_a_transposed_view_input_and_a_second_use_of_the_hidden_layer(kernel_file):
    path = mlp_kernel(kernel_file, result="(x + self.fc2(hidden), hidden.sum(-1))",
                      input="torch.randn(37, 2, 24, generator=g).transpose(0, 1)")
    assert _kernels(path) == 2
    assert_matches(compile_kernel(path))


def test_a_layer_norm_before_one_linear_layer(kernel_file):
    path = mlp_kernel(kernel_file, result="self.fc1(self.norm(x)).transpose(1, 2)")
    assert _kernels(path) == 1
    assert_matches(compile_kernel(path))




VIT = """
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(d_model={d}, nhead=2, dim_feedforward={d},
                                                 dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2,
                                                   enable_nested_tensor=False)
        self.embed = torch.nn.Linear(3 * 16 * 16, {d})
        self.cls = torch.nn.Parameter(torch.randn(1, 1, {d}))
        self.position = torch.nn.Parameter(torch.randn(1, {patches} + 1, {d}))
        self.head = torch.nn.Sequential(torch.nn.Linear({d}, 32), torch.nn.GELU(),
                                        torch.nn.Linear(32, 10))

    def forward(self, image):
        x = image.unfold(2, 16, 16).unfold(3, 16, 16).reshape(image.shape[0], -1, 3 * 16 * 16)
        x = torch.cat((self.cls.expand(image.shape[0], -1, -1), self.embed(x)), dim=1)
        x += self.position
        x = self.encoder(x)
        return self.head(x[:, 0])

def get_inputs():
    return [torch.randn({b}, 3, {side}, {side}, generator=torch.Generator().manual_seed(1))]

def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("b,side,d", [(2, 224, 32), (3, 48, 16)])
def test_vit_layers_keep_each_contraction_once(kernel_file, b, side, d):
    """One thread: a layer norm reading a linear layer of one output tile (whose forall
    folds into its scf.for) is tiled alone: structured.fuse would follow the reshape into the layer's
    unpack loop and the layers before it, copying them per row (a ViT's fuse stage grew
    fivefold per layer and took over 15 minutes). The head's two layers over the b class
    tokens are short products, split (transform_ext.split_matvec_lanes), not packed."""
    path = kernel_file(VIT.format(b=b, side=side, d=d, patches=(side // 16) ** 2))
    fused = str(compile_kernel(path, stop_after="fuse", threads=1, schedule="matmul").module)
    assert fused.count("lh.mm_done") == 13
    assert f"tensor<10x{b}x16xf32>" in fused  # the last layer's partial sums
    assert fused.count("linalg.generic") < 100
    assert_matches(compile_kernel(path, threads=1, schedule="matmul"))
