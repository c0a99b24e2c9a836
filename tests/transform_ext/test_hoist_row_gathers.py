"""hoist_row_gathers: the weight w[y_i] gathered per element of a [4, 16] op becomes a [4]
generic the op reads through (d0, d1) -> (d0) (FileCheck, same numbers on the CPU); a gather
at an index that varies along the classes is refused."""

import torch

from schedules.common import match
from transform_ext.hoist_row_gathers import hoist_row_gathers
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

WEIGHTED = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x16xf32>, %y: tensor<4xi64>, %w: tensor<16xf32>) -> tensor<4x16xf32> {
  %e2 = tensor.empty() : tensor<4x16xf32>
  %g = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %y : tensor<4x16xf32>, tensor<4xi64>) outs(%e2 : tensor<4x16xf32>) {
  ^bb0(%a: f32, %t: i64, %o: f32):
    %j = arith.index_cast %t : i64 to index
    %wt = tensor.extract %w[%j] : tensor<16xf32>
    %r = arith.mulf %a, %wt : f32
    linalg.yield %r : f32
  } -> tensor<4x16xf32>
  return %g : tensor<4x16xf32>
}
"""


def test_the_weight_at_the_target_is_gathered_once_per_row():
    payload = parse(WEIGHTED)
    apply(payload, lambda root: hoist_row_gathers(match(root, "linalg.generic")))
    check(str(payload), """
        CHECK-DAG: #[[ID:.*]] = affine_map<(d0, d1) -> (d0, d1)>
        CHECK-DAG: #[[ROW:.*]] = affine_map<(d0, d1) -> (d0)>
        CHECK-DAG: #[[R:.*]] = affine_map<(d0) -> (d0)>
        CHECK: %[[WT:[0-9]+]] = linalg.generic {indexing_maps = [#[[R]], #[[R]]], iterator_types = ["parallel"]} ins(%arg1 : tensor<4xi64>) outs(%{{.*}} : tensor<4xf32>)
        CHECK: arith.index_cast
        CHECK: tensor.extract %arg2
        CHECK: linalg.generic {indexing_maps = [#[[ID]], #[[ROW]], #[[ROW]], #[[ID]]], iterator_types = ["parallel", "parallel"]} ins(%arg0, %arg1, %[[WT]] : tensor<4x16xf32>, tensor<4xi64>, tensor<4xf32>)
        CHECK-NEXT: ^bb0(%[[A:[a-z0-9_]+]]: f32, %{{.*}}: i64, %[[W:[a-z0-9_]+]]: f32, %{{.*}}: f32):
        CHECK-NOT: tensor.extract
        CHECK: arith.mulf %[[A]], %[[W]] : f32
    """)
    assert str(payload).count("tensor.extract") == 1
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 16, generator=g), torch.rand(16, generator=g)
    y = torch.tensor([3, 0, 15, 7])
    (got,) = run_module(payload, [x, y, w])
    torch.testing.assert_close(got, x * w[y][:, None])


def test_rejects_a_gather_that_varies_along_the_classes():
    payload = parse(WEIGHTED.replace("%j = arith.index_cast %t : i64 to index",
                                     "%j = linalg.index 1 : index"))
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: hoist_row_gathers(match(root, "linalg.generic")))
    assert "transform_ext.hoist_row_gathers: linalg.generic" in message
    assert "gathers at an index that varies along the classes" in message
    assert str(payload) == before
