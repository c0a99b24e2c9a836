"""Zero-size tensors and repeated results: every kernel matches torch (cleanup folds the
linalg ops that iterate over nothing; a buffer returned twice gets a copy per result)."""

import pytest

from lighthouse.compile import compile_kernel

KERNEL = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, {args}):
        return {body}
def get_inputs():
    return [{inputs}]
def get_init_inputs():
    return []
"""

CASES = {
    "softmax_no_rows": ("x", "torch.softmax(x, -1)", "torch.randn(0, 16)"),
    "log_softmax_no_rows": ("x", "torch.log_softmax(x, -1)", "torch.randn(0, 9)"),
    "sum_and_mean_over_no_rows": ("x", "x.sum(0), x.mean(0), x.amax(1)", "torch.randn(0, 5)"),
    "view_of_no_rows": ("x", "x.amax(1).view(0, 1) + 1", "torch.randn(0, 5)"),
    "matmul_k0": ("a, b", "a @ b", "torch.randn(5, 0), torch.randn(0, 7)"),
    "bmm_no_batch": ("a, b", "torch.bmm(a, b)", "torch.randn(0, 4, 5), torch.randn(0, 5, 6)"),
    "layer_norm_no_rows": ("x", "F.layer_norm(x, (32,))", "torch.randn(0, 32)"),
    "cross_entropy_no_rows_mean": ("x, y", "F.cross_entropy(x, y)",
                                   "torch.randn(0, 19), torch.zeros(0, dtype=torch.long)"),
    "cross_entropy_no_rows_sum": ("x, y", "F.cross_entropy(x, y, reduction='sum')",
                                  "torch.randn(0, 19), torch.zeros(0, dtype=torch.long)"),
    "cross_entropy_no_rows_none": ("x, y", "F.cross_entropy(x, y, reduction='none')",
                                   "torch.randn(0, 19), torch.zeros(0, dtype=torch.long)"),
    "returned_twice": ("x", "(lambda y: (y, y))(x * 2)", "torch.randn(4, 16)"),
    "input_returned": ("x, z", "(lambda y: (y, x, y, z, x))(x + 1)",
                       "torch.randn(4, 16), torch.randn(3)"),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_matches_torch(kernel_file, name, backward):
    args, body, inputs = CASES[name]
    path = kernel_file(KERNEL.format(args=args, body=body, inputs=inputs))
    compiled = compile_kernel(path, backward=backward)
    reports = compiled.check()
    assert reports
    for r in reports:
        assert r.ok, f"{name}: {r}"
