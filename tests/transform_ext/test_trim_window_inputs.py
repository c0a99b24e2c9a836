"""trim_window_inputs: an input read through window expressions is sliced to the elements
the windows reach (FileCheck on the rewritten IR); inputs read whole stay. The fuzz case it
came from (a window of one output along a padded dim) is in
tests/schedules/test_generic_pooling.py."""

from schedules.common import match
from transform_ext.trim_window_inputs import trim_window_inputs
from tests.transform_ext.helpers import apply, check, parse

# a 3-D max pooling, windows (8, 12, 5), strides (4, 10, 3), dilation (3, 1, 1), on an input
# padded to 43 x 20 x 5: H's one output reaches 12 of 20 (folded, d3 * 10 + d6 is d6); D
# reaches 42 of 43 but keeps its two dims of extent > 1; W reads all 5
POOLING_3D = """
#x = affine_map<(d0, d1, d2, d3, d4, d5, d6, d7) -> (d0, d1, d2 * 4 + d5 * 3, d3 * 10 + d6, d4 * 3 + d7)>
#w = affine_map<(d0, d1, d2, d3, d4, d5, d6, d7) -> (d5, d6, d7)>
#y = affine_map<(d0, d1, d2, d3, d4, d5, d6, d7) -> (d0, d1, d2, d3, d4)>
func.func @main(%x: tensor<1x4x43x20x5xf32>, %win: tensor<8x12x5xf32>, %init: tensor<1x4x6x1x1xf32>) -> tensor<1x4x6x1x1xf32> {
  %p = linalg.generic {indexing_maps = [#x, #w, #y],
         iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "reduction", "reduction", "reduction"]}
         ins(%x, %win : tensor<1x4x43x20x5xf32>, tensor<8x12x5xf32>) outs(%init : tensor<1x4x6x1x1xf32>) {
  ^bb0(%in: f32, %w: f32, %out: f32):
    %m = arith.maximumf %in, %out : f32
    linalg.yield %m : f32
  } -> tensor<1x4x6x1x1xf32>
  return %p : tensor<1x4x6x1x1xf32>
}
"""


def test_an_input_is_sliced_to_what_its_windows_reach():
    payload = parse(POOLING_3D)
    apply(payload, lambda root: trim_window_inputs(match(root, "func.func")))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: %[[X:.*]] = tensor.extract_slice %arg0[0, 0, 0, 0, 0] [1, 4, 43, 12, 5] [1, 1, 1, 1, 1] : tensor<1x4x43x20x5xf32> to tensor<1x4x43x12x5xf32>
        CHECK: linalg.generic {{.*}} ins(%[[X]], %arg1 : tensor<1x4x43x12x5xf32>, tensor<8x12x5xf32>)
    """)


def test_an_input_the_windows_read_whole_stays():
    payload = parse(POOLING_3D.replace("1x4x43x20x5", "1x4x43x12x5"))
    apply(payload, lambda root: trim_window_inputs(match(root, "func.func")))
    assert "tensor.extract_slice" not in str(payload)
