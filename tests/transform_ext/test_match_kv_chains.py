"""match_kv_chains: the elementwise ops computing the scores' and P V's operands (tagged
with transform.annotate and FileChecked: K's transpose, not the softmax), nothing when K^T
is a named transpose, and the rejection of a function without an attention."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_kv_chains import match_kv_chains
from tests.transform_ext.attention_payloads import attention
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

NAMED_TRANSPOSE = ("%kt = linalg.transpose ins(%k : tensor<2x8x16xf32>) outs(%ekt : tensor<2x16x8xf32>) "
                   "permutation = [0, 2, 1]")
GENERIC_TRANSPOSE = """%kt = linalg.generic {indexing_maps = [affine_map<(b, d, j) -> (b, j, d)>, affine_map<(b, d, j) -> (b, d, j)>], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%k : tensor<2x8x16xf32>) outs(%ekt : tensor<2x16x8xf32>) {
  ^bb0(%x: f32, %o: f32):
    linalg.yield %x : f32
  } -> tensor<2x16x8xf32>"""


def _tag(root):
    transform.AnnotateOp(match_kv_chains(match(root, "func.func")), "kv_chain")


def test_matches_the_transpose_of_k():
    payload = parse(attention(scale="0.25").replace(NAMED_TRANSPOSE, GENERIC_TRANSPOSE))
    apply(payload, _tag)
    check(payload, """
        CHECK: %[[KT:.*]] = linalg.generic {{.*}} ins(%arg1 : tensor<2x8x16xf32>) outs(%{{.*}} : tensor<2x16x8xf32>) attrs =  {kv_chain}
        CHECK-NOT: kv_chain
        CHECK: ins(%arg0, %[[KT]] : tensor<2x4x16xf32>, tensor<2x16x8xf32>)
    """)


def test_matches_nothing_without_elementwise_operand_chains():
    payload = parse(attention(scale="0.25"))
    before = str(payload)
    apply(payload, _tag)
    assert str(payload) == before


def test_rejects_a_function_without_an_attention():
    payload = parse(attention().replace("arith.maximumf", "arith.minimumf"))
    message = apply_expect_failure(payload, _tag)
    assert "transform_ext.match_kv_chains: func.func" in message
    assert "expected one row max (softmax), found 0" in message
