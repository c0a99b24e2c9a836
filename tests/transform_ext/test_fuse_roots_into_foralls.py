"""fuse_roots_into_foralls: IR (FileCheck) of a row chain tiled into a forall with its
producer fused, a small op left sequential (and no marker left behind), a reduction of few
long rows split and a small contraction not, rejection of a
target that is not a function; numerics of the chain against torch."""

import torch

from schedules.common import match
from transform_ext.fuse_roots_into_foralls import fuse_roots_into_foralls
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

_ROW_SUMS = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#rows = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<ROWSxCOLSxf32>) -> tensor<ROWSxf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<ROWSxCOLSxf32>
  %exp = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<ROWSxCOLSxf32>) outs(%e : tensor<ROWSxCOLSxf32>) {
  ^bb0(%a: f32, %out: f32):
    %y = math.exp %a : f32
    linalg.yield %y : f32
  } -> tensor<ROWSxCOLSxf32>
  %r0 = tensor.empty() : tensor<ROWSxf32>
  %acc = linalg.fill ins(%zero : f32) outs(%r0 : tensor<ROWSxf32>) -> tensor<ROWSxf32>
  %sum = linalg.generic {indexing_maps = [#id, #rows], iterator_types = ["parallel", "reduction"]}
      ins(%exp : tensor<ROWSxCOLSxf32>) outs(%acc : tensor<ROWSxf32>) {
  ^bb0(%a: f32, %out: f32):
    %s = arith.addf %a, %out : f32
    linalg.yield %s : f32
  } -> tensor<ROWSxf32>
  return %sum : tensor<ROWSxf32>
}
"""


def row_sums(rows: int = 64, cols: int = 128) -> str:
    """sum_j exp(x[i, j]) per row of a rows x cols tensor."""
    return _ROW_SUMS.replace("ROWS", str(rows)).replace("COLS", str(cols))


ROW_SUMS = row_sums()

POLICY = dict(threads=2, tiles_per_thread=4, tile_bytes=1 << 20, vector_tile=16,
              pass_bytes=1 << 20)

_ROW_NORMALIZE = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#rows = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<64x128xf32>) -> tensor<64x128xf32> {
  %zero = arith.constant 0.0 : f32
  %r0 = tensor.empty() : tensor<64xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%r0 : tensor<64xf32>) -> tensor<64xf32>
  %sum = linalg.generic {indexing_maps = [#id, #rows], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<64x128xf32>) outs(%acc : tensor<64xf32>) {
  ^bb0(%a: f32, %out: f32):
    %s = arith.addf %a, %out : f32
    linalg.yield %s : f32
  } -> tensor<64xf32>
  %e = tensor.empty() : tensor<64x128xf32>
  %q = linalg.generic {indexing_maps = [#id, #rows, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %sum : tensor<64x128xf32>, tensor<64xf32>) outs(%e : tensor<64x128xf32>) {
  ^bb0(%a: f32, %d: f32, %out: f32):
    %y = arith.divf %a, %d : f32
    linalg.yield %y : f32
  } -> tensor<64x128xf32>
  return %q : tensor<64x128xf32>
}
"""


def test_a_root_is_tiled_into_a_forall_with_its_producers_fused():
    """64 rows into 2 x 4 = 8 tiles of 8 rows; the exp and the fill are computed per tile."""
    payload = parse(ROW_SUMS)
    apply(payload, lambda root: fuse_roots_into_foralls(
        match(root, "func.func"), min_parallel_work=1, **POLICY))
    check(payload, """
        CHECK: func.func @main
        CHECK: scf.forall (%[[I:.*]]) = (0) to (64) step (8)
        CHECK: %[[X:.*]] = tensor.extract_slice %{{.*}}[%[[I]], 0] [8, 128] [1, 1]
        CHECK: %[[EXP:.*]] = linalg.generic {{.*}} ins(%[[X]] : tensor<8x128xf32>)
        CHECK: math.exp
        CHECK: %[[ACC:.*]] = linalg.fill {{.*}} -> tensor<8xf32>
        CHECK: linalg.generic {{.*}} ins(%[[EXP]] : tensor<8x128xf32>) outs(%[[ACC]] : tensor<8xf32>)
        CHECK: scf.forall.in_parallel
        CHECK-NOT: linalg.
        CHECK: return
    """)


def test_a_chain_of_passes_over_its_rows_is_bounded_by_pass_bytes():
    """x / sum_j x[i, j]: the sum reads each row before the quotient reads it again, so a
    tile holds at most pass_bytes of the result: 2 KiB, 4 rows of 128 f32 (16 tiles, not
    the threads' 8)."""
    payload = parse(_ROW_NORMALIZE)
    apply(payload, lambda root: fuse_roots_into_foralls(
        match(root, "func.func"), min_parallel_work=1, **{**POLICY, "pass_bytes": 2048}))
    check(payload, """
        CHECK: scf.forall (%[[I:.*]]) = (0) to (64) step (4)
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<4x128xf32>) outs(%{{.*}} : tensor<4xf32>)
        CHECK: arith.divf
        CHECK: scf.forall.in_parallel
    """)


_CHANNEL_NORMALIZE = """
#id = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
#nw = affine_map<(d0, d1, d2) -> (d0, d2)>
func.func @main(%x: tensor<8x16x64xf32>) -> tensor<8x16x64xf32> {
  %zero = arith.constant 0.0 : f32
  %r0 = tensor.empty() : tensor<8x64xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%r0 : tensor<8x64xf32>) -> tensor<8x64xf32>
  %sum = linalg.generic {indexing_maps = [#id, #nw],
                         iterator_types = ["parallel", "reduction", "parallel"]}
      ins(%x : tensor<8x16x64xf32>) outs(%acc : tensor<8x64xf32>) {
  ^bb0(%a: f32, %out: f32):
    %s = arith.addf %a, %out : f32
    linalg.yield %s : f32
  } -> tensor<8x64xf32>
  %e = tensor.empty() : tensor<8x16x64xf32>
  %q = linalg.generic {indexing_maps = [#id, #nw, #id],
                       iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%x, %sum : tensor<8x16x64xf32>, tensor<8x64xf32>) outs(%e : tensor<8x16x64xf32>) {
  ^bb0(%a: f32, %d: f32, %out: f32):
    %y = arith.divf %a, %d : f32
    linalg.yield %y : f32
  } -> tensor<8x16x64xf32>
  return %q : tensor<8x16x64xf32>
}
"""


def test_a_chain_reducing_an_outer_dim_keeps_tile_bytes():
    """x[n, c, w] / sum_c x[n, c, w] (a norm over the channels): the batch is split for the
    threads (8 tiles of one), the contiguous dim is not cut into pass_bytes tiles, which
    would read shorter runs of each channel."""
    payload = parse(_CHANNEL_NORMALIZE)
    apply(payload, lambda root: fuse_roots_into_foralls(
        match(root, "func.func"), min_parallel_work=1, **{**POLICY, "pass_bytes": 64}))
    check(payload, """
        CHECK: scf.forall (%{{.*}}) in (8) shared_outs(%{{.*}}) -> (tensor<8x16x64xf32>)
        CHECK: arith.divf
    """)


def test_a_single_pass_reduction_is_not_bounded_by_pass_bytes():
    """A row sum reads each row once: the threads' 8 tiles, whatever pass_bytes says."""
    payload = parse(ROW_SUMS)
    apply(payload, lambda root: fuse_roots_into_foralls(
        match(root, "func.func"), min_parallel_work=1, **{**POLICY, "pass_bytes": 64}))
    check(payload, """
        CHECK: scf.forall (%{{.*}}) = (0) to (64) step (8)
    """)


def test_too_little_work_stays_sequential_and_unmarked():
    payload = parse(ROW_SUMS)
    before = str(payload)
    apply(payload, lambda root: fuse_roots_into_foralls(
        match(root, "func.func"), min_parallel_work=1 << 20, **POLICY))
    assert str(payload) == before


_ROW_MAX = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#rows = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<16x4096xf32>) -> tensor<16xf32> {
  %low = arith.constant 0xFF800000 : f32
  %r0 = tensor.empty() : tensor<16xf32>
  %acc = linalg.fill ins(%low : f32) outs(%r0 : tensor<16xf32>) -> tensor<16xf32>
  %max = linalg.generic {indexing_maps = [#id, #rows], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<16x4096xf32>) outs(%acc : tensor<16xf32>) {
  ^bb0(%a: f32, %out: f32):
    %m = arith.maximumf %a, %out : f32
    linalg.yield %m : f32
  } -> tensor<16xf32>
  return %max : tensor<16xf32>
}
"""


def test_a_reduction_over_few_long_rows_counts_its_iteration_points():
    """16 results, 16 x 4096 iteration points: parallel at min_parallel_work 4096 (a row max
    of [1023, 128256] stayed on one thread), sequential one point above them."""
    payload = parse(_ROW_MAX)
    apply(payload, lambda root: fuse_roots_into_foralls(
        match(root, "func.func"), min_parallel_work=4096, **POLICY))
    check(payload, """
        CHECK: scf.forall (%{{.*}}) = (0) to (16) step (2)
        CHECK:   linalg.generic {{.*}} ins(%{{.*}} : tensor<2x4096xf32>)
        CHECK:     arith.maximumf
    """)
    payload = parse(_ROW_MAX)
    before = str(payload)
    apply(payload, lambda root: fuse_roots_into_foralls(
        match(root, "func.func"), min_parallel_work=16 * 4096 + 1, **POLICY))
    assert str(payload) == before


_SMALL_MATMUL = """
func.func @main(%a: tensor<24x40xf32>, %b: tensor<40x64xf32>) -> tensor<24x64xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<24x64xf32>
  %c = linalg.fill ins(%zero : f32) outs(%e : tensor<24x64xf32>) -> tensor<24x64xf32>
  %p = linalg.matmul ins(%a, %b : tensor<24x40xf32>, tensor<40x64xf32>)
      outs(%c : tensor<24x64xf32>) -> tensor<24x64xf32>
  return %p : tensor<24x64xf32>
}
"""


def test_a_contraction_counts_its_results():
    """24 x 64 results (24 x 40 x 64 iteration points) under min_parallel_work 4096: split
    for 8 tiles, its rows would come in threes, below an 8-row register tile."""
    payload = parse(_SMALL_MATMUL)
    before = str(payload)
    apply(payload, lambda root: fuse_roots_into_foralls(
        match(root, "func.func"), min_parallel_work=4096, **POLICY))
    assert str(payload) == before


def test_the_tiled_chain_matches_torch():
    """8192 rows: enough work for the generic schedule's forall (min_parallel_work 4096)."""
    x = torch.randn(8192, 24, generator=torch.Generator().manual_seed(0))
    got = run_module(parse(row_sums(8192, 24)), [x])[0]
    torch.testing.assert_close(got, torch.exp(x).sum(dim=1), rtol=1e-5, atol=1e-5)


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(ROW_SUMS)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: fuse_roots_into_foralls(
        match(root, "linalg.fill"), min_parallel_work=1, **POLICY))
    assert "transform_ext.fuse_roots_into_foralls: linalg.fill at" in message
    assert "not a func.func" in message
    assert str(payload) == before
