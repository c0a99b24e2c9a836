"""narrow_contracts_for_dpas: IR (FileCheck), numerics before/after on the CPU and against
torch, rejections (message and unchanged payload)."""

import torch

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module
from transform_ext.narrow_contracts_for_dpas import narrow_contracts_for_dpas

MAPS = """
#a = affine_map<(m, n, k) -> (m, k)>
#b = affine_map<(m, n, k) -> (k, n)>
#c = affine_map<(m, n, k) -> (m, n)>
"""
CONTRACT = ('indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction"], '
            'kind = #vector.kind<add>')

# S = (Q * 0.125) K^T + mask with Q, K f16 extended to f32 (SDPA's scale on Q, K keys-major)
SCORES = MAPS + f"""
func.func @main(%q: tensor<8x16xf16>, %k: tensor<32x16xf16>, %mask: tensor<8x32xf32>) -> tensor<8x32xf32> {{
  %i0 = arith.constant 0 : index
  %ph = arith.constant 0.0 : f16
  %pf = arith.constant 0.0 : f32
  %scale = arith.constant dense<0.125> : vector<8x16xf32>
  %vq = vector.transfer_read %q[%i0, %i0], %ph {{in_bounds = [true, true]}} : tensor<8x16xf16>, vector<8x16xf16>
  %vk = vector.transfer_read %k[%i0, %i0], %ph {{in_bounds = [true, true]}} : tensor<32x16xf16>, vector<32x16xf16>
  %vm = vector.transfer_read %mask[%i0, %i0], %pf {{in_bounds = [true, true]}} : tensor<8x32xf32>, vector<8x32xf32>
  %eq = arith.extf %vq : vector<8x16xf16> to vector<8x16xf32>
  %sq = arith.mulf %eq, %scale : vector<8x16xf32>
  %ek = arith.extf %vk : vector<32x16xf16> to vector<32x16xf32>
  %tk = vector.transpose %ek, [1, 0] : vector<32x16xf32> to vector<16x32xf32>
  %s = vector.contract {{{CONTRACT}}} %sq, %tk, %vm : vector<8x16xf32>, vector<16x32xf32> into vector<8x32xf32>
  %e = tensor.empty() : tensor<8x32xf32>
  %w = vector.transfer_write %s, %e[%i0, %i0] {{in_bounds = [true, true]}} : vector<8x32xf32>, tensor<8x32xf32>
  return %w : tensor<8x32xf32>
}}
"""

# O = exp(S) V with S f32 and V bf16 extended (P @ V of attention, P computed in f32)
PV = MAPS + f"""
func.func @main(%s: tensor<8x32xf32>, %v: tensor<32x16xbf16>) -> tensor<8x16xf32> {{
  %i0 = arith.constant 0 : index
  %ph = arith.constant 0.0 : bf16
  %pf = arith.constant 0.0 : f32
  %zero = arith.constant dense<0.0> : vector<8x16xf32>
  %vs = vector.transfer_read %s[%i0, %i0], %pf {{in_bounds = [true, true]}} : tensor<8x32xf32>, vector<8x32xf32>
  %vv = vector.transfer_read %v[%i0, %i0], %ph {{in_bounds = [true, true]}} : tensor<32x16xbf16>, vector<32x16xbf16>
  %p = math.exp %vs : vector<8x32xf32>
  %ev = arith.extf %vv : vector<32x16xbf16> to vector<32x16xf32>
  %o = vector.contract {{{CONTRACT}}} %p, %ev, %zero : vector<8x32xf32>, vector<32x16xf32> into vector<8x16xf32>
  %e = tensor.empty() : tensor<8x16xf32>
  %w = vector.transfer_write %o, %e[%i0, %i0] {{in_bounds = [true, true]}} : vector<8x16xf32>, tensor<8x16xf32>
  return %w : tensor<8x16xf32>
}}
"""


def _narrow(payload, names="func.func"):
    apply(payload, lambda root: narrow_contracts_for_dpas(match(root, names)))


def _scores_inputs():
    torch.manual_seed(0)
    return [torch.randn(8, 16).half(), torch.randn(32, 16).half(), torch.randn(8, 32)]


def test_scaled_extended_operands_contract_narrow_and_the_scale_follows_in_f32():
    payload = parse(SCORES)
    _narrow(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: %[[Q:.*]] = vector.transfer_read %arg0
        CHECK: %[[K:.*]] = vector.transfer_read %arg1
        CHECK: %[[M:.*]] = vector.transfer_read %arg2
        CHECK: %[[KT:.*]] = vector.transpose %[[K]], [1, 0] : vector<32x16xf16> to vector<16x32xf16>
        CHECK: %[[Z:.*]] = arith.constant dense<0.000000e+00> : vector<8x32xf32>
        CHECK: %[[S:.*]] = vector.contract {{.*}} %[[Q]], %[[KT]], %[[Z]] : vector<8x16xf16>, vector<16x32xf16> into vector<8x32xf32>
        CHECK: %[[C:.*]] = arith.constant dense<1.250000e-01> : vector<8x32xf32>
        CHECK: %[[SC:.*]] = arith.mulf %[[S]], %[[C]] : vector<8x32xf32>
        CHECK: %[[SM:.*]] = arith.addf %[[SC]], %[[M]] : vector<8x32xf32>
        CHECK: vector.transfer_write %[[SM]]
    """)


def test_scaled_scores_match_before_and_torch():
    inputs = _scores_inputs()
    before = run_module(parse(SCORES), inputs)
    payload = parse(SCORES)
    _narrow(payload)
    after = run_module(payload, inputs)
    q, k, mask = inputs
    # the mask is added after the scaled sum instead of first: a rounding apart
    torch.testing.assert_close(after[0], before[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(after[0], (q.float() * 0.125) @ k.float().T + mask, rtol=1e-5, atol=1e-5)


def test_a_computed_f32_operand_is_truncated_to_its_partner_type():
    payload = parse(PV)
    _narrow(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: %[[Z:.*]] = arith.constant dense<0.000000e+00> : vector<8x16xf32>
        CHECK: %[[V:.*]] = vector.transfer_read %arg1
        CHECK: %[[P:.*]] = math.exp
        CHECK: %[[PT:.*]] = arith.truncf %[[P]] : vector<8x32xf32> to vector<8x32xbf16>
        CHECK: vector.contract {{.*}} %[[PT]], %[[V]], %[[Z]] : vector<8x32xbf16>, vector<32x16xbf16> into vector<8x16xf32>
        CHECK-NOT: arith.mulf
    """)


def test_truncated_probabilities_match_torch():
    torch.manual_seed(0)
    s, v = torch.randn(8, 32), torch.randn(32, 16).bfloat16()
    payload = parse(PV)
    _narrow(payload)
    after = run_module(payload, [s, v])
    p = torch.exp(s).bfloat16().float()
    torch.testing.assert_close(after[0], p @ v.float(), rtol=1e-5, atol=1e-5)


def test_rejects_an_f32_by_f32_contraction():
    payload = parse(PV.replace("%ev = arith.extf %vv : vector<32x16xbf16> to vector<32x16xf32>",
                               "%evb = arith.extf %vv : vector<32x16xbf16> to vector<32x16xf32>\n"
                               "  %ev = math.exp %evb : vector<32x16xf32>"))
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: narrow_contracts_for_dpas(match(root, "func.func")))
    assert "transform_ext.narrow_contracts_for_dpas: vector.contract" in message
    assert "a contraction of two f32 multiplicands has no DPAS form" in message
    assert str(payload) == before


def test_rejects_an_f64_accumulator():
    text = SCORES.replace("tensor<8x32xf32>", "tensor<8x32xf64>").replace(
        "vector<8x32xf32>", "vector<8x32xf64>").replace("%pf = arith.constant 0.0 : f32",
                                                        "%pf = arith.constant 0.0 : f64")
    text = text.replace("vector<8x16xf32>", "vector<8x16xf64>").replace(
        "vector<16x32xf32>", "vector<16x32xf64>").replace("vector<32x16xf32>", "vector<32x16xf64>")
    payload = parse(text)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: narrow_contracts_for_dpas(match(root, "func.func")))
    assert "transform_ext.narrow_contracts_for_dpas: vector.contract" in message
    assert "it accumulates in vector<8x32xf64>; DPAS accumulates in f32" in message
    assert str(payload) == before
