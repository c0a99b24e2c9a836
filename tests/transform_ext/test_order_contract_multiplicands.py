"""order_contract_multiplicands: a vector.contract whose left multiplicand runs along the
accumulator's lanes and whose right one does not gets them swapped (with their maps);
contractions already in order, or with the lanes on both sides, stay."""

from schedules.common import match
from transform_ext.order_contract_multiplicands import order_contract_multiplicands
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

# C[m, n] += sum_k L[k, {l}] R[k, {r}]: L the [1, {ls}] step, R the [1, {rs}] one
CONTRACT = """
#l = affine_map<(k, m, n) -> (k, {l})>
#r = affine_map<(k, m, n) -> (k, {r})>
#c = affine_map<(k, m, n) -> (m, n)>
func.func @main(%l: vector<1x{ls}xf32>, %r: vector<1x{rs}xf32>, %c: vector<8x32xf32>) -> vector<8x32xf32> {{
  %d = vector.contract {{indexing_maps = [#l, #r, #c], iterator_types = ["reduction", "parallel", "parallel"], kind = #vector.kind<add>}}
      %l, %r, %c : vector<1x{ls}xf32>, vector<1x{rs}xf32> into vector<8x32xf32>
  return %d : vector<8x32xf32>
}}
"""


def _ordered(l, r):
    sizes = {"m": 8, "n": 32}
    payload = parse(CONTRACT.format(l=l, r=r, ls=sizes[l], rs=sizes[r]))
    apply(payload, lambda root: order_contract_multiplicands(match(root, "func.func")))
    payload.operation.verify()
    return payload


def test_the_lanes_multiplicand_moves_right():
    check(_ordered("n", "m"), """
        CHECK-DAG:   #[[M:.*]] = affine_map<(d0, d1, d2) -> (d0, d1)>
        CHECK-DAG:   #[[N:.*]] = affine_map<(d0, d1, d2) -> (d0, d2)>
        CHECK-DAG:   #[[C:.*]] = affine_map<(d0, d1, d2) -> (d1, d2)>
        CHECK:       func.func @main(%[[L:.*]]: vector<1x32xf32>, %[[R:.*]]: vector<1x8xf32>
        CHECK:       vector.contract {indexing_maps = [#[[M]], #[[N]], #[[C]]]
        CHECK-SAME:  %[[R]], %[[L]], %{{.*}} : vector<1x8xf32>, vector<1x32xf32> into vector<8x32xf32>
    """)


def test_contractions_in_order_stay():
    check(_ordered("m", "n"), """
        CHECK:       func.func @main(%[[L:.*]]: vector<1x8xf32>, %[[R:.*]]: vector<1x32xf32>
        CHECK:       vector.contract
        CHECK-SAME:  %[[L]], %[[R]], %{{.*}} : vector<1x8xf32>, vector<1x32xf32> into vector<8x32xf32>
    """)


def test_lanes_on_both_sides_stay():
    payload = parse("""
#a = affine_map<(k, n) -> (k, n)>
#c = affine_map<(k, n) -> (n)>
func.func @main(%a: vector<4x32xf32>, %b: vector<4x32xf32>, %c: vector<32xf32>) -> vector<32xf32> {
  %d = vector.contract {indexing_maps = [#a, #a, #c], iterator_types = ["reduction", "parallel"], kind = #vector.kind<add>}
      %a, %b, %c : vector<4x32xf32>, vector<4x32xf32> into vector<32xf32>
  return %d : vector<32xf32>
}
""")
    before = str(payload)
    apply(payload, lambda root: order_contract_multiplicands(match(root, "func.func")))
    assert str(payload) == before


def test_a_target_that_is_no_function_fails():
    payload = parse(CONTRACT.format(l="n", r="m", ls=32, rs=8))
    message = apply_expect_failure(
        payload, lambda root: order_contract_multiplicands(match(root, "vector.contract")))
    assert "not a func.func" in message
