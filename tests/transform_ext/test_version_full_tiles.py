"""version_full_tiles: a tile whose sizes are affine.min(c, ...) gets an scf.if whose then
branch runs the op on static shapes (the bounds c) when every size equals its bound; its
producer fused in the tile and the insert_slice writing the result back go into both
branches (in place after bufferization); a result read elsewhere is carried out of the
scf.if; results are bit-identical to the unversioned loop; static tiles and tiles with an
unbounded size are left alone; an op that is not linalg is refused."""

import pytest
import torch
from torch_mlir import ir

from schedules.common import match
from transform_ext.version_full_tiles import version_full_tiles
from tests.transform_ext.helpers import (apply, apply_expect_failure, check, clear_tags, match_id,
                                         parse, tag_ops)
from tests.transform_ext.numeric import run_module

# y = 2 x + 1 over [10, 37] in tiles of 4 x 16 (the last row and column of tiles partial),
# 2 x computed in the tile by a producer; `first` sums the first element of each tile (a
# second use of the tile's result)
TILED = """
#min4 = affine_map<(d0) -> (4, -d0 + 10)>
#min16 = affine_map<(d0)[s0] -> (-d0 + s0, 16)>
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%x: tensor<10x37xf32>) -> (tensor<10x37xf32>, tensor<1xf32>) {
  %c0 = arith.constant 0 : index
  %c4 = arith.constant 4 : index
  %c16 = arith.constant 16 : index
  %c10 = arith.constant 10 : index
  %c37 = arith.constant 37 : index
  %two = arith.constant 2.0 : f32
  %zero = arith.constant 0.0 : f32
  %one = arith.constant 1.0 : f32
  %e = tensor.empty() : tensor<10x37xf32>
  %y:2 = scf.for %i = %c0 to %c10 step %c4 iter_args(%acc = %e, %s = %zero) -> (tensor<10x37xf32>, f32) {
    %r:2 = scf.for %j = %c0 to %c37 step %c16 iter_args(%acc2 = %acc, %s2 = %s) -> (tensor<10x37xf32>, f32) {
      %m = affine.min #min4(%i)
      %n = affine.min #min16(%j)[%c37]
      %xs = tensor.extract_slice %x[%i, %j] [%m, %n] [1, 1] : tensor<10x37xf32> to tensor<?x?xf32>
      %es = tensor.extract_slice %e[%i, %j] [%m, %n] [1, 1] : tensor<10x37xf32> to tensor<?x?xf32>
      %u = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
          ins(%xs : tensor<?x?xf32>) outs(%es : tensor<?x?xf32>) {
        ^bb0(%a: f32, %b: f32):
          %p = arith.mulf %a, %two : f32
          linalg.yield %p : f32
      } -> tensor<?x?xf32>
      %ys = tensor.extract_slice %acc2[%i, %j] [%m, %n] [1, 1] : tensor<10x37xf32> to tensor<?x?xf32>
      %t = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
          ins(%u : tensor<?x?xf32>) outs(%ys : tensor<?x?xf32>) {
        ^bb0(%a: f32, %b: f32):
          %p = arith.addf %a, %one : f32
          linalg.yield %p : f32
      } -> tensor<?x?xf32>
      %w = tensor.insert_slice %t into %acc2[%i, %j] [%m, %n] [1, 1] : tensor<?x?xf32> into tensor<10x37xf32>
      %f = tensor.extract %t[%c0, %c0] : tensor<?x?xf32>
      %sum = arith.addf %s2, %f : f32
      scf.yield %w, %sum : tensor<10x37xf32>, f32
    }
    scf.yield %r#0, %r#1 : tensor<10x37xf32>, f32
  }
  %out = tensor.from_elements %y#1 : tensor<1xf32>
  return %y#0, %out : tensor<10x37xf32>, tensor<1xf32>
}
"""

STATIC = """
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%x: tensor<4x16xf32>) -> tensor<4x16xf32> {
  %e = tensor.empty() : tensor<4x16xf32>
  %t = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<4x16xf32>) outs(%e : tensor<4x16xf32>) {
    ^bb0(%a: f32, %b: f32):
      %p = arith.addf %a, %a : f32
      linalg.yield %p : f32
  } -> tensor<4x16xf32>
  return %t : tensor<4x16xf32>
}
"""

UNBOUNDED = """
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%x: tensor<?x?xf32>, %y: tensor<?x?xf32>) -> tensor<?x?xf32> {
  %t = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<?x?xf32>) outs(%y : tensor<?x?xf32>) {
    ^bb0(%a: f32, %b: f32):
      %p = arith.addf %a, %a : f32
      linalg.yield %p : f32
  } -> tensor<?x?xf32>
  return %t : tensor<?x?xf32>
}
"""


def _versioned(text):
    """`text` with its last linalg.generic versioned (the generics tagged in order)."""
    payload = parse(text)
    generics = [op for op in walk(payload) if op.name == "linalg.generic"]
    with payload.context:
        tag_ops(generics)
    apply(payload, lambda root: version_full_tiles(match_id(root, len(generics) - 1)))
    clear_tags(payload)
    payload.operation.verify()
    return payload


def walk(payload):
    ops = []
    payload.operation.walk(lambda op: ops.append(op.operation) or ir.WalkResult.ADVANCE)
    return ops


def test_a_partial_tile_loop_gets_a_static_full_version():
    payload = _versioned(TILED)
    check(str(payload), """
        CHECK:      %[[M:.*]] = affine.min
        CHECK:      %[[N:.*]] = affine.min
        CHECK-DAG:  arith.cmpi eq, %[[M]], %{{.*}} : index
        CHECK-DAG:  arith.cmpi eq, %[[N]], %{{.*}} : index
        CHECK:      %[[IF:.*]]:2 = scf.if %{{.*}} -> (tensor<?x?xf32>, tensor<10x37xf32>)
        CHECK:        %[[U:.*]] = linalg.generic
        CHECK-SAME:     ins(%{{.*}} : tensor<4x16xf32>) outs(%{{.*}} : tensor<4x16xf32>)
        CHECK:        arith.mulf
        CHECK:        linalg.generic
        CHECK-SAME:     ins(%[[U]] : tensor<4x16xf32>) outs(%{{.*}} : tensor<4x16xf32>)
        CHECK:        arith.addf
        CHECK:        %[[BACK:.*]] = tensor.cast %{{.*}} : tensor<4x16xf32> to tensor<?x?xf32>
        CHECK:        %[[W:.*]] = tensor.insert_slice %[[BACK]]
        CHECK:        scf.yield %[[BACK]], %[[W]]
        CHECK:      } else {
        CHECK:        %[[U2:.*]] = linalg.generic
        CHECK-SAME:     ins(%{{.*}} : tensor<?x?xf32>) outs(%{{.*}} : tensor<?x?xf32>)
        CHECK:        %[[T:.*]] = linalg.generic
        CHECK-SAME:     ins(%[[U2]] : tensor<?x?xf32>)
        CHECK:        %[[W2:.*]] = tensor.insert_slice %[[T]]
        CHECK:        scf.yield %[[T]], %[[W2]]
        CHECK:      }
        CHECK:      tensor.extract %[[IF]]#0
        CHECK:      scf.yield %[[IF]]#1
    """)
    x = torch.randn(10, 37, generator=torch.Generator().manual_seed(0))
    y, first = run_module(payload, [x], cleanup=False)
    want_y, want_first = run_module(parse(TILED), [x], cleanup=False)
    torch.testing.assert_close(y, 2 * x + 1)
    torch.testing.assert_close(first, (2 * x[::4, ::16] + 1).sum().reshape(1))
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(first, want_first, rtol=0, atol=0)


def test_static_tiles_are_left_alone():
    payload = _versioned(STATIC)
    assert "scf.if" not in str(payload)


def test_an_operand_without_a_bound_is_left_alone():
    before = str(parse(UNBOUNDED))
    assert str(_versioned(UNBOUNDED)) == before


def test_a_size_whose_min_has_no_constant_is_left_alone():
    text = TILED.replace("#min4 = affine_map<(d0) -> (4, -d0 + 10)>",
                         "#min4 = affine_map<(d0) -> (d0 + 4, -d0 + 10)>")
    assert "scf.if" not in str(_versioned(text))


@pytest.mark.parametrize("op", ["func.func", "tensor.empty"])
def test_an_op_that_is_not_linalg_is_refused(op):
    payload = parse(STATIC)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: version_full_tiles(match(root, op)))
    assert "version_full_tiles" in message and "not a linalg op" in message
    assert str(payload) == before


# a transposed tile of x: [16, 4] in tiles of at most 4 x 16 of y = x^T ([37, 10])
TRANSPOSED = """
#min4 = affine_map<(d0) -> (4, -d0 + 10)>
#min16 = affine_map<(d0) -> (16, -d0 + 37)>
func.func @main(%x: tensor<37x10xf32>) -> tensor<10x37xf32> {
  %c0 = arith.constant 0 : index
  %c4 = arith.constant 4 : index
  %c16 = arith.constant 16 : index
  %c10 = arith.constant 10 : index
  %c37 = arith.constant 37 : index
  %e = tensor.empty() : tensor<10x37xf32>
  %y = scf.for %i = %c0 to %c10 step %c4 iter_args(%acc = %e) -> (tensor<10x37xf32>) {
    %r = scf.for %j = %c0 to %c37 step %c16 iter_args(%acc2 = %acc) -> (tensor<10x37xf32>) {
      %m = affine.min #min4(%i)
      %n = affine.min #min16(%j)
      %xs = tensor.extract_slice %x[%j, %i] [%n, %m] [1, 1] : tensor<37x10xf32> to tensor<?x?xf32>
      %ys = tensor.extract_slice %acc2[%i, %j] [%m, %n] [1, 1] : tensor<10x37xf32> to tensor<?x?xf32>
      %t = linalg.transpose ins(%xs : tensor<?x?xf32>) outs(%ys : tensor<?x?xf32>) permutation = [1, 0]
      %w = tensor.insert_slice %t into %acc2[%i, %j] [%m, %n] [1, 1] : tensor<?x?xf32> into tensor<10x37xf32>
      scf.yield %w : tensor<10x37xf32>
    }
    scf.yield %r : tensor<10x37xf32>
  }
  return %y : tensor<10x37xf32>
}
"""


def test_a_transpose_tile_is_versioned():
    """linalg.transpose (its init is `init`, not `outputs`: the matmul fuzzer's
    'TransposeOp' object has no attribute 'outputs' through torch.compile) is versioned like
    any linalg op: a 4 x 16 full version, numerics bit-identical."""
    payload = parse(TRANSPOSED)
    transposes = [op for op in walk(payload) if op.name == "linalg.transpose"]
    with payload.context:
        tag_ops(transposes)
    apply(payload, lambda root: version_full_tiles(match_id(root, 0)))
    clear_tags(payload)
    payload.operation.verify()
    check(str(payload), """
        CHECK:      scf.if
        CHECK:        linalg.transpose ins(%{{.*}} : tensor<16x4xf32>) outs(%{{.*}} : tensor<4x16xf32>)
        CHECK:      } else {
        CHECK:        linalg.transpose ins(%{{.*}} : tensor<?x?xf32>) outs(%{{.*}} : tensor<?x?xf32>)
    """)
    x = torch.randn(37, 10, generator=torch.Generator().manual_seed(0))
    (y,) = run_module(payload, [x], cleanup=False)
    torch.testing.assert_close(y, x.t(), rtol=0, atol=0)
