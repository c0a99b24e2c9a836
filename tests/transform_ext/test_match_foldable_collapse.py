"""match_foldable_collapse: the first collapse fold_reshape_ops_by_expansion can fold into
all its readers (tagged with transform.annotate and FileChecked), and nothing (no failure)
for a collapse no linalg op reads."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_foldable_collapse import match_foldable_collapse
from tests.transform_ext.helpers import apply, check, parse

SHARED = """
#id = affine_map<(i, j) -> (i, j)>
func.func @main(%x: tensor<2x3x4xf32>, %y: tensor<4x5xf32>) -> (tensor<6x4xf32>, tensor<6x4xf32>, tensor<20xf32>) {
  %c = tensor.collapse_shape %x [[0, 1], [2]] : tensor<2x3x4xf32> into tensor<6x4xf32>
  %e = tensor.empty() : tensor<6x4xf32>
  %a = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%c : tensor<6x4xf32>) outs(%e : tensor<6x4xf32>) {
  ^bb0(%v: f32, %o: f32):
    %0 = math.exp %v : f32
    linalg.yield %0 : f32
  } -> tensor<6x4xf32>
  %b = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%c : tensor<6x4xf32>) outs(%e : tensor<6x4xf32>) {
  ^bb0(%v: f32, %o: f32):
    %0 = arith.negf %v : f32
    linalg.yield %0 : f32
  } -> tensor<6x4xf32>
  %flat = tensor.collapse_shape %y [[0, 1]] : tensor<4x5xf32> into tensor<20xf32>
  return %a, %b, %flat : tensor<6x4xf32>, tensor<6x4xf32>, tensor<20xf32>
}
"""


def _tag(root):
    transform.AnnotateOp(match_foldable_collapse(match(root, "func.func")), "foldable")


def test_matches_a_collapse_read_by_two_generics():
    payload = parse(SHARED)
    apply(payload, _tag)
    check(payload, """
        CHECK: tensor.collapse_shape %arg0 {{.*}} {foldable}
        CHECK: tensor.collapse_shape %arg1
        CHECK-NOT: foldable
    """)


def test_matches_nothing_when_no_linalg_op_reads_the_collapse():
    text = SHARED.replace("ins(%c : tensor<6x4xf32>)", "ins(%e : tensor<6x4xf32>)")
    payload = parse(text)
    before = str(payload)
    apply(payload, _tag)
    assert str(payload) == before
