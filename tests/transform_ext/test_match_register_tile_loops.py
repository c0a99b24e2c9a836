"""match_register_tile_loops: which loops it returns (tagged with transform.annotate and
FileChecked: only loops carrying vectors around a vector.contract), that it leaves the
payload unchanged otherwise and matches nothing (no failure) when there is no such loop."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_register_tile_loops import match_register_tile_loops
from tests.transform_ext.helpers import apply, check, parse

CONTRACT = ('vector.contract {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", '
            '"reduction"], kind = #vector.kind<add>} %a, %b, %c : vector<4x1xf32>, vector<1x8xf32> '
            'into vector<4x8xf32>')

LOOPS = """
#a = affine_map<(m, n, k) -> (m, k)>
#b = affine_map<(m, n, k) -> (k, n)>
#c = affine_map<(m, n, k) -> (m, n)>
func.func @main(%a: vector<4x1xf32>, %b: vector<1x8xf32>, %acc: vector<4x8xf32>, %t: tensor<8xf32>)
    -> (vector<4x8xf32>, vector<4x8xf32>, tensor<8xf32>) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c16 = arith.constant 16 : index
  %tile = scf.for %k = %c0 to %c16 step %c1 iter_args(%c = %acc) -> (vector<4x8xf32>) {
    %next = {contract}
    scf.yield %next : vector<4x8xf32>
  } {tile}
  %sum = scf.for %k = %c0 to %c16 step %c1 iter_args(%c = %acc) -> (vector<4x8xf32>) {
    %next = arith.addf %c, %c : vector<4x8xf32>
    scf.yield %next : vector<4x8xf32>
  } {no_contract}
  %tensor = scf.for %k = %c0 to %c16 step %c1 iter_args(%c = %t) -> (tensor<8xf32>) {
    scf.yield %c : tensor<8xf32>
  } {tensor}
  return %tile, %sum, %tensor : vector<4x8xf32>, vector<4x8xf32>, tensor<8xf32>
}
"""


def test_matches_only_loops_carrying_vectors_around_a_contraction():
    payload = parse(LOOPS.replace("{contract}", CONTRACT))
    apply(payload, lambda root: transform.AnnotateOp(match_register_tile_loops(root), "register_tile"))
    check(payload, """
        CHECK: vector.contract
        CHECK: } {register_tile, tile}
        CHECK: } {no_contract}
        CHECK: } {tensor}
    """)


def test_matches_nothing_without_a_register_tile():
    payload = parse(LOOPS.replace("{contract}", "arith.mulf %c, %c : vector<4x8xf32>"))
    before = str(payload)
    apply(payload, lambda root: transform.AnnotateOp(match_register_tile_loops(root), "register_tile"))
    assert str(payload) == before
