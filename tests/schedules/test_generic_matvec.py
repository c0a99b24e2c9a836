"""Matrix-vector products with the generic schedule: k split into lanes of partial sums
(transform_ext.split_matvec_lanes), each step an FMA of several rows' vectors with one
vector of x (transform_ext.lane_contracts_to_fmas); compared with torch at sizes that do not
divide the lanes, batched, transposed, bf16, with a second use of the result, and the
vector-matrix product beside them; a transposed view is read in place
(transform_ext.fold_transposes_into_matvecs), never copied, and A^T x accumulates in lane
vectors along A's rows (no [M, 1] accumulator of one-lane vectors)."""

import pytest

from lighthouse.benchmarks.suite import module_globals
from lighthouse.compile import compile_kernel
from tests.conftest import EXAMPLES
from tests.transform_ext.helpers import check

KERNEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, x):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({a}, generator=g){cast}, torch.randn({x}, generator=g){cast}]
def get_init_inputs():
    return []
"""

PRODUCTS = {
    # KernelBench 4's form: A [M, K] @ x [K, 1]
    "column": ("a @ x", "64, 256", "256, 1", ""),
    "rows_and_k_odd": ("a @ x", "37, 203", "203, 1", ""),
    "k_prime_rows_one": ("a @ x", "1, 131", "131, 1", ""),
    "vector": ("torch.mv(a, x)", "48, 320", "320", ""),
    "batched": ("torch.bmm(a, x)", "3, 20, 160", "3, 160, 1", ""),
    "transposed_a": ("a.t() @ x", "192, 40", "192, 1", ""),
    "epilogue_and_second_use": ("(lambda y: (torch.relu(y) + 1, y.sum()))(a @ x)",
                                "40, 300", "300, 1", ""),
    "vector_matrix": ("x @ a", "256, 96", "1, 256", ""),
    "bf16": ("a @ x", "24, 200", "200, 1", ".to(torch.bfloat16)"),
    # transposed views (transform_ext.fold_transposes_into_matvecs): A^T x, x A^T, torch.mv
    "transposed_a_odd": ("a.t() @ x", "203, 37", "203, 1", ""),
    "transposed_vector_matrix": ("x @ a.t()", "96, 256", "1, 256", ""),
    "transposed_vector_matrix_k_odd": ("x @ a.t()", "40, 131", "1, 131", ""),
    "transposed_mv": ("torch.mv(a.t(), x)", "320, 48", "320", ""),
    "transposed_batched": ("torch.bmm(a.transpose(1, 2), x)", "3, 160, 20", "3, 160, 1", ""),
    "transposed_vector_n1": ("x @ a.t()", "1, 200", "64, 200", ""),
    "transposed_a_m1": ("a.t() @ x", "200, 1", "200, 64", ""),
    "transposed_a_bf16": ("a.t() @ x", "200, 24", "200, 1", ".to(torch.bfloat16)"),
    "transposed_a_then_transpose": ("(a.t() @ x).t() + 1", "192, 40", "192, 1", ""),
    # A^T x as y[m] += A[k, m] x[k] (unit dims dropped): lane runs of 256 along A's rows,
    # k in chunks of 16 rows; M = 521 (prime) peels its last run, K = 203 has no chunks
    "transposed_a_peeled_chunked": ("a.t() @ x", "64, 521", "64, 1", ""),
    "transposed_a_k_odd_rows_over_a_run": ("a.t() @ x", "203, 300", "203, 1", ""),
    "transposed_mv_bf16": ("torch.mv(a.t(), x)", "96, 300", "96", ".to(torch.bfloat16)"),
    "transposed_a_peeled_bf16": ("a.t() @ x", "48, 521", "48, 1", ".to(torch.bfloat16)"),
    "transposed_batched_chunked_odd": ("torch.bmm(a.transpose(1, 2), x)", "2, 64, 131",
                                       "2, 64, 1", ""),
    "transposed_batched_bf16": ("torch.bmm(a.transpose(1, 2), x)", "2, 40, 70", "2, 40, 1",
                                ".to(torch.bfloat16)"),
    "transposed_a_k1": ("a.t() @ x", "1, 37", "1, 1", ""),
    "transposed_a_dot": ("a.t() @ x", "5, 1", "5, 1", ""),
    "transposed_mv_second_use_and_transpose": (
        "(lambda y: (y.t(), torch.relu(y) * y.sum()))(a.t() @ x)", "64, 300", "64, 1", ""),
}


def _compile(kernel_file, expr, a, x, cast="", **kw):
    source = KERNEL.format(expr=expr, a=a, x=x, cast=cast)
    return compile_kernel(kernel_file(source), schedule="generic", strict=True, **kw)


@pytest.mark.parametrize("name", PRODUCTS)
def test_matvec_matches_torch(kernel_file, name):
    compiled = _compile(kernel_file, *PRODUCTS[name])
    reports = compiled.check()
    assert reports
    for report in reports:
        assert report.ok, str(report)


def test_each_step_is_an_fma_of_rows_with_one_vector_of_x(kernel_file):
    compiled = _compile(kernel_file, "a @ x", "64, 256", "256, 1", stop_after="vectorize")
    check(str(compiled.module), """
        CHECK-LABEL: func.func @main
        CHECK: %[[X:.*]] = tensor.expand_shape %{{.*}} output_shape [4, 64] : tensor<256xf32> into tensor<4x64xf32>
        CHECK: scf.for %[[K1:.*]] = %c0 to %c4 step %c1 iter_args(%{{.*}} = %{{.*}}) -> (vector<4x1x64xf32>)
        CHECK:   %[[A:.*]] = vector.transfer_read %{{.*}}[%{{.*}}, %c0, %[[K1]], %c0]{{.*}} vector<4x1x1x64xf32>
        CHECK:   %[[XV:.*]] = vector.transfer_read %[[X]][%[[K1]], %c0]{{.*}} vector<1x64xf32>
        CHECK:   vector.broadcast %{{.*}} : vector<64xf32> to vector<4x1x64xf32>
        CHECK:   vector.fma %{{.*}}, %{{.*}}, %{{.*}} : vector<4x1x64xf32>
        CHECK-NOT: vector.contract
        CHECK: vector.multi_reduction <add>, %{{.*}} [2] : vector<1x1x64xf32> to vector<1x1xf32>
    """)


def test_the_k_remainder_is_the_product_over_the_last_columns(kernel_file):
    compiled = _compile(kernel_file, "a @ x", "37, 203", "203, 1", stop_after="fuse")
    check(str(compiled.module), """
        CHECK-LABEL: func.func @main
        CHECK: tensor.extract_slice %arg0[0, 0] [37, 192] [1, 1] : tensor<37x203xf32> to tensor<37x192xf32>
        CHECK: tensor.extract_slice %arg1[0, 0] [192, 1] [1, 1] : tensor<203x1xf32> to tensor<192xf32>
        CHECK: linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "reduction", "parallel"]
        CHECK-SAME: tensor<37x1x3x64xf32>, tensor<3x64xf32>
        CHECK: tensor.extract_slice %arg0[0, 192] [37, 11] [1, 1] : tensor<37x203xf32> to tensor<37x11xf32>
        CHECK: linalg.matmul ins(%{{.*}}, %{{.*}} : tensor<37x11xf32>, tensor<11x1xf32>)
    """)


IN_PLACE = """
    CHECK: #[[A:.*]] = affine_map<READ>
    CHECK-NOT: linalg.transpose
    CHECK: linalg.generic {indexing_maps = [#[[A]],
    CHECK-SAME: ins(%arg0
    CHECK-NOT: linalg.transpose
"""


@pytest.mark.parametrize("expr, a, x, checks", [
    # A^T x: A [K, M] read in place, m innermost (the vector x matrix form)
    ("a.t() @ x", "256, 64", "256, 1", IN_PLACE.replace("READ", "(d0, d1) -> (d1, d0)")),
    ("torch.mv(a.t(), x)", "256, 64", "256", IN_PLACE.replace("READ", "(d0, d1) -> (d1, d0)")),
    # x A^T: A [N, K] read in place, k innermost: split into lanes, rows of A [N, K1, L]
    ("x @ a.t()", "64, 256", "1, 256", """
        CHECK-NOT: linalg.transpose
        CHECK: tensor.extract_slice %arg0[%{{.*}}, 0] [8, 256] [1, 1] : tensor<64x256xf32> to tensor<8x256xf32>
        CHECK: tensor.expand_shape %{{.*}} output_shape [8, 4, 64] : tensor<8x256xf32> into tensor<8x4x64xf32>
        CHECK-NOT: linalg.transpose
    """),
])
def test_a_transposed_view_is_read_in_place(kernel_file, expr, a, x, checks):
    check(str(_compile(kernel_file, expr, a, x, stop_after="fuse").module), checks)


def test_a_transposed_views_accumulator_is_a_lane_vector(kernel_file):
    """A^T x (x [K, 1]): the running sums are one vector of 256 lanes along A's rows,
    carried over a chunk of 16 rows of A; no [M, 1] accumulator (M one-lane vectors: M
    scalar FMA chains) and no transposed copy."""
    compiled = _compile(kernel_file, "a.t() @ x", "64, 512", "64, 1", stop_after="vectorize")
    check(str(compiled.module), """
        CHECK-LABEL: func.func @main(%arg0: tensor<64x512xf32>, %arg1: tensor<64x1xf32>)
        CHECK-NOT: linalg.transpose
        CHECK: %[[X:.*]] = tensor.collapse_shape %arg1 {{\\[}}[0, 1]] : tensor<64x1xf32> into tensor<64xf32>
        CHECK: scf.for %{{.*}} = %c0 to %c64 step %c16
        CHECK:   scf.for %{{.*}} = %c0 to %c512 step %c256
        CHECK:     scf.for %[[K:.*]] = %c0 to %c16 step %c1 iter_args(%{{.*}} = %{{.*}}) -> (vector<256xf32>)
        CHECK:       vector.transfer_read %arg0[%{{.*}}, %{{.*}}]{{.*}} : tensor<64x512xf32>, vector<1x256xf32>
        CHECK:       vector.transfer_read %[[X]][%{{.*}}]{{.*}} : tensor<64xf32>, vector<1xf32>
        CHECK:       vector.broadcast %{{.*}} : vector<f32> to vector<256xf32>
        CHECK:       vector.fma %{{.*}}, %{{.*}}, %{{.*}} : vector<256xf32>
        CHECK-NOT: vector.contract
        CHECK: tensor.expand_shape %{{.*}} {{\\[}}[0, 1]] output_shape [512, 1] : tensor<512xf32> into tensor<512x1xf32>
        CHECK-NOT: linalg.transpose
    """)
    assert "x1xf32> into vector" not in str(compiled.module)


@pytest.mark.parametrize("x", ["1, 512", "512"])
def test_a_row_times_a_matrix_walks_k_in_chunks(kernel_file, x):
    """x @ A for x of one row (2-D, whose unit row dim the matmul keeps, or 1-D): A's k loop
    in chunks of 16 rows outside the lane runs, each chunk's rows read as sequential
    streams (one run per row down a 256-column strip of A, 16 KiB apart, ran at 0.80x
    torch; is_vector_matrix had not looked past the unit dim)."""
    compiled = _compile(kernel_file, "x @ a", "512, 1024", x, stop_after="vectorize")
    check(str(compiled.module), """
        CHECK: scf.for %{{.*}} = %c0 to %c512 step %c16 iter_args
        CHECK:   scf.for %{{.*}} = %c0 to %c1024 step %c256 iter_args
        CHECK:     scf.for %{{.*}} = %c0 to %c16 step %c1 iter_args(%{{.*}} = %{{.*}}) -> (vector<1x256xf32>)
        CHECK:       vector.fma %{{.*}}, %{{.*}}, %{{.*}} : vector<1x256xf32>
    """)
    for report in compile_kernel(compiled.kernel.path, schedule="generic").check():
        assert report.ok, str(report)


@pytest.mark.parametrize("threads,step", [(2, 2048), (4, 1024)])
def test_a_row_times_a_matrix_takes_one_forall_tile_per_thread(kernel_file, threads, step):
    """Each forall tile streams its strip of every row of A: one tile per thread (four per
    thread had cut A's rows into runs of 4 KiB)."""
    compiled = _compile(kernel_file, "x @ a", "512, 4096", "1, 512", threads=threads,
                        stop_after="fuse")
    check(str(compiled.module), f"""
        CHECK: scf.forall (%{{{{.*}}}}) = (0) to (4096) step ({step})
        CHECK:   linalg.matmul
    """)


def test_a_batched_transposed_views_accumulator_is_a_lane_vector(kernel_file):
    """bmm(A^T, x): per batch the same lane run along the rows of A[b], a bf16 A widened
    into f32 running sums by one FMA per step (the contraction lowering had extracted
    each of its 256 lanes); no k chunks for a bf16 A (transform_ext.analysis.tiles
    vector_matrix_k_chunk)."""
    compiled = _compile(kernel_file, "torch.bmm(a.transpose(1, 2), x)", "2, 32, 256",
                        "2, 32, 1", ".to(torch.bfloat16)", stop_after="vectorize")
    check(str(compiled.module), """
        CHECK-LABEL: func.func @main(%arg0: tensor<2x32x256xbf16>
        CHECK-NOT: linalg.transpose
        CHECK: scf.for %{{.*}} = %c0 to %c2 step %c1
        CHECK-NOT: step %c16
        CHECK:   scf.for %{{.*}} = %c0 to %c32 step %c1 iter_args(%{{.*}} = %{{.*}}) -> (vector<1x256xf32>)
        CHECK:   vector.transfer_read %arg0[%{{.*}}, %{{.*}}, %{{.*}}]{{.*}} : tensor<2x32x256xbf16>, vector<1x1x256xbf16>
        CHECK:   vector.fma %{{.*}}, %{{.*}}, %{{.*}} : vector<1x256xf32>
        CHECK-NOT: vector.contract
        CHECK-NOT: linalg.transpose
    """)


@pytest.mark.parametrize("name", sorted(p.stem for p in (EXAMPLES / "matvec").glob("*.py")))
def test_the_matvec_example_files_match_torch(name):
    """examples/matvec (the bench's kernel files) at small odd sizes, f32 and bf16."""
    for dtype in ("float32", "bfloat16"):
        overrides = {"M": 37, "N": 37, "K": 203, "B": 2, "DTYPE": dtype}
        path = EXAMPLES / "matvec" / f"{name}.py"
        known = module_globals(path)
        compiled = compile_kernel(path, overrides={k: v for k, v in overrides.items() if k in known})
        for report in compiled.check():
            assert report.ok, f"{name} {dtype}: {report}"
