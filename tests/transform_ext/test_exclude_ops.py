"""exclude_ops: the class sums but the max, marked and checked on the payload (FileCheck);
an empty difference is no failure."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.exclude_ops import exclude_ops
from transform_ext.filter_ops import filter_reductions
from tests.transform_ext.helpers import apply, check, parse

GROUP = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x8xf32>, %m0: tensor<4xf32>, %z: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>, tensor<4xf32>) {
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %s = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %q = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %t = arith.mulf %a, %a : f32
    %r = arith.addf %t, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %m, %s, %q : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>
}
"""


def test_the_sums_but_the_max():
    payload = parse(GROUP)

    def body(root):
        group = match(root, "linalg.generic")
        others = exclude_ops(group, filter_reductions(group, combiner="max"))
        transform.AnnotateOp(others, "kept")

    apply(payload, body)
    check(str(payload), """
        CHECK: linalg.generic
        CHECK-NOT: kept
        CHECK: arith.maximumf
        CHECK: linalg.generic {{.*}} {kept}
        CHECK: linalg.generic {{.*}} {kept}
    """)


def test_excluding_everything_leaves_an_empty_handle():
    payload = parse(GROUP)
    before = str(payload)

    def body(root):
        group = match(root, "linalg.generic")
        transform.AnnotateOp(exclude_ops(group, group), "kept")

    apply(payload, body)
    assert str(payload) == before
