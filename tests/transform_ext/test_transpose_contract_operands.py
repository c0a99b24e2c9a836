"""transpose_contract_operands: IR (FileCheck), numerics before/after on the CPU and against
torch, contractions left alone, rejection (message and unchanged payload)."""

import torch

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module
from transform_ext.transpose_contract_operands import transpose_contract_operands


def payload_text(a_map="(m, k)", b_map="(n, k)", a_shape="8x16", b_shape="32x16"):
    """C = A B^T + C (B stored keys-major, as K in Q K^T) on vectors read from tensors."""
    return f"""
#a = affine_map<(m, n, k) -> {a_map}>
#b = affine_map<(m, n, k) -> {b_map}>
#c = affine_map<(m, n, k) -> (m, n)>
func.func @main(%a: tensor<{a_shape}xf32>, %b: tensor<{b_shape}xf32>, %c: tensor<8x32xf32>) -> tensor<8x32xf32> {{
  %i0 = arith.constant 0 : index
  %p = arith.constant 0.0 : f32
  %va = vector.transfer_read %a[%i0, %i0], %p {{in_bounds = [true, true]}} : tensor<{a_shape}xf32>, vector<{a_shape}xf32>
  %vb = vector.transfer_read %b[%i0, %i0], %p {{in_bounds = [true, true]}} : tensor<{b_shape}xf32>, vector<{b_shape}xf32>
  %vc = vector.transfer_read %c[%i0, %i0], %p {{in_bounds = [true, true]}} : tensor<8x32xf32>, vector<8x32xf32>
  %r = vector.contract {{indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction"], kind = #vector.kind<add>}} %va, %vb, %vc : vector<{a_shape}xf32>, vector<{b_shape}xf32> into vector<8x32xf32>
  %e = tensor.empty() : tensor<8x32xf32>
  %w = vector.transfer_write %r, %e[%i0, %i0] {{in_bounds = [true, true]}} : vector<8x32xf32>, tensor<8x32xf32>
  return %w : tensor<8x32xf32>
}}
"""


def _transpose(payload, names="func.func"):
    apply(payload, lambda root: transpose_contract_operands(match(root, names)))


def test_a_keys_major_operand_is_transposed():
    payload = parse(payload_text())
    _transpose(payload)
    check(payload, """
        CHECK-DAG: #[[A:.*]] = affine_map<(d0, d1, d2) -> (d0, d2)>
        CHECK-DAG: #[[B:.*]] = affine_map<(d0, d1, d2) -> (d2, d1)>
        CHECK-DAG: #[[C:.*]] = affine_map<(d0, d1, d2) -> (d0, d1)>
        CHECK-LABEL: func.func @main
        CHECK: %[[VA:.*]] = vector.transfer_read %arg0
        CHECK: %[[VB:.*]] = vector.transfer_read %arg1
        CHECK: %[[T:.*]] = vector.transpose %[[VB]], [1, 0] : vector<32x16xf32> to vector<16x32xf32>
        CHECK: vector.contract {indexing_maps = [#[[A]], #[[B]], #[[C]]]
        CHECK-SAME: %[[VA]], %[[T]],
        CHECK-SAME: vector<8x16xf32>, vector<16x32xf32> into vector<8x32xf32>
    """)


def test_both_operands_the_other_way_round():
    payload = parse(payload_text(a_map="(k, m)", a_shape="16x8"))
    _transpose(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: vector.transpose {{.*}} : vector<16x8xf32> to vector<8x16xf32>
        CHECK: vector.transpose {{.*}} : vector<32x16xf32> to vector<16x32xf32>
        CHECK: vector.contract
        CHECK-SAME: vector<8x16xf32>, vector<16x32xf32> into vector<8x32xf32>
    """)


def test_same_result_before_and_after():
    torch.manual_seed(0)
    a, b, c = torch.randn(8, 16), torch.randn(32, 16), torch.randn(8, 32)
    before = run_module(parse(payload_text()), [a, b, c])
    payload = parse(payload_text())
    _transpose(payload)
    after = run_module(payload, [a, b, c])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[0], a @ b.T + c)


def test_a_canonical_contraction_is_left_alone():
    payload = parse(payload_text(b_map="(k, n)", b_shape="16x32"))
    before = str(payload)
    _transpose(payload)
    assert str(payload) == before


def test_rejects_a_target_contraction_with_a_transposed_result():
    payload = parse(payload_text().replace("#c = affine_map<(m, n, k) -> (m, n)>",
                                           "#c = affine_map<(m, n, k) -> (n, m)>").replace(
        "8x32xf32", "32x8xf32"))
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: transpose_contract_operands(match(root, "vector.contract")))
    assert "transform_ext.transpose_contract_operands: vector.contract" in message
    assert "not a contraction C[m, n] += A B over a third reduction loop k" in message
    assert str(payload) == before
