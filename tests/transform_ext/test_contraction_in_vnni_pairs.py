"""contraction_in_vnni_pairs: the IR (FileCheck) of a bf16 contraction reading a transpose
made for it, rewritten to read A's rows in pairs in place and X's pairs transposed; the
transpose kept when another op reads it; the same sums as before (the rewritten payload
run against torch); and the targets it refuses with their reasons (f32 factors, an odd
depth, a B that is no transpose, A with k outermost)."""

import pytest
import torch
from torch_mlir import ir

from schedules.common import match
from transform_ext.contraction_in_vnni_pairs import contraction_in_vnni_pairs
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# S^T[c, r] = sum_d W[c, d] X^T[d, r], X^T = transpose(X): the linear cross-entropy's logits
# tile, classes-major, with W's rows and X's rows in place. `extra` may read X^T too.
KERNEL = """
#xt = affine_map<(r, c, d) -> (d, r)>
#w = affine_map<(r, c, d) -> (c, d)>
#s = affine_map<(r, c, d) -> (c, r)>
func.func @main(%X: tensor<{r}x{d}x{t}>, %W: tensor<{c}x{d}x{t}>) -> ({results}) attributes {{llvm.emit_c_interface}} {{
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{d}x{r}x{t}>
  %xt = linalg.transpose ins(%X : tensor<{r}x{d}x{t}>) outs(%e : tensor<{d}x{r}x{t}>) permutation = [1, 0]
  %es = tensor.empty() : tensor<{c}x{r}xf32>
  %init = linalg.fill ins(%zero : f32) outs(%es : tensor<{c}x{r}xf32>) -> tensor<{c}x{r}xf32>
  %s = linalg.generic {{indexing_maps = [{xt_map}, #w, #s], iterator_types = ["parallel", "parallel", "reduction"]}}
      ins(%xt, %W : tensor<{d}x{r}x{t}>, tensor<{c}x{d}x{t}>) outs(%init : tensor<{c}x{r}xf32>) attrs = {{lh.mark}} {{
  ^bb0(%x: {t}, %w: {t}, %acc: f32):
    {widen}
    %p = arith.mulf %xe, %we : f32
    %sum = arith.addf %acc, %p : f32
    linalg.yield %sum : f32
  }} -> tensor<{c}x{r}xf32>
  return {returned}
}}
"""


def kernel(r=32, c=64, d=64, dtype="bf16", xt_map="#xt", return_xt=False) -> str:
    widen = ("%xe = arith.extf %x : bf16 to f32\n    %we = arith.extf %w : bf16 to f32"
             if dtype == "bf16" else "%xe = arith.addf %x, %x : f32\n    %we = arith.addf %w, %w : f32")
    results = f"tensor<{c}x{r}xf32>" + (f", tensor<{d}x{r}x{dtype}>" if return_xt else "")
    returned = f"%s, %xt : {results}" if return_xt else f"%s : {results}"
    return KERNEL.format(r=r, c=c, d=d, t=dtype, widen=widen, xt_map=xt_map, results=results,
                         returned=returned)


def paired(text: str) -> ir.Module:
    payload = parse(text)
    apply(payload, lambda root: contraction_in_vnni_pairs(match(root, "linalg.generic")))
    return payload


def test_factors_are_read_in_pairs():
    check(str(paired(kernel())), """
        CHECK-DAG: #[[A:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>
        CHECK-DAG: #[[B:.*]] = affine_map<(d0, d1, d2, d3) -> (d2, d1, d3)>
        CHECK-DAG: #[[C:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d1)>
        CHECK: func.func @main(%[[X:.*]]: tensor<32x64xbf16>, %[[W:.*]]: tensor<64x64xbf16>)
        CHECK: %[[X2:.*]] = tensor.expand_shape %[[X]] {{\\[}}[0], [1, 2]] output_shape [32, 32, 2] : tensor<32x64xbf16> into tensor<32x32x2xbf16>
        CHECK: %[[XP:.*]] = linalg.transpose ins(%[[X2]] : tensor<32x32x2xbf16>) outs(%{{.*}} : tensor<32x32x2xbf16>) permutation = [1, 0, 2]
        CHECK-NOT: permutation = [1, 0]{{$}}
        CHECK: %[[W2:.*]] = tensor.expand_shape %[[W]] {{\\[}}[0], [1, 2]] output_shape [64, 32, 2]
        CHECK: linalg.generic {indexing_maps = [#[[B]], #[[A]], #[[C]]], iterator_types = ["parallel", "parallel", "reduction", "reduction"]}
        CHECK-SAME: ins(%[[XP]], %[[W2]] : tensor<32x32x2xbf16>, tensor<64x32x2xbf16>)
        CHECK-SAME: lh.mark
        CHECK: arith.extf
        CHECK: arith.extf
        CHECK: arith.mulf
        CHECK: arith.addf
    """)


def test_a_transpose_read_elsewhere_stays():
    check(str(paired(kernel(return_xt=True))), """
        CHECK: linalg.transpose {{.*}} permutation = [1, 0, 2]
        CHECK: %[[XT:.*]] = linalg.transpose {{.*}} permutation = [1, 0]
        CHECK: return %{{.*}}, %[[XT]]
    """)


@pytest.mark.parametrize("text, reason", [
    (kernel(dtype="f32"), "not bf16 factors into an f32 accumulator"),
    (kernel(d=33), "its depth 33 is odd: no pairs"),
    (kernel(xt_map="affine_map<(r, c, d) -> (d, r)>").replace(
        "ins(%xt, %W", "ins(%e, %W"), "its B is not a transpose of X[n, k]"),
], ids=["f32", "odd_depth", "no_transpose"])
def test_refused_targets_name_the_reason(text, reason):
    payload = parse(text)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: contraction_in_vnni_pairs(match(root, "linalg.generic")))
    assert reason in message
    assert str(payload) == before


def test_a_factor_with_k_outermost_is_refused():
    """W read as W[d, c] (a column of W per class): no rows of pairs in place."""
    text = kernel(c=64, d=64).replace("#w = affine_map<(r, c, d) -> (c, d)>",
                                      "#w = affine_map<(r, c, d) -> (d, c)>")
    message = apply_expect_failure(
        parse(text), lambda root: contraction_in_vnni_pairs(match(root, "linalg.generic")))
    assert "its factors are not A[m, k] (k innermost) and B[k, n]" in message


def test_paired_sums_match_torch():
    """The rewritten payload under the generic CPU schedule, against
    torch's bf16 product accumulated in f32."""
    r, c, d = 32, 64, 96
    module = paired(kernel(r=r, c=c, d=d))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(r, d, generator=g).to(torch.bfloat16)
    w = torch.randn(c, d, generator=g).to(torch.bfloat16)
    (s,) = run_module(module, [x, w], cleanup=False)
    torch.testing.assert_close(s, w.float() @ x.float().t(), rtol=1e-5, atol=1e-5)
