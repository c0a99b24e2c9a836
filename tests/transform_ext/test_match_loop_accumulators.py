"""match_loop_accumulators: a workgroup forall's loop split into the accumulations it carries
(dh += G W_c, with its fill before the loop and its cast after it) and the tiles it computes
afresh (S = h W_c^T); a target without one loop, or an accumulator not started by a fill,
is refused with the reason. The tiling of what it matches runs on real payloads in
tests/lighthouse/test_xegpu_linear_cross_entropy.py (the passes in D slices, numerics on
the CPU)."""

from torch_mlir.dialects import transform

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from transform_ext.match_loop_accumulators import match_loop_accumulators

# a pass of the two-pass backward: S = h_s W_c^T, G = exp(S), dh += G W_c; dh cast to bf16
PASS = """
#a = affine_map<(m, n, k) -> (m, k)>
#b = affine_map<(m, n, k) -> (n, k)>
#bt = affine_map<(m, n, k) -> (k, n)>
#c = affine_map<(m, n, k) -> (m, n)>
#id = affine_map<(i, j) -> (i, j)>
func.func @main(%h: tensor<64x128xbf16>, %w: tensor<256x128xbf16>) -> tensor<64x128xbf16> {
  %zero = arith.constant 0.0 : f32
  %c0 = arith.constant 0 : index
  %c32 = arith.constant 32 : index
  %c256 = arith.constant 256 : index
  %out = tensor.empty() : tensor<64x128xbf16>
  %r = scf.forall (%i) in (1) shared_outs(%o = %out) -> (tensor<64x128xbf16>) {
    %e = tensor.empty() : tensor<64x128xf32>
    %init = linalg.fill ins(%zero : f32) outs(%INIT : tensor<64x128xf32>) -> tensor<64x128xf32>
    %acc = scf.for %c = %c0 to %c256 step %c32 iter_args(%dh = %init) -> (tensor<64x128xf32>) {
      %wc = tensor.extract_slice %w[%c, 0] [32, 128] [1, 1] : tensor<256x128xbf16> to tensor<32x128xbf16>
      %es = tensor.empty() : tensor<64x32xf32>
      %fs = linalg.fill ins(%zero : f32) outs(%es : tensor<64x32xf32>) -> tensor<64x32xf32>
      %s = linalg.generic {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction"]} ins(%h, %wc : tensor<64x128xbf16>, tensor<32x128xbf16>) outs(%fs : tensor<64x32xf32>) {
      ^bb0(%x: bf16, %y: bf16, %acc0: f32):
        %xf = arith.extf %x : bf16 to f32
        %yf = arith.extf %y : bf16 to f32
        %p = arith.mulf %xf, %yf : f32
        %q = arith.addf %acc0, %p : f32
        linalg.yield %q : f32
      } -> tensor<64x32xf32>
      %eg = tensor.empty() : tensor<64x32xbf16>
      %g = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]} ins(%s : tensor<64x32xf32>) outs(%eg : tensor<64x32xbf16>) {
      ^bb0(%x: f32, %unused: bf16):
        %ex = math.exp %x : f32
        %t = arith.truncf %ex : f32 to bf16
        linalg.yield %t : bf16
      } -> tensor<64x32xbf16>
      %next = linalg.generic {indexing_maps = [#a, #bt, #c], iterator_types = ["parallel", "parallel", "reduction"]} ins(%g, %wc : tensor<64x32xbf16>, tensor<32x128xbf16>) outs(%dh : tensor<64x128xf32>) {
      ^bb0(%x: bf16, %y: bf16, %acc0: f32):
        %xf = arith.extf %x : bf16 to f32
        %yf = arith.extf %y : bf16 to f32
        %p = arith.mulf %xf, %yf : f32
        %q = arith.addf %acc0, %p : f32
        linalg.yield %q : f32
      } -> tensor<64x128xf32>
      scf.yield %next : tensor<64x128xf32>
    }
    %cast = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]} ins(%acc : tensor<64x128xf32>) outs(%out : tensor<64x128xbf16>) {
    ^bb0(%x: f32, %unused: bf16):
      %t = arith.truncf %x : f32 to bf16
      linalg.yield %t : bf16
    } -> tensor<64x128xbf16>
    scf.forall.in_parallel {
      tensor.parallel_insert_slice %cast into %o[0, 0] [64, 128] [1, 1] : tensor<64x128xbf16> into tensor<64x128xbf16>
    }
  }
  return %r : tensor<64x128xbf16>
}
"""


def test_the_accumulation_its_fill_and_cast_and_the_fresh_tile():
    payload = parse(PASS.replace("%INIT", "%e"))

    def body(root):
        products, tiles, fills, epilogues = match_loop_accumulators(match(root, "scf.forall"))
        for handle, name in ((products, "product"), (tiles, "tile"), (fills, "fill"),
                             (epilogues, "epilogue")):
            transform.AnnotateOp(handle, name)

    apply(payload, body)
    check(str(payload), """
        CHECK: linalg.fill {fill} {{.*}} outs({{.*}} : tensor<64x128xf32>)
        CHECK: scf.for
        CHECK:   linalg.fill ins({{.*}} outs({{.*}} : tensor<64x32xf32>) -> tensor<64x32xf32>
        CHECK-NEXT: linalg.generic {{.*}} outs({{.*}} : tensor<64x32xf32>) attrs = {tile}
        CHECK:   math.exp
        CHECK:   linalg.generic {{.*}} outs({{.*}} : tensor<64x128xf32>) attrs = {product}
        CHECK: linalg.generic {{.*}} outs({{.*}} : tensor<64x128xbf16>) attrs = {epilogue}
    """)


def test_an_accumulator_not_started_by_a_fill_is_refused():
    payload = parse(PASS.replace("%acc = scf.for %c = %c0 to %c256 step %c32 iter_args(%dh = %init)",
                                 "%acc = scf.for %c = %c0 to %c256 step %c32 iter_args(%dh = %e)")
                    .replace("%INIT", "%e"))
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: match_loop_accumulators(
        match(root, "scf.forall")))
    assert "transform_ext.match_loop_accumulators: scf.forall" in message
    assert "the init of the accumulator 0 of its loop is not a linalg.fill" in message
    assert str(payload) == before


def test_a_target_without_one_loop_is_refused():
    payload = parse(PASS.replace("%INIT", "%e"))
    message = apply_expect_failure(payload, lambda root: match_loop_accumulators(
        match(root, "func.func")))
    assert "holds 0 scf.for loops directly, not one" in message
