"""CPU lowering details that speed kernels up without changing results: lane-tree
reductions (NaN still propagates), no sequential max, in-place loop-carried buffers."""

import torch

from lighthouse.compile import compile_kernel

ROWS = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x.amax(-1), x.amin(-1), x.sum(-1), torch.softmax(x, -1)
def get_inputs():
    x = torch.randn(6, 64)
    x[1, 5] = float("nan"); x[2, :] = float("-inf"); x[3, 7] = float("inf")
    return [x]
def get_init_inputs():
    return []
"""


def test_row_max_min_sum_reduce_as_trees_and_match_torch_with_nan_and_inf(kernel_file):
    path = kernel_file(ROWS)
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    assert "vector.shuffle" in bufferized                   # max/min: shuffle trees
    assert "vector.reduction <maximumf>" not in bufferized
    assert "fastmath<reassoc>" in bufferized                # sums: reassociated lane trees
    compiled = compile_kernel(path)
    for r in compiled.check():
        assert r.ok, str(r)
    amax = compiled.run()[0]
    assert torch.isnan(amax[1]) and amax[2] == float("-inf") and amax[3] == float("inf")
