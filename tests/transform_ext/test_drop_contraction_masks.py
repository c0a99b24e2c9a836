"""drop_contraction_masks: IR (FileCheck) of the masks dropped and kept. The numerics: every
convolution of tests/schedules/test_convolution.py whose output is not a multiple of the
register tile runs its edge tiles through this op and is compared with torch."""

from schedules.common import match
from transform_ext.drop_contraction_masks import drop_contraction_masks
from tests.transform_ext.helpers import apply, check, parse

MASKED = """
#a = affine_map<(m, n, k) -> (m, k)>
#b = affine_map<(m, n, k) -> (k, n)>
#c = affine_map<(m, n, k) -> (m, n)>
func.func @main(%a: vector<8x1xf32>, %b: vector<1x32xf32>, %c: vector<8x32xf32>, %n: index, %k: index) -> (vector<8x32xf32>, vector<8x32xf32>) {
  %c8 = arith.constant 8 : index
  %c1 = arith.constant 1 : index
  %lanes = vector.create_mask %c8, %n, %c1 : vector<8x32x1xi1>
  %r = vector.mask %lanes { vector.contract {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction"], kind = #vector.kind<add>} %a, %b, %c : vector<8x1xf32>, vector<1x32xf32> into vector<8x32xf32> } : vector<8x32x1xi1> -> vector<8x32xf32>
  %terms = vector.create_mask %c8, %n, %k : vector<8x32x1xi1>
  %s = vector.mask %terms { vector.contract {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction"], kind = #vector.kind<add>} %a, %b, %c : vector<8x1xf32>, vector<1x32xf32> into vector<8x32xf32> } : vector<8x32x1xi1> -> vector<8x32xf32>
  return %r, %s : vector<8x32xf32>, vector<8x32xf32>
}
"""


def test_masks_of_parallel_dims_only_are_dropped():
    payload = parse(MASKED)
    apply(payload, lambda root: drop_contraction_masks(match(root, "func.func")))
    check(payload, """
        CHECK: %[[R:.*]] = vector.contract
        CHECK-NOT: vector.create_mask %c8, %arg3, %c1
        CHECK: %[[TERMS:.*]] = vector.create_mask %c8, %arg3, %arg4
        CHECK: %[[S:.*]] = vector.mask %[[TERMS]] { vector.contract
        CHECK: return %[[R]], %[[S]]
    """)


def test_nothing_to_drop_leaves_the_payload_alone():
    payload = parse(MASKED.replace("%r = vector.mask %lanes {", "%r = vector.mask %terms {")
                    .replace("  %terms = vector.create_mask %c8, %n, %k : vector<8x32x1xi1>\n", "")
                    .replace("  %lanes = vector.create_mask %c8, %n, %c1 : vector<8x32x1xi1>\n",
                             "  %terms = vector.create_mask %c8, %n, %k : vector<8x32x1xi1>\n"))
    before = str(payload)
    apply(payload, lambda root: drop_contraction_masks(match(root, "func.func")))
    assert str(payload) == before
