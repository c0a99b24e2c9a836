"""match_assertion_checks: which ops it selects (tagged with transform.annotate and
FileChecked), in block order, and that it leaves the payload unchanged otherwise; the
target checks of cross_entropy named through it."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_assertion_checks import match_assertion_checks
from tests.transform_ext.helpers import apply, check, parse

CHECKS = """
#id = affine_map<(d0) -> (d0)>
func.func @main(%i: tensor<4xi64>, %x: tensor<4xf32>) -> tensor<4xf32> {
  %c0 = arith.constant 0 : i64
  %c9 = arith.constant 9 : i64
  linalg.generic {indexing_maps = [#id], iterator_types = ["parallel"]} ins(%i : tensor<4xi64>) {
  ^bb0(%v: i64):
    %ok = arith.cmpi sge, %v, %c0 : i64
    cf.assert %ok, "negative"
    linalg.yield
  }
  %e = tensor.empty() : tensor<4xf32>
  %r = linalg.generic {indexing_maps = [#id, #id, #id], iterator_types = ["parallel"]}
      ins(%i, %x : tensor<4xi64>, tensor<4xf32>) outs(%e : tensor<4xf32>) {
  ^bb0(%v: i64, %a: f32, %o: f32):
    %ok = arith.cmpi sle, %v, %c9 : i64
    cf.assert %ok, "computes and checks"
    linalg.yield %a : f32
  } -> tensor<4xf32>
  linalg.generic {indexing_maps = [#id], iterator_types = ["parallel"]} ins(%i : tensor<4xi64>) {
  ^bb0(%v: i64):
    linalg.yield
  }
  linalg.generic {indexing_maps = [#id], iterator_types = ["parallel"]} ins(%i : tensor<4xi64>) {
  ^bb0(%v: i64):
    %ok = arith.cmpi sle, %v, %c9 : i64
    cf.assert %ok, "too large"
    linalg.yield
  }
  return %r : tensor<4xf32>
}
"""


def test_selects_the_result_less_generics_holding_assertions_in_order():
    payload = parse(CHECKS)

    def body(root):
        checks = match_assertion_checks(match(root, "func.func"))
        transform.AnnotateOp(checks, "check")
        transform.AnnotateOp(transform.SplitHandleOp([transform.AnyOpType.get()] * 2, checks).results[1],
                             "second")

    apply(payload, body)
    check(payload, """
        CHECK: linalg.generic {{.*}} attrs =  {check}
        CHECK: cf.assert {{.*}} "negative"
        CHECK: linalg.generic
        CHECK-NOT: check
        CHECK-SAME: outs
        CHECK: cf.assert {{.*}} "computes and checks"
        CHECK: linalg.generic
        CHECK-NOT: check
        CHECK-SAME: ins
        CHECK-NEXT: ^bb0
        CHECK-NEXT: linalg.yield
        CHECK: linalg.generic {{.*}} attrs =  {check, second}
        CHECK: cf.assert {{.*}} "too large"
    """)


def test_finds_nothing_in_a_function_without_checks():
    payload = parse("""
        func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
          return %x : tensor<4xf32>
        }
    """)
    before = str(payload)
    apply(payload, lambda root: transform.AnnotateOp(match_assertion_checks(match(root, "func.func")), "check"))
    assert str(payload) == before


def test_cross_entropy_names_the_target_checks():
    """name_target_checks rewrites the message of the checks' assertions only (through
    transform.annotate of the matched checks' cf.assert ops)."""
    from schedules.cross_entropy import name_target_checks

    payload = parse(CHECKS)
    apply(payload, name_target_checks(7))
    check(payload, """
        CHECK: cf.assert {{.*}} "cross_entropy: a target is out of range: class indices must be in [0, 7) or equal ignore_index"
        CHECK: cf.assert {{.*}} "computes and checks"
        CHECK: cf.assert {{.*}} "cross_entropy: a target is out of range: class indices must be in [0, 7) or equal ignore_index"
    """)
