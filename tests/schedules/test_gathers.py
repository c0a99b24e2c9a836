"""Reads at data-dependent indices (x[i], index_select, embedding, gather): torch's values in
range, negative indices wrapped where torch wraps them, and a KernelError where torch raises
(schedules/prepare.py: clamp_gather_indices). The reads are clamped, so a bad index never
reads outside the tensor."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.errors import KernelError

KERNEL = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, x, i):
        return {expr}
def get_inputs():
    return [torch.randn(10, 6), torch.tensor([1, 3, 2, 9, 0])]
def get_init_inputs():
    return []
"""

GATHERS = {
    "index": ("x[i]", True),
    "index_select": ("torch.index_select(x, 0, i)", False),
    "embedding": ("F.embedding(i, x)", False),
    "gather": ("torch.gather(x, 0, i.view(5, 1).expand(5, 6))", False),
    "columns": ("x[:, i % 6].sum(0) + x[i].t().sum(0)", True),
    "twice": ("x[i] + x[i.flip(0)].exp()", True),
}


@pytest.mark.parametrize("name", GATHERS)
def test_gathers_match_torch_and_report_bad_indices(kernel_file, name):
    expr, wraps = GATHERS[name]
    path = kernel_file(KERNEL.format(expr=expr))
    compiled = compile_kernel(path)
    model = compiled.kernel.model
    x = torch.randn(10, 6)
    good = [torch.tensor([1, 3, 2, 9, 0])] + ([torch.tensor([-1, -10, 4, 5, 0])] if wraps else [])
    for i in good:
        torch.testing.assert_close(compiled.run(x, i)[0], model(x, i))
    for bad in (10, 10**9, -11, -1 if not wraps else -12):
        i = torch.tensor([1, bad, 2, 0, 3])
        with pytest.raises(IndexError if name != "gather" else RuntimeError):
            model(x, i)
        with pytest.raises(KernelError):
            compiled.run(x, i)


STRIDED = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, i):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 9, generator=g), torch.randint(0, 3, (5, 3), generator=g)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("expr", [
    "torch.gather(x[:, :3], 1, i)", "torch.gather(x[:, 4:7], 1, i) * 2",
    "torch.gather(x[1:4], 1, i[:3])", "torch.gather(x.t()[:3], 0, i.t()[:, :3])",
    "torch.gather(x[:, ::2], 1, i)",
])
def test_gathers_from_a_strided_slice(kernel_file, expr):
    """The vectorized gather linearizes indices over the slice's own shape; a slice that
    is not one contiguous run of memory (x[:, :3] of [5, 9]) is read through a dense copy
    (it read the wrong rows: max abs err 2.9)."""
    compiled = compile_kernel(kernel_file(STRIDED.format(expr=expr)))
    for r in compiled.check():
        assert r.ok, str(r)


def test_topk_backward(kernel_file):
    """topk's backward scatters into a gather of a strided slice (wrong d_input before)."""
    path = kernel_file("""
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return torch.topk(x, 3, dim=1).values * 2
def get_inputs():
    return [torch.randn(6, 11)]
def get_init_inputs():
    return []
""")
    for r in compile_kernel(path, backward=True).check():
        assert r.ok, str(r)
