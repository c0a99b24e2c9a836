"""match_key_loop_ops: the contraction over the keys of an attention without a softmax and
the ops computing its key tiles (K^T, S, its fill, f), not O's fill."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_key_loop_ops import match_key_loop_ops
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

# O = relu(0.5 * Q K^T) V with K^T materialized outside the key loop
RELU_ATTENTION = """
#q = affine_map<(b, i, j, d) -> (b, i, d)>
#kt = affine_map<(b, i, j, d) -> (b, d, j)>
#s = affine_map<(b, i, j, d) -> (b, i, j)>
#id3 = affine_map<(b, i, j) -> (b, i, j)>
#e = affine_map<(b, i, e, j) -> (b, i, j)>
#v = affine_map<(b, i, e, j) -> (b, j, e)>
#o = affine_map<(b, i, e, j) -> (b, i, e)>
func.func @main(%q: tensor<2x4x16xf32>, %k: tensor<2x8x16xf32>, %v: tensor<2x8x6xf32>)
    -> tensor<2x4x6xf32> {
  %zero = arith.constant 0.0 : f32
  %half = arith.constant 0.5 : f32
  %ekt = tensor.empty() : tensor<2x16x8xf32>
  %kt = linalg.transpose ins(%k : tensor<2x8x16xf32>) outs(%ekt : tensor<2x16x8xf32>) permutation = [0, 2, 1]
  %es = tensor.empty() : tensor<2x4x8xf32>
  %fs = linalg.fill ins(%zero : f32) outs(%es : tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %s = linalg.generic {indexing_maps = [#q, #kt, #s], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%q, %kt : tensor<2x4x16xf32>, tensor<2x16x8xf32>) outs(%fs : tensor<2x4x8xf32>) {
  ^bb0(%a: f32, %bb: f32, %acc: f32):
    %0 = arith.mulf %a, %bb : f32
    %1 = arith.addf %acc, %0 : f32
    linalg.yield %1 : f32
  } -> tensor<2x4x8xf32>
  %p = linalg.generic {indexing_maps = [#id3, #id3], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%s : tensor<2x4x8xf32>) outs(%es : tensor<2x4x8xf32>) {
  ^bb0(%x: f32, %o: f32):
    %0 = arith.mulf %x, %half : f32
    %1 = arith.maximumf %0, %zero : f32
    linalg.yield %1 : f32
  } -> tensor<2x4x8xf32>
  %eo = tensor.empty() : tensor<2x4x6xf32>
  %fo = linalg.fill ins(%zero : f32) outs(%eo : tensor<2x4x6xf32>) -> tensor<2x4x6xf32>
  %out = linalg.generic {indexing_maps = [#e, #v, #o], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%p, %v : tensor<2x4x8xf32>, tensor<2x8x6xf32>) outs(%fo : tensor<2x4x6xf32>) {
  ^bb0(%a: f32, %bb: f32, %acc: f32):
    %0 = arith.mulf %a, %bb : f32
    %1 = arith.addf %acc, %0 : f32
    linalg.yield %1 : f32
  } -> tensor<2x4x6xf32>
  return %out : tensor<2x4x6xf32>
}
"""


def _tag(root):
    values, producers = match_key_loop_ops(match(root, "func.func"))
    transform.AnnotateOp(values, "values")
    transform.AnnotateOp(producers, "key_tile")


def test_matches_the_key_contraction_and_its_key_tile_producers():
    payload = parse(RELU_ATTENTION)
    apply(payload, _tag)
    text = str(payload)
    check(text, """
        CHECK: linalg.transpose {{.*}} permutation = [0, 2, 1]  {key_tile}
        CHECK: linalg.fill {key_tile} {{.*}} -> tensor<2x4x8xf32>
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<2x4x8xf32>) attrs =  {key_tile}
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<2x4x8xf32>) attrs =  {key_tile}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.mulf
        CHECK-NEXT: arith.maximumf
        CHECK: linalg.fill {{.*}} -> tensor<2x4x6xf32>{{ ?$}}
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<2x4x6xf32>) attrs =  {values}
    """)
    assert text.count("key_tile}") == 4, "O's fill runs along no key tile"


def test_rejects_a_chain_with_a_row_reduction_between():
    # f reads a max of the scores over the keys: no elementwise map, no key tiles
    softmax_like = RELU_ATTENTION.replace(
        "  %p = linalg.generic", """  %er = tensor.empty() : tensor<2x4xf32>
  %fm = linalg.fill ins(%zero : f32) outs(%er : tensor<2x4xf32>) -> tensor<2x4xf32>
  %m = linalg.generic {indexing_maps = [#id3, affine_map<(b, i, j) -> (b, i)>], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%s : tensor<2x4x8xf32>) outs(%fm : tensor<2x4xf32>) {
  ^bb0(%x: f32, %acc: f32):
    %0 = arith.minimumf %x, %acc : f32
    linalg.yield %0 : f32
  } -> tensor<2x4xf32>
  %sm = linalg.generic {indexing_maps = [#id3, affine_map<(b, i, j) -> (b, i)>, #id3], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%s, %m : tensor<2x4x8xf32>, tensor<2x4xf32>) outs(%es : tensor<2x4x8xf32>) {
  ^bb0(%x: f32, %mn: f32, %o: f32):
    %0 = arith.subf %x, %mn : f32
    linalg.yield %0 : f32
  } -> tensor<2x4x8xf32>
  %p = linalg.generic""").replace("ins(%s : tensor<2x4x8xf32>) outs(%es : tensor<2x4x8xf32>) {\n  ^bb0(%x: f32, %o: f32):",
                                  "ins(%sm : tensor<2x4x8xf32>) outs(%es : tensor<2x4x8xf32>) {\n  ^bb0(%x: f32, %o: f32):")
    payload = parse(softmax_like)
    message = apply_expect_failure(payload, _tag)
    assert "transform_ext.match_key_loop_ops: func.func" in message
    assert "expected one contraction over the keys of an elementwise map of Q K^T, found 0" in message
