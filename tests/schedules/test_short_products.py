"""Short products (x @ W^T for a batch of at most GenericParams.short_rows rows): W read in
place, k split into one vector of lanes per pair of rows (transform_ext.split_matvec_lanes),
each step an FMA per pair (transform_ext.lane_contracts_to_fmas), the threads splitting W's
rows, never the batch (transform_ext.analysis.tiles.splits_short_rows). Against torch at
batches of 2-16, sizes that do not divide the lanes or the register tile, a bias and an
activation, a second use and a transpose of the result, bf16, a batch of products, two
layers, beside a product the matmul family packs, and past short_rows (packed)."""

import pytest

from lighthouse.compile import compile_kernel
from tests.transform_ext.helpers import check

KERNEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, w, v):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({x}, generator=g){cast}, torch.randn({w}, generator=g){cast},
            torch.randn({v}, generator=g){cast}]
def get_init_inputs():
    return []
"""

CASES = {
    "batch_4": ("x @ w.t()", "4, 256", "320, 256", "1", ""),
    "batch_2_k_half_lanes": ("x @ w.t()", "2, 200", "48, 200", "1", ""),
    "batch_3_k_odd": ("x @ w.t()", "3, 203", "70, 203", "1", ""),
    "batch_7_n_prime": ("x @ w.t()", "7, 128", "131, 128", "1", ""),
    "batch_12": ("x @ w.t()", "12, 96", "64, 96", "1", ""),
    "batch_16": ("x @ w.t()", "16, 64", "40, 64", "1", ""),
    "batch_17_packed": ("x @ w.t()", "17, 64", "40, 64", "1", ""),
    "bias_and_gelu": ("torch.nn.functional.gelu(torch.nn.functional.linear(x, w, v))",
                      "5, 160", "96, 160", "96", ""),
    "transposed_result_and_second_use": ("(lambda y: (y.t() + 1, y.sum(1)))(x @ w.t())",
                                         "6, 128", "72, 128", "1", ""),
    "bf16": ("x @ w.t()", "4, 192", "64, 192", "1", ".to(torch.bfloat16)"),
    "batched": ("torch.bmm(x, w.transpose(1, 2))", "3, 4, 96", "3, 40, 96", "1", ""),
    "two_layers": ("torch.relu(x @ w.t()) @ v.t()", "4, 128", "96, 128", "48, 96", ""),
    "beside_a_packed_product": ("(x @ w.t(), v @ v)", "4, 128", "96, 128", "64, 64", ""),
    "weight_not_transposed": ("x @ w", "4, 96", "96, 80", "1", ""),
}


def _kernel(kernel_file, expr, x, w, v, cast=""):
    return kernel_file(KERNEL.format(expr=expr, x=x, w=w, v=v, cast=cast))


@pytest.mark.parametrize("name", CASES)
def test_short_products_match_torch(kernel_file, name):
    compiled = compile_kernel(_kernel(kernel_file, *CASES[name]), runtime_checks=True)
    reports = compiled.check()
    assert reports
    for report in reports:
        assert report.ok, str(report)


def test_each_step_pairs_the_batch_with_rows_of_w(kernel_file):
    """4 rows x 4 rows of W: 16 vector accumulators, one load of x and of W per row and k
    step, FMAs; the threads split W's rows (320 = 8 x 40), never the batch; W read in place
    (no transpose, no pack); the lane sums at the end."""
    path = _kernel(kernel_file, *CASES["batch_4"])
    fused = str(compile_kernel(path, stop_after="fuse").module)
    check(fused, """
        CHECK-NOT: linalg.transpose
        CHECK: scf.forall (%[[N:.*]]) = (0) to (320) step (40)
        CHECK: tensor.extract_slice %arg1[%[[N]], 0] [40, 256] [1, 1]
        CHECK-NOT: linalg.pack
    """)
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    check(vectorized, """
        CHECK: scf.for %[[K1:.*]] = %c0 to %c16 step %c1 iter_args(%{{.*}} = %{{.*}}) -> (vector<4x4x16xf32>)
        CHECK:   vector.transfer_read {{.*}} vector<4x1x16xf32>
        CHECK:   vector.transfer_read {{.*}} vector<4x1x16xf32>
        CHECK:   vector.fma %{{.*}}, %{{.*}}, %{{.*}} : vector<4x4x16xf32>
        CHECK-NOT: vector.contract
        CHECK: vector.multi_reduction <add>, %{{.*}} [2] : vector<1x1x16xf32> to vector<1x1xf32>
    """)


def test_a_single_row_takes_several_rows_of_w(kernel_file):
    """x @ W^T with one row (a mat-vec over W's rows, the n side): register tiles of 4 rows
    of W x 64 lanes, not one row (its loop read one row of W at a time: 0.85x torch)."""
    path = _kernel(kernel_file, "x @ w.t()", "1, 256", "64, 256", "1")
    check(str(compile_kernel(path, stop_after="vectorize").module), """
        CHECK: vector.fma %{{.*}}, %{{.*}}, %{{.*}} : vector<4x64xf32>
    """)


def test_beside_a_packed_product_the_short_one_is_split_too(kernel_file):
    """The matmul family packs v @ v and splits x @ W^T (its `split_short_products` step),
    whose partial sums the family's @vectorize turns into FMAs."""
    path = _kernel(kernel_file, *CASES["beside_a_packed_product"])
    compiled = compile_kernel(path, stop_after="vectorize")
    assert compiled.family.name == "matmul", compiled.notes
    check(str(compiled.module), """
        CHECK-DAG: vector.fma %{{.*}}, %{{.*}}, %{{.*}} : vector<4x4x16xf32>
        CHECK-DAG: tensor<2x64x32xf32>
    """)


@pytest.mark.parametrize("batch, step", [(4, "vector<4x4x16xf32>"), (1, "vector<4x64xf32>")])
def test_a_bf16_short_product_reads_w_in_bf16(kernel_file, batch, step):
    """nn.Linear in bf16 over a batch of 4, or of one row: W^T's f32 widening (and x's, when
    it is not behind the reshape of a unit dim) folded into the product (schedules.matmul
    `fold_short_product_widenings`), then split: each step loads bf16 vectors of W where it
    is and widens them (before: a transposed f32 copy of W per call: at 4096 x 4096 12.3 ms
    for a batch of 4 against torch's 2.3 ms, 15 ms for one row against 2.5 ms). The matmul
    family takes the one-row layer, though no contraction of it fits its packing (`check`;
    `recognize` does not count the widening as work of its own); against torch."""
    source = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(192, 96).to(torch.bfloat16)
    def forward(self, x):
        return self.fc(x)
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, 192, generator=g).to(torch.bfloat16)]
def get_init_inputs():
    return []
""".replace("BATCH", str(batch))
    path = kernel_file(source)
    compiled = compile_kernel(path, stop_after="vectorize")
    assert compiled.family.name == "matmul", compiled.notes
    check(str(compiled.module), f"""
        CHECK-NOT: tensor<192x96xf32>
        CHECK: vector.transfer_read {{{{.*}}}}xbf16>
        CHECK: arith.extf
        CHECK: vector.fma %{{{{.*}}}}, %{{{{.*}}}}, %{{{{.*}}}} : {step}
    """)
    compiled = compile_kernel(path, runtime_checks=True)
    for report in compiled.check():
        assert report.ok, str(report)


def test_sixteen_rows_walk_the_batch_inside_each_pair_of_w_rows(kernel_file):
    """A batch of 16: register tiles of 2 rows of W x 8 of the batch, the batch's tiles
    inside each pair of W's rows (their 2 rows then stay in L1 for the second tile); a tile
    of all 16 x 1 row loaded 17 vectors per 16 FMAs, 16 of them from L2 (4096 x 4096:
    11.6 -> 8.4 ms, torch 10.4 ms)."""
    path = _kernel(kernel_file, "x @ w.t()", "16, 256", "320, 256", "1")
    check(str(compile_kernel(path, stop_after="vectorize").module), """
        CHECK: scf.for %{{.*}} = %c0 to %c40 step %c2
        CHECK:   scf.for %{{.*}} = %c0 to %c16 step %c8
        CHECK:     scf.for %{{.*}} = %c0 to %c16 step %c1 iter_args(%{{.*}} = %{{.*}}) -> (vector<2x8x16xf32>)
        CHECK:       vector.fma %{{.*}}, %{{.*}}, %{{.*}} : vector<2x8x16xf32>
    """)
    compiled = compile_kernel(path, runtime_checks=True)
    for report in compiled.check():
        assert report.ok, str(report)
