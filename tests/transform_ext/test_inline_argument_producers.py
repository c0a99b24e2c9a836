"""inline_argument_producers: the target check computes the valid flag and the clamped
target from y itself, the count reads y (FileCheck); a weight gathered at the target, w[y_i],
is inlined only with `gathers` (FileCheck; the numbers: the inlining of
inline_elementwise_producers, and the end-to-end loss tests); a consumer that is not a generic is
refused."""

from schedules.common import match
from transform_ext.inline_argument_producers import inline_argument_producers
from transform_ext.match_loss_kernels import match_loss_kernels
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.loss_payloads import LOSS

WEIGHTS = """
#r = affine_map<(d0) -> (d0)>
#s = affine_map<(d0) -> ()>
func.func @main(%y: tensor<4xi64>, %w: tensor<16xf32>) -> tensor<f32> {
  %zero = arith.constant 0.0 : f32
  %e4 = tensor.empty() : tensor<4xf32>
  %e0 = tensor.empty() : tensor<f32>
  %wt = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%y : tensor<4xi64>) outs(%e4 : tensor<4xf32>) {
  ^bb0(%a: i64, %o: f32):
    %j = arith.index_cast %a : i64 to index
    %g = tensor.extract %w[%j] : tensor<16xf32>
    linalg.yield %g : f32
  } -> tensor<4xf32>
  %s0 = linalg.fill ins(%zero : f32) outs(%e0 : tensor<f32>) -> tensor<f32>
  %total = linalg.generic {indexing_maps = [#r, #s], iterator_types = ["reduction"]}
      ins(%wt : tensor<4xf32>) outs(%s0 : tensor<f32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<f32>
  return %total : tensor<f32>
}
"""


def test_the_check_and_the_count_read_the_targets():
    payload = parse(LOSS)

    def body(root):
        func = match(root, "func.func")
        inline_argument_producers(match_loss_kernels(func).host)
        inline_argument_producers(match_loss_kernels(func).row_sums)

    apply(payload, body)
    check(str(payload), """
        CHECK: linalg.generic {{.*}} ins(%arg1, %arg1 : tensor<4xi64>, tensor<4xi64>) {
        CHECK: arith.cmpi ne
        CHECK: arith.select
        CHECK: cf.assert
        CHECK: cf.assert
        CHECK: linalg.generic {{.*}} iterator_types = ["reduction"]} ins(%arg1 : tensor<4xi64>)
        CHECK: arith.cmpi ne
        CHECK: arith.uitofp
        CHECK: linalg.generic {{.*}} iterator_types = ["reduction"]} ins(%{{.*}} : tensor<4xf32>)
    """)


def test_a_gather_of_an_argument_is_inlined_with_gathers_only():
    def inline(gathers):
        payload = parse(WEIGHTS)
        apply(payload, lambda root: inline_argument_producers(
            match(match(root, "func.func"), "linalg.generic"), gathers=gathers))
        return payload

    assert str(inline(False)).count("linalg.generic") == 2
    payload = inline(True)
    assert str(payload).count("linalg.generic") == 1
    check(str(payload), """
        CHECK: linalg.generic {{.*}} iterator_types = ["reduction"]} ins(%arg0 : tensor<4xi64>)
        CHECK: tensor.extract %arg1
        CHECK: arith.addf
    """)


def test_rejects_a_consumer_that_is_not_a_generic():
    payload = parse(LOSS)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: inline_argument_producers(match(root, "linalg.fill")))
    assert "transform_ext.inline_argument_producers: linalg.fill" in message
    assert "not a linalg.generic" in message
    assert str(payload) == before
