"""match_class_reductions: the exp-sum and the one-hot sum of a row max are found, the sum
over the rows is not (FileCheck on the marked payload); a target of two ops is refused."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.filter_ops import filter_reductions
from transform_ext.match_class_reductions import match_class_reductions
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

PAYLOAD = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#col = affine_map<(d0, d1) -> (d1)>
func.func @main(%x: tensor<4x8xf32>, %y: tensor<4xi64>, %w: tensor<8xf32>, %m0: tensor<4xf32>, %z: tensor<4xf32>,
                %z8: tensor<8xf32>) -> (tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<8xf32>) {
  %zero = arith.constant 0.0 : f32
  %one = arith.constant 1.0 : f32
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %l = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %t = math.exp %d : f32
    %r = arith.addf %t, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %wx = linalg.generic {indexing_maps = [#id, #col, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x, %w : tensor<4x8xf32>, tensor<8xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %t = arith.mulf %a, %b : f32
    %r = arith.addf %t, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %h = linalg.generic {indexing_maps = [#row, #col, #row], iterator_types = ["parallel", "reduction"]}
      ins(%y, %w : tensor<4xi64>, tensor<8xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%t: i64, %b: f32, %o: f32):
    %j = linalg.index 1 : index
    %ji = arith.index_cast %j : index to i64
    %hit = arith.cmpi eq, %ji, %t : i64
    %v = arith.select %hit, %b, %zero : f32
    %r = arith.addf %v, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %c = linalg.generic {indexing_maps = [#id, #col], iterator_types = ["reduction", "parallel"]}
      ins(%x : tensor<4x8xf32>) outs(%z8 : tensor<8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  return %m, %l, %wx, %h, %c : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<8xf32>
}
"""


def test_the_reductions_over_the_classes_of_the_row_max():
    """The exp-sum, the weighted sum and the weighted one-hot sum (it reads no [4, 8] tensor:
    its class loop runs with the classes through the weights); not the column sums."""
    payload = parse(PAYLOAD)

    def body(root):
        row_max = filter_reductions(match(root, "linalg.generic"), combiner="max")
        transform.AnnotateOp(match_class_reductions(row_max), "class_sum")

    apply(payload, body)
    check(str(payload), """
        CHECK: linalg.generic {{.*}} ins(%arg0 : tensor<4x8xf32>) outs(%arg3 : tensor<4xf32>) {
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.maximumf
        CHECK: linalg.generic {{.*}} ins(%arg0, %{{.*}} : tensor<4x8xf32>, tensor<4xf32>) {{.*}} attrs = {class_sum}
        CHECK: linalg.generic {{.*}} ins(%arg0, %arg2 : tensor<4x8xf32>, tensor<8xf32>) {{.*}} attrs = {class_sum}
        CHECK: linalg.generic {{.*}} ins(%arg1, %arg2 : tensor<4xi64>, tensor<8xf32>) {{.*}} attrs = {class_sum}
        CHECK: linalg.generic {{.*}} ins(%arg0 : tensor<4x8xf32>) outs(%arg5 : tensor<8xf32>) {
    """)
    assert str(payload).count("class_sum") == 3


def test_a_target_of_several_ops_is_refused():
    """(the add reductions but the weighted sum, a contraction)"""
    payload = parse(PAYLOAD)
    message = apply_expect_failure(payload, lambda root: match_class_reductions(
        filter_reductions(match(root, "linalg.generic"), combiner="add")))
    assert "transform_ext.match_class_reductions: linalg.generic at" in message
    assert "the target must be one reduction (the row max), got 3 ops" in message
