"""drop_unit_reduction_dims_of_contracts: a vector.contract over a unit reduction dim and
another one becomes a contraction over one reduction dim, which the outer-product lowering
takes (it unrolled the two-dim form element by element); reduction dims of other extents
stay, and a target that is no function fails."""

from torch_mlir.dialects.transform import vector as tvec

from schedules.common import apply_patterns, match
from transform_ext.drop_unit_reduction_dims_of_contracts import drop_unit_reduction_dims_of_contracts
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

# C[m, n] += sum_{h, d} A[m, h, d] B[h, d, n], h of extent {h} and d of extent {d}
CONTRACT = """
#a = affine_map<(m, n, h, d) -> (m, h, d)>
#b = affine_map<(m, n, h, d) -> (h, d, n)>
#c = affine_map<(m, n, h, d) -> (m, n)>
func.func @main(%a: vector<8x{h}x{d}xf32>, %b: vector<{h}x{d}x32xf32>, %c: vector<8x32xf32>) -> vector<8x32xf32> {{
  %r = vector.contract {{indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction", "reduction"], kind = #vector.kind<add>}}
      %a, %b, %c : vector<8x{h}x{d}xf32>, vector<{h}x{d}x32xf32> into vector<8x32xf32>
  return %r : vector<8x32xf32>
}}
"""


def _dropped(h, d, lower=False):
    payload = parse(CONTRACT.format(h=h, d=d))

    def body(root):
        func = match(root, "func.func")
        drop_unit_reduction_dims_of_contracts(func)
        if lower:
            apply_patterns(func, lambda: tvec.ApplyLowerContractionPatternsOp(
                lowering_strategy=tvec.VectorContractLowering.OuterProduct))

    apply(payload, body)
    payload.operation.verify()
    return payload


def test_a_unit_head_dim_is_dropped():
    check(_dropped(1, 4), """
        CHECK-DAG:   #[[A:.*]] = affine_map<(d0, d1, d2) -> (d0, d2)>
        CHECK-DAG:   #[[B:.*]] = affine_map<(d0, d1, d2) -> (d2, d1)>
        CHECK-DAG:   #[[C:.*]] = affine_map<(d0, d1, d2) -> (d0, d1)>
        CHECK:       func.func @main(%[[X:.*]]: vector<8x1x4xf32>, %[[Y:.*]]: vector<1x4x32xf32>, %[[Z:.*]]: vector<8x32xf32>)
        CHECK-DAG:   %[[XA:.*]] = vector.shape_cast %[[X]] : vector<8x1x4xf32> to vector<8x4xf32>
        CHECK-DAG:   %[[YB:.*]] = vector.shape_cast %[[Y]] : vector<1x4x32xf32> to vector<4x32xf32>
        CHECK:       vector.contract {indexing_maps = [#[[A]], #[[B]], #[[C]]], iterator_types = ["parallel", "parallel", "reduction"], kind = #vector.kind<add>} %[[XA]], %[[YB]], %[[Z]]
    """)


def test_two_unit_reduction_dims_keep_the_inner_one_and_lower_to_one_outer_product():
    payload = _dropped(1, 1, lower=True)
    text = str(payload)
    assert "vector.contract" not in text
    check(text, """
        CHECK:     vector.outerproduct {{.*}} : vector<8xf32>, vector<32xf32>
        CHECK-NOT: vector.outerproduct
    """)


def test_without_the_rewrite_the_lowering_unrolls_by_element():
    """What the rewrite avoids (the test above fails without it): no outer product."""
    payload = parse(CONTRACT.format(h=1, d=1))
    apply(payload, lambda root: apply_patterns(
        match(root, "func.func"), lambda: tvec.ApplyLowerContractionPatternsOp(
            lowering_strategy=tvec.VectorContractLowering.OuterProduct)))
    assert "vector.outerproduct" not in str(payload)


def test_reduction_dims_of_other_extents_stay():
    payload = _dropped(2, 4)
    assert "vector.shape_cast" not in str(payload)
    assert str(payload).count('"reduction"') == 2


def test_a_target_that_is_no_function_fails():
    payload = parse(CONTRACT.format(h=1, d=4))
    message = apply_expect_failure(
        payload, lambda root: drop_unit_reduction_dims_of_contracts(match(root, "vector.contract")))
    assert "not a func.func" in message
