"""checks_to_error_code: IR (FileCheck), the messages attribute, rejections. The numerics
(the code a compiled kernel returns, raised as a KernelError) are covered end to end by
tests/lighthouse/test_runtime.py and test_runtime_checks.py."""


from schedules.common import match
from transform_ext.checks_to_error_code import checks_to_error_code, kernel_error_messages
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

CHECKED = """
#v = affine_map<(d0) -> (d0)>
module attributes {lh.kernel_errors = ["already listed", "too large"]} {
  func.func @main(%i: tensor<4xi64>, %x: tensor<4xf32>) -> tensor<4xf32> {
    %c0 = arith.constant 0 : i64
    %c9 = arith.constant 9 : i64
    linalg.generic {indexing_maps = [#v], iterator_types = ["parallel"]} ins(%i : tensor<4xi64>) {
    ^bb0(%in: i64):
      %lo = arith.cmpi sge, %in, %c0 : i64
      cf.assert %lo, "negative"
      %hi = arith.cmpi sle, %in, %c9 : i64
      cf.assert %hi, "too large"
      linalg.yield
    }
    %e = tensor.empty() : tensor<4xf32>
    %r = linalg.generic {indexing_maps = [#v, #v, #v], iterator_types = ["parallel"]}
        ins(%i, %x : tensor<4xi64>, tensor<4xf32>) outs(%e : tensor<4xf32>) {
    ^bb0(%in: i64, %a: f32, %o: f32):
      %ok = arith.cmpi ne, %in, %c0 : i64
      cf.assert %ok, "zero"
      linalg.yield %a : f32
    } -> tensor<4xf32>
    return %r : tensor<4xf32>
  }
}
"""


def test_checks_become_the_last_result():
    """The result-producing generic's check is split out first; each check reduces to a
    rank-0 i32 code (0, else the message's 1-based position), combined with maxsi."""
    payload = parse(CHECKED)
    apply(payload, checks_to_error_code)
    payload.operation.verify()
    check(payload, """
        CHECK: module attributes {lh.kernel_errors = ["already listed", "too large", "negative", "zero"]}
        CHECK-LABEL: func.func @main({{.*}}) -> (tensor<4xf32>, tensor<i32>)
        CHECK-NOT: cf.assert
        CHECK: %[[C1:.*]] = linalg.generic {{.*}} iterator_types = ["reduction"]} ins(%{{.*}} : tensor<4xi64>) outs(%{{.*}} : tensor<i32>)
        CHECK: %[[K3:.*]] = arith.constant 3 : i32
        CHECK: arith.select %{{.*}}, %{{.*}}, %[[K3]] : i32
        CHECK: arith.maxsi
        CHECK: %[[K2:.*]] = arith.constant 2 : i32
        CHECK: arith.select %{{.*}}, %{{.*}}, %[[K2]] : i32
        CHECK: arith.maxsi
        CHECK: %[[C2:.*]] = linalg.generic {{.*}} iterator_types = ["reduction"]}
        CHECK: arith.constant 4 : i32
        CHECK: %[[R:.*]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<4xf32>)
        CHECK-NOT: cf.assert
        CHECK: %[[MAX:.*]] = linalg.generic {{.*}} ins(%[[C1]], %[[C2]] : tensor<i32>, tensor<i32>)
        CHECK: arith.maxsi
        CHECK: return %[[R]], %[[MAX]] : tensor<4xf32>, tensor<i32>
    """)
    assert kernel_error_messages(payload.operation) == ["already listed", "too large", "negative", "zero"]


def test_a_function_without_checks_is_unchanged():
    payload = parse("""
        func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
          return %x : tensor<4xf32>
        }
    """)
    before = str(payload)
    apply(payload, checks_to_error_code)
    assert str(payload) == before
    assert kernel_error_messages(payload.operation) == []


def test_rejects_a_target_that_is_not_a_module():
    payload = parse(CHECKED)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: checks_to_error_code(match(root, "func.func")))
    assert "transform_ext.checks_to_error_code: func.func" in message
    assert "not a builtin.module" in message
    assert str(payload) == before


def test_rejects_a_messages_attribute_of_another_kind():
    payload = parse(CHECKED.replace('["already listed", "too large"]', "[1, 2]"))
    before = str(payload)
    message = apply_expect_failure(payload, checks_to_error_code)
    assert "transform_ext.checks_to_error_code: builtin.module" in message
    assert "lh.kernel_errors attribute is not an array of strings" in message
    assert str(payload) == before
