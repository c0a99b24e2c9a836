"""The matmul family's packing of a transposed operand (KernelBench 16 and 18: A given as
[K, M], `A.T @ B`): the transpose folds into the pack, which then reads m contiguous, so
its slices are visited k outer and panel inner (each k row's cache line serves every panel
of the block before it is evicted; panel outer read each line once per panel, 4 KiB apart:
0.61x torch on AVX2). Against torch (odd sizes, both operands transposed, bf16, a second
use of the product) and the loop order of the pack in the vectorized IR."""

import pytest

from lighthouse.compile import compile_kernel
from tests.schedules.test_matmul import assert_matches, binary_kernel
from tests.transform_ext.helpers import check as filecheck

# (m, n, k, expr, a's shape, b's shape); A given as [K, M]
CASES = [
    (256, 256, 256, "a.t() @ b", "K, M", "K, N"),
    (77, 203, 131, "a.t() @ b", "K, M", "K, N"),                # sizes that divide no tile
    (77, 203, 131, "a.t() @ b.t()", "K, M", "N, K"),            # both (KernelBench 18)
    (48, 40, 64, "(lambda c: (c, c.sum(0)))(a.t() @ b)", "K, M", "K, N"),  # a second use
]


@pytest.mark.parametrize("m,n,k,expr,a_shape,b_shape", CASES)
def test_transposed_operands_match_torch(kernel_file, m, n, k, expr, a_shape, b_shape):
    path = binary_kernel(kernel_file, m, n, k, expr=expr, a_shape=a_shape, b_shape=b_shape)
    assert_matches(compile_kernel(path))


def test_bf16(kernel_file):
    assert_matches(compile_kernel(binary_kernel(kernel_file, 77, 203, 131, dtype="bfloat16",
                                                expr="a.t() @ b", a_shape="K, M")))


def test_the_pack_of_a_transposed_operand_walks_k_outer(kernel_file):
    """A [K, M] read as A^T: per 16 rows of k, every 8-row panel of the block (the tests'
    CPU description: 8 x 32 register tiles), each a 16 x 8 read of 8 contiguous m."""
    path = binary_kernel(kernel_file, 256, 256, 256, expr="a.t() @ b", a_shape="K, M")
    vectorized = str(compile_kernel(path, stop_after="vectorize", threads=1).module)
    filecheck(vectorized, """
        CHECK:      scf.for %{{.*}} = %c0 to %c256 step %c16 iter_args({{.*}}) -> (tensor<8x256x8xf32>)
        CHECK-NEXT:   scf.for %{{.*}} = %c0 to %c8 step %c1 iter_args({{.*}}) -> (tensor<8x256x8xf32>)
        CHECK:          vector.transfer_read {{.*}} : tensor<16x8xf32>, vector<16x8xf32>
    """)


LINEAR_THEN_POOLING = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(256, 512)
    def forward(self, x):
        return F.max_pool1d(self.fc(x).unsqueeze(1), 2).squeeze(1).sum(1) * 0.5
def get_inputs():
    return [torch.randn(16, 256, generator=torch.Generator().manual_seed(0))]
def get_init_inputs():
    return []
"""


def test_a_linear_weight_transposed_by_a_generic_is_packed_along_its_rows(kernel_file):
    """KernelBench 55 (nn.Linear, then a max pooling and a sum): folding the pooling's unit
    dims turns the weight's linalg.transpose into a generic, which folds into B's pack all
    the same; its slices are then visited panel outer, k inner (W's rows read along k). The
    generic was not taken for a transpose, so the pack walked k outer across 2048 rows of
    W at once: 42% of the kernel's time, 0.83x torch at 128 x 8192 x 8192."""
    path = kernel_file(LINEAR_THEN_POOLING)
    assert_matches(compile_kernel(path))
    vectorized = str(compile_kernel(path, stop_after="vectorize", threads=1).module)
    filecheck(vectorized, """
        CHECK:      scf.for %{{.*}} = %c0 to %c16 step %c1 iter_args({{.*}}) -> (tensor<16x256x32xf32>)
        CHECK-NEXT:   scf.for %{{.*}} = %c0 to %c256 step %c16 iter_args({{.*}}) -> (tensor<16x256x32xf32>)
        CHECK:          vector.transfer_read {{.*}} : tensor<32x16xf32>, vector<32x16xf32>
    """)
