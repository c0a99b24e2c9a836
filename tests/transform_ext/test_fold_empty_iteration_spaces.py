"""fold_empty_iteration_spaces: IR (FileCheck), the buffer-semantics rejection."""

from schedules.common import match
from transform_ext.fold_empty_iteration_spaces import fold_empty_iteration_spaces
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

EMPTY_ROWS = """
#map = affine_map<(d0, d1) -> (d0, d1)>
#map1 = affine_map<(d0, d1) -> (d0)>
#map2 = affine_map<(d0, d1) -> (d1)>
func.func @main(%x: tensor<0x16xf32>, %a: tensor<5x0xf32>, %b: tensor<0x7xf32>)
    -> (tensor<0xf32>, tensor<16xf32>, tensor<5x7xf32>, tensor<4xf32>) {
  %ninf = arith.constant 0xFF800000 : f32
  %zero = arith.constant 0.0 : f32
  %e0 = tensor.empty() : tensor<0xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e0 : tensor<0xf32>) -> tensor<0xf32>
  %max = linalg.generic {indexing_maps = [#map, #map1], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<0x16xf32>) outs(%m0 : tensor<0xf32>) {
  ^bb0(%in: f32, %out: f32):
    %r = arith.maximumf %in, %out : f32
    linalg.yield %r : f32
  } -> tensor<0xf32>
  %e1 = tensor.empty() : tensor<16xf32>
  %s0 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<16xf32>) -> tensor<16xf32>
  %colsum = linalg.generic {indexing_maps = [#map, #map2], iterator_types = ["reduction", "parallel"]}
      ins(%x : tensor<0x16xf32>) outs(%s0 : tensor<16xf32>) {
  ^bb0(%in: f32, %out: f32):
    %r = arith.addf %in, %out : f32
    linalg.yield %r : f32
  } -> tensor<16xf32>
  %e2 = tensor.empty() : tensor<5x7xf32>
  %c0 = linalg.fill ins(%zero : f32) outs(%e2 : tensor<5x7xf32>) -> tensor<5x7xf32>
  %mm = linalg.matmul ins(%a, %b : tensor<5x0xf32>, tensor<0x7xf32>) outs(%c0 : tensor<5x7xf32>) -> tensor<5x7xf32>
  %e3 = tensor.empty() : tensor<4xf32>
  %kept = linalg.fill ins(%zero : f32) outs(%e3 : tensor<4xf32>) -> tensor<4xf32>
  return %max, %colsum, %mm, %kept : tensor<0xf32>, tensor<16xf32>, tensor<5x7xf32>, tensor<4xf32>
}
"""


def test_empty_loops_become_their_inits():
    """The row max over no rows and its fill vanish; the column sum over no rows is its
    zero fill; a K = 0 matmul is its zero init; the [4] fill (non-empty) stays."""
    payload = parse(EMPTY_ROWS)
    apply(payload, lambda root: fold_empty_iteration_spaces(match(root, "func.func")))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-NOT: linalg.generic
        CHECK-NOT: linalg.matmul
        CHECK-DAG: %[[E0:.*]] = tensor.empty() : tensor<0xf32>
        CHECK-DAG: %[[S:.*]] = linalg.fill {{.*}} -> tensor<16xf32>
        CHECK-DAG: %[[C:.*]] = linalg.fill {{.*}} -> tensor<5x7xf32>
        CHECK-DAG: %[[K:.*]] = linalg.fill {{.*}} -> tensor<4xf32>
        CHECK: return %[[E0]], %[[S]], %[[C]], %[[K]]
    """)


def test_an_empty_op_on_buffers_is_refused_and_nothing_changes():
    payload = parse("""
        func.func @main(%m: memref<0x4xf32>) {
          %zero = arith.constant 0.0 : f32
          linalg.fill ins(%zero : f32) outs(%m : memref<0x4xf32>)
          return
        }""")
    message = apply_expect_failure(
        payload, lambda root: fold_empty_iteration_spaces(match(root, "func.func")))
    assert "transform_ext.fold_empty_iteration_spaces: linalg.fill at" in message
    assert "works on buffers" in message
    assert "linalg.fill" in str(payload)


# Empty pack / unpack (no indexing maps: they used to crash the loop analysis), a padded
# pack whose destination is not its last operand, a non-empty pack and a linalg.softmax
# (no indexing maps either), which stay.
RELAYOUTS = """
func.func @main(%x: tensor<0x8x2xf32>, %y: tensor<0x16xf32>, %z: tensor<4x16xf32>,
                %s: tensor<2x3xf32>)
    -> (tensor<0x16xf32>, tensor<0x8x2xf32>, tensor<0x6x3xf32>, tensor<4x8x2xf32>, tensor<2x3xf32>) {
  %pad = arith.constant 0.0 : f32
  %eu = tensor.empty() : tensor<0x16xf32>
  %u = linalg.unpack %x inner_dims_pos = [1] inner_tiles = [2] into %eu
      : tensor<0x8x2xf32> -> tensor<0x16xf32>
  %ep = tensor.empty() : tensor<0x8x2xf32>
  %p = linalg.pack %y inner_dims_pos = [1] inner_tiles = [2] into %ep
      : tensor<0x16xf32> -> tensor<0x8x2xf32>
  %epp = tensor.empty() : tensor<0x6x3xf32>
  %pp = linalg.pack %y padding_value(%pad : f32) inner_dims_pos = [1] inner_tiles = [3] into %epp
      : tensor<0x16xf32> -> tensor<0x6x3xf32>
  %ek = tensor.empty() : tensor<4x8x2xf32>
  %kept = linalg.pack %z inner_dims_pos = [1] inner_tiles = [2] into %ek
      : tensor<4x16xf32> -> tensor<4x8x2xf32>
  %es = tensor.empty() : tensor<2x3xf32>
  %sm = linalg.softmax dimension(1) ins(%s : tensor<2x3xf32>) outs(%es : tensor<2x3xf32>) -> tensor<2x3xf32>
  return %u, %p, %pp, %kept, %sm
      : tensor<0x16xf32>, tensor<0x8x2xf32>, tensor<0x6x3xf32>, tensor<4x8x2xf32>, tensor<2x3xf32>
}
"""


def test_empty_pack_and_unpack_become_their_destinations():
    payload = parse(RELAYOUTS)
    apply(payload, lambda root: fold_empty_iteration_spaces(match(root, "func.func")))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-NOT: linalg.unpack
        CHECK-DAG: %[[EU:.*]] = tensor.empty() : tensor<0x16xf32>
        CHECK-DAG: %[[EP:.*]] = tensor.empty() : tensor<0x8x2xf32>
        CHECK-DAG: %[[EPP:.*]] = tensor.empty() : tensor<0x6x3xf32>
        CHECK-DAG: %[[K:.*]] = linalg.pack {{.*}} -> tensor<4x8x2xf32>
        CHECK-DAG: %[[S:.*]] = linalg.softmax
        CHECK: return %[[EU]], %[[EP]], %[[EPP]], %[[K]], %[[S]]
    """)
    assert str(payload).count("linalg.pack") == 1
