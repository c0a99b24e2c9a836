"""--backward of the normalization layers against torch, on small odd shapes with random
affine parameters and running statistics: batch norm in eval mode (1-D, 2-D, 3-D, without
affine, bf16), which imported as torch's eval kernel whose backward read the empty saved
statistics with the channels' shape ('tensor.cast' ... 'tensor<0xf32>' are cast
incompatible) and is now traced in its affine form; batch norm with batch statistics
(track_running_stats=False), LayerNorm, GroupNorm, InstanceNorm (with and without running
statistics)."""

import pytest

from lighthouse.compile import compile_kernel

KERNEL = """
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = {module}
        g = torch.Generator().manual_seed(1)
        for p in self.norm.parameters():
            p.data = torch.randn(p.shape, generator=g)
        if getattr(self.norm, "running_mean", None) is not None:
            self.norm.running_mean = torch.randn(self.norm.running_mean.shape, generator=g)
            self.norm.running_var = torch.rand(self.norm.running_var.shape, generator=g) + 0.5
        self.to(torch.{dtype})

    def forward(self, x):
        return self.norm(x)

def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({shape}, generator=g).to(torch.{dtype}) * 2 + 0.5]

def get_init_inputs():
    return []
"""

CASES = [
    ("batchnorm1d_eval", "torch.nn.BatchNorm1d(3)", (4, 3), "float32"),
    ("batchnorm1d_eval_3d", "torch.nn.BatchNorm1d(3)", (5, 3, 7), "float32"),
    ("batchnorm2d_eval", "torch.nn.BatchNorm2d(3)", (2, 3, 5, 7), "float32"),
    ("batchnorm3d_eval", "torch.nn.BatchNorm3d(2)", (2, 2, 3, 5, 3), "float32"),
    ("batchnorm2d_eval_no_affine", "torch.nn.BatchNorm2d(3, affine=False)", (2, 3, 5, 7), "float32"),
    ("batchnorm1d_eval_bf16", "torch.nn.BatchNorm1d(3)", (5, 3, 7), "bfloat16"),
    ("batchnorm1d_batch_stats", "torch.nn.BatchNorm1d(3, track_running_stats=False)", (5, 3, 7), "float32"),
    ("batchnorm2d_batch_stats_no_affine",
     "torch.nn.BatchNorm2d(3, affine=False, track_running_stats=False)", (3, 3, 5, 1), "float32"),
    ("layernorm", "torch.nn.LayerNorm([5, 7])", (3, 5, 7), "float32"),
    ("layernorm_bf16", "torch.nn.LayerNorm(7)", (5, 7), "bfloat16"),
    ("groupnorm", "torch.nn.GroupNorm(2, 6)", (3, 6, 5), "float32"),
    ("instancenorm2d_affine", "torch.nn.InstanceNorm2d(3, affine=True)", (2, 3, 5, 7), "float32"),
    ("instancenorm1d_running_stats", "torch.nn.InstanceNorm1d(3, track_running_stats=True)", (2, 3, 7), "float32"),
]


@pytest.mark.parametrize("name,module,shape,dtype", CASES, ids=[c[0] for c in CASES])
def test_norm_backward_matches_torch(kernel_file, name, module, shape, dtype):
    path = kernel_file(KERNEL.format(module=module, shape=", ".join(map(str, shape)), dtype=dtype))
    compiled = compile_kernel(path, backward=True)
    for report in compiled.check():
        assert report.ok, str(report)


GROUP_NORM_NEAR_OVERFLOW = """
import torch
DTYPE = torch.float16
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, 4).to(DTYPE)
    def forward(self, x):
        return torch.tanh(self.norm(x)) * 3.0
def get_inputs():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5) * 30000
    x[1, 0, 1] = float("inf")  # sample 1: group 0 is NaN, group 1 stays finite
    return [x.to(DTYPE)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_narrow_group_norm_backward_sums_in_f32(kernel_file, dtype):
    """f16 GroupNorm backward with |x| near 60000: the sums of dy x over a group are f32 as
    in torch's kernel (autograd's own formula, in f16, overflowed them and made the finite
    group next to a NaN one NaN too)."""
    compiled = compile_kernel(kernel_file(GROUP_NORM_NEAR_OVERFLOW), backward=True,
                              overrides={"DTYPE": dtype})
    for r in compiled.check():
        assert r.ok, str(r)
    d_input = compiled.run()[1]
    assert d_input[1, 2:].isfinite().all() and d_input[1, :2].isnan().all()
