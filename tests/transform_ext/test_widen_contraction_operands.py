"""widen_contraction_operands: IR (FileCheck) for f16 and bf16, the returned handles,
numerics before/after on the CPU, an f32 contraction left alone, rejections."""

import pytest
import torch
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.widen_contraction_operands import widen_contraction_operands
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

MATMUL = """
func.func @main(%a: tensor<6x20x{t}>, %b: tensor<20x9x{u}>) -> tensor<6x9xf32> {{
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<6x9xf32>
  %c = linalg.fill ins(%zero : f32) outs(%e : tensor<6x9xf32>) -> tensor<6x9xf32>
  %r = linalg.matmul ins(%a, %b : tensor<6x20x{t}>, tensor<20x9x{u}>) outs(%c : tensor<6x9xf32>) -> tensor<6x9xf32>
  return %r : tensor<6x9xf32>
}}
"""


def _widen_and_tag(root):
    contraction, lhs, rhs = widen_contraction_operands(match(root, "linalg.matmul"))
    transform.AnnotateOp(contraction, "contraction")
    transform.AnnotateOp(lhs, "lhs")
    transform.AnnotateOp(rhs, "rhs")


def test_f16_operands_are_extended_and_the_contraction_rebuilt_on_f32():
    payload = parse(MATMUL.format(t="f16", u="f16"))
    apply(payload, _widen_and_tag)
    payload.operation.verify()
    check(payload, """
        CHECK: %[[A:.*]] = linalg.generic {{.*}} ins(%arg0 : tensor<6x20xf16>) outs(%{{.*}} : tensor<6x20xf32>) attrs =  {lhs}
        CHECK-NEXT: ^bb0(%[[X:[a-z0-9_]+]]: f16, %{{.*}}: f32):
        CHECK-NEXT: %[[W:.*]] = arith.extf %[[X]] : f16 to f32
        CHECK-NEXT: linalg.yield %[[W]] : f32
        CHECK: %[[B:.*]] = linalg.generic {{.*}} ins(%arg1 : tensor<20x9xf16>) outs(%{{.*}} : tensor<20x9xf32>) attrs =  {rhs}
        CHECK: linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "reduction"]} ins(%[[A]], %[[B]] : tensor<6x20xf32>, tensor<20x9xf32>) outs(%{{.*}} : tensor<6x9xf32>) attrs =  {contraction}
        CHECK-NEXT: ^bb0(%[[P:[a-z0-9_]+]]: f32, %[[Q:[a-z0-9_]+]]: f32, %[[ACC:[a-z0-9_]+]]: f32):
        CHECK-NEXT: %[[M:.*]] = arith.mulf %[[P]], %[[Q]] : f32
        CHECK-NEXT: %[[S:.*]] = arith.addf %[[ACC]], %[[M]] : f32
        CHECK-NEXT: linalg.yield %[[S]] : f32
        CHECK-NOT: linalg.matmul
    """)


def test_bf16_is_extended_by_a_shift_and_an_f32_operand_is_read_as_it_is():
    payload = parse(MATMUL.format(t="f32", u="bf16"))
    apply(payload, _widen_and_tag)
    check(payload, """
        CHECK: linalg.generic {{.*}} ins(%arg1 : tensor<20x9xbf16>) outs(%{{.*}} : tensor<20x9xf32>) attrs =  {rhs}
        CHECK: arith.bitcast %{{.*}} : bf16 to i16
        CHECK-NEXT: arith.extui %{{.*}} : i16 to i32
        CHECK-NEXT: arith.constant 16 : i32
        CHECK-NEXT: arith.shli
        CHECK-NEXT: arith.bitcast %{{.*}} : i32 to f32
        CHECK: linalg.generic {{.*}} ins(%arg0, %{{.*}} : tensor<6x20xf32>, tensor<20x9xf32>) {{.*}} attrs =  {contraction}
    """)
    assert "lhs" not in str(payload)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_same_result_before_and_after(dtype):
    name = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    text = MATMUL.format(t=name, u=name)
    a, b = torch.randn(6, 20).to(dtype), torch.randn(20, 9).to(dtype)
    before = run_module(parse(text), [a, b])
    payload = parse(text)
    apply(payload, lambda root: widen_contraction_operands(match(root, "linalg.matmul")))
    after = run_module(payload, [a, b])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[0], a.float() @ b.float(), rtol=1e-5, atol=1e-5)


def test_an_f32_contraction_is_left_alone():
    payload = parse(MATMUL.format(t="f32", u="f32"))
    apply(payload, _widen_and_tag)
    check(payload, """
        CHECK-NOT: linalg.generic
        CHECK: linalg.matmul {contraction}
    """)


def test_rejects_what_is_not_a_contraction_and_an_integer_accumulator():
    payload = parse(MATMUL.format(t="f16", u="f16"))
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: widen_contraction_operands(match(root, "linalg.fill")))
    assert "transform_ext.widen_contraction_operands: linalg.fill" in message
    assert "does not have two inputs and one output" in message
    assert str(payload) == before
    payload = parse("""
        func.func @main(%a: tensor<6x20xi8>, %b: tensor<20x9xi8>, %c: tensor<6x9xi32>) -> tensor<6x9xi32> {
          %r = linalg.matmul ins(%a, %b : tensor<6x20xi8>, tensor<20x9xi8>) outs(%c : tensor<6x9xi32>) -> tensor<6x9xi32>
          return %r : tensor<6x9xi32>
        }
    """)
    message = apply_expect_failure(payload, lambda root: widen_contraction_operands(match(root, "linalg.matmul")))
    assert "transform_ext.widen_contraction_operands: linalg.matmul" in message
    assert "has element type i8 (wants f32, f16 or bf16)" in message
