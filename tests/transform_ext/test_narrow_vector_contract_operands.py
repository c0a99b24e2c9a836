"""narrow_vector_contract_operands: IR (FileCheck), numerics before/after on the CPU and
against torch, rejections (message and unchanged payload)."""

import torch

from schedules.common import match
from transform_ext.narrow_vector_contract_operands import narrow_vector_contract_operands
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module


def payload_text(a="f16", b="f16", b_extended=True, acc="f32", ext="f32", extra_use=False):
    """C = A @ B + C on vectors read from tensors; A (and B when `b_extended`) extended to
    `ext`; with `extra_use` the extended A is also added to a second result."""
    b_type = b if b_extended else ext
    extra = ""
    results, result_types = "%w", "tensor<8x32xACC>"
    if extra_use:
        extra = """
  %ea2 = arith.addf %ea, %ea : vector<8x16xEXT>
  %z = tensor.empty() : tensor<8x16xEXT>
  %w2 = vector.transfer_write %ea2, %z[%i0, %i0] {in_bounds = [true, true]} : vector<8x16xEXT>, tensor<8x16xEXT>"""
        results, result_types = "%w, %w2", "tensor<8x32xACC>, tensor<8x16xEXT>"
    b_ext = (f"%eb = arith.extf %vb : vector<16x32x{b}> to vector<16x32xEXT>" if b_extended
             else "%eb = arith.addf %vb, %vb : vector<16x32xEXT>")
    text = f"""
#a = affine_map<(m, n, k) -> (m, k)>
#b = affine_map<(m, n, k) -> (k, n)>
#c = affine_map<(m, n, k) -> (m, n)>
func.func @main(%a: tensor<8x16x{a}>, %b: tensor<16x32x{b_type}>, %c: tensor<8x32xACC>) -> ({result_types}) {{
  %i0 = arith.constant 0 : index
  %pa = arith.constant 0.0 : {a}
  %pb = arith.constant 0.0 : {b_type}
  %pc = arith.constant 0.0 : ACC
  %va = vector.transfer_read %a[%i0, %i0], %pa {{in_bounds = [true, true]}} : tensor<8x16x{a}>, vector<8x16x{a}>
  %vb = vector.transfer_read %b[%i0, %i0], %pb {{in_bounds = [true, true]}} : tensor<16x32x{b_type}>, vector<16x32x{b_type}>
  %vc = vector.transfer_read %c[%i0, %i0], %pc {{in_bounds = [true, true]}} : tensor<8x32xACC>, vector<8x32xACC>
  %ea = arith.extf %va : vector<8x16x{a}> to vector<8x16xEXT>
  {b_ext}
  %r = vector.contract {{indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction"], kind = #vector.kind<add>}} %ea, %eb, %vc : vector<8x16xEXT>, vector<16x32xEXT> into vector<8x32xACC>
  %e = tensor.empty() : tensor<8x32xACC>
  %w = vector.transfer_write %r, %e[%i0, %i0] {{in_bounds = [true, true]}} : vector<8x32xACC>, tensor<8x32xACC>{extra}
  return {results} : {result_types}
}}
"""
    return text.replace("ACC", acc).replace("EXT", ext)


def _narrow(payload, names="func.func"):
    apply(payload, lambda root: narrow_vector_contract_operands(match(root, names)))


def _inputs(a_dtype, b_dtype):
    torch.manual_seed(0)
    return [torch.randn(8, 16).to(a_dtype), torch.randn(16, 32).to(b_dtype), torch.randn(8, 32)]


def test_both_extended_multiplicands_contract_narrow():
    payload = parse(payload_text())
    _narrow(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: %[[VA:.*]] = vector.transfer_read %arg0{{.*}} vector<8x16xf16>
        CHECK: %[[VB:.*]] = vector.transfer_read %arg1{{.*}} vector<16x32xf16>
        CHECK-NOT: arith.extf
        CHECK: vector.contract {{.*}} %[[VA]], %[[VB]], %{{.*}} : vector<8x16xf16>, vector<16x32xf16> into vector<8x32xf32>
    """)


def test_a_wide_partner_is_truncated_for_the_contract_only():
    payload = parse(payload_text(b_extended=False, extra_use=True))
    _narrow(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: %[[VA:.*]] = vector.transfer_read %arg0{{.*}} vector<8x16xf16>
        CHECK: %[[EA:.*]] = arith.extf %[[VA]] : vector<8x16xf16> to vector<8x16xf32>
        CHECK: %[[EB:.*]] = arith.addf
        CHECK: %[[TB:.*]] = arith.truncf %[[EB]] : vector<16x32xf32> to vector<16x32xf16>
        CHECK: vector.contract {{.*}} %[[VA]], %[[TB]], %{{.*}} : vector<8x16xf16>, vector<16x32xf16> into vector<8x32xf32>
        CHECK: arith.addf %[[EA]], %[[EA]] : vector<8x16xf32>
    """)


def test_f16_same_result_before_after_and_torch():
    text = payload_text()
    a, b, c = _inputs(torch.float16, torch.float16)
    before = run_module(parse(text), [a, b, c.clone()])
    payload = parse(text)
    _narrow(payload)
    after = run_module(payload, [a, b, c.clone()])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[0], a.float() @ b.float() + c)


def test_bf16_same_result_before_after_and_torch():
    text = payload_text(a="bf16", b="bf16")
    a, b, c = _inputs(torch.bfloat16, torch.bfloat16)
    before = run_module(parse(text), [a, b, c.clone()])
    payload = parse(text)
    _narrow(payload)
    after = run_module(payload, [a, b, c.clone()])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[0], a.float() @ b.float() + c)


def test_truncated_partner_rounds_to_f16():
    text = payload_text(b_extended=False)
    a, b, c = _inputs(torch.float16, torch.float32)
    before = run_module(parse(text), [a, b, c.clone()])
    payload = parse(text)
    _narrow(payload)
    after = run_module(payload, [a, b, c.clone()])
    wide = 2 * b
    torch.testing.assert_close(before[0], a.float() @ wide + c)
    torch.testing.assert_close(after[0], a.float() @ wide.half().float() + c)
    assert not torch.equal(after[0], before[0])  # the rounding is real


def _rejected(text, reason):
    payload = parse(text)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: narrow_vector_contract_operands(match(root, "vector.contract")))
    assert "transform_ext.narrow_vector_contract_operands: vector.contract" in message
    assert reason in message, message
    assert str(payload) == before
    _narrow(payload)  # nested in the function instead: left alone, no failure
    assert str(payload) == before


def test_rejects_a_contract_without_extended_multiplicands():
    text = payload_text(a="f32", b="f32").replace(
        "%ea = arith.extf %va : vector<8x16xf32> to vector<8x16xf32>", "%ea = arith.negf %va : vector<8x16xf32>").replace(
        "%eb = arith.extf %vb : vector<16x32xf32> to vector<16x32xf32>", "%eb = arith.negf %vb : vector<16x32xf32>")
    _rejected(text, "neither multiplicand is an arith.extf result")


def test_rejects_f16_times_bf16():
    _rejected(payload_text(a="f16", b="bf16"), "the multiplicands narrow to different types f16 and bf16")


def test_rejects_an_extension_short_of_the_accumulator():
    _rejected(payload_text(acc="f64"), "operand 0 extends to f32, not to the accumulator type f64")
