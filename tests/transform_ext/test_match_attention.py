"""match_attention: the row max, scores and P V contractions it returns (tagged with
transform.annotate and FileChecked), and its rejection of a body without one row max."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_attention import match_attention
from tests.transform_ext.attention_payloads import attention
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse


def test_finds_the_row_max_the_scores_and_the_values():
    payload = parse(attention(scale="0.25"))

    def body(root):
        row_max, scores, values = match_attention(match(root, "func.func"))
        transform.AnnotateOp(row_max, "row_max")
        transform.AnnotateOp(scores, "scores")
        transform.AnnotateOp(values, "values")

    apply(payload, body)
    check(payload, """
        CHECK: %[[S:.*]] = linalg.generic {{.*}} ins(%{{.*}}, %{{.*}} : tensor<2x4x16xf32>, tensor<2x16x8xf32>) {{.*}} attrs =  {scores}
        CHECK: %[[SC:.*]] = linalg.generic {{.*}} ins(%[[S]] :
        CHECK: arith.mulf
        CHECK: linalg.generic {{.*}} ins(%[[SC]] : {{.*}} attrs =  {row_max}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.maximumf
        CHECK: math.exp
        CHECK: linalg.generic {{.*}} attrs =  {values}
        CHECK: return
    """)


def test_rejects_a_body_without_a_row_max():
    text = attention().replace("arith.maximumf", "arith.minimumf")
    payload = parse(text)
    message = apply_expect_failure(payload, lambda root: match_attention(match(root, "func.func")))
    assert "transform_ext.match_attention: func.func" in message
    assert "expected one row max (softmax), found 0" in message
