"""promote_reductions_to_f32 and match_narrow_reductions: IR (FileCheck), which ops the
matcher finds, numerics against torch's f32 accumulation, the rejection."""

import torch
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

from schedules.common import match
from transform_ext.match_narrow_reductions import match_narrow_reductions
from transform_ext.promote_reductions_to_f32 import promote_reductions_to_f32
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

SUMS = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x300xf16>, %a: tensor<2x4x8xbf16>, %b: tensor<2x8x3xbf16>, %y: tensor<4x300xf32>)
    -> (tensor<4xf16>, tensor<2x4x3xbf16>, tensor<4xf32>) {
  %zero = arith.constant 0.0 : f16
  %zb = arith.constant 0.0 : bf16
  %zf = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4xf16>
  %i = linalg.fill ins(%zero : f16) outs(%e : tensor<4xf16>) -> tensor<4xf16>
  %s = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x300xf16>) outs(%i : tensor<4xf16>) {
  ^bb0(%in: f16, %acc: f16):
    %t = arith.addf %in, %acc : f16
    linalg.yield %t : f16
  } -> tensor<4xf16>
  %eb = tensor.empty() : tensor<2x4x3xbf16>
  %ib = linalg.fill ins(%zb : bf16) outs(%eb : tensor<2x4x3xbf16>) -> tensor<2x4x3xbf16>
  %m = linalg.batch_matmul ins(%a, %b : tensor<2x4x8xbf16>, tensor<2x8x3xbf16>) outs(%ib : tensor<2x4x3xbf16>) -> tensor<2x4x3xbf16>
  %ef = tensor.empty() : tensor<4xf32>
  %if = linalg.fill ins(%zf : f32) outs(%ef : tensor<4xf32>) -> tensor<4xf32>
  %sf = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%y : tensor<4x300xf32>) outs(%if : tensor<4xf32>) {
  ^bb0(%in: f32, %acc: f32):
    %t = arith.addf %in, %acc : f32
    linalg.yield %t : f32
  } -> tensor<4xf32>
  return %s, %m, %sf : tensor<4xf16>, tensor<2x4x3xbf16>, tensor<4xf32>
}
"""


def _promote(root):
    promote_reductions_to_f32(structured.GeneralizeOp(match_narrow_reductions(root)).transformed)


def test_the_matcher_finds_the_narrow_reductions_named_or_not():
    payload = parse(SUMS)
    apply(payload, lambda root: transform.AnnotateOp(match_narrow_reductions(root), "narrow"))
    check(payload, """
        CHECK: linalg.generic {{.*}} attrs =  {narrow}
        CHECK: linalg.batch_matmul {narrow}
        CHECK: linalg.generic
        CHECK-NOT: narrow
        CHECK: return
    """)


def test_narrow_reductions_accumulate_in_f32_and_round_once():
    payload = parse(SUMS)
    apply(payload, _promote)
    payload.operation.verify()
    check(payload, """
        CHECK: %[[I:.*]] = linalg.fill {{.*}} -> tensor<4xf16>
        CHECK: %[[W:.*]] = linalg.generic {{.*}} ins(%[[I]] : tensor<4xf16>) outs(%{{.*}} : tensor<4xf32>)
        CHECK: arith.extf
        CHECK: %[[S:.*]] = linalg.generic {{.*}} ins(%arg0 : tensor<4x300xf16>) outs(%[[W]] : tensor<4xf32>)
        CHECK: arith.extf %{{.*}} : f16 to f32
        CHECK: arith.addf %{{.*}}, %{{.*}} : f32
        CHECK: %[[R:.*]] = linalg.generic {{.*}} ins(%[[S]] : tensor<4xf32>) outs(%{{.*}} : tensor<4xf16>)
        CHECK: arith.truncf
        CHECK-NOT: linalg.batch_matmul
        CHECK: %[[M:.*]] = linalg.generic {{.*}} ins(%arg1, %arg2 : tensor<2x4x8xbf16>, tensor<2x8x3xbf16>) outs(%{{.*}} : tensor<2x4x3xf32>)
        CHECK: %[[MR:.*]] = linalg.generic {{.*}} ins(%[[M]] : tensor<2x4x3xf32>) outs(%{{.*}} : tensor<2x4x3xbf16>)
        CHECK: return %[[R]], %[[MR]], %{{.*}} : tensor<4xf16>, tensor<2x4x3xbf16>, tensor<4xf32>
    """)


def test_the_sums_match_an_f32_accumulation():
    """run_module's cleanup promotes the reductions itself; here they are promoted before,
    and cleanup finds nothing left to do: torch's f32 accumulation, rounded once."""
    x = torch.randn(4, 300).half()
    a, b = torch.randn(2, 4, 8).bfloat16(), torch.randn(2, 8, 3).bfloat16()
    y = torch.randn(4, 300)
    payload = parse(SUMS)
    apply(payload, _promote)
    s, m, sf = run_module(payload, [x, a, b, y])
    torch.testing.assert_close(s, x.float().sum(1).half(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(m, torch.bmm(a.float(), b.float()).bfloat16(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(sf, y.sum(1), rtol=1e-5, atol=1e-4)


def test_rejects_an_f32_reduction():
    payload = parse(SUMS)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: promote_reductions_to_f32(match(root, "linalg.generic")))
    assert "transform_ext.promote_reductions_to_f32: linalg.generic" in message
    assert "not a linalg.generic or named pooling reducing into an f16 or bf16 result" in message
    assert str(payload) == before


POOLING = """
func.func @main(%x: tensor<1x2x1x9xbf16>) -> tensor<1x2x1x4xbf16> {
  %low = arith.constant 0xFF80 : bf16
  %e = tensor.empty() : tensor<1x2x1x4xbf16>
  %i = linalg.fill ins(%low : bf16) outs(%e : tensor<1x2x1x4xbf16>) -> tensor<1x2x1x4xbf16>
  %w = tensor.empty() : tensor<1x3xbf16>
  %p = linalg.pooling_nchw_max {dilations = dense<1> : vector<2xi64>, strides = dense<[1, 2]> : vector<2xi64>}
      ins(%x, %w : tensor<1x2x1x9xbf16>, tensor<1x3xbf16>) outs(%i : tensor<1x2x1x4xbf16>) -> tensor<1x2x1x4xbf16>
  return %p : tensor<1x2x1x4xbf16>
}
"""


def test_a_named_pooling_stays_named_with_an_f32_accumulator():
    payload = parse(POOLING)
    apply(payload, lambda root: promote_reductions_to_f32(match(root, "linalg.pooling_nchw_max")))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: %[[INIT:.*]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<1x2x1x4xf32>)
        CHECK: arith.extf %{{.*}} : bf16 to f32
        CHECK: %[[P:.*]] = linalg.pooling_nchw_max {dilations = dense<1> : tensor<2xi64>, strides = dense<[1, 2]> : tensor<2xi64>} ins(%arg0, %{{.*}} : tensor<1x2x1x9xbf16>, tensor<1x3xbf16>) outs(%[[INIT]] : tensor<1x2x1x4xf32>)
        CHECK: %[[R:.*]] = linalg.generic {{.*}} ins(%[[P]] : tensor<1x2x1x4xf32>)
        CHECK: arith.truncf %{{.*}} : f32 to bf16
        CHECK: return %[[R]]
    """)
    x = torch.randn(1, 2, 1, 9).to(torch.bfloat16)
    got = run_module(payload, [x])[0]
    assert torch.equal(got, torch.nn.functional.max_pool2d(x, (1, 3), (1, 2)))
