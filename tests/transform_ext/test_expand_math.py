"""expand_math as a transform op: FileCheck of an erf-only expansion (exp kept, f16 computed in
f32), the handle it returns, and the rejection of a math op it has no expansion of. The
expansions' accuracy is measured in tests/lighthouse/test_math_approx.py."""

from schedules.common import match
from transform_ext.expand_math import expand_math
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

MIXED = """
func.func @f(%x: vector<16xf32>, %h: f16) -> (vector<16xf32>, vector<16xf32>, f16) {
  %e = math.exp %x : vector<16xf32>
  %r = math.erf %x : vector<16xf32>
  %s = math.erf %h : f16
  return %e, %r, %s : vector<16xf32>, vector<16xf32>, f16
}
"""


def test_only_the_named_ops_are_expanded_and_the_function_handle_comes_back():
    payload = parse(MIXED)

    def body(root):
        func = expand_math(match(root, "func.func"), ops=("math.erf",))
        expand_math(func, ops=("math.erf",))   # the returned handle is usable (nothing left)

    apply(payload, body)
    check(payload, """
        CHECK: func.func @f
        CHECK: math.exp %{{.*}} : vector<16xf32>
        CHECK-NOT: math.erf
        CHECK: arith.extf %{{.*}} : f16 to f32
        CHECK: arith.truncf %{{.*}} : f32 to f16
        CHECK: return
    """)


def test_a_math_op_without_an_expansion_is_refused():
    payload = parse(MIXED)
    message = apply_expect_failure(
        payload, lambda root: expand_math(match(root, "func.func"), ops=("math.sin",)))
    assert "transform_ext.expand_math" in message and "no expansion of math.sin" in message
    assert "math.erf" in str(payload)   # nothing rewritten
