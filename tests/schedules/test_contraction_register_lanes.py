"""Register tiles of contractions whose n extent is not a multiple of two vectors
(transform_ext.analysis.tiles.register_lanes): the lanes are a power-of-two multiple of one
vector, else at most one vector, never 24 or 48 lanes (LLVM took such loop-carried
accumulators apart element by element: KernelBench level 3's NetVLAD with ghost clusters,
x [B*N, D] @ W [D, K+G = 48], ran at 0.3x torch). Compared with torch: products of such
widths, and the NetVLAD pattern (a softmax's first K columns summed over N and read by a
batched product with a transposed A) with odd sizes, a second use of the slice, bf16."""

import pytest

from lighthouse.compile import compile_kernel
from tests.transform_ext.helpers import check
from transform_ext.analysis.tiles import register_lanes

PRODUCT = """
import torch
B, S, K, N = {b}, {s}, {k}, {n}
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(K, N) / K ** 0.5)
    def forward(self, x):
        return {expr}
def get_inputs():
    return [torch.randn(B, S, K){cast}]
def get_init_inputs():
    return []
"""

NETVLAD = """
import torch
import torch.nn.functional as F
B, N, D, K, G = {b}, {n}, {d}, {k}, {g}
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.clusters = torch.nn.Parameter(torch.randn(D, K + G) / D ** 0.5)
        self.clusters2 = torch.nn.Parameter(torch.randn(1, D, K) / D ** 0.5)
    def forward(self, x):
        flat = x.view(-1, D)
        assignment = F.softmax(flat @ self.clusters, dim=1)[:, :K].view(-1, N, K)
        a = assignment.sum(dim=1, keepdim=True) * self.clusters2
        vlad = (assignment.transpose(1, 2) @ x).transpose(1, 2) - a
        vlad = F.normalize(F.normalize(vlad).reshape(-1, K * D))
        return {result}
def get_inputs():
    return [torch.rand(B, N, D){cast}]
def get_init_inputs():
    return []
"""

BF16 = ".to(torch.bfloat16)"


@pytest.mark.parametrize("extent, limit, lanes", [
    (32, 32, 32), (96, 32, 32), (48, 32, 16), (80, 32, 16), (16, 32, 16),
    (12, 32, 12), (100, 32, 10), (20, 32, 10), (37, 32, 1), (96, 64, 32), (128, 64, 64),
])
def test_register_lanes(extent, limit, lanes):
    assert register_lanes(extent, limit, 16) == lanes


@pytest.mark.parametrize("n, cast", [(48, ""), (24, ""), (20, ""), (100, ""), (12, ""),
                                     (80, ""), (48, BF16), (20, BF16)])
def test_products_of_narrow_widths_match_torch(kernel_file, n, cast):
    """[B, S, K] viewed as [B*S, K] @ W [K, n]: rows 2 x 37 (prime), k 40, n of each form."""
    source = PRODUCT.format(b=2, s=37, k=40, n=n, expr="x.view(-1, K) @ self.w.to(x.dtype)",
                            cast=cast)
    compiled = compile_kernel(kernel_file(source), schedule="generic", strict=True)
    reports = compiled.check()
    assert reports and all(r.ok for r in reports), [str(r) for r in reports]


@pytest.mark.parametrize("b, n, d, k, g, result, cast", [
    (3, 20, 48, 8, 4, "vlad", ""),             # K+G = 12: one vector
    (2, 37, 40, 32, 16, "vlad", ""),           # K+G = 48 (the KernelBench shape), N odd
    (2, 19, 24, 13, 7, "vlad", ""),            # K+G = 20, K and D not multiples of a vector
    (2, 20, 48, 32, 16, "(vlad, assignment.sum(), assignment.transpose(1, 2) + 1)", ""),
    (2, 20, 48, 32, 16, "vlad", BF16),
])
def test_netvlad_with_ghost_clusters_matches_torch(kernel_file, b, n, d, k, g, result, cast):
    source = NETVLAD.format(b=b, n=n, d=d, k=k, g=g, result=result, cast=cast)
    if cast:
        source = source.replace("flat @ self.clusters", "flat @ self.clusters.to(x.dtype)") \
            .replace("* self.clusters2", "* self.clusters2.to(x.dtype)")
    compiled = compile_kernel(kernel_file(source))
    reports = compiled.check()
    assert reports and all(r.ok for r in reports), [str(r) for r in reports]


def test_a_48_wide_product_runs_in_16_lane_tiles_of_more_rows(kernel_file):
    """n = 48: register tiles of 15 rows x 16 lanes (3 tiles across n, 15 accumulators),
    not 5 x 24 (the largest divisor of 48 up to 32)."""
    source = PRODUCT.format(b=2, s=30, k=40, n=48, expr="x.view(-1, K) @ self.w", cast="")
    compiled = compile_kernel(kernel_file(source), schedule="generic", strict=True,
                              stop_after="vectorize")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main
        CHECK: scf.for %{{.*}} = %c0 to %c30 step %c15
        CHECK:   scf.for %{{.*}} = %c0 to %c48 step %c16
        CHECK:     scf.for %{{.*}} = %c0 to %c40 step %c1 iter_args(%{{.*}} = %{{.*}}) -> (vector<1x15x16xf32>)
        CHECK:       vector.transfer_read %{{.*}} : tensor<40x48xf32>, vector<1x16xf32>
        CHECK:       vector.contract {{.*}} into vector<1x15x16xf32>
    """)
    assert "x24xf32>" not in text


def test_netvlad_assignment_product_has_no_24_lane_tiles(kernel_file):
    """The KernelBench shape's first product (x @ clusters over [B, N, D] tokens, K+G = 48
    columns) in the family the compile picks (matmul): its two m loops collapsed into one
    (transform_ext.collapse_contraction_parallel_dims), the matmul schedule's packed
    8 x 32 register tiles (no 24-lane tile)."""
    source = NETVLAD.format(b=2, n=20, d=48, k=32, g=16, result="vlad", cast="")
    compiled = compile_kernel(kernel_file(source), stop_after="vectorize")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main
        CHECK: scf.for %{{.*}} = %c0 to %c48 step %c4 iter_args(%{{.*}} = %{{.*}}) -> (vector<8x32xf32>)
        CHECK:   vector.contract {{.*}} : vector<1x8xf32>, vector<1x32xf32> into vector<8x32xf32>
    """)
    assert "x24xf32>" not in text
