"""drop_broadcast_dims: a generic repeating values along a dim is rebuilt without it; users
read the smaller tensor; a resulting plain copy disappears."""

import torch

from schedules.common import match
from transform_ext.drop_broadcast_dims import drop_broadcast_dims
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.numeric import run_module

REPEATED = """
#b = affine_map<(h, g, s, d) -> (h, s, d)>
#t = affine_map<(h, g, d, s) -> (h, s, d)>
#id4 = affine_map<(h, g, s, d) -> (h, g, s, d)>
#q = affine_map<(h, g, i, j, d) -> (h, g, i, d)>
#k = affine_map<(h, g, i, j, d) -> (h, g, d, j)>
#s = affine_map<(h, g, i, j, d) -> (h, g, i, j)>
func.func @main(%q: tensor<2x3x5x4xf32>, %k: tensor<2x7x4xf32>) -> tensor<2x3x5x7xf32> {
  %zero = arith.constant 0.0 : f32
  %c = arith.constant 0.5 : f32
  %e = tensor.empty() : tensor<2x3x4x7xf32>
  %kt = linalg.generic {indexing_maps = [#t, #id4], iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%k : tensor<2x7x4xf32>) outs(%e : tensor<2x3x4x7xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.mulf %a, %c : f32
    linalg.yield %r : f32
  } -> tensor<2x3x4x7xf32>
  %es = tensor.empty() : tensor<2x3x5x7xf32>
  %s0 = linalg.fill ins(%zero : f32) outs(%es : tensor<2x3x5x7xf32>) -> tensor<2x3x5x7xf32>
  %s = linalg.generic {indexing_maps = [#q, #k, #s], iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
      ins(%q, %kt : tensor<2x3x5x4xf32>, tensor<2x3x4x7xf32>) outs(%s0 : tensor<2x3x5x7xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %p = arith.mulf %a, %b : f32
    %r = arith.addf %o, %p : f32
    linalg.yield %r : f32
  } -> tensor<2x3x5x7xf32>
  return %s : tensor<2x3x5x7xf32>
}
"""


def test_repeated_k_is_materialized_once_per_head():
    payload = parse(REPEATED)
    apply(payload, lambda root: drop_broadcast_dims(match(root, "func.func")))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK:       %[[KT:.*]] = linalg.generic {{.*}} ins(%arg1 : tensor<2x7x4xf32>) outs(%{{.*}} : tensor<2x4x7xf32>)
        CHECK:         arith.mulf
        CHECK:       linalg.generic {indexing_maps = [#{{.*}}, #[[KMAP:.*]], #{{.*}}]{{.*}} ins(%arg0, %[[KT]] : tensor<2x3x5x4xf32>, tensor<2x4x7xf32>)
    """)
    assert "(d0, d1, d2, d3, d4) -> (d0, d4, d3)" in str(payload)
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 7, 4)
    out = run_module(payload, [q, k])[0]
    ref = q @ (k * 0.5).transpose(-1, -2)[:, None]
    torch.testing.assert_close(out, ref)


def test_a_plain_repeat_disappears():
    payload = parse(REPEATED.replace("%r = arith.mulf %a, %c : f32\n    linalg.yield %r : f32",
                                     "linalg.yield %a : f32")
                    .replace("#t = affine_map<(h, g, d, s) -> (h, s, d)>",
                             "#t = affine_map<(h, g, d, s) -> (h, d, s)>")
                    .replace("%k: tensor<2x7x4xf32>", "%k: tensor<2x4x7xf32>")
                    .replace("ins(%k : tensor<2x7x4xf32>)", "ins(%k : tensor<2x4x7xf32>)"))
    apply(payload, lambda root: drop_broadcast_dims(match(root, "func.func")))
    text = str(payload)
    assert text.count("linalg.generic") == 1  # only the contraction, reading %arg1 directly
    assert "ins(%arg0, %arg1 : tensor<2x3x5x4xf32>, tensor<2x4x7xf32>)" in text
