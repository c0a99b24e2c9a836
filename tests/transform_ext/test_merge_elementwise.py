"""merge_elementwise: two elementwise results computed by one op (FileCheck, numbers against
torch), and the refusal of a reduction."""

import torch

from schedules.common import match
from transform_ext.merge_elementwise import merge_elementwise
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

TWO = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x8xf32>, %m: tensor<4xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>) {
  %e = tensor.empty() : tensor<4x8xf32>
  %a = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%p: f32, %q: f32, %o: f32):
    %s = arith.subf %p, %q : f32
    linalg.yield %s : f32
  } -> tensor<4x8xf32>
  %b = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%p: f32, %q: f32, %o: f32):
    %s = arith.mulf %p, %q : f32
    linalg.yield %s : f32
  } -> tensor<4x8xf32>
  return %a, %b : tensor<4x8xf32>, tensor<4x8xf32>
}
"""


def test_two_elementwise_results_merge_into_one_op():
    """d x and d t of a loss with probability targets: one op writes both (one sweep)."""
    payload = parse(TWO)
    apply(payload, lambda root: merge_elementwise(match(root, "linalg.generic")))
    check(str(payload), """
        CHECK: %[[R:.*]]:2 = linalg.generic {{.*}} ins(%arg0, %arg1 : tensor<4x8xf32>, tensor<4xf32>)
        CHECK:   ^bb0(%[[P:.*]]: f32, %[[Q:.*]]: f32, %{{.*}}: f32, %{{.*}}: f32):
        CHECK:   %[[S:.*]] = arith.subf %[[P]], %[[Q]]
        CHECK:   %[[T:.*]] = arith.mulf %[[P]], %[[Q]]
        CHECK:   linalg.yield %[[S]], %[[T]]
        CHECK: return %[[R]]#0, %[[R]]#1
    """)
    assert str(payload).count("linalg.generic") == 1
    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
    a, b = run_module(payload, [x, m])
    torch.testing.assert_close(a, x - m[:, None])
    torch.testing.assert_close(b, x * m[:, None])


def test_a_reduction_is_refused():
    text = TWO.replace('ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%e : tensor<4x8xf32>) {\n'
                       '  ^bb0(%p: f32, %q: f32, %o: f32):\n    %s = arith.mulf',
                       'ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%e : tensor<4x8xf32>) {\n'
                       '  ^bb0(%p: f32, %q: f32, %o: f32):\n    %s = arith.mulf')
    text = text.replace('%b = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}',
                        '%b = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}')
    text = text.replace("""    %s = arith.mulf %p, %q : f32
    linalg.yield %s : f32
  } -> tensor<4x8xf32>""", """    %s = arith.mulf %p, %q : f32
    %t = arith.addf %s, %o : f32
    linalg.yield %t : f32
  } -> tensor<4xf32>""").replace("outs(%e : tensor<4x8xf32>) {\n  ^bb0(%p: f32, %q: f32, %o: f32):\n    %s = arith.mulf",
                                 "outs(%m : tensor<4xf32>) {\n  ^bb0(%p: f32, %q: f32, %o: f32):\n    %s = arith.mulf")
    text = text.replace("-> (tensor<4x8xf32>, tensor<4x8xf32>)", "-> (tensor<4x8xf32>, tensor<4xf32>)").replace(
        "return %a, %b : tensor<4x8xf32>, tensor<4x8xf32>", "return %a, %b : tensor<4x8xf32>, tensor<4xf32>")
    payload = parse(text)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: merge_elementwise(match(root, "linalg.generic")))
    assert "transform_ext.merge_elementwise: linalg.generic at" in message
    assert "not elementwise (a reduction loop)" in message
    assert str(payload) == before
