"""fuse_elementwise_producers: single-use, non-broadcast elementwise producers merge into
elementwise consumers; multi-use producers and reductions stay apart."""

import torch

from schedules.common import match
from transform_ext.fuse_elementwise_producers import fuse_elementwise_producers
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.numeric import run_module

CHAIN = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#t = affine_map<(d0, d1) -> (d1, d0)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<8x16xf32>, %m: tensor<8xf32>) -> (tensor<8x16xf32>, tensor<16x8xf32>, tensor<8xf32>) {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8x16xf32>
  %et = tensor.empty() : tensor<16x8xf32>
  %sub = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m : tensor<8x16xf32>, tensor<8xf32>) outs(%e : tensor<8x16xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %r = arith.subf %a, %b : f32
    linalg.yield %r : f32
  } -> tensor<8x16xf32>
  %exp = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%sub : tensor<8x16xf32>) outs(%e : tensor<8x16xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = math.exp %a : f32
    linalg.yield %r : f32
  } -> tensor<8x16xf32>
  %neg = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<8x16xf32>) outs(%e : tensor<8x16xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.negf %a : f32
    linalg.yield %r : f32
  } -> tensor<8x16xf32>
  %tr = linalg.generic {indexing_maps = [#t, #id], iterator_types = ["parallel", "parallel"]}
      ins(%neg : tensor<8x16xf32>) outs(%et : tensor<16x8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.mulf %a, %a : f32
    linalg.yield %r : f32
  } -> tensor<16x8xf32>
  %l0 = tensor.empty() : tensor<8xf32>
  %l1 = linalg.fill ins(%zero : f32) outs(%l0 : tensor<8xf32>) -> tensor<8xf32>
  %sum = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%exp : tensor<8x16xf32>) outs(%l1 : tensor<8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  return %exp, %tr, %sum : tensor<8x16xf32>, tensor<16x8xf32>, tensor<8xf32>
}
"""


def test_fuses_single_use_chains_through_permutations_only():
    payload = parse(CHAIN)
    apply(payload, lambda root: fuse_elementwise_producers(match(root, "func.func")))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK:       linalg.generic {{.*}} ins(%arg0, %arg1 : tensor<8x16xf32>, tensor<8xf32>)
        CHECK-NEXT:  ^bb0
        CHECK-NEXT:    arith.subf
        CHECK-NEXT:    math.exp
        CHECK:       linalg.generic {indexing_maps = [#{{.*}}, #{{.*}}]{{.*}} ins(%arg0 : tensor<8x16xf32>) outs(%{{.*}} : tensor<16x8xf32>)
        CHECK-NEXT:  ^bb0
        CHECK-NEXT:    arith.negf
        CHECK-NEXT:    arith.mulf
        CHECK:       arith.addf
    """)
    text = str(payload)
    assert text.count("linalg.generic") == 3  # sub+exp, neg+transpose-square, the sum
    x, m = torch.randn(8, 16), torch.randn(8)
    before = run_module(parse(CHAIN), [x, m])
    after = run_module(payload, [x, m])
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(after[1], (x * x).t())


def test_multi_use_producer_and_reduction_consumer_stay():
    payload = parse(CHAIN.replace("return %exp, %tr, %sum", "return %sub, %tr, %sum")
                    .replace("(tensor<8x16xf32>, tensor<16x8xf32>, tensor<8xf32>)",
                             "(tensor<8x16xf32>, tensor<16x8xf32>, tensor<8xf32>)"))
    apply(payload, lambda root: fuse_elementwise_producers(match(root, "func.func")))
    text = str(payload)
    assert "arith.subf" in text and text.count("math.exp") == 1
    # %sub has two users (exp, return): it stays; exp feeds only the sum (a reduction): stays
    assert text.count("linalg.generic") == 4


READS_INIT = """
#id = affine_map<(d0) -> (d0)>
func.func @main(%m_old: tensor<8xf32>, %tile_max: tensor<8xf32>) -> tensor<8xf32> {
  %ninf = arith.constant 0xFF800000 : f32
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8xf32>
  %m_new = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%tile_max : tensor<8xf32>) outs(%m_old : tensor<8xf32>) {
  ^bb0(%t: f32, %o: f32):
    %r = arith.maximumf %o, %t : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  %safe = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%m_new : tensor<8xf32>) outs(%e : tensor<8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %c = arith.cmpf oeq, %a, %ninf : f32
    %r = arith.select %c, %zero, %a : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  return %safe : tensor<8xf32>
}
"""


def test_a_producer_reading_its_init_passes_the_init_in():
    # the running max of an online softmax: max(out, tile max) reads its init (the old max);
    # the fused op reads that init as an input (it used to be left unmapped: a null operand)
    payload = parse(READS_INIT)
    apply(payload, lambda root: fuse_elementwise_producers(match(root, "func.func")))
    payload.operation.verify()
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK:       linalg.generic {{.*}} ins(%arg1, %arg0 : tensor<8xf32>, tensor<8xf32>)
        CHECK-NEXT:  ^bb0(%[[T:.*]]: f32, %[[OLD:.*]]: f32, %{{.*}}: f32):
        CHECK-NEXT:    arith.maximumf %[[OLD]], %[[T]]
        CHECK:         arith.select
        CHECK-NOT:   linalg.generic
    """)
    old = torch.tensor([float("-inf"), 1.0, -2.0, 3.0, float("-inf"), 0.5, 7.0, -1.0])
    tile = torch.tensor([float("-inf"), 2.0, -3.0, 1.0, 4.0, 0.5, float("-inf"), -1.5])
    (after,) = run_module(payload, [old, tile])
    ref = torch.maximum(old, tile)
    torch.testing.assert_close(after, torch.where(ref == float("-inf"), torch.zeros(8), ref))


THREE = """
#id = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<16xf32>) -> tensor<16xf32> {
  %e = tensor.empty() : tensor<16xf32>
  %a = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%x : tensor<16xf32>) outs(%e : tensor<16xf32>) {
  ^bb0(%v: f32, %o: f32):
    %r = arith.negf %v : f32
    linalg.yield %r : f32
  } -> tensor<16xf32>
  %b = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%a : tensor<16xf32>) outs(%e : tensor<16xf32>) {
  ^bb0(%v: f32, %o: f32):
    %r = math.exp %v : f32
    linalg.yield %r : f32
  } -> tensor<16xf32>
  %c = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%b : tensor<16xf32>) outs(%e : tensor<16xf32>) {
  ^bb0(%v: f32, %o: f32):
    %r = arith.mulf %v, %v : f32
    linalg.yield %r : f32
  } -> tensor<16xf32>
  return %c : tensor<16xf32>
}
"""


def test_generics_given_as_targets_fuse_into_one_the_handle_holds():
    """The targets are the three generics themselves (each fusion replaces or erases a
    target): one generic is left, and the result handle holds it (annotated through it)."""
    from schedules.common import annotate

    payload = parse(THREE)
    apply(payload, lambda root: annotate(fuse_elementwise_producers(match(root, "linalg.generic")),
                                         "fused"))
    check(payload, """
        CHECK:     linalg.generic {{.*}} ins(%arg0 : tensor<16xf32>) {{.*}} attrs = {fused}
        CHECK:       arith.negf
        CHECK-NEXT:  math.exp
        CHECK-NEXT:  arith.mulf
        CHECK-NOT: linalg.generic
    """)


# a bf16 GELU-like rounding, its widening read by a matmul and another read elementwise
WIDENINGS = """
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%x: tensor<8x16xf32>, %w: tensor<16x4xf32>) -> (tensor<8x4xf32>, tensor<8x16xf32>) {
  %zero = arith.constant 0.0 : f32
  %eb = tensor.empty() : tensor<8x16xbf16>
  %e = tensor.empty() : tensor<8x16xf32>
  %round = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<8x16xf32>) outs(%eb : tensor<8x16xbf16>) {
  ^bb0(%a: f32, %o: bf16):
    %r = arith.truncf %a : f32 to bf16
    linalg.yield %r : bf16
  } -> tensor<8x16xbf16>
  %widen = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%round : tensor<8x16xbf16>) outs(%e : tensor<8x16xf32>) {
  ^bb0(%a: bf16, %o: f32):
    %r = arith.extf %a : bf16 to f32
    linalg.yield %r : f32
  } -> tensor<8x16xf32>
  %round2 = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<8x16xf32>) outs(%eb : tensor<8x16xbf16>) {
  ^bb0(%a: f32, %o: bf16):
    %r = arith.truncf %a : f32 to bf16
    linalg.yield %r : bf16
  } -> tensor<8x16xbf16>
  %widen2 = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%round2 : tensor<8x16xbf16>) outs(%e : tensor<8x16xf32>) {
  ^bb0(%a: bf16, %o: f32):
    %r = arith.extf %a : bf16 to f32
    linalg.yield %r : f32
  } -> tensor<8x16xf32>
  %ec = tensor.empty() : tensor<8x4xf32>
  %c0 = linalg.fill ins(%zero : f32) outs(%ec : tensor<8x4xf32>) -> tensor<8x4xf32>
  %mm = linalg.matmul ins(%widen, %w : tensor<8x16xf32>, tensor<16x4xf32>) outs(%c0 : tensor<8x4xf32>) -> tensor<8x4xf32>
  return %mm, %widen2 : tensor<8x4xf32>, tensor<8x16xf32>
}
"""


def test_a_widening_a_contraction_reads_keeps_its_bf16_input():
    """The matmul's operand stays extf of the rounded bf16 values (the matmul family then
    reads them as bf16 pairs); the widening returned elementwise takes its producer in."""
    payload = parse(WIDENINGS)
    apply(payload, lambda root: fuse_elementwise_producers(match(root, "func.func")))
    check(payload, """
        CHECK: %[[ROUND:.*]] = linalg.generic
        CHECK: arith.truncf
        CHECK: %[[WIDEN:.*]] = linalg.generic {{.*}} ins(%[[ROUND]] : tensor<8x16xbf16>)
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.extf
        CHECK-NEXT: linalg.yield
        CHECK: %[[FUSED:.*]] = linalg.generic {{.*}} ins(%arg0 : tensor<8x16xf32>)
        CHECK: arith.truncf
        CHECK: arith.extf
        CHECK: linalg.matmul ins(%[[WIDEN]],
    """)
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    mm, widened = run_module(payload, [x, w])
    rounded = x.bfloat16().float()
    torch.testing.assert_close(widened, rounded)
    torch.testing.assert_close(mm, rounded @ w)
