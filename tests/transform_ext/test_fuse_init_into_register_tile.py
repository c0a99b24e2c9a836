"""fuse_init_into_register_tile: IR (FileCheck) of a matmul register tile computing its
zero fill and of one computing a rescale of its accumulator, rejection of an untiled
contraction; numerics through the generic schedule against torch."""

import torch
from torch_mlir.dialects.transform import structured

from schedules.common import match
from transform_ext.fuse_init_into_register_tile import fuse_init_into_register_tile
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

FILLED = """
func.func @main(%a: tensor<16x24xf32>, %b: tensor<24x64xf32>) -> tensor<16x64xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<16x64xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<16x64xf32>) -> tensor<16x64xf32>
  %r = linalg.matmul ins(%a, %b : tensor<16x24xf32>, tensor<24x64xf32>)
      outs(%acc : tensor<16x64xf32>) -> tensor<16x64xf32>
  return %r : tensor<16x64xf32>
}
"""

# c = 0.5 * c0 + a @ b: the rescale of c0 is the accumulator's producer
RESCALED = """
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%a: tensor<16x24xf32>, %b: tensor<24x64xf32>, %c0: tensor<16x64xf32>) -> tensor<16x64xf32> {
  %half = arith.constant 0.5 : f32
  %e = tensor.empty() : tensor<16x64xf32>
  %acc = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%c0 : tensor<16x64xf32>) outs(%e : tensor<16x64xf32>) {
  ^bb0(%x: f32, %out: f32):
    %y = arith.mulf %x, %half : f32
    linalg.yield %y : f32
  } -> tensor<16x64xf32>
  %r = linalg.matmul ins(%a, %b : tensor<16x24xf32>, tensor<24x64xf32>)
      outs(%acc : tensor<16x64xf32>) -> tensor<16x64xf32>
  return %r : tensor<16x64xf32>
}
"""


def _tile_and_fuse(root):
    tiled = structured.TileUsingForOp(match(root, "linalg.matmul"), sizes=[8, 32, 0])
    fuse_init_into_register_tile(tiled.tiled_linalg_op)


def test_the_zero_fill_is_computed_per_register_tile():
    payload = parse(FILLED)
    apply(payload, _tile_and_fuse)
    check(payload, """
        CHECK: func.func @main
        CHECK-NOT: linalg.fill
        CHECK: %[[E:[^ ]+]] = tensor.empty() : tensor<16x64xf32>
        CHECK: scf.for %[[I:[^ ]+]] = {{.*}} iter_args(%[[C:[^ ]+]] = %[[E]])
        CHECK: scf.for %[[J:[^ ]+]] = {{.*}} iter_args(%[[D:[^ ]+]] = %[[C]])
        CHECK: %[[TILE:[^ ]+]] = tensor.extract_slice %[[D]][%[[I]], %[[J]]] [8, 32] [1, 1]
        CHECK: %[[ZERO:[^ ]+]] = linalg.fill ins(%{{.*}} : f32) outs(%[[TILE]] : tensor<8x32xf32>)
        CHECK: linalg.matmul ins(%{{.*}}, %{{.*}} : tensor<8x24xf32>, tensor<24x32xf32>) outs(%[[ZERO]] : tensor<8x32xf32>)
    """)


def test_a_rescale_reads_the_same_tile_of_its_input():
    payload = parse(RESCALED)
    apply(payload, _tile_and_fuse)
    check(payload, """
        CHECK: func.func @main(%{{.*}}: tensor<16x24xf32>, %{{.*}}: tensor<24x64xf32>, %[[C0:.*]]: tensor<16x64xf32>)
        CHECK: scf.for %[[I:[^ ]+]] =
        CHECK: scf.for %[[J:[^ ]+]] = {{.*}} iter_args(%[[D:[^ ]+]] =
        CHECK-DAG: %[[TILE:[^ ]+]] = tensor.extract_slice %[[D]][%[[I]], %[[J]]] [8, 32] [1, 1]
        CHECK-DAG: %[[IN:[^ ]+]] = tensor.extract_slice %[[C0]][%[[I]], %[[J]]] [8, 32] [1, 1]
        CHECK: %[[SCALED:[^ ]+]] = linalg.generic {{.*}} ins(%[[IN]] : tensor<8x32xf32>) outs(%[[TILE]] : tensor<8x32xf32>)
        CHECK: arith.mulf
        CHECK: linalg.matmul {{.*}} outs(%[[SCALED]] : tensor<8x32xf32>)
    """)
    assert str(payload).count("linalg.generic") == 1


def test_the_rescaled_product_matches_torch():
    g = torch.Generator().manual_seed(0)
    a, b, c0 = torch.randn(16, 24, generator=g), torch.randn(24, 64, generator=g), \
        torch.randn(16, 64, generator=g)
    got = run_module(parse(RESCALED), [a, b, c0])[0]
    torch.testing.assert_close(got, 0.5 * c0 + a @ b, rtol=1e-5, atol=1e-5)


def test_rejects_a_contraction_that_is_not_tiled():
    payload = parse(FILLED)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: fuse_init_into_register_tile(match(root, "linalg.matmul")))
    assert "transform_ext.fuse_init_into_register_tile: linalg.matmul at" in message
    assert "its accumulator is not a tensor.extract_slice" in message
    assert str(payload) == before
