"""add_unread_input: the weighted one-hot sum gets the logits as an unread input through the
loops that run with their dims (FileCheck, numbers against torch); an op with no loop
running with a dim of the value is refused."""

import torch
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.add_unread_input import add_unread_input
from transform_ext.filter_ops import filter_reductions
from transform_ext.match_class_reductions import match_class_reductions
from transform_ext.trace_to_argument import trace_to_argument
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module
from tests.transform_ext.test_match_class_reductions import PAYLOAD


def _tie(select_targets):
    def body(root):
        row_max = filter_reductions(match(root, "linalg.generic"), combiner="max")
        add_unread_input(select_targets(root, row_max), trace_to_argument(row_max, 0))
    return body


def test_the_one_hot_sum_reads_the_logits_unread():
    payload = parse(PAYLOAD)
    apply(payload, _tie(lambda root, row_max: match_class_reductions(row_max)))
    check(str(payload), """
        CHECK-DAG: #[[ID:.*]] = affine_map<(d0, d1) -> (d0, d1)>
        CHECK-DAG: #[[ROW:.*]] = affine_map<(d0, d1) -> (d0)>
        CHECK-DAG: #[[COL:.*]] = affine_map<(d0, d1) -> (d1)>
        CHECK: linalg.generic {indexing_maps = [#[[ROW]], #[[COL]], #[[ID]], #[[ROW]]]
        CHECK-SAME: ins(%arg1, %arg2, %arg0 : tensor<4xi64>, tensor<8xf32>, tensor<4x8xf32>)
        CHECK-NEXT: ^bb0(%{{.*}}: i64, %{{.*}}: f32, %{{.*}}: f32, %{{.*}}: f32):
    """)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.rand(8, generator=g)
    y = torch.tensor([0, 7, 3, 5])
    zeros = [torch.full((4,), -float("inf")), torch.zeros(4), torch.zeros(8)]
    m, l, wx, h, c = run_module(payload, [x, y, w] + zeros)
    torch.testing.assert_close(h, w[y])
    torch.testing.assert_close(wx, x @ w)


UNRELATED = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#r = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<4x8xf32>, %m0: tensor<4xf32>, %v: tensor<3xf32>) -> (tensor<4xf32>, tensor<3xf32>) {
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %n = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%v : tensor<3xf32>) outs(%v : tensor<3xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.negf %a : f32
    linalg.yield %r : f32
  } -> tensor<3xf32>
  return %m, %n : tensor<4xf32>, tensor<3xf32>
}
"""


def test_an_op_without_a_loop_along_a_dim_of_the_value_is_refused():
    """A negation of an unrelated [3] vector runs with neither dim of the logits."""
    payload = parse(UNRELATED)
    before = str(payload)

    def negation(root, row_max):
        return transform.SplitHandleOp([transform.AnyOpType.get()] * 2,
                                       match(root, "linalg.generic")).results[1]

    message = apply_expect_failure(payload, _tie(negation))
    assert "transform_ext.add_unread_input: linalg.generic at" in message
    assert "none of its loops runs with dim 0 of the value" in message
    assert str(payload) == before
