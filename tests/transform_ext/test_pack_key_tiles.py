"""pack_key_tiles: the key tiles of a contraction in a query block's key loop read from a
tile-packed copy (FileCheck), the same sums as torch, a loop that does not start on a tile
left as it is, and the rejection of a target that is not a function."""

import torch

from schedules.common import match
from transform_ext.pack_key_tiles import pack_key_tiles
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# out[b] = sum_t Q[b] X[b, :, 32 t : 32 t + 32]: per query block b, a key loop over tiles of
# X [2, 16, 96] (keys last, as K^T), each read by a batch matmul.
KEY_LOOP = """
func.func @main(%q: tensor<2x8x16xf32>, %x: tensor<2x16x96xf32>) -> tensor<2x8x32xf32> {
  %c0 = arith.constant 0 : index
  %c32 = arith.constant 32 : index
  %c96 = arith.constant 96 : index
  %start = arith.constant START : index
  %zero = arith.constant 0.0 : f32
  %init = tensor.empty() : tensor<2x8x32xf32>
  %r = scf.forall (%b) in (2) shared_outs(%o = %init) -> (tensor<2x8x32xf32>) {
    %qb = tensor.extract_slice %q[%b, 0, 0] [1, 8, 16] [1, 1, 1] : tensor<2x8x16xf32> to tensor<1x8x16xf32>
    %e = tensor.empty() : tensor<1x8x32xf32>
    %acc0 = linalg.fill ins(%zero : f32) outs(%e : tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    %sum = scf.for %j = %start to %c96 step %c32 iter_args(%acc = %acc0) -> (tensor<1x8x32xf32>) {
      %tile = tensor.extract_slice %x[%b, 0, %j] [1, 16, 32] [1, 1, 1] : tensor<2x16x96xf32> to tensor<1x16x32xf32>
      %next = linalg.batch_matmul ins(%qb, %tile : tensor<1x8x16xf32>, tensor<1x16x32xf32>) outs(%acc : tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      scf.yield %next : tensor<1x8x32xf32>
    }
    scf.forall.in_parallel {
      tensor.parallel_insert_slice %sum into %o[%b, 0, 0] [1, 8, 32] [1, 1, 1] : tensor<1x8x32xf32> into tensor<2x8x32xf32>
    }
  }
  return %r : tensor<2x8x32xf32>
}
"""


def _payload(start: int = 0):
    return parse(KEY_LOOP.replace("START", str(start)))


def _pack(root):
    pack_key_tiles(match(root, "func.func"))


def test_key_tiles_are_read_from_the_packed_copy():
    payload = _payload()
    apply(payload, _pack)
    check(payload, """
        CHECK: func.func @main(%{{.*}}: tensor<2x8x16xf32>, %[[X:.*]]: tensor<2x16x96xf32>)
        CHECK: %[[EXPANDED:.*]] = tensor.expand_shape %[[X]] {{\\[}}[0], [1], [2, 3]] output_shape [2, 16, 3, 32]
        CHECK: %[[P:.*]] = linalg.transpose ins(%[[EXPANDED]] : tensor<2x16x3x32xf32>) outs(%{{.*}} : tensor<2x3x16x32xf32>) permutation = [0, 2, 1, 3]
        CHECK: scf.forall (%[[B:.*]]) in (2)
        CHECK: scf.for %[[J:.*]] = %{{.*}} to %c96 step %c32
        CHECK: %[[T:.*]] = arith.divui %[[J]], %c32
        CHECK: %[[TILE:.*]] = tensor.extract_slice %[[P]][%[[B]], %[[T]], 0, 0] [1, 1, 16, 32] [1, 1, 1, 1] : tensor<2x3x16x32xf32> to tensor<1x16x32xf32>
        CHECK: linalg.batch_matmul ins(%{{.*}}, %[[TILE]] :
    """)


def test_packed_tiles_sum_what_torch_does():
    g = torch.Generator().manual_seed(0)
    q, x = torch.randn(2, 8, 16, generator=g), torch.randn(2, 16, 96, generator=g)
    payload = _payload()
    apply(payload, _pack)
    got = run_module(payload, [q, x])[0]
    want = sum(q @ x[:, :, 32 * t:32 * t + 32] for t in range(3))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_loop_that_does_not_start_on_a_tile_is_left_alone():
    payload = _payload(start=16)
    before = str(payload)
    apply(payload, _pack)
    assert str(payload) == before


def test_rejects_a_target_that_is_not_a_function():
    payload = _payload()
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: pack_key_tiles(match(root, "scf.forall")))
    assert "transform_ext.pack_key_tiles: scf.forall" in message
    assert "not a function" in message
    assert str(payload) == before
