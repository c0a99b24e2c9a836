"""fold_gathers_through_contraction: the target logit S[n, y_n] of S = h W^T becomes the dot
product h_n . W_{y_n} read from W through its transpose (IR, and numerics against torch
after promote_indexed_extracts, as the linear cross-entropy schedule runs it); a reader
with a reduction loop is refused."""

import torch

from schedules.common import match
from transform_ext.fold_gathers_through_contraction import fold_gathers_through_contraction
from transform_ext.promote_indexed_extracts import promote_indexed_extracts
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

PAYLOAD = """
func.func @main(%h: tensor<8x16xf32>, %w: tensor<40x16xf32>, %y: tensor<8xi64>) -> tensor<8xf32> {
  %zero = arith.constant 0.0 : f32
  %c0 = arith.constant 0 : index
  %c39 = arith.constant 39 : index
  %e0 = tensor.empty() : tensor<16x40xf32>
  %wt = linalg.transpose ins(%w : tensor<40x16xf32>) outs(%e0 : tensor<16x40xf32>) permutation = [1, 0]
  %e1 = tensor.empty() : tensor<8x40xf32>
  %f1 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<8x40xf32>) -> tensor<8x40xf32>
  %s = linalg.matmul ins(%h, %wt : tensor<8x16xf32>, tensor<16x40xf32>) outs(%f1 : tensor<8x40xf32>) -> tensor<8x40xf32>
  %e2 = tensor.empty() : tensor<8xf32>
  %t = linalg.generic {indexing_maps = [affine_map<(n, k) -> (n)>, affine_map<(n, k) -> (k)>, affine_map<(n, k) -> (n)>], iterator_types = ["parallel", "%KIND"]} ins(%y, %y : tensor<8xi64>, tensor<8xi64>) outs(%e2 : tensor<8xf32>) {
  ^bb0(%yy: i64, %unused: i64, %o: f32):
    %n = linalg.index 0 : index
    %i = arith.index_cast %yy : i64 to index
    %lo = arith.maxsi %i, %c0 : index
    %j = arith.minsi %lo, %c39 : index
    %x = tensor.extract %s[%n, %j] : tensor<8x40xf32>
    %r = arith.mulf %x, %x : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  return %t : tensor<8xf32>
}
"""


def test_the_gather_reads_a_dot_product():
    payload = parse(PAYLOAD.replace("(n, k) -> (n)>, affine_map<(n, k) -> (k)>, affine_map<(n, k) -> (n)>",
                                    "(n) -> (n)>, affine_map<(n) -> (n)>, affine_map<(n) -> (n)>")
                    .replace('["parallel", "%KIND"]', '["parallel"]'))
    apply(payload, lambda root: fold_gathers_through_contraction(match(root, "func.func")))
    check(str(payload), """
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]{{.*}} ins(%arg2, %{{.*}} : tensor<8xi64>, tensor<16xf32>)
        CHECK:   arith.minsi
        CHECK:   %[[D:.*]] = linalg.index 1
        CHECK:   tensor.extract %{{.*}}[%{{.*}}, %[[D]]] : tensor<8x16xf32>
        CHECK:   tensor.extract %arg1[%{{.*}}, %[[D]]] : tensor<40x16xf32>
        CHECK:   arith.mulf
        CHECK:   arith.addf
        CHECK: linalg.generic
        CHECK-NOT: tensor.extract
        CHECK:   arith.mulf %[[X:.*]], %[[X]]
    """)
    # as the linear cross-entropy's step does: h's gather at the loop indices becomes an input
    apply(payload, lambda root: promote_indexed_extracts(match(root, "func.func")))
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(8, 16, generator=g), torch.randn(40, 16, generator=g)
    y = torch.tensor([0, 39, 5, 7, -100, 12, 1, 30])
    got = run_module(payload, [h, w, y], cleanup=False)[0]
    want = (h * w[y.clamp(0, 39)]).sum(1) ** 2
    torch.testing.assert_close(got, want)


def test_a_reader_with_a_reduction_is_refused():
    payload = parse(PAYLOAD.replace("%KIND", "reduction"))
    message = apply_expect_failure(payload, lambda root: fold_gathers_through_contraction(
        match(root, "func.func")))
    assert "must have static, parallel loops only" in message
