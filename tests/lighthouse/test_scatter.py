"""torch-mlir's tm_tensor.scatter and tm_tensor.sort (lighthouse/tm_tensor_lowering.py):
scatter_add, index_put (with and without accumulate), index_add, the backward of embedding,
max(dim) and max_pool, and sort, compiled end to end and compared with torch, forward and
--backward, f32 and bf16; duplicate indices, odd sizes, zero-size updates, negative indices
where torch wraps them; an index torch rejects is a KernelError, and never a write outside
the tensor."""

import subprocess
import sys
import textwrap

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.errors import KernelError
from tests.conftest import ROOT
from tests.transform_ext.helpers import check

KERNEL = """
import torch
import torch.nn.functional as F
N = 33
class Model(torch.nn.Module):
    def forward(self, {args}):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    dt = torch.{dtype}
    return {inputs}
def get_init_inputs():
    return []
"""


def _compile(kernel_file, expr, inputs, args, dtype="float32", **kw):
    return compile_kernel(kernel_file(KERNEL.format(expr=expr, inputs=inputs, args=args,
                                                    dtype=dtype)), **kw)


def _assert_matches(compiled):
    reports = compiled.check()
    assert reports
    for report in reports:
        assert report.ok, str(report)


# name: (expr, inputs, args, backward too)
SCATTERS = {
    # the kernel: rows 0 and 1 both land on row 0 (a duplicate summed)
    "scatter_add": ("torch.scatter_add(x, 0, t.clamp(0, 2).view(3, 1).expand(3, N), y)",
                    "[torch.randn(3, N, generator=g, dtype=dt), torch.randn(3, N, generator=g, "
                    "dtype=dt), torch.tensor([0, -100, N - 1])]", "x, y, t", True),
    "scatter_add_dim1": ("torch.scatter_add(x, 1, t, y)",
                         "[torch.randn(5, 17, generator=g, dtype=dt), torch.randn(5, 23, generator=g, "
                         "dtype=dt), torch.randint(0, 17, (5, 23), generator=g)]", "x, y, t", True),
    # duplicates (1 three times, -1 == 9 twice) summed; negative indices wrapped as torch does
    "index_put_accumulate": ("x.index_put((i,), v, accumulate=True)",
                             "[torch.randn(10, N, generator=g, dtype=dt), "
                             "torch.tensor([1, -1, 3, 1, 9, -9, 1]), "
                             "torch.randn(7, N, generator=g, dtype=dt)]", "x, i, v", True),
    # without accumulate torch leaves duplicates undefined: unique indices, one negative
    "index_put": ("x.index_put((i,), v)",
                  "[torch.randn(10, 17, generator=g, dtype=dt), torch.tensor([4, -1, 0, 7]), "
                  "torch.randn(4, 17, generator=g, dtype=dt)]", "x, i, v", True),
    "index_put_columns": ("x.index_put((torch.arange(3).view(3, 1), i), v)",
                          "[torch.randn(3, 19, generator=g, dtype=dt), torch.tensor([5, -2, 0]), "
                          "torch.randn(3, 3, generator=g, dtype=dt)]", "x, i, v", True),
    "index_put_two_indices": ("x.index_put((i, j), v, accumulate=True)",
                              "[torch.randn(6, 17, generator=g, dtype=dt), "
                              "torch.tensor([0, 5, -1, 0, 2]), torch.tensor([3, 16, -17, 3, 9]), "
                              "torch.randn(5, generator=g, dtype=dt)]", "x, i, j, v", True),
    "index_add": ("x.index_add(0, i, v)",
                  "[torch.randn(7, N, generator=g, dtype=dt), torch.tensor([6, 0, 6, 2, 6]), "
                  "torch.randn(5, N, generator=g, dtype=dt)]", "x, i, v", True),
    "index_add_dim1_alpha": ("x.index_add(1, i, v, alpha=0.5)",
                             "[torch.randn(3, 17, generator=g, dtype=dt), torch.tensor([16, 1, 1]), "
                             "torch.randn(3, 3, generator=g, dtype=dt)]", "x, i, v", True),
    "embedding": ("F.embedding(i, w) * 3", "[torch.randn(11, N, generator=g, dtype=dt), "
                  "torch.tensor([[1, 3, 3], [10, 0, 3]])]", "w, i", True),
    "embedding_padding": ("F.embedding(i, w, padding_idx=3)",
                          "[torch.randn(11, 17, generator=g, dtype=dt), torch.tensor([1, 3, 3, 10])]",
                          "w, i", True),
    "max_dim": ("x.max(dim=1)[0]", "[torch.randn(5, 37, generator=g, dtype=dt)]", "x", True),
    "max_dim_keepdim_3d": ("x.max(dim=0, keepdim=True)[0] * 2",
                           "[torch.randn(3, 5, 17, generator=g, dtype=dt)]", "x", True),
    "max_pool1d": ("F.max_pool1d(x, 3, 2)", "[torch.randn(2, 3, 17, generator=g, dtype=dt)]", "x",
                   True),
    # overlapping windows: one input element is the max of several (its gradients summed)
    "max_pool2d": ("F.max_pool2d(x, 3, 1, padding=1)",
                   "[torch.randn(1, 2, 9, 11, generator=g, dtype=dt)]", "x", True),
    "max_pool2d_floor": ("F.max_pool2d(x, 2)", "[torch.randn(2, 3, 9, 11, generator=g, dtype=dt)]",
                         "x", True),
    # a second use of the scattered result, then a consumer
    "consumers": ("torch.softmax(x.index_put((i,), v, accumulate=True), 1), "
                  "x.index_put((i,), v, accumulate=True).sum(0)",
                  "[torch.randn(10, 17, generator=g, dtype=dt), torch.tensor([2, 2, -3]), "
                  "torch.randn(3, 17, generator=g, dtype=dt)]", "x, i, v", True),
    # zero-size updates: nothing is written
    "empty_index_put": ("x.index_put((i,), v, accumulate=True)",
                        "[torch.randn(10, 17, generator=g, dtype=dt), torch.zeros(0, dtype=torch.long), "
                        "torch.randn(0, 17, generator=g, dtype=dt)]", "x, i, v", False),
    "empty_scatter_add": ("torch.scatter_add(x, 1, t, y)",
                          "[torch.randn(4, 17, generator=g, dtype=dt), torch.randn(4, 0, generator=g, "
                          "dtype=dt), torch.zeros(4, 0, dtype=torch.long)]", "x, y, t", False),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", SCATTERS)
def test_scatters_match_torch(kernel_file, name, dtype):
    expr, inputs, args, _ = SCATTERS[name]
    _assert_matches(_compile(kernel_file, expr, inputs, args, dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", [n for n, case in SCATTERS.items() if case[3]])
def test_scatter_backward_matches_torch(kernel_file, name, dtype):
    expr, inputs, args, _ = SCATTERS[name]
    _assert_matches(_compile(kernel_file, expr, inputs, args, dtype, backward=True))


SORTS = {
    "rows": ("torch.sort(x, 1)[0]", "[torch.randn(5, 37, generator=g, dtype=dt)]"),
    "descending": ("torch.sort(x, 1, descending=True)[0]", "[torch.randn(5, 37, generator=g, dtype=dt)]"),
    "dim0_3d": ("torch.sort(x, 0)[0]", "[torch.randn(17, 3, 5, generator=g, dtype=dt)]"),
    "middle_dim": ("torch.sort(x, 1, descending=True)[0]", "[torch.randn(3, 19, 4, generator=g, dtype=dt)]"),
    # argsort of distinct values: the permutation itself
    "indices": ("torch.sort(x, dim=1, stable=True)", "[torch.randperm(41, generator=g).to(dt).view(1, 41)]"),
    # equal keys keep their order (stable), in both directions
    "stable_ties": ("torch.sort(x, dim=1, stable=True)[1], torch.sort(x, dim=1, descending=True, stable=True)[1]",
                    "[torch.randint(0, 4, (3, 29), generator=g).to(dt)]"),
    # torch: NaN sorts last ascending, first descending; infinities in between
    "nan": ("torch.sort(x, 1)[0], torch.sort(x, 1, descending=True)[0]",
            "[torch.tensor([[1.0, float('nan'), -float('inf'), 0.5, float('nan'), float('inf'), -2.0]], "
            "dtype=dt)]"),
    "one_element": ("torch.sort(x, 1)[0]", "[torch.randn(4, 1, generator=g, dtype=dt)]"),
    "consumer": ("torch.sort(x, 1)[0][:, -3:].sum(1) + x.sum(1)", "[torch.randn(6, 33, generator=g, dtype=dt)]"),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", SORTS)
def test_sorts_match_torch(kernel_file, name, dtype):
    expr, inputs = SORTS[name]
    _assert_matches(_compile(kernel_file, expr, inputs, "x", dtype))


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_sorts_match_torch(kernel_file, dtype):
    _assert_matches(_compile(kernel_file, "torch.sort(x, 1)[0], torch.sort(x, 1, descending=True)[0]",
                             "[torch.randint(-50, 50, (4, 33), generator=g, dtype=dt)]", "x", dtype))


def test_sort_backward_matches_torch(kernel_file):
    _assert_matches(_compile(kernel_file, "torch.sort(x, 1)[0] * w",
                             "[torch.randn(4, 19, generator=g), torch.randn(4, 19, generator=g)]",
                             "x, w", backward=True))


# name: (expr, inputs in range, args, bad index values, where the bad index goes, exception)
BAD_INDICES = {
    "scatter_add": ("torch.scatter_add(x, 0, t.view(3, 1).expand(3, N), y)",
                    "[torch.randn(3, N), torch.randn(3, N), torch.tensor([0, 2, 1])]", "x, y, t",
                    (-1, 3, 10**9), RuntimeError),
    "index_put_accumulate": ("x.index_put((i,), v, accumulate=True)",
                             "[torch.randn(10, N), torch.tensor([1, -1, 3]), torch.randn(3, N)]",
                             "x, i, v", (10, -11, 10**9), IndexError),
    "index_put": ("x.index_put((i,), v)",
                  "[torch.randn(10, N), torch.tensor([1, -1, 3]), torch.randn(3, N)]",
                  "x, i, v", (10, -11), IndexError),
    "index_add": ("x.index_add(0, i, v)", "[torch.randn(10, N), torch.tensor([1, 9, 3]), torch.randn(3, N)]",
                  "x, i, v", (-1, 10, -11), (IndexError, RuntimeError)),
}


@pytest.mark.parametrize("name", BAD_INDICES)
def test_an_index_torch_rejects_is_a_kernel_error(kernel_file, name):
    expr, inputs, args, bad_values, error = BAD_INDICES[name]
    compiled = _compile(kernel_file, expr, inputs, args)
    model = compiled.kernel.model
    good = list(compiled.imported.args)
    position = next(k for k, t in enumerate(good) if not t.is_floating_point())
    for bad in bad_values:
        args_ = list(good)
        args_[position] = good[position].clone()
        args_[position][1] = bad
        with pytest.raises(error):
            model(*args_)
        with pytest.raises(KernelError, match="index out of range: dimension 0 of a"):
            compiled.run(*args_)
    torch.testing.assert_close(compiled.run(*good)[0], model(*good))  # the function lives on


def test_embedding_backward_with_a_bad_index_is_a_kernel_error(kernel_file):
    compiled = _compile(kernel_file, "F.embedding(i, w)", "[torch.randn(11, 17), torch.tensor([1, 3, 10])]",
                        "w, i", backward=True)
    with pytest.raises(KernelError):
        compiled.run(torch.randn(11, 17), torch.tensor([1, 11, 3]))


def test_a_bad_index_writes_nothing_outside_the_tensor(kernel_file):
    """With runtime checks on, an out-of-bounds store would stop the process; the clamped
    scatter stays inside and the call raises the kernel's error."""
    path = kernel_file(KERNEL.format(expr="x.index_put((i,), v, accumulate=True)", args="x, i, v",
                                     dtype="float32", inputs="[torch.randn(10, N), "
                                     "torch.tensor([1, 2, 3]), torch.randn(3, N)]"))
    script = textwrap.dedent(f"""
        import torch
        from lighthouse.compile import compile_kernel
        c = compile_kernel({str(path)!r}, runtime_checks=True)
        c.run(torch.randn(10, 33), torch.tensor([1, 10**6, 2]), torch.randn(3, 33))
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "KernelError: index out of range: dimension 0 of a 10x33 tensor has size 10" in r.stderr


def test_import_holds_a_loop_over_the_updates(kernel_file):
    compiled = _compile(kernel_file, "x.index_put((i,), v, accumulate=True)",
                        "[torch.randn(10, 7), torch.tensor([1, 2, 1, 4]), torch.randn(4, 7)]",
                        "x, i, v", stop_after="import")
    check(compiled.module, """
        CHECK-LABEL: func.func @main(%arg0: tensor<10x7xf32>, %arg1: tensor<4xi64>, %arg2: tensor<4x7xf32>)
        CHECK: linalg.generic {{.*}} ins(%[[IDX:.*]] : tensor<4x1xi64>) {
        CHECK: cf.assert {{.*}} "index out of range: dimension 0 of a 10x7 tensor has size 10"
        CHECK: scf.for %[[N:.*]] = %{{.*}} iter_args(%[[OUT:.*]] = %arg0)
        CHECK: %[[RAW:.*]] = tensor.extract %[[IDX]][%[[N]], %{{.*}}] : tensor<4x1xi64>
        CHECK: %[[I:.*]] = arith.index_cast %[[RAW]]
        CHECK: %[[LOW:.*]] = arith.maxsi %[[I]]
        CHECK: %[[ROW:.*]] = arith.minsi %[[LOW]]
        CHECK: %[[V:.*]] = tensor.extract_slice %{{.*}}[%[[N]], 0, 0] [1, 1, 7] [1, 1, 1] : tensor<4x1x7xf32> to tensor<1x7xf32>
        CHECK: %[[OLD:.*]] = tensor.extract_slice %[[OUT]][%[[ROW]], 0] [1, 7] [1, 1] : tensor<10x7xf32> to tensor<1x7xf32>
        CHECK: %[[NEW:.*]] = linalg.generic {{.*}} ins(%[[V]], %[[OLD]] : tensor<1x7xf32>, tensor<1x7xf32>)
        CHECK: arith.addf
        CHECK: tensor.insert_slice %[[NEW]] into %[[OUT]][%[[ROW]], 0] [1, 7] [1, 1]
        CHECK-NOT: tm_tensor
    """)


def test_import_of_a_sort_is_a_bitonic_network_over_packed_keys(kernel_file):
    """[6, 4] sorted along 6: each element's key and position packed into one i64, padded
    to 8 (the largest key), 6 compare-exchange stages (k = 2; 4, 2; 8, 4, 2 with j = k / 2
    .. 1), each one reduction over a pair of a [P / k, k / 2j, 2, j] view of the sort dim
    (the other dim last, whole), then the values read at the sorted positions (their bound
    tells clamp_gather_indices that no check is needed)."""
    compiled = _compile(kernel_file, "torch.sort(x, 0)[0]", "[torch.randn(6, 4)]", "x",
                        stop_after="import")
    check(compiled.module, """
        CHECK-LABEL: func.func @main(%arg0: tensor<6x4xf32>)
        CHECK-NOT: tm_tensor
        CHECK: %[[KEYS:.*]] = linalg.generic {{.*}} ins(%arg0 : tensor<6x4xf32>) outs(%{{.*}} : tensor<6x4xi64>)
        CHECK: arith.bitcast %{{.*}} : f32 to i32
        CHECK: %[[PADS:.*]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<8x4xi64>)
        CHECK: tensor.insert_slice %[[KEYS]] into %[[PADS]][0, 0] [6, 4] [1, 1] : tensor<6x4xi64> into tensor<8x4xi64>
        CHECK: tensor.expand_shape %{{.*}} output_shape [4, 1, 2, 1, 4]
        CHECK: linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "reduction"]
        CHECK: arith.maxsi
        CHECK: arith.minsi
        CHECK: tensor.expand_shape %{{.*}} output_shape [2, 1, 2, 2, 4]
        CHECK: tensor.expand_shape %{{.*}} output_shape [2, 2, 2, 1, 4]
        CHECK: tensor.expand_shape %{{.*}} output_shape [1, 1, 2, 4, 4]
        CHECK: tensor.expand_shape %{{.*}} output_shape [1, 2, 2, 2, 4]
        CHECK: tensor.expand_shape %{{.*}} output_shape [1, 4, 2, 1, 4]
        CHECK-NOT: tensor.expand_shape
        CHECK: tensor.extract_slice %{{.*}}[0, 0] [6, 4] [1, 1] : tensor<8x4xi64> to tensor<6x4xi64>
        CHECK: arith.minui
        CHECK: tensor.extract %arg0
        CHECK-NOT: tm_tensor
    """)
    fused = str(_compile(kernel_file, "torch.sort(x, 0)[0]", "[torch.randn(6, 4)]", "x",
                         stop_after="fuse").module)
    assert "cf.assert" not in fused


def test_import_of_a_row_sort_runs_on_transposed_blocks_of_rows(kernel_file):
    """A sort along the innermost dim runs per block of 16 rows (the blocks in parallel),
    on the block's transpose: [16, 6] -> [6, 16], padded to [8, 16], the same 6 stages over
    dim 0 (each compares whole 16-row vectors), the values read there, and transposed back;
    the indices are the sorted positions themselves (torch-mlir's iota operand is neither
    transposed nor read)."""
    compiled = _compile(kernel_file, "torch.sort(x, 1)", "[torch.randn(32, 6)]", "x",
                        stop_after="import")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main(%arg0: tensor<32x6xf32>)
        CHECK: scf.forall (%[[R:.*]]) = (0) to (32) step (16) shared_outs(%[[V:.*]] = %{{.*}}, %[[I:.*]] = %{{.*}})
        CHECK: %[[X:.*]] = tensor.extract_slice %arg0[%[[R]], 0] [16, 6] [1, 1]
        CHECK: %[[XT:.*]] = linalg.transpose ins(%[[X]] : tensor<16x6xf32>) outs(%{{.*}} : tensor<6x16xf32>) permutation = [1, 0]
        CHECK: linalg.generic {{.*}} ins(%[[XT]] : tensor<6x16xf32>) outs(%{{.*}} : tensor<6x16xi64>)
        CHECK: tensor.expand_shape %{{.*}} output_shape [4, 1, 2, 1, 16]
        CHECK-COUNT-5: tensor.expand_shape %{{.*}} : tensor<8x16xi64> into
        CHECK: tensor.extract %[[XT]]
        CHECK: %[[VT:.*]] = linalg.transpose ins(%{{.*}} : tensor<6x16xf32>) outs(%{{.*}} : tensor<16x6xf32>)
        CHECK: %[[IT:.*]] = linalg.transpose ins(%{{.*}} : tensor<6x16xi64>) outs(%{{.*}} : tensor<16x6xi64>)
        CHECK: tensor.parallel_insert_slice %[[VT]] into %[[V]][%[[R]], 0] [16, 6] [1, 1]
        CHECK: tensor.parallel_insert_slice %[[IT]] into %[[I]][%[[R]], 0] [16, 6] [1, 1]
    """)
    assert text.count("tensor.extract %") == 1  # the values; the indices are no gather


def test_import_of_a_small_topk_selects(kernel_file):
    """topk(x, 3) of [4, 300]: no sort; three reductions over the packed keys, the first the
    smallest (the largest value), each next the smallest above the one before, stored as
    the kept keys [4, 3], then the values read at their positions and the indices the
    positions themselves."""
    compiled = _compile(kernel_file, "torch.topk(x, 3, dim=1)", "[torch.randn(4, 300)]", "x",
                        stop_after="import")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main(%arg0: tensor<4x300xf32>)
        CHECK: %[[KEYS:.*]] = linalg.generic {{.*}} ins(%{{.*}} : tensor<4x300xf32>) outs(%{{.*}} : tensor<4x300xi64>)
        CHECK: %[[M1:.*]] = linalg.generic {{.*}} iterator_types = ["parallel", "reduction"]} ins(%[[KEYS]] : tensor<4x300xi64>) outs(%{{.*}} : tensor<4xi64>)
        CHECK: arith.minsi
        CHECK: %[[K1:.*]] = tensor.insert_slice %[[M1]] into %{{.*}}[0, 0] [4, 1] [1, 1] : tensor<4xi64> into tensor<4x3xi64>
        CHECK: %[[M2:.*]] = linalg.generic {{.*}} ins(%[[KEYS]], %[[M1]] : tensor<4x300xi64>, tensor<4xi64>)
        CHECK: arith.cmpi sgt
        CHECK: arith.select
        CHECK: arith.minsi
        CHECK: %[[K2:.*]] = tensor.insert_slice %[[M2]] into %[[K1]][0, 1] [4, 1] [1, 1]
        CHECK: %[[M3:.*]] = linalg.generic {{.*}} ins(%[[KEYS]], %[[M2]] : tensor<4x300xi64>, tensor<4xi64>)
        CHECK: %[[K3:.*]] = tensor.insert_slice %[[M3]] into %[[K2]][0, 2] [4, 1] [1, 1]
        CHECK: linalg.generic {{.*}} ins(%[[K3]] : tensor<4x3xi64>) outs(%{{.*}} : tensor<4x3xf32>)
        CHECK: tensor.extract
        CHECK: linalg.generic {{.*}} ins(%[[K3]] : tensor<4x3xi64>) outs(%{{.*}} : tensor<4x3xi64>)
        CHECK-NOT: tensor.extract
    """)


def test_import_of_a_topk_sorts_blocks_and_halves_them(kernel_file):
    """topk(x, 70) of [300, 4] along dim 0 (more than a selection takes): the dim padded to
    512 keys; blocks of K = 128 sorted (28 stages); then twice, each pair of blocks halved
    to its 128 first keys (a minimum over the pair) and sorted again (7 stages), 512 ->
    128; the 70 first read back (no full sort: 28 + 2 x (1 + 7) = 44 steps in place of 45
    stages, on ever shorter dims)."""
    compiled = _compile(kernel_file, "torch.topk(x, 70, dim=0).values", "[torch.randn(300, 4)]",
                        "x", stop_after="import")
    text = str(compiled.module)
    check(text, """
        CHECK-COUNT-28: tensor.collapse_shape {{.*}} into tensor<512x4xi64>
        CHECK:          tensor.expand_shape %{{.*}} output_shape [2, 2, 128, 4] : tensor<512x4xi64> into tensor<2x2x128x4xi64>
        CHECK:          linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "parallel", "reduction"]
        CHECK:          arith.minsi
        CHECK:          tensor.collapse_shape {{.*}} : tensor<2x128x4xi64> into tensor<256x4xi64>
        CHECK-COUNT-7:  tensor.collapse_shape {{.*}} into tensor<256x4xi64>
        CHECK:          tensor.collapse_shape {{.*}} : tensor<1x128x4xi64> into tensor<128x4xi64>
        CHECK-COUNT-7:  tensor.collapse_shape {{.*}} into tensor<128x4xi64>
        CHECK:          tensor.extract_slice %{{.*}}[0, 0] [70, 4] [1, 1] : tensor<128x4xi64> to tensor<70x4xi64>
        CHECK:          tensor.extract %arg0
    """)
    assert "tensor<300x4xf32> to tensor<70x4xf32>" not in text  # no slice of a full sort


# sorts the network pads (n no power of two), long rows, ties, NaN and signed zeros, in
# both directions, and key types of every width (64-bit keys: the rank sort)
EDGE_SORTS = {
    "long_rows": ("torch.sort(x, 1)", "[torch.randn(3, 1000, generator=g, dtype=dt)]", "float32"),
    "power_of_two": ("torch.sort(x, 1, descending=True)", "[torch.randn(2, 1024, generator=g, dtype=dt)]",
                     "float32"),
    "ties_nan_zeros": (
        "(*torch.sort(x, dim=1, stable=True), *torch.sort(x, dim=1, descending=True, stable=True))",
        "[torch.tensor([[0.0, -0.0, float('nan'), 1.0, -float('nan'), -1.0, 0.0, float('inf'), "
        "-float('inf'), 1.0, -0.0]] * 2, dtype=dt)]", "float32"),
    "float16": ("torch.sort(x, dim=1, descending=True, stable=True)",
                "[torch.randint(-8, 8, (3, 77), generator=g).to(dt)]", "float16"),
    "int16": ("torch.sort(x, dim=1, stable=True)", "[torch.randint(-9, 9, (3, 50), generator=g, dtype=dt)]",
              "int16"),
    "bool": ("torch.sort(x, dim=1, descending=True, stable=True)",
             "[torch.randint(0, 2, (3, 50), generator=g).to(dt)]", "bool"),
    "int32_extremes": ("torch.sort(x, dim=1, stable=True)",
                       "[torch.tensor([[2**31 - 1, -2**31, 0, -1, 2**31 - 1, -2**31, 5]], dtype=dt)]",
                       "int32"),
    "float64": ("torch.sort(x, 1)", "[torch.randn(3, 40, generator=g, dtype=dt)]", "float64"),
    "topk": ("torch.topk(x, 5, dim=1)", "[torch.randn(4, 300, generator=g, dtype=dt)]", "float32"),
    # top-k keeps blocks of K = 2^q >= k and halves them: k of one block, of half the row,
    # the smallest along dim 0, one element, and two slices of one sort
    "topk_150": ("torch.topk(x, 150, dim=1)", "[torch.randn(3, 300, generator=g, dtype=dt)]", "float32"),
    "topk_smallest_dim0": ("torch.topk(x, 3, dim=0, largest=False)",
                           "[torch.randn(37, 4, generator=g, dtype=dt)]", "float32"),
    "topk_1": ("torch.topk(x, 1, dim=1)[0]", "[torch.randn(5, 64, generator=g, dtype=dt)]", "float32"),
    "topk_bf16_ties": ("torch.topk(x, 9, dim=1).values",
                       "[torch.randint(-4, 4, (6, 100), generator=g).to(dt)]", "bfloat16"),
    "two_slices": ("(lambda s: (s[0][:, :4], s[1][:, :7]))(torch.sort(x, 1, descending=True))",
                   "[torch.randn(4, 200, generator=g, dtype=dt)]", "float32"),
    # rows sorted in transposed blocks of 16 (two blocks; blocks of 12 and of 4; a prime row
    # count sorts its rows as they are), 3-D, NaN and ties, integers
    "row_blocks": ("torch.sort(x, 1, descending=True)", "[torch.randn(32, 77, generator=g, dtype=dt)]",
                   "float32"),
    "row_blocks_of_12": ("torch.sort(x, -1)", "[torch.randn(2, 12, 40, generator=g, dtype=dt)]", "float32"),
    "row_blocks_of_4": ("torch.sort(x, dim=1, stable=True)", "[torch.randint(-3, 3, (4, 33), generator=g).to(dt)]",
                        "float32"),
    "prime_rows": ("torch.sort(x, 1)", "[torch.randn(37, 50, generator=g, dtype=dt)]", "float32"),
    "row_blocks_nan": ("torch.sort(x, dim=1, descending=True, stable=True)",
                       "[torch.where(torch.rand(16, 40, generator=g) < 0.2, float('nan'), "
                       "torch.randint(-3, 3, (16, 40), generator=g).to(dt))]", "float32"),
    "row_blocks_int32": ("torch.sort(x, dim=1, stable=True)",
                         "[torch.randint(-99, 99, (16, 50), generator=g, dtype=dt)]",
                         "int32"),
    "row_blocks_topk_70": ("torch.topk(x, 70, dim=1)", "[torch.randn(16, 300, generator=g, dtype=dt)]",
                           "float32"),
    # top-k by selection (k <= 64): one and 64 of them, the smallest, NaN (the largest),
    # -0.0 and 0.0, integers, bf16, 3-D, along dim 0, row blocks of 8 (32 KiB) and more
    "select_64": ("torch.topk(x, 64, dim=1)", "[torch.randn(8, 300, generator=g, dtype=dt)]", "float32"),
    "select_smallest": ("torch.topk(x, 7, dim=1, largest=False)", "[torch.randn(24, 1024, generator=g, dtype=dt)]",
                        "float32"),
    "select_nan_zeros": ("torch.topk(x, 4, dim=1).values, torch.topk(x, 4, dim=1, largest=False).values",
                         "[torch.tensor([[0.0, -0.0, float('nan'), 1.0, -1.0, float('inf'), -float('inf'), "
                         "2.0, float('nan')]] * 3, dtype=dt)]", "float32"),
    "select_int64_indices": ("torch.topk(x, 5, dim=1)",
                             "[torch.randperm(64, generator=g).to(dt).view(2, 32)]", "int32"),
    "select_bf16": ("torch.topk(x, 6, dim=-1)", "[torch.randn(3, 5, 64, generator=g).to(dt)]", "bfloat16"),
    "select_dim0": ("torch.topk(x, 5, dim=0)", "[torch.randn(300, 6, generator=g, dtype=dt)]", "float32"),
    "select_then_use": ("(lambda t: t.values.sum(1) + t.indices.float().mean(1))(torch.topk(x, 3, dim=1))",
                        "[torch.randn(40, 100, generator=g, dtype=dt)]", "float32"),
}


@pytest.mark.parametrize("name", EDGE_SORTS)
def test_edge_sorts_match_torch(kernel_file, name):
    expr, inputs, dtype = EDGE_SORTS[name]
    _assert_matches(_compile(kernel_file, expr, inputs, "x", dtype))
