"""fold_casts_into_contractions: the bf16 linear layer's f32 copies of h and W^T go, the
contraction reads h [n, d] and W [v, d] in place and widens in its body; a transpose that
would be read with the depth outermost stays; a target that is not a contraction generic is
refused."""

from torch_mlir.dialects.transform import structured

from schedules.common import match
from transform_ext.fold_casts_into_contractions import fold_casts_into_contractions
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

WIDEN = """
  %{name} = linalg.generic {{indexing_maps = [affine_map<(a, b) -> (a, b)>, affine_map<(a, b) -> (a, b)>], iterator_types = ["parallel", "parallel"]}} ins(%{src} : tensor<{shape}xbf16>) outs(%{name}_e : tensor<{shape}xf32>) {{
  ^bb0(%in: bf16, %o: f32):
    %x = arith.extf %in : bf16 to f32
    linalg.yield %x : f32
  }} -> tensor<{shape}xf32>"""

PAYLOAD = """
func.func @main(%h: tensor<8x16xbf16>, %w: tensor<40x16xbf16>, %ht: tensor<16x8xf32>) -> (tensor<8x40xf32>, tensor<8x40xf32>) {
  %zero = arith.constant 0.0 : f32
  %e0 = tensor.empty() : tensor<16x40xbf16>
  %wt = linalg.transpose ins(%w : tensor<40x16xbf16>) outs(%e0 : tensor<16x40xbf16>) permutation = [1, 0]
  %hf_e = tensor.empty() : tensor<8x16xf32>
  %wf_e = tensor.empty() : tensor<16x40xf32>
""" + WIDEN.format(name="hf", src="h", shape="8x16") + WIDEN.format(name="wf", src="wt", shape="16x40") + """
  %e1 = tensor.empty() : tensor<8x40xf32>
  %f1 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<8x40xf32>) -> tensor<8x40xf32>
  %s = linalg.matmul ins(%hf, %wf : tensor<8x16xf32>, tensor<16x40xf32>) outs(%f1 : tensor<8x40xf32>) -> tensor<8x40xf32>
  %e2 = tensor.empty() : tensor<8x16xf32>
  %hc = linalg.transpose ins(%ht : tensor<16x8xf32>) outs(%e2 : tensor<8x16xf32>) permutation = [1, 0]
  %s2 = linalg.matmul ins(%hc, %wf : tensor<8x16xf32>, tensor<16x40xf32>) outs(%f1 : tensor<8x40xf32>) -> tensor<8x40xf32>
  return %s, %s2 : tensor<8x40xf32>, tensor<8x40xf32>
}
"""


def test_widenings_and_the_weight_transpose_fold():
    payload = parse(PAYLOAD)
    apply(payload, lambda root: fold_casts_into_contractions(
        structured.GeneralizeOp(match(root, "linalg.matmul")).transformed))
    check(str(payload), """
        CHECK-DAG: #[[H:.*]] = affine_map<(d0, d1, d2) -> (d0, d2)>
        CHECK-DAG: #[[W:.*]] = affine_map<(d0, d1, d2) -> (d1, d2)>
        CHECK: linalg.generic {indexing_maps = [#[[H]], #[[W]], {{.*}}]{{.*}} ins(%arg0, %arg1 : tensor<8x16xbf16>, tensor<40x16xbf16>)
        CHECK:   arith.extf
        CHECK:   arith.extf
        CHECK:   arith.mulf
        CHECK: %[[HC:.*]] = linalg.transpose ins(%arg2
        CHECK: linalg.generic {indexing_maps = [#[[H]], #[[W]], {{.*}}]{{.*}} ins(%[[HC]], %arg1 : tensor<8x16xf32>, tensor<40x16xbf16>)
        CHECK-NOT: linalg.generic
        CHECK: return
    """)


def test_a_target_that_is_not_a_contraction_is_refused():
    payload = parse(PAYLOAD)
    message = apply_expect_failure(payload, lambda root: fold_casts_into_contractions(
        match(root, "linalg.transpose")))
    assert "not a linalg.generic contraction" in message
