"""sink_normalization_past_contraction: IR (FileCheck), numerics before/after on the CPU and
against torch, rejections (message and unchanged payload), and SDPA's masked P @ V."""

import torch
import torch.nn.functional as F

import transform_ext
from lighthouse.ingress import import_forward
from schedules.common import canonicalize, match, run_passes
from transform_ext.drop_unused_results import drop_unused_results
from transform_ext.filter_ops import filter_contractions
from transform_ext.fold_reshape_ops_by_expansion import fold_reshape_ops_by_expansion
from transform_ext.fold_scalar_or_splat_constant import fold_scalar_or_splat_constant
from transform_ext.sink_normalization_past_contraction import sink_normalization_past_contraction
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

HEAD = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
"""

# P = x / s (s per row) in its own generic, then P @ v.
DIVIDE = HEAD + """
func.func @main(%x: tensor<4x8xf32>, %s: tensor<4xf32>, %v: tensor<8x5xf32>) -> tensor<4x5xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4x8xf32>
  %p = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %s : tensor<4x8xf32>, tensor<4xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%a: f32, %b: f32, %out: f32):
    %0 = arith.divf %a, %b : f32
    linalg.yield %0 : f32
  } -> tensor<4x8xf32>
  %oe = tensor.empty() : tensor<4x5xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<4x5xf32>) -> tensor<4x5xf32>
  %r = linalg.matmul ins(%p, %v : tensor<4x8xf32>, tensor<8x5xf32>) outs(%acc : tensor<4x5xf32>) -> tensor<4x5xf32>
  return %r : tensor<4x5xf32>
}
"""

# SDPA's guard: P = select(mask, 0, x / s) with the mask computed from a per-row flag in a
# select generic of its own (the i8-stored-bool form after cleanup).
MASKED = HEAD + """
func.func @main(%x: tensor<4x8xf32>, %s: tensor<4xf32>, %flag: tensor<4xf32>, %v: tensor<8x5xf32>) -> tensor<4x5xf32> {
  %zero = arith.constant 0.0 : f32
  %zeros = arith.constant dense<0.0> : tensor<4x8xf32>
  %e = tensor.empty() : tensor<4x8xf32>
  %p = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %s : tensor<4x8xf32>, tensor<4xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%a: f32, %b: f32, %out: f32):
    %0 = arith.divf %a, %b : f32
    linalg.yield %0 : f32
  } -> tensor<4x8xf32>
  %pm = linalg.generic {indexing_maps = [#row, #id, #id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%flag, %zeros, %p : tensor<4xf32>, tensor<4x8xf32>, tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%f: f32, %z: f32, %a: f32, %out: f32):
    %m = arith.cmpf ogt, %f, %zero : f32
    %0 = arith.select %m, %z, %a : f32
    linalg.yield %0 : f32
  } -> tensor<4x8xf32>
  %oe = tensor.empty() : tensor<4x5xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<4x5xf32>) -> tensor<4x5xf32>
  %r = linalg.matmul ins(%pm, %v : tensor<4x8xf32>, tensor<8x5xf32>) outs(%acc : tensor<4x5xf32>) -> tensor<4x5xf32>
  return %r : tensor<4x5xf32>
}
"""

# The normalization inside the contraction's own body: acc + select(m, 0, x / s) * v.
IN_BODY = """
#x = affine_map<(d0, d1, d2) -> (d0, d2)>
#s = affine_map<(d0, d1, d2) -> (d0)>
#v = affine_map<(d0, d1, d2) -> (d2, d1)>
#o = affine_map<(d0, d1, d2) -> (d0, d1)>
func.func @main(%x: tensor<4x8xf32>, %s: tensor<4xf32>, %flag: tensor<4xf32>, %v: tensor<8x5xf32>) -> tensor<4x5xf32> {
  %zero = arith.constant 0.0 : f32
  %oe = tensor.empty() : tensor<4x5xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<4x5xf32>) -> tensor<4x5xf32>
  %r = linalg.generic {indexing_maps = [#x, #s, #s, #v, #o], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%x, %s, %flag, %v : tensor<4x8xf32>, tensor<4xf32>, tensor<4xf32>, tensor<8x5xf32>) outs(%acc : tensor<4x5xf32>) {
  ^bb0(%a: f32, %b: f32, %f: f32, %w: f32, %out: f32):
    %m = arith.cmpf ogt, %f, %zero : f32
    %0 = arith.divf %a, %b : f32
    %1 = arith.select %m, %zero, %0 : f32
    %2 = arith.mulf %1, %w : f32
    %3 = arith.addf %out, %2 : f32
    linalg.yield %3 : f32
  } -> tensor<4x5xf32>
  return %r : tensor<4x5xf32>
}
"""

# Both operands of a batch matmul scaled by a constant (SDPA's sqrt(scale) on q and k).
SCALED = """
#id = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
func.func @main(%q: tensor<2x4x8xf32>, %k: tensor<2x8x5xf32>) -> tensor<2x4x5xf32> {
  %zero = arith.constant 0.0 : f32
  %c = arith.constant 0.5 : f32
  %qe = tensor.empty() : tensor<2x4x8xf32>
  %qs = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%q : tensor<2x4x8xf32>) outs(%qe : tensor<2x4x8xf32>) {
  ^bb0(%a: f32, %out: f32):
    %0 = arith.mulf %a, %c : f32
    linalg.yield %0 : f32
  } -> tensor<2x4x8xf32>
  %ke = tensor.empty() : tensor<2x8x5xf32>
  %ks = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%k : tensor<2x8x5xf32>) outs(%ke : tensor<2x8x5xf32>) {
  ^bb0(%a: f32, %out: f32):
    %0 = arith.mulf %c, %a : f32
    linalg.yield %0 : f32
  } -> tensor<2x8x5xf32>
  %oe = tensor.empty() : tensor<2x4x5xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<2x4x5xf32>) -> tensor<2x4x5xf32>
  %r = linalg.batch_matmul ins(%qs, %ks : tensor<2x4x8xf32>, tensor<2x8x5xf32>) outs(%acc : tensor<2x4x5xf32>) -> tensor<2x4x5xf32>
  return %r : tensor<2x4x5xf32>
}
"""


def _sink(payload, names):
    def body(root):
        sink_normalization_past_contraction(match(root, names))
        canonicalize(match(root, "func.func"))

    apply(payload, body)


def _inputs(masked: bool):
    torch.manual_seed(0)
    x = torch.rand(4, 8) + 0.1
    s = x.sum(dim=1)
    v = torch.randn(8, 5)
    if not masked:
        return [x, s, v]
    flag = torch.tensor([0.0, 1.0, 0.0, 1.0])
    s[1] = 0.0            # a masked row whose normalizer is 0: x / 0 must not leak
    s[3] = float("nan")   # and one whose normalizer is NaN (SDPA's fully masked rows)
    return [x, s, flag, v]


def _same_before_and_after(text, names, args, expected):
    before = run_module(parse(text), args)
    payload = parse(text)
    _sink(payload, names)
    after = run_module(payload, args)
    torch.testing.assert_close(after[0], before[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after[0], expected, rtol=1e-5, atol=1e-6)


def test_divide_generic_moves_after_the_matmul():
    payload = parse(DIVIDE)
    _sink(payload, "linalg.matmul")
    check(payload, """
        CHECK-DAG: #[[ID:.*]] = affine_map<(d0, d1) -> (d0, d1)>
        CHECK-DAG: #[[ROW:.*]] = affine_map<(d0, d1) -> (d0)>
        CHECK-LABEL: func.func @main
        CHECK-SAME: (%[[X:.*]]: tensor<4x8xf32>, %[[S:.*]]: tensor<4xf32>, %[[V:.*]]: tensor<8x5xf32>)
        CHECK-NOT: arith.divf
        CHECK: %[[MM:.*]] = linalg.matmul ins(%[[X]], %[[V]] : tensor<4x8xf32>, tensor<8x5xf32>)
        CHECK: %[[N:.*]] = linalg.generic {indexing_maps = [#[[ID]], #[[ROW]], #[[ID]]], iterator_types = ["parallel", "parallel"]}
        CHECK-SAME: ins(%[[MM]], %[[S]] : tensor<4x5xf32>, tensor<4xf32>)
        CHECK-NEXT: ^bb0(%[[C:.*]]: f32, %[[D:.*]]: f32, %{{.*}}: f32):
        CHECK-NEXT: %[[Q:.*]] = arith.divf %[[C]], %[[D]] : f32
        CHECK-NEXT: linalg.yield %[[Q]]
        CHECK: return %[[N]]
    """)


def test_divide_same_result_before_after_and_torch():
    x, s, v = _inputs(masked=False)
    _same_before_and_after(DIVIDE, "linalg.matmul", [x, s, v], (x / s[:, None]) @ v)


def test_masked_select_chain_keeps_the_select_and_masks_the_result():
    payload = parse(MASKED)
    _sink(payload, "linalg.matmul")
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-SAME: (%[[X:.*]]: tensor<4x8xf32>, %[[S:.*]]: tensor<4xf32>, %[[FLAG:.*]]: tensor<4xf32>, %[[V:.*]]: tensor<8x5xf32>)
        CHECK: %[[PM:.*]] = linalg.generic
        CHECK-SAME: ins(%[[FLAG]], %{{.*}}, %[[X]] :
        CHECK: arith.select
        CHECK: %[[MM:.*]] = linalg.matmul ins(%[[PM]], %[[V]]
        CHECK: linalg.generic
        CHECK-SAME: ins(%[[MM]], %[[S]], %[[FLAG]] : tensor<4x5xf32>, tensor<4xf32>, tensor<4xf32>)
        CHECK-DAG: %[[M:.*]] = arith.cmpf ogt
        CHECK-DAG: %[[Q:.*]] = arith.divf
        CHECK: arith.select %[[M]], %{{.*}}, %[[Q]] : f32
        CHECK-NOT: arith.divf
    """)


def test_masked_rows_with_zero_or_nan_normalizer_stay_zero():
    x, s, flag, v = _inputs(masked=True)
    p = torch.where(flag[:, None] > 0, torch.zeros(()), x / s[:, None])
    expected = p @ v
    assert torch.isfinite(expected).all()
    _same_before_and_after(MASKED, "linalg.matmul", [x, s, flag, v], expected)


def test_normalization_in_the_contraction_body():
    payload = parse(IN_BODY)
    _sink(payload, "linalg.generic")
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-SAME: (%[[X:.*]]: tensor<4x8xf32>, %[[S:.*]]: tensor<4xf32>, %[[FLAG:.*]]: tensor<4xf32>, %[[V:.*]]: tensor<8x5xf32>)
        CHECK: %[[C:.*]] = linalg.generic
        CHECK-SAME: iterator_types = ["parallel", "parallel", "reduction"]
        CHECK-SAME: ins(%[[X]], %[[FLAG]], %[[V]] :
        CHECK-NOT: arith.divf
        CHECK: arith.select
        CHECK: arith.mulf
        CHECK: arith.addf
        CHECK: linalg.generic
        CHECK-SAME: ins(%[[C]], %[[S]], %[[FLAG]] :
        CHECK: arith.divf
        CHECK: arith.select
    """)


def test_normalization_in_the_body_same_result():
    x, s, flag, v = _inputs(masked=True)
    p = torch.where(flag[:, None] > 0, torch.zeros(()), x / s[:, None])
    _same_before_and_after(IN_BODY, "linalg.generic", [x, s, flag, v], p @ v)


def test_both_scaled_operands_of_a_batch_matmul():
    payload = parse(SCALED)
    _sink(payload, "linalg.batch_matmul")
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-SAME: (%[[Q:.*]]: tensor<2x4x8xf32>, %[[K:.*]]: tensor<2x8x5xf32>)
        CHECK-DAG: %[[C:.*]] = arith.constant 5.000000e-01 : f32
        CHECK: %[[MM:.*]] = linalg.batch_matmul ins(%[[Q]], %[[K]] :
        CHECK: linalg.generic
        CHECK-SAME: ins(%[[MM]] : tensor<2x4x5xf32>)
        CHECK-NEXT: ^bb0(%[[IN:.*]]: f32, %{{.*}}: f32):
        CHECK-NEXT: %[[A:.*]] = arith.mulf %[[IN]], %[[C]] : f32
        CHECK-NEXT: %[[B:.*]] = arith.mulf %[[A]], %[[C]] : f32
        CHECK-NEXT: linalg.yield %[[B]]
    """)
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 8), torch.randn(2, 8, 5)
    _same_before_and_after(SCALED, "linalg.batch_matmul", [q, k], (q * 0.5) @ (k * 0.5))


def _rejected(text, names, reason):
    payload = parse(text)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: sink_normalization_past_contraction(match(root, names)))
    assert "transform_ext.sink_normalization_past_contraction: " + names.split(",")[0] in message
    assert reason in message, message
    assert str(payload) == before


def test_rejects_a_divisor_that_varies_along_k():
    text = DIVIDE.replace("#row, #id], iterator_types", "#id, #id], iterator_types").replace(
        "%s : tensor<4x8xf32>, tensor<4xf32>", "%s : tensor<4x8xf32>, tensor<4x8xf32>").replace(
        "%s: tensor<4xf32>", "%s: tensor<4x8xf32>")
    _rejected(text, "linalg.matmul", "the divisor varies along the reduction dim d2")


def test_rejects_a_mask_that_varies_along_k():
    text = MASKED.replace("#row, #id, #id, #id]", "#id, #id, #id, #id]").replace(
        "ins(%flag, %zeros, %p : tensor<4xf32>", "ins(%flag, %zeros, %p : tensor<4x8xf32>").replace(
        "%flag: tensor<4xf32>", "%flag: tensor<4x8xf32>")
    _rejected(text, "linalg.matmul", "the select mask varies along the reduction dim d2")


def test_rejects_a_non_zero_select_fill():
    text = MASKED.replace("dense<0.0> : tensor<4x8xf32>", "dense<1.0> : tensor<4x8xf32>")
    _rejected(text, "linalg.matmul", "the select's other branch is not a constant zero")


def test_rejects_a_non_zero_init():
    text = DIVIDE.replace("%zero = arith.constant 0.0 : f32", "%zero = arith.constant 1.0 : f32")
    _rejected(text, "linalg.matmul", "its init is not a constant zero")


def test_rejects_composite_maps():
    _rejected("""
        func.func @main(%x: tensor<1x10x2xf32>, %w: tensor<3x2x4xf32>) -> tensor<1x8x4xf32> {
          %zero = arith.constant 0.0 : f32
          %e = tensor.empty() : tensor<1x8x4xf32>
          %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<1x8x4xf32>) -> tensor<1x8x4xf32>
          %r = linalg.conv_1d_nwc_wcf {dilations = dense<1> : tensor<1xi64>, strides = dense<1> : tensor<1xi64>}
              ins(%x, %w : tensor<1x10x2xf32>, tensor<3x2x4xf32>) outs(%acc : tensor<1x8x4xf32>) -> tensor<1x8x4xf32>
          return %r : tensor<1x8x4xf32>
        }
    """, "linalg.conv_1d_nwc_wcf", "composite indexing map")


def test_rejects_a_named_op_that_is_not_a_sum_of_products():
    _rejected("""
        func.func @main(%x: tensor<4x8xf32>) -> tensor<4xf32> {
          %zero = arith.constant 0.0 : f32
          %e = tensor.empty() : tensor<4xf32>
          %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<4xf32>) -> tensor<4xf32>
          %r = linalg.reduce { arith.maximumf } ins(%x : tensor<4x8xf32>) outs(%acc : tensor<4xf32>) dimensions = [1]
          return %r : tensor<4xf32>
        }
    """, "linalg.reduce", "the named op's body is not a sum of products acc + u * v")


def test_rejects_a_contraction_with_no_normalized_factor():
    _rejected(SCALED.replace("%0 = arith.mulf %a, %c : f32", "%0 = math.exp %a : f32").replace(
        "%0 = arith.mulf %c, %a : f32", "%0 = math.sqrt %a : f32"),
        "linalg.batch_matmul", "no factor is normalized")


class _MaskedAttention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_sdpa_with_a_fully_masked_row():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    mask = torch.rand(1, 2, 8, 8) > 0.3
    mask[0, 1, 5, :] = False  # a fully masked query row: torch returns zeros there
    imported = import_forward(_MaskedAttention(), (q, k, v, mask), name="masked sdpa")
    payload = imported.module
    transform_ext.load(payload.context)

    def body(root):
        func = match(root, "func.func")
        func = fold_scalar_or_splat_constant(func)
        func = drop_unused_results(func)
        func = fold_reshape_ops_by_expansion(func)
        canonicalize(func)

    apply(payload, body)
    run_passes(payload, "linalg-fold-unit-extent-dims, canonicalize, cse")
    apply(payload, lambda root: sink_normalization_past_contraction(
        filter_contractions(match(root, "linalg.generic"))))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "reduction"]{{.*}}tensor<2x8x8xf32>, tensor<2x8x4xf32>
        CHECK: arith.mulf
        CHECK-NEXT: arith.addf
        CHECK: linalg.generic
        CHECK-SAME: iterator_types = ["parallel", "parallel", "parallel"]
        CHECK: arith.divf
        CHECK: arith.select
        CHECK: tensor.expand_shape
        CHECK-NEXT: return
    """)
    got = run_module(payload, list(imported.args))[0]
    want = imported.reference()[0]
    assert torch.equal(want[0, 1, 5], torch.zeros(4))
    torch.testing.assert_close(got, want)
