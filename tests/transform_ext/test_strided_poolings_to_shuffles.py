"""strided_poolings_to_shuffles: one-tap pooling tiles become a load, a shuffle and the
body on vectors (FileCheck on the rewritten IR); ops that are not such tiles stay."""

from schedules.common import match
from transform_ext.strided_poolings_to_shuffles import strided_poolings_to_shuffles
from tests.transform_ext.helpers import apply, check, parse

TILES = """
#in3 = affine_map<(d0, d1, d2, d3, d4, d5, d6, d7) -> (d0, d1, d2 + d4, d3 + d5, d7 * 2 + d6 * 3)>
#win3 = affine_map<(d0, d1, d2, d3, d4, d5, d6, d7) -> (d4, d5, d6)>
#out3 = affine_map<(d0, d1, d2, d3, d4, d5, d6, d7) -> (d0, d1, d2, d3, d7)>
#col_in = affine_map<(d0, d1) -> (d1, d0)>
#col_out = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<1x1x9xf16>, %win: tensor<1xf16>, %acc: tensor<1x1x5xf32>,
                %y: tensor<1x1x1x1x27xf32>, %win3: tensor<1x1x1xf32>, %acc3: tensor<1x1x1x1x14xf32>,
                %col: tensor<1x8xf32>, %row: tensor<8xf32>,
                %x1: tensor<1x1x5xf32>, %win1: tensor<1xf32>, %acc1: tensor<1x1x5xf32>)
    -> (tensor<1x1x5xf32>, tensor<1x1x1x1x14xf32>, tensor<8xf32>, tensor<1x1x5xf32>) {
  %p = linalg.pooling_ncw_max {dilations = dense<1> : tensor<1xi64>, strides = dense<2> : tensor<1xi64>}
         ins(%x, %win : tensor<1x1x9xf16>, tensor<1xf16>) outs(%acc : tensor<1x1x5xf32>) -> tensor<1x1x5xf32>
  %g = linalg.generic {indexing_maps = [#in3, #win3, #out3],
         iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction", "reduction", "reduction", "parallel"]}
         ins(%y, %win3 : tensor<1x1x1x1x27xf32>, tensor<1x1x1xf32>) outs(%acc3 : tensor<1x1x1x1x14xf32>) {
  ^bb0(%in: f32, %w: f32, %out: f32):
    %s = arith.addf %out, READ : f32
    linalg.yield %s : f32
  } -> tensor<1x1x1x1x14xf32>
  %c = linalg.generic {indexing_maps = [#col_in, #col_out], iterator_types = ["parallel", "reduction"]}
         ins(%col : tensor<1x8xf32>) outs(%row : tensor<8xf32>) {
  ^bb0(%in: f32, %out: f32):
    %s = arith.addf %out, %in : f32
    linalg.yield %s : f32
  } -> tensor<8xf32>
  %q = linalg.pooling_ncw_max {dilations = dense<1> : tensor<1xi64>, strides = dense<1> : tensor<1xi64>}
         ins(%x1, %win1 : tensor<1x1x5xf32>, tensor<1xf32>) outs(%acc1 : tensor<1x1x5xf32>) -> tensor<1x1x5xf32>
  return %p, %g, %c, %q : tensor<1x1x5xf32>, tensor<1x1x1x1x14xf32>, tensor<8xf32>, tensor<1x1x5xf32>
}
"""


def test_one_tap_tiles_become_a_load_a_shuffle_and_the_body():
    payload = parse(TILES.replace("READ", "%in"))
    apply(payload, lambda root: strided_poolings_to_shuffles(match(root, "func.func")))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: %[[X:.*]] = vector.transfer_read %arg0[%{{.*}}, %{{.*}}, %{{.*}}], %{{.*}} {in_bounds = [true, true, true]} : tensor<1x1x9xf16>, vector<1x1x9xf16>
        CHECK: %[[ROW:.*]] = vector.shape_cast %[[X]] : vector<1x1x9xf16> to vector<9xf16>
        CHECK: %[[TAPS:.*]] = vector.shuffle %[[ROW]], %[[ROW]] [0, 2, 4, 6, 8] : vector<9xf16>, vector<9xf16>
        CHECK: %[[ACC:.*]] = vector.shape_cast %{{.*}} : vector<1x1x5xf32> to vector<5xf32>
        CHECK: %[[WIDE:.*]] = arith.extf %[[TAPS]] : vector<5xf16> to vector<5xf32>
        CHECK: %[[MAX:.*]] = arith.maximumf %[[ACC]], %[[WIDE]] : vector<5xf32>
        CHECK: %[[P:.*]] = vector.transfer_write %{{.*}}, %arg2[
        CHECK: %[[Y:.*]] = vector.transfer_read %arg3{{.*}} : tensor<1x1x1x1x27xf32>, vector<1x1x1x1x27xf32>
        CHECK: vector.shuffle %{{.*}}, %{{.*}} [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26] : vector<27xf32>, vector<27xf32>
        CHECK: arith.addf %{{.*}}, %{{.*}} : vector<14xf32>
        CHECK: %[[G:.*]] = vector.transfer_write %{{.*}}, %arg5[
        CHECK: %[[C:.*]] = linalg.generic
        CHECK: %[[Q:.*]] = linalg.pooling_ncw_max
        CHECK: return %[[P]], %[[G]], %[[C]], %[[Q]]
    """)


def test_a_body_reading_the_window_stays():
    payload = parse(TILES.replace("READ", "%w"))
    apply(payload, lambda root: strided_poolings_to_shuffles(match(root, "func.func")))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: vector.shuffle
        CHECK: linalg.generic
        CHECK: arith.addf %{{.*}}, %{{.*}} : f32
    """)


# a tap of a separated pooling's outer window (transform_ext.separate_pooling_windows): the
# window is in the rows' dim (d2 * 11 + d3), the innermost dim reads 55 whole lanes
OUTER_TAP = """
#x = affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2 * 11 + d3, d4)>
#w = affine_map<(d0, d1, d2, d3, d4) -> (d3)>
#t = affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2, d4)>
func.func @main(%x: tensor<1x1x1x55xf32>, %win: tensor<1xf32>, %acc: tensor<1x1x1x55xf32>) -> tensor<1x1x1x55xf32> {
  %t = linalg.generic {indexing_maps = [#x, #w, #t],
         iterator_types = ["parallel", "parallel", "parallel", "reduction", "parallel"]}
         ins(%x, %win : tensor<1x1x1x55xf32>, tensor<1xf32>) outs(%acc : tensor<1x1x1x55xf32>) {
  ^bb0(%in: f32, %w: f32, %out: f32):
    %s = arith.addf %out, %in : f32
    linalg.yield %s : f32
  } -> tensor<1x1x1x55xf32>
  return %t : tensor<1x1x1x55xf32>
}
"""


def test_a_tap_of_an_outer_window_reads_whole_lanes():
    payload = parse(OUTER_TAP)
    apply(payload, lambda root: strided_poolings_to_shuffles(match(root, "func.func")))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: %[[X:.*]] = vector.transfer_read %arg0{{.*}} : tensor<1x1x1x55xf32>, vector<1x1x1x55xf32>
        CHECK: %[[ROW:.*]] = vector.shape_cast %[[X]] : vector<1x1x1x55xf32> to vector<55xf32>
        CHECK-NOT: vector.shuffle
        CHECK: arith.addf %{{.*}}, %[[ROW]] : vector<55xf32>
        CHECK: vector.transfer_write
    """)
    assert "linalg.generic" not in str(payload)
