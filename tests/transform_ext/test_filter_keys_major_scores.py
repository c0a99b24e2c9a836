"""filter_keys_major_scores: keeps the scores store_scores_keys_major accepts (tagged with
transform.annotate and FileChecked) and drops, without failing, those it would refuse."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.filter_keys_major_scores import filter_keys_major_scores
from transform_ext.match_attention import match_attention
from tests.transform_ext.attention_payloads import attention
from tests.transform_ext.helpers import apply, check, parse


def _tag(root):
    scores = match_attention(match(root, "func.func"))[1]
    transform.AnnotateOp(filter_keys_major_scores(scores), "keys_major")


def test_keeps_scores_it_can_relayout():
    payload = parse(attention())
    apply(payload, _tag)
    check(payload, """
        CHECK: linalg.generic {{.*}} ins(%{{.*}}, %{{.*}} : tensor<2x4x16xf32>, tensor<2x16x8xf32>) {{.*}} attrs =  {keys_major}
        CHECK-NOT: keys_major
    """)


def test_drops_scores_read_by_a_non_generic():
    extra = """
  %copy = linalg.copy ins(%s : tensor<2x4x8xf32>) outs(%es : tensor<2x4x8xf32>) -> tensor<2x4x8xf32>"""
    payload = parse(attention(scores_reader_extra=extra))
    before = str(payload)
    apply(payload, _tag)
    assert str(payload) == before
