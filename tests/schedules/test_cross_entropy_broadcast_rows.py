"""The cross-entropy schedule's row tile when the row max reads a broadcast row first (a
[1, C] bias added to transposed logits): its class dim is one of the row max's loops, not a
dim of that operand (an IndexError in the planner; found by the fuzzer's rows family)."""

import pytest

from lighthouse.compile import compile_kernel

BROADCAST_ROW_SOFTMAX = """
import torch
DTYPE = torch.float16
class Model(torch.nn.Module):
    def forward(self, x0, x1):
        e1 = x0 + 0.5 + x1
        r0 = torch.softmax(e1, dim=1)
        return torch.log((r0 + 0.5).abs() + 1.0), e1
def get_inputs():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(33, 5, generator=g, dtype=DTYPE).t()
    x1 = torch.randn(1, 66, generator=g, dtype=DTYPE)[..., ::2]
    return [x0, x1]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_softmax_of_a_broadcast_row_sum_matches_torch(kernel_file, dtype):
    path = kernel_file(BROADCAST_ROW_SOFTMAX.replace("torch.float16", f"torch.{dtype}"))
    compiled = compile_kernel(path)
    assert compiled.family.name == "cross_entropy"
    for r in compiled.check():
        assert r.ok, str(r)
