"""promote_indexed_extracts: an extract at the op's own loop indices becomes an input
(FileCheck, numbers against torch), a data-dependent gather stays, and a target without a
body is refused."""

import torch

from schedules.common import match
from transform_ext.promote_indexed_extracts import promote_indexed_extracts
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

GATHERS = """
#r = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<4x8xf32>, %m: tensor<4xf32>, %y: tensor<4xi64>) -> tensor<4xf32> {
  %e = tensor.empty() : tensor<4xf32>
  %g = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%y : tensor<4xi64>) outs(%e : tensor<4xf32>) {
  ^bb0(%t: i64, %o: f32):
    %i = linalg.index 0 : index
    %c2 = arith.constant 2 : index
    %j = arith.index_cast %t : i64 to index
    %v = tensor.extract %x[%i, %j] : tensor<4x8xf32>
    %w = tensor.extract %x[%i, %c2] : tensor<4x8xf32>
    %mi = tensor.extract %m[%i] : tensor<4xf32>
    %s = arith.subf %v, %mi : f32
    %r = arith.addf %s, %w : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %g : tensor<4xf32>
}
"""


def test_extracts_at_loop_indices_become_inputs_and_gathers_stay():
    payload = parse(GATHERS)
    apply(payload, lambda root: promote_indexed_extracts(match(root, "func.func")))
    check(str(payload), """
        CHECK-DAG: #[[ID:.*]] = affine_map<(d0) -> (d0)>
        CHECK-DAG: #[[COL2:.*]] = affine_map<(d0) -> (d0, 2)>
        CHECK: linalg.generic {indexing_maps = [#[[ID]], #[[COL2]], #[[ID]], #[[ID]]]
        CHECK-SAME: ins(%arg2, %arg0, %arg1 : tensor<4xi64>, tensor<4x8xf32>, tensor<4xf32>)
        CHECK: ^bb0(%[[T:.*]]: i64, %[[W:.*]]: f32, %[[MI:.*]]: f32, %{{.*}}: f32):
        CHECK: %[[V:.*]] = tensor.extract %arg0[%{{.*}}, %{{.*}}] : tensor<4x8xf32>
        CHECK: %[[S:.*]] = arith.subf %[[V]], %[[MI]]
        CHECK: arith.addf %[[S]], %[[W]]
    """)
    g = torch.Generator().manual_seed(0)
    x, m, y = torch.randn(4, 8, generator=g), torch.randn(4, generator=g), torch.tensor([0, 7, 3, 5])
    (got,) = run_module(payload, [x, m, y])
    torch.testing.assert_close(got, x.gather(1, y[:, None])[:, 0] - m + x[:, 2])


def test_a_target_without_a_body_is_refused():
    payload = parse(GATHERS)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: promote_indexed_extracts(match(root, "tensor.empty")))
    assert "transform_ext.promote_indexed_extracts: tensor.empty at" in message
    assert "it has no body" in message
    assert str(payload) == before
