"""widen_softmax: P V reads the f32 probabilities instead of their bf16 rounding, a bf16 op
computed from them is recomputed in f32 (FileCheck), a rounding fused with another op is
left as it is, and the rejection of a target that is not a function."""

from schedules.common import match
from transform_ext.widen_softmax import widen_softmax
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

# torch.softmax(s) @ v in bf16: the softmax computed in f32, P rounded to bf16 (and, with
# SCALED, scaled by 2 in bf16), then read back through extf by P V.
SOFTMAX_PV = """
#id = affine_map<(i, j) -> (i, j)>
#row = affine_map<(i, j) -> (i)>
#p = affine_map<(i, e, j) -> (i, j)>
#v = affine_map<(i, e, j) -> (j, e)>
#o = affine_map<(i, e, j) -> (i, e)>
func.func @main(%s: tensor<4x8xbf16>, %v: tensor<8x6xbf16>) -> tensor<4x6xf32> {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %two = arith.constant 2.0 : bf16
  %e32 = tensor.empty() : tensor<4x8xf32>
  %e16 = tensor.empty() : tensor<4x8xbf16>
  %x = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%s : tensor<4x8xbf16>) outs(%e32 : tensor<4x8xf32>) {
  ^bb0(%a: bf16, %o: f32):
    %0 = arith.extf %a : bf16 to f32
    linalg.yield %0 : f32
  } -> tensor<4x8xf32>
  %er = tensor.empty() : tensor<4xf32>
  %fm = linalg.fill ins(%ninf : f32) outs(%er : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%fm : tensor<4xf32>) {
  ^bb0(%a: f32, %acc: f32):
    %0 = arith.maximumf %a, %acc : f32
    linalg.yield %0 : f32
  } -> tensor<4xf32>
  %e = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%e32 : tensor<4x8xf32>) {
  ^bb0(%a: f32, %mx: f32, %o: f32):
    %0 = arith.subf %a, %mx : f32
    %1 = math.exp %0 : f32
    linalg.yield %1 : f32
  } -> tensor<4x8xf32>
  %fl = linalg.fill ins(%zero : f32) outs(%er : tensor<4xf32>) -> tensor<4xf32>
  %l = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%e : tensor<4x8xf32>) outs(%fl : tensor<4xf32>) {
  ^bb0(%a: f32, %acc: f32):
    %0 = arith.addf %a, %acc : f32
    linalg.yield %0 : f32
  } -> tensor<4xf32>
  %p = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%e, %l : tensor<4x8xf32>, tensor<4xf32>) outs(%e32 : tensor<4x8xf32>) {
  ^bb0(%a: f32, %sum: f32, %o: f32):
    %0 = arith.divf %a, %sum : f32
    linalg.yield %0 : f32
  } -> tensor<4x8xf32>
  %pb = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%p : tensor<4x8xf32>) outs(%e16 : tensor<4x8xbf16>) {
  ^bb0(%a: f32, %o: bf16):
    %0 = arith.truncf %a : f32 to bf16
    linalg.yield %0 : bf16
  } -> tensor<4x8xbf16>
  %scaled = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%pb : tensor<4x8xbf16>) outs(%e16 : tensor<4x8xbf16>) {
  ^bb0(%a: bf16, %o: bf16):
    %0 = arith.mulf %a, %two : bf16
    linalg.yield %0 : bf16
  } -> tensor<4x8xbf16>
  %eo = tensor.empty() : tensor<4x6xf32>
  %fo = linalg.fill ins(%zero : f32) outs(%eo : tensor<4x6xf32>) -> tensor<4x6xf32>
  %out = linalg.generic {indexing_maps = [#p, #v, #o], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%scaled, %v : tensor<4x8xbf16>, tensor<8x6xbf16>) outs(%fo : tensor<4x6xf32>) {
  ^bb0(%a: bf16, %b: bf16, %acc: f32):
    %0 = arith.extf %a : bf16 to f32
    %1 = arith.extf %b : bf16 to f32
    %2 = arith.mulf %0, %1 : f32
    %3 = arith.addf %acc, %2 : f32
    linalg.yield %3 : f32
  } -> tensor<4x6xf32>
  return %out : tensor<4x6xf32>
}
"""


def test_p_v_reads_the_probabilities_in_f32():
    payload = parse(SOFTMAX_PV)
    apply(payload, lambda root: widen_softmax(match(root, "func.func")))
    check(payload, """
        CHECK: math.exp
        CHECK: %[[P:.*]] = linalg.generic {{.*}} ins(%{{.*}}, %{{.*}} : tensor<4x8xf32>, tensor<4xf32>)
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.divf
        CHECK: %[[SCALED:.*]] = linalg.generic {{.*}} ins(%[[P]] : tensor<4x8xf32>) outs(%{{.*}} : tensor<4x8xf32>)
        CHECK-NEXT: ^bb0
        CHECK-NEXT: %[[TWO:.*]] = arith.extf %{{.*}} : bf16 to f32
        CHECK-NEXT: arith.mulf %{{.*}}, %[[TWO]] : f32
        CHECK: linalg.generic {{.*}} ins(%[[SCALED]], %{{.*}} : tensor<4x8xf32>, tensor<8x6xbf16>)
        CHECK-NEXT: ^bb0(%[[A:.*]]: f32, %[[B:.*]]: bf16, %{{.*}}: f32)
        CHECK-NEXT: %[[BE:.*]] = arith.extf %[[B]] : bf16 to f32
        CHECK-NEXT: arith.mulf %[[A]], %[[BE]] : f32
    """)


def test_a_rounding_fused_with_another_op_is_left_alone():
    """The rounding of P fused with another op (not a truncf-only generic) gives no f32
    shadow: nothing is widened."""
    text = SOFTMAX_PV.replace("%0 = arith.truncf %a : f32 to bf16\n    linalg.yield %0 : bf16",
                              "%0 = arith.truncf %a : f32 to bf16\n    %1 = arith.negf %0 : bf16\n    linalg.yield %1 : bf16")
    payload = parse(text)
    before = str(payload)
    apply(payload, lambda root: widen_softmax(match(root, "func.func")))
    assert str(payload) == before


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(SOFTMAX_PV)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: widen_softmax(match(root, "linalg.fill")))
    assert "transform_ext.widen_softmax: linalg.fill" in message
    assert "not a function with a body" in message
    assert str(payload) == before
