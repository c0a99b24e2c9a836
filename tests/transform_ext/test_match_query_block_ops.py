"""match_query_block_ops: the attention output and the ops computing its query rows (tagged
with transform.annotate and FileChecked: S, m, E and the output, not K's transpose or the
row sum returned on its own), and the rejection of a function without an attention."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_query_block_ops import match_query_block_ops
from tests.transform_ext.attention_payloads import attention
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse


def _tag(root):
    output, producers = match_query_block_ops(match(root, "func.func"))
    transform.AnnotateOp(output, "output")
    transform.AnnotateOp(producers, "query_rows")


def test_matches_the_output_and_its_query_row_producers():
    payload = parse(attention())
    apply(payload, _tag)
    check(payload, """
        CHECK: linalg.transpose {{.*}} permutation = [0, 2, 1] {{ ?$}}
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<2x4x8xf32>) attrs =  {query_rows}
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<2x4xf32>) attrs =  {query_rows}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.maximumf
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<2x4x8xf32>) attrs =  {query_rows}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.subf
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<2x4xf32>) {
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.addf
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<2x4x6xf32>) attrs =  {output}
    """)


def test_rejects_a_function_without_an_attention():
    payload = parse(attention().replace("arith.maximumf", "arith.minimumf"))
    message = apply_expect_failure(payload, _tag)
    assert "transform_ext.match_query_block_ops: func.func" in message
    assert "expected one row max (softmax), found 0" in message
