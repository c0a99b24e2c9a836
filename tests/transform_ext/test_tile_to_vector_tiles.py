"""tile_to_vector_tiles: IR (FileCheck) of a matmul's register tiles with its fill inside, of
a prime row length whose partial tile is peeled and of a vector-matrix product's lane runs
(with and without k chunks), rejection of a target that is not a function and of a bad
k_chunk; numerics through the generic schedule against torch."""

import pytest
import torch
from torch_mlir import ir

from schedules.common import apply_schedule, build_schedule, canonicalize, match
from transform_ext.tile_to_vector_tiles import tile_to_vector_tiles
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module
from tests.transform_ext.test_fuse_init_into_register_tile import FILLED

# y = 2 x over rows of 131 (a prime): tiles of 16 lanes, the last 3 lanes peeled
PRIME_ROWS = """
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%x: tensor<4x131xf32>) -> tensor<4x131xf32> {
  %two = arith.constant 2.0 : f32
  %e = tensor.empty() : tensor<4x131xf32>
  %r = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<4x131xf32>) outs(%e : tensor<4x131xf32>) {
  ^bb0(%a: f32, %out: f32):
    %y = arith.mulf %a, %two : f32
    linalg.yield %y : f32
  } -> tensor<4x131xf32>
  return %r : tensor<4x131xf32>
}
"""


def _tile(vector_tile=16, register_tile=(8, 32)):
    return lambda root: tile_to_vector_tiles(match(root, "func.func"), vector_tile=vector_tile,
                                             register_tile=register_tile)


def test_a_matmul_gets_register_tiles_that_compute_its_fill():
    payload = parse(FILLED)
    apply(payload, _tile())
    check(payload, """
        CHECK: func.func @main
        CHECK-NOT: linalg.fill
        CHECK: scf.for %[[I:[^ ]+]] = %{{.*}} to %c16 step %c8
        CHECK: scf.for %[[J:[^ ]+]] = %{{.*}} to %c64 step %c32
        CHECK: %[[ZERO:[^ ]+]] = linalg.fill {{.*}} -> tensor<8x32xf32>
        CHECK: scf.for %[[K:[^ ]+]] = %{{.*}} to %c24 step %c1 iter_args(%[[ACC:[^ ]+]] = %[[ZERO]])
        CHECK: %[[TILE:[^ ]+]] = tensor.extract_slice %[[ACC]][0, 0] [8, 32] [1, 1]
        CHECK: linalg.matmul ins(%{{.*}}, %{{.*}} : tensor<8x1xf32>, tensor<1x32xf32>) outs(%[[TILE]] : tensor<8x32xf32>)
    """)


def test_the_partial_tile_of_a_prime_row_is_peeled():
    payload = parse(PRIME_ROWS)
    apply(payload, _tile())
    check(payload, """
        CHECK: func.func @main
        CHECK: scf.for %{{.*}} = %{{.*}} to %c4 step %c1
        CHECK: scf.for %{{.*}} = %{{.*}} to %c128 step %c16
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<1x16xf32>) outs(%{{.*}} : tensor<1x16xf32>)
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<1x3xf32>) outs(%{{.*}} : tensor<1x3xf32>)
    """)
    assert "tensor<1x?xf32>" not in str(payload)


def test_an_op_marked_for_the_target_is_left_whole():
    """lh.target_kernel (transform_ext.common.TARGET_KERNEL): the target lowers the op
    itself; the op beside it is still tiled."""
    marked = PRIME_ROWS.replace("outs(%e : tensor<4x131xf32>) {",
                                "outs(%e : tensor<4x131xf32>) attrs = {lh.target_kernel} {")
    twice = marked.replace("return %r", "%r2 = linalg.generic {indexing_maps = [#id, #id], "
                           "iterator_types = [\"parallel\", \"parallel\"]} ins(%r : "
                           "tensor<4x131xf32>) outs(%e : tensor<4x131xf32>) {\n^bb0(%a: f32, "
                           "%out: f32):\n  %y = arith.addf %a, %two : f32\n  linalg.yield %y : "
                           "f32\n} -> tensor<4x131xf32>\n  return %r2")
    payload = parse(twice)
    apply(payload, _tile())
    check(payload, """
        CHECK: func.func @main
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<4x131xf32>) outs(%{{.*}} : tensor<4x131xf32>) attrs = {lh.target_kernel}
        CHECK: scf.for
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<1x16xf32>) outs(%{{.*}} : tensor<1x16xf32>)
    """)


def test_an_odd_divisor_of_the_row_is_not_a_vector_tile():
    """Rows of 255 = 3 x 5 x 17 on 8 lanes (register tile 4 x 16): a tile of 17 would be
    legalized into two vectors and a single lane each time; tiles of 32 (the vector tile)
    with the last 31 lanes peeled instead. Rows of 264 keep a divisor of whole vectors (24)."""
    payload = parse(PRIME_ROWS.replace("4x131", "4x255"))
    apply(payload, _tile(vector_tile=32, register_tile=(4, 16)))
    check(payload, """
        CHECK: func.func @main
        CHECK: scf.for %{{.*}} = %{{.*}} to %c224 step %c32
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<1x32xf32>) outs(%{{.*}} : tensor<1x32xf32>)
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<1x31xf32>) outs(%{{.*}} : tensor<1x31xf32>)
    """)
    assert "tensor<1x17xf32>" not in str(payload)
    even = parse(PRIME_ROWS.replace("4x131", "4x264"))
    apply(even, _tile(vector_tile=32, register_tile=(4, 16)))
    check(even, """
        CHECK: scf.for %{{.*}} = %{{.*}} to %c264 step %c24
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<1x24xf32>) outs(%{{.*}} : tensor<1x24xf32>)
    """)
    x = torch.randn(4, 255, generator=torch.Generator().manual_seed(1))
    assert torch.equal(run_module(payload, [x])[0], 2.0 * x)


def test_the_peeled_rows_match_torch():
    """263 lanes (a prime above twice the default vector tile, 64): 4 x 64 lanes, 7 peeled."""
    x = torch.randn(4, 263, generator=torch.Generator().manual_seed(0))
    got = run_module(parse(PRIME_ROWS.replace("4x131", "4x263")), [x])[0]
    assert torch.equal(got, 2.0 * x)


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(PRIME_ROWS)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: tile_to_vector_tiles(
        match(root, "linalg.generic"), vector_tile=16, register_tile=(8, 32)))
    assert "transform_ext.tile_to_vector_tiles: linalg.generic at" in message
    assert "not a func.func" in message
    assert str(payload) == before


def test_a_handle_into_the_function_is_invalidated_not_left_dangling():
    """The op replaces the function's linalg ops through nested interpreter runs: it consumes
    the function's handle, so a handle to an op inside, kept across it, is a checked error
    when used (with the checks the compile pipeline applies scripts with; it pointed to a
    freed op before: a crash or a silent wrong rewrite)."""
    payload = parse(PRIME_ROWS)

    def body(root):
        generic = match(root, "linalg.generic")
        tile_to_vector_tiles(match(root, "func.func"), vector_tile=16, register_tile=(8, 32))
        canonicalize(generic)

    with payload.context, ir.Location.unknown():
        with pytest.raises(ValueError, match="invalidated by a previously executed transform op"):
            apply_schedule(payload, build_schedule(body), expensive_checks=True)


# the max over the middle dim of [3, 9, 131] (lanes along 131, a prime: a peeled tile)
MIDDLE_MAX = """
#x = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
#out = affine_map<(d0, d1, d2) -> (d0, d2)>
func.func @main(%x: tensor<3x9x131xf32>) -> tensor<3x131xf32> {
  %low = arith.constant 0xFF800000 : f32
  %e = tensor.empty() : tensor<3x131xf32>
  %init = linalg.fill ins(%low : f32) outs(%e : tensor<3x131xf32>) -> tensor<3x131xf32>
  %r = linalg.generic {indexing_maps = [#x, #out], iterator_types = ["parallel", "reduction", "parallel"]}
      ins(%x : tensor<3x9x131xf32>) outs(%init : tensor<3x131xf32>) {
  ^bb0(%a: f32, %acc: f32):
    %m = arith.maximumf %a, %acc : f32
    linalg.yield %m : f32
  } -> tensor<3x131xf32>
  return %r : tensor<3x131xf32>
}
"""


def test_a_reduction_over_a_middle_dim_runs_innermost():
    """Each lane tile loops over the reduced rows inside: its accumulator stays one tile
    (in registers once vectorized) instead of being read and written per reduced row."""
    payload = parse(MIDDLE_MAX)
    apply(payload, _tile())
    check(payload, """
        CHECK: func.func @main
        CHECK: linalg.fill
        CHECK: scf.for %{{.*}} = %{{.*}} to %c3 step %c1
        CHECK: scf.for %{{.*}} = %{{.*}} to %c128 step %c16
        CHECK: scf.for %{{.*}} = %{{.*}} to %c9 step %c1
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<1x1x16xf32>) outs(%{{.*}} : tensor<1x16xf32>)
        CHECK: scf.for %{{.*}} = %{{.*}} to %c9 step %c1
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<1x1x3xf32>) outs(%{{.*}} : tensor<1x3xf32>)
    """)


def test_middle_dim_reductions_match_torch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 9, 131, generator=g)
    x[1, 4, 7] = float("nan")
    (r,) = run_module(parse(MIDDLE_MAX), [x])
    torch.testing.assert_close(r, x.amax(1), equal_nan=True)


# y[m] = sum_k A[k, m] x[k] (A^T x with A read in place), K = 64, M = 512, y zero-filled
VECTOR_MATRIX = """
#a = affine_map<(d0, d1) -> (d1, d0)>
#x = affine_map<(d0, d1) -> (d1)>
#y = affine_map<(d0, d1) -> (d0)>
func.func @main(%a: tensor<64x512xf32>, %x: tensor<64xf32>) -> tensor<512xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<512xf32>
  %init = linalg.fill ins(%zero : f32) outs(%e : tensor<512xf32>) -> tensor<512xf32>
  %r = linalg.generic {indexing_maps = [#a, #x, #y], iterator_types = ["parallel", "reduction"]}
      ins(%a, %x : tensor<64x512xf32>, tensor<64xf32>) outs(%init : tensor<512xf32>) {
  ^bb0(%av: f32, %xv: f32, %out: f32):
    %p = arith.mulf %av, %xv : f32
    %s = arith.addf %out, %p : f32
    linalg.yield %s : f32
  } -> tensor<512xf32>
  return %r : tensor<512xf32>
}
"""


def test_a_vector_matrix_product_walks_its_k_chunks_across_lane_runs_of_a():
    payload = parse(VECTOR_MATRIX)
    apply(payload, lambda root: tile_to_vector_tiles(match(root, "func.func"), vector_tile=16,
                                                     register_tile=(8, 32), k_chunk=16))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: linalg.fill {{.*}} -> tensor<16xf32>
        CHECK: scf.for %{{.*}} = %{{.*}} to %c64{{.*}} step %c16
        CHECK:   scf.for %{{.*}} = %{{.*}} to %c512{{.*}} step %c256
        CHECK:     scf.for %{{.*}} = %{{.*}} to %c16{{.*}} step %c1
        CHECK:       linalg.generic
        CHECK-SAME:    ins(%{{.*}}, %{{.*}} : tensor<1x256xf32>, tensor<1xf32>) outs(%{{.*}} : tensor<256xf32>)
    """)


def test_a_vector_matrix_product_without_chunks_keeps_its_lane_run_over_all_of_k():
    payload = parse(VECTOR_MATRIX)
    apply(payload, _tile())
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: scf.for %{{.*}} = %{{.*}} to %c512{{.*}} step %c256
        CHECK:   linalg.fill {{.*}} -> tensor<256xf32>
        CHECK:   scf.for %{{.*}} = %{{.*}} to %c64{{.*}} step %c1
        CHECK:     linalg.generic
        CHECK-SAME:  ins(%{{.*}}, %{{.*}} : tensor<1x256xf32>, tensor<1xf32>) outs(%{{.*}} : tensor<256xf32>)
    """)


def test_rejects_a_k_chunk_below_one():
    payload = parse(VECTOR_MATRIX)
    message = apply_expect_failure(payload, lambda root: tile_to_vector_tiles(
        match(root, "func.func"), vector_tile=16, register_tile=(8, 32), k_chunk=0))
    assert "k_chunk = 0 must be >= 1" in message
    check(payload, "CHECK-NOT: scf.for")
