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


def test_the_erfc_polynomial_is_summed_by_estrins_scheme():
    """erf's degree-15 polynomial of t on [0.875, 4): 8 pairs by fma, joined by t^2, t^4 and
    t^8 (a tree of depth 4, not a chain of 15 fmas that bounds a GELU loop by its latency)."""
    payload = parse("""
        func.func @f(%x: vector<8xf32>) -> vector<8xf32> {
          %r = math.erf %x : vector<8xf32>
          return %r : vector<8xf32>
        }""")
    apply(payload, lambda root: expand_math(match(root, "func.func"), ops=("math.erf",)))
    check(payload, """
        CHECK: arith.subf
        CHECK: %[[T:.*]] = arith.mulf %{{.*}}, %{{.*}} : vector<8xf32>
        CHECK-COUNT-8: math.fma %{{.*}}, %[[T]], %{{.*}} : vector<8xf32>
        CHECK: %[[T2:.*]] = arith.mulf %[[T]], %[[T]] : vector<8xf32>
        CHECK-COUNT-4: math.fma %{{.*}}, %[[T2]], %{{.*}} : vector<8xf32>
        CHECK: %[[T4:.*]] = arith.mulf %[[T2]], %[[T2]] : vector<8xf32>
        CHECK-COUNT-2: math.fma %{{.*}}, %[[T4]], %{{.*}} : vector<8xf32>
        CHECK: %[[T8:.*]] = arith.mulf %[[T4]], %[[T4]] : vector<8xf32>
        CHECK: math.fma %{{.*}}, %[[T8]], %{{.*}} : vector<8xf32>
    """)
