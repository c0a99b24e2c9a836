"""append_lse_result: the log-sum-exp computed beside the passed-through output and returned
last (FileCheck), its value against torch, and the rejection of a function without an
attention (nothing rewritten)."""

import torch

from schedules.common import match
from transform_ext.append_lse_result import append_lse_result
from tests.transform_ext.attention_payloads import SHAPES, attention, torch_attention
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module


def _append(root):
    append_lse_result(match(root, "func.func"))


def test_lse_is_computed_with_the_output_and_returned_last():
    payload = parse(attention())
    apply(payload, _append)
    check(payload, """
        CHECK: func.func @main({{.*}}) -> (tensor<2x4x6xf32>, tensor<2x4xf32>, tensor<2x4xf32>)
        CHECK: %[[M:.*]] = linalg.generic {{.*}} ins(%{{.*}} : tensor<2x4x8xf32>) outs(%{{.*}} : tensor<2x4xf32>)
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.maximumf
        CHECK: %[[L:.*]] = linalg.generic {{.*}} ins(%{{.*}} : tensor<2x4x8xf32>) outs(%{{.*}} : tensor<2x4xf32>)
        CHECK: %[[O:.*]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<2x4x6xf32>)
        CHECK: %[[BOTH:.*]]:2 = linalg.generic {{.*}} ins(%[[O]], %[[M]], %[[L]] : tensor<2x4x6xf32>, tensor<2x4xf32>, tensor<2x4xf32>)
        CHECK-NEXT: ^bb0(%[[OV:[^:]*]]: f32, %[[MV:[^:]*]]: f32, %[[LV:[^:]*]]: f32,
        CHECK-NEXT: %[[NINF:.*]] = arith.constant 0xFF800000 : f32
        CHECK-NEXT: %[[MASKED:.*]] = arith.cmpf oeq, %[[MV]], %[[NINF]] : f32
        CHECK-NEXT: %[[LOG:.*]] = math.log %[[LV]] : f32
        CHECK-NEXT: %[[SUM:.*]] = arith.addf %[[MV]], %[[LOG]] : f32
        CHECK-NEXT: %[[LSE:.*]] = arith.select %[[MASKED]], %[[NINF]], %[[SUM]] : f32
        CHECK-NEXT: linalg.yield %[[OV]], %[[LSE]] : f32, f32
        CHECK: %[[ROWS:.*]] = tensor.extract_slice %[[BOTH]]#1[0, 0, 0] [2, 4, 1] [1, 1, 1] : tensor<2x4x6xf32> to tensor<2x4xf32>
        CHECK: return %[[BOTH]]#0, %[[L]], %[[ROWS]]
    """)


def test_lse_is_torchs_logsumexp():
    b, l, s, d, e = (SHAPES[k] for k in "BLSDE")
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(b, l, d, generator=g), torch.randn(b, s, d, generator=g), \
        torch.randn(b, s, e, generator=g)
    payload = parse(attention())
    apply(payload, _append)
    out, rows, lse = run_module(payload, [q, k, v])
    want_out, want_rows = torch_attention(q, k, v)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-1, -2), -1), rtol=1e-5, atol=1e-5)


def test_rejects_a_function_without_an_attention():
    payload = parse(attention().replace("arith.maximumf", "arith.minimumf"))
    before = str(payload)
    message = apply_expect_failure(payload, _append)
    assert "transform_ext.append_lse_result: func.func" in message
    assert "expected one row max (softmax), found 0" in message
    assert str(payload) == before
