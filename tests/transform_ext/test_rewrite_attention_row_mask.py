"""rewrite_attention_row_mask: the masked-row guard read from the row max; IR, numerics
(alone and followed by the online fusion), rejections."""

import torch
from torch_mlir.dialects import transform

from transform_ext.fuse_dependent_reduction_ops import fuse_dependent_reduction_ops
from transform_ext.rewrite_attention_row_mask import rewrite_attention_row_mask
from tests.transform_ext.helpers import (clear_tags, match_id, tag_ops,
                                         apply, apply_expect_failure, check, parse)
from tests.transform_ext.numeric import run_module

GUARDED = """
#id3 = affine_map<(b, i, j) -> (b, i, j)>
#row3 = affine_map<(b, i, j) -> (b, i)>
#pv_p = affine_map<(b, i, d, j) -> (b, i, j)>
#pv_v = affine_map<(b, i, d, j) -> (b, j, d)>
#pv_o = affine_map<(b, i, d, j) -> (b, i, d)>
#id3o = affine_map<(b, i, d) -> (b, i, d)>
#row3o = affine_map<(b, i, d) -> (b, i)>
func.func @main(%s: tensor<2x8x24xf32>, %v: tensor<2x24x4xf32>) -> tensor<2x8x4xf32> {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %ninf64 = arith.constant 0xFFF0000000000000 : f64
  %true = arith.constant true
  %zeros = arith.constant dense<0.0> : tensor<2x8x24xf32>
  %es = tensor.empty() : tensor<2x8x24xf32>
  %em = tensor.empty() : tensor<2x8xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%em : tensor<2x8xf32>) -> tensor<2x8xf32>
  %m = linalg.generic {indexing_maps = [#id3, #row3], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%s : tensor<2x8x24xf32>) outs(%m0 : tensor<2x8xf32>) {
  ^bb0(%a: f32, %c: f32):
    %r = arith.maximumf %a, %c : f32
    linalg.yield %r : f32
  } -> tensor<2x8xf32>
  %e = linalg.generic {indexing_maps = [#id3, #row3, #id3], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%s, %m : tensor<2x8x24xf32>, tensor<2x8xf32>) outs(%es : tensor<2x8x24xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %d = arith.subf %a, %b : f32
    %r = math.exp %d : f32
    linalg.yield %r : f32
  } -> tensor<2x8x24xf32>
  %l0 = linalg.fill ins(%zero : f32) outs(%em : tensor<2x8xf32>) -> tensor<2x8xf32>
  %l = linalg.generic {indexing_maps = [#id3, #row3], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%e : tensor<2x8x24xf32>) outs(%l0 : tensor<2x8xf32>) {
  ^bb0(%a: f32, %c: f32):
    %r = arith.addf %a, %c : f32
    linalg.yield %r : f32
  } -> tensor<2x8xf32>
  %eb = tensor.empty() : tensor<2x8x24xi1>
  %isinf = linalg.generic {indexing_maps = [#id3, #id3], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%s : tensor<2x8x24xf32>) outs(%eb : tensor<2x8x24xi1>) {
  ^bb0(%a: f32, %c: i1):
    %w = arith.extf %a : f32 to f64
    %r = arith.cmpf oeq, %w, %ninf64 : f64
    linalg.yield %r : i1
  } -> tensor<2x8x24xi1>
  %ebr = tensor.empty() : tensor<2x8xi1>
  %all0 = linalg.fill ins(%true : i1) outs(%ebr : tensor<2x8xi1>) -> tensor<2x8xi1>
  %rows = linalg.generic {indexing_maps = [#id3, #row3], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%isinf : tensor<2x8x24xi1>) outs(%all0 : tensor<2x8xi1>) {
  ^bb0(%a: i1, %c: i1):
    %r = arith.andi %a, %c : i1
    linalg.yield %r : i1
  } -> tensor<2x8xi1>
  %p = linalg.generic {indexing_maps = [#row3, #id3, #id3, #id3], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%rows, %zeros, %e : tensor<2x8xi1>, tensor<2x8x24xf32>, tensor<2x8x24xf32>) outs(%es : tensor<2x8x24xf32>) {
  ^bb0(%r: i1, %z: f32, %a: f32, %c: f32):
    %x = arith.select %r, %z, %a : f32
    linalg.yield %x : f32
  } -> tensor<2x8x24xf32>
  %eo = tensor.empty() : tensor<2x8x4xf32>
  %o0 = linalg.fill ins(%zero : f32) outs(%eo : tensor<2x8x4xf32>) -> tensor<2x8x4xf32>
  %o = linalg.generic {indexing_maps = [#pv_p, #pv_v, #pv_o], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%p, %v : tensor<2x8x24xf32>, tensor<2x24x4xf32>) outs(%o0 : tensor<2x8x4xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %x = arith.mulf %a, %b : f32
    %r = arith.addf %c, %x : f32
    linalg.yield %r : f32
  } -> tensor<2x8x4xf32>
  %out = linalg.generic {indexing_maps = [#id3o, #row3o, #id3o], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%o, %l : tensor<2x8x4xf32>, tensor<2x8xf32>) outs(%eo : tensor<2x8x4xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %d = arith.divf %a, %b : f32
    linalg.yield %d : f32
  } -> tensor<2x8x4xf32>
  return %out : tensor<2x8x4xf32>
}
"""
# generics: 0 m, 1 e, 2 l, 3 isinf, 4 rows, 5 p, 6 o, 7 out


def _generics(payload):
    func = next(op for op in payload.body.operations if op.operation.name == "func.func")
    return [op.operation for op in func.regions[0].blocks[0].operations
            if op.operation.name == "linalg.generic"]


def _inputs():
    torch.manual_seed(3)
    s = torch.randn(2, 8, 24) * 4
    s[0, 2, :] = float("-inf")        # fully masked row
    s[1, 4, :15] = float("-inf")      # masked prefix
    v = torch.randn(2, 24, 4)
    return s, v


def _reference(s, v):
    p = torch.softmax(s, -1)
    p = torch.where(torch.isinf(s).all(-1, keepdim=True), 0.0, p)
    return p @ v


def _rewrite(payload, then_fuse=None):
    g = _generics(payload)
    with payload.context:
        tag_ops([g[0], g[6], g[2]])

    def body(root):
        rewrite_attention_row_mask(match_id(root, 0), match_id(root, 1))
        if then_fuse:
            cons = transform.merge_handles([match_id(root, 2), match_id(root, 1)])
            fuse_dependent_reduction_ops(match_id(root, 0), cons, then_fuse)

    apply(payload, body)
    clear_tags(payload)


def test_guard_reads_the_max_and_moves_after_the_normalization():
    payload = parse(GUARDED)
    _rewrite(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-NOT:   arith.andi
        CHECK:       %[[M:.*]] = linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "reduction"]
        CHECK:         arith.maximumf
        CHECK:       %[[E:.*]] = linalg.generic
        CHECK:         math.exp
        CHECK:       %[[O:.*]] = linalg.generic {{.*}} ins(%[[E]], %{{.*}} : tensor<2x8x24xf32>, tensor<2x24x4xf32>)
        CHECK:       %[[N:.*]] = linalg.generic {{.*}} ins(%[[O]], %{{.*}} : tensor<2x8x4xf32>, tensor<2x8xf32>)
        CHECK:         arith.divf
        CHECK:       linalg.generic {{.*}} ins(%[[N]], %[[M]] : tensor<2x8x4xf32>, tensor<2x8xf32>)
        CHECK:         %[[IS:.*]] = arith.cmpf oeq, %{{.*}}, %{{.*}} : f32
        CHECK:         arith.select %[[IS]], %{{.*}}, %{{.*}} : f32
        CHECK-NOT:   arith.andi
    """)
    out = run_module(payload, list(_inputs()))[0]
    torch.testing.assert_close(out, _reference(*_inputs()), rtol=1e-5, atol=1e-6)
    assert torch.equal(out[0, 2], torch.zeros(4))


def test_then_fused_into_one_key_loop_without_nan():
    payload = parse(GUARDED)
    _rewrite(payload, then_fuse=8)
    text = str(payload)
    assert text.count("scf.for") == 1 and "arith.andi" not in text
    out = run_module(payload, list(_inputs()))[0]
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, _reference(*_inputs()), rtol=1e-5, atol=1e-6)


def test_rejects_a_guard_that_is_not_all_minus_inf():
    payload = parse(GUARDED.replace("%r = arith.cmpf oeq, %w, %ninf64 : f64",
                                    "%r = arith.cmpf ogt, %w, %ninf64 : f64"))
    before = str(payload)
    g = _generics(payload)
    with payload.context:
        tag_ops([g[0], g[6]])
    message = apply_expect_failure(
        payload, lambda root: rewrite_attention_row_mask(match_id(root, 0), match_id(root, 1)))
    assert "transform_ext.rewrite_attention_row_mask: linalg.generic" in message
    assert "neither all(s == -inf)" in message
    with payload.context:
        clear_tags(payload)
    assert str(payload) == before


def test_rejects_a_contraction_without_a_guard():
    payload = parse(GUARDED)
    g = _generics(payload)
    with payload.context:
        tag_ops([g[0], g[2]])   # the row sum is no contraction fed by a select
    message = apply_expect_failure(
        payload, lambda root: rewrite_attention_row_mask(match_id(root, 0), match_id(root, 1)))
    assert "no select(rows, 0, P) feeds the contraction" in message
