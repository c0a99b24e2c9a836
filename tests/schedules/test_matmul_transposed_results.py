"""A product read only through a transpose of its lanes, (A @ B).T or (W @ x.T).T: the
matmul family computes C^T as a product of its own (transform_ext.
fold_result_transposes_into_contractions, its first input holding C^T's rows) whose
register tiles run along C^T's rows as any product's do, and the contraction's multiplicand
on the lanes is the right one of its outer products (transform_ext.
order_contract_multiplicands). Folded into the unpack instead, the [8, 32] register tile
ran along C's rows and was transposed by shuffles in the k loop: 0.10x torch. Against
torch: odd sizes, a batch, a batch moved (not folded), a second use of the product, an
elementwise op after the transpose, bf16, few rows; the IR of the k loop."""

import pytest

from lighthouse.compile import compile_kernel
from tests.schedules.test_matmul import assert_matches, binary_kernel
from tests.transform_ext.helpers import check as filecheck

CASES = [
    (96, 96, 96, 1, "(a @ b).t()", "M, K", "K, N"),
    (77, 203, 131, 1, "(a @ b).t()", "M, K", "K, N"),                 # sizes that divide no tile
    (77, 203, 131, 1, "(b @ a.t()).t()", "M, K", "N, K"),             # (W @ x.T).T
    (70, 45, 300, 3, "torch.bmm(a, b).transpose(1, 2)", "B, M, K", "B, K, N"),
    (40, 33, 64, 3, "torch.bmm(a, b).permute(2, 0, 1)", "B, M, K", "B, K, N"),  # batch moved: not folded
    (48, 40, 64, 1, "(lambda c: (c.t(), c.sum(0)))(a @ b)", "M, K", "K, N"),    # a second use
    (48, 40, 64, 1, "torch.relu((a @ b).t()) * 2", "M, K", "K, N"),   # elementwise after it
    (4, 96, 256, 1, "(b @ a.t()).t()", "M, K", "N, K"),               # few rows: a short product
    (96, 4, 256, 1, "(a @ b).t()", "M, K", "K, N"),                   # few columns
]


@pytest.mark.parametrize("m, n, k, b, expr, a_shape, b_shape", CASES)
def test_transposed_results_match_torch(kernel_file, m, n, k, b, expr, a_shape, b_shape):
    path = binary_kernel(kernel_file, m, n, k, b=b, expr=expr, a_shape=a_shape, b_shape=b_shape)
    assert_matches(compile_kernel(path))


def test_bf16(kernel_file):
    path = binary_kernel(kernel_file, 77, 203, 131, dtype="bfloat16", expr="(b @ a.t()).t()",
                         b_shape="N, K")
    assert_matches(compile_kernel(path))


def test_the_transposed_result_steps_by_row_broadcasts(kernel_file):
    """(W @ x.T).T: no transpose left after fuse, x packed as A (its rows on the register
    tile's 8 rows), W as B, C unpacked as it is; each k step of the 8 x 32 register tile is 8 FMAs of 32 lanes
    (4 steps unrolled), as for x @ W^T."""
    path = binary_kernel(kernel_file, 256, 256, 256, expr="(b @ a.t()).t()", b_shape="N, K")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    assert "linalg.transpose" not in fused
    filecheck(fused, """
        CHECK: linalg.pack {{.*}} into {{.*}} {lh.mm_role = "pack_a", {{.*}}} : tensor<8x16xf32> -> tensor<1x16x8xf32>
        CHECK: linalg.pack {{.*}} into {{.*}} {lh.mm_role = "pack_b", {{.*}}} : tensor<32x16xf32> -> tensor<1x16x32xf32>
        CHECK: linalg.unpack %{{.*}} inner_dims_pos = [0, 1] inner_tiles = [8, 32] into
    """)
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    filecheck(bufferized, """
        CHECK: scf.parallel
        CHECK: scf.for {{.*}} -> (vector<8x32xf32>)
        CHECK-COUNT-32: vector.fma {{.*}} : vector<32xf32>
        CHECK-NOT: vector.fma
        CHECK: scf.yield
    """)
