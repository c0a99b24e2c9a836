"""CPU lowering details that speed kernels up without changing results: lane-tree
reductions (NaN still propagates), no sequential max, in-place loop-carried buffers,
results written straight into the caller's tensors."""

import torch

from lighthouse.compile import compile_kernel
from tests.conftest import ROOT
from tests.transform_ext.helpers import check as filecheck

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


RESHAPED_RESULTS = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        y = torch.exp(x).reshape(4, 3, 8)
        return y, y.reshape(12, 8), x.sum(0)
def get_inputs():
    return [torch.randn(12, 8)]
def get_init_inputs():
    return []
"""


def test_attention_writes_its_result_in_place_of_a_copy(tmp_path):
    """Attention's [B*H, S, D] result is returned as [B, H, S, D]: the kernel writes the
    caller's tensor through a collapsed view of it, with no result-sized buffer and no copy."""
    compiled = compile_kernel(ROOT / "examples" / "attention.py", stop_after="bufferize",
                              overrides={"B": 1, "H": 4, "S": 64, "D": 16})
    filecheck(str(compiled.module), """
        CHECK: func.func @main({{.*}}, %[[OUT:.*]]: memref<1x4x64x16xf32>)
        CHECK: memref.collapse_shape %[[OUT]] {{\\[\\[}}0, 1], [2], [3]] : memref<1x4x64x16xf32> into memref<4x64x16xf32>
        CHECK-NOT: memref.alloc() {{.*}} : memref<4x64x16xf32>
        CHECK-NOT: memref.copy {{.*}}, %[[OUT]]
        CHECK: return
    """)


def test_a_buffer_returned_twice_keeps_its_copies(kernel_file):
    """One buffer returned as two results (reshaped) becomes one out-parameter; the other
    result stays a copy of it (a view of an out-parameter is not rewritten), and every
    result matches torch."""
    path = kernel_file(RESHAPED_RESULTS)
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    assert bufferized.count("memref.copy") == 1
    compiled = compile_kernel(path)
    for r in compiled.check():
        assert r.ok, str(r)



BF16_ROWS = """
import torch
N = 17
class Model(torch.nn.Module):
    def forward(self, x, y):
        return x * 2.0, torch.softmax(y, -1), (y.float() + 1).to(torch.bfloat16)
def get_inputs():
    return [torch.randn(N, dtype=torch.bfloat16), torch.randn(3, N, dtype=torch.bfloat16)]
def get_init_inputs():
    return []
"""


def test_bf16_vectors_of_any_width_convert(kernel_file):
    """9, 17, 33 lanes: LLVM's x86 backend aborted on the odd lane of a bf16 conversion."""
    path = kernel_file(BF16_ROWS)
    for n in (9, 17, 33, 48):
        compiled = compile_kernel(path, overrides={"N": n})
        for r in compiled.check():
            assert r.ok, f"N={n}: {r}"
