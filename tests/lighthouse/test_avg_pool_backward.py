"""The backward of average poolings (lighthouse.pool_decompositions: a transposed depthwise
convolution of dy / D with ones) against torch: 1-D and 2-D, overlapping and gapped
windows, padding counted or not, a divisor override, sizes the windows do not cover, an
unbatched input, bf16, a transposed-view input; ceil mode and 3-D are refused with a clear
error.
Unbatched poolings (pooled as a batch of one) forward, average and max."""

import pytest

from lighthouse.compile import compile_kernel
from lighthouse.errors import LighthouseError

KERNEL = """
import torch
import torch.nn.functional as F
DTYPE = torch.{dtype}

class Model(torch.nn.Module):
    def forward(self, x):
        return {expr}

def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({shape}, generator=g).to(DTYPE).requires_grad_()]

def get_init_inputs():
    return []
"""

CASES = {
    "1d": ("F.avg_pool1d(x, 2, 2)", "3, 5, 9"),
    "1d_overlapping_padded": ("F.avg_pool1d(x, 3, 2, padding=1)", "2, 4, 10"),
    "2d_gapped": ("F.avg_pool2d(x, 2, 3)", "2, 3, 8, 11"),
    "2d_padding_not_counted": ("F.avg_pool2d(x, 3, 2, padding=1, count_include_pad=False)", "2, 3, 7, 9"),
    "2d_divisor": ("F.avg_pool2d(x, (2, 3), (1, 2), divisor_override=5)", "1, 2, 6, 9"),
    "2d_unbatched": ("F.avg_pool2d(x, 2)", "3, 6, 7"),
    "2d_transposed_view": ("F.avg_pool2d(x.transpose(2, 3), 2) * 3.0", "2, 3, 9, 6"),
    "after_matmul": ("F.avg_pool1d((x @ x.transpose(1, 2)).relu(), 2, 2)", "2, 6, 5"),
}


def _kernel(kernel_file, expr, shape, dtype="float32"):
    return kernel_file(KERNEL.format(expr=expr, shape=shape, dtype=dtype))


@pytest.mark.parametrize("case", CASES)
def test_average_pooling_backward_matches_torch(kernel_file, case):
    expr, shape = CASES[case]
    compiled = compile_kernel(_kernel(kernel_file, expr, shape), backward=True)
    reports = compiled.check()
    assert any(r.name.startswith("d_") for r in reports), [r.name for r in reports]
    for r in reports:
        assert r.ok, str(r)


def test_bf16_average_pooling_backward(kernel_file):
    compiled = compile_kernel(_kernel(kernel_file, "F.avg_pool2d(x, 3, 2, padding=1)", "2, 3, 9, 8",
                                      "bfloat16"), backward=True)
    for r in compiled.check():
        assert r.ok, str(r)


@pytest.mark.parametrize("expr,shape", [("F.avg_pool2d(x, 2, 2, ceil_mode=True)", "1, 2, 5, 5"),
                                        ("F.avg_pool3d(x, 2)", "1, 2, 4, 4, 4")])
def test_ceil_mode_and_3d_are_refused_with_a_clear_error(kernel_file, expr, shape):
    with pytest.raises(LighthouseError, match="torch-mlir cannot lower"):
        compile_kernel(_kernel(kernel_file, expr, shape), backward=True)


@pytest.mark.parametrize("expr", ["F.avg_pool2d(x, 2)", "F.max_pool2d(x, 3, 2, padding=1)",
                                  "F.avg_pool3d(x.unsqueeze(0), 2).squeeze(0)",
                                  "F.max_pool3d(x.unsqueeze(0), 2).squeeze(0)"])
def test_unbatched_poolings_forward(kernel_file, expr):
    compiled = compile_kernel(_kernel(kernel_file, expr, "3, 6, 7"))
    for r in compiled.check():
        assert r.ok, str(r)
