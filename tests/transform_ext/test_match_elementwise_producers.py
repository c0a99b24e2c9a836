"""match_elementwise_producers: the gradient's exp then x - m, the last first (FileCheck on the
split, annotated handle); the row max, the fill and a [4] op are not taken; a target that is
not a linalg op is refused."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_elementwise_producers import match_elementwise_producers
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

GRADIENT = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#r = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %ninf = arith.constant 0xFF800000 : f32
  %e4 = tensor.empty() : tensor<4xf32>
  %e2 = tensor.empty() : tensor<4x8xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e4 : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %d = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%e2 : tensor<4x8xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %r = arith.subf %a, %b : f32
    linalg.yield %r : f32
  } -> tensor<4x8xf32>
  %h = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%m : tensor<4xf32>) outs(%e4 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.negf %a : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %ex = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%d : tensor<4x8xf32>) outs(%e2 : tensor<4x8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = math.exp %a : f32
    linalg.yield %r : f32
  } -> tensor<4x8xf32>
  %g = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%ex, %h : tensor<4x8xf32>, tensor<4xf32>) outs(%e2 : tensor<4x8xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %r = arith.mulf %a, %b : f32
    linalg.yield %r : f32
  } -> tensor<4x8xf32>
  return %g : tensor<4x8xf32>
}
"""


def test_the_gradients_producers_in_fusion_order():
    payload = parse(GRADIENT)

    def body(root):
        generics = match(root, "linalg.generic")
        gradient = transform.SplitHandleOp([transform.AnyOpType.get()] * 5, generics).results[4]
        first, second = transform.SplitHandleOp(
            [transform.AnyOpType.get()] * 2, match_elementwise_producers(gradient)).results
        transform.AnnotateOp(first, "first")
        transform.AnnotateOp(second, "second")

    apply(payload, body)
    text = str(payload)
    check(text, """
        CHECK: arith.maximumf
        CHECK: linalg.generic {{.*}} attrs =  {second}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.subf
        CHECK: arith.negf
        CHECK: linalg.generic {{.*}} attrs =  {first}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: math.exp
        CHECK: arith.mulf
    """)
    assert text.count("first") == text.count("second") == 1


def test_rejects_a_target_that_is_not_a_linalg_op():
    payload = parse(GRADIENT)
    message = apply_expect_failure(
        payload, lambda root: match_elementwise_producers(match(root, "func.return")))
    assert "transform_ext.match_elementwise_producers: func.return" in message
    assert "not a linalg op" in message
