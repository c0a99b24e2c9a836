"""store_scores_keys_major: the scores and the values computed from them stored
[..., keys, queries] (FileCheck), the same results as torch, and the rejection of scores
read by an op that is not a linalg.generic (nothing rewritten)."""

import torch

from schedules.common import match
from transform_ext.match_attention import match_attention
from transform_ext.store_scores_keys_major import store_scores_keys_major
from tests.transform_ext.attention_payloads import SHAPES, attention, torch_attention
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module


def _relayout(root):
    store_scores_keys_major(match_attention(match(root, "func.func"))[1])


def test_scores_and_exp_are_stored_keys_major():
    payload = parse(attention())
    apply(payload, _relayout)
    check(payload, """
        CHECK-DAG: #[[QT:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d3, d1)>
        CHECK-DAG: #[[ST:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d2, d1)>
        CHECK-DAG: #[[T3:.*]] = affine_map<(d0, d1, d2) -> (d0, d2, d1)>
        CHECK: func.func @main(%[[Q:.*]]: tensor<2x4x16xf32>
        CHECK: %[[QTV:.*]] = linalg.transpose ins(%[[Q]] : tensor<2x4x16xf32>) outs(%{{.*}} : tensor<2x16x4xf32>) permutation = [0, 2, 1]
        CHECK: %[[S:.*]] = linalg.generic {indexing_maps = [#[[QT]], #{{.*}}, #[[ST]]]
        CHECK-SAME: ins(%[[QTV]], %{{.*}} : tensor<2x16x4xf32>, tensor<2x16x8xf32>) outs(%{{.*}} : tensor<2x8x4xf32>)
        CHECK: linalg.generic {indexing_maps = [#[[T3]], #{{.*}}]{{.*}} ins(%[[S]] : tensor<2x8x4xf32>)
        CHECK: arith.maximumf
        CHECK: %[[E:.*]] = linalg.generic {indexing_maps = [#[[T3]], #{{.*}}, #[[T3]]]{{.*}} ins(%[[S]], %{{.*}} : tensor<2x8x4xf32>, tensor<2x4xf32>) outs(%{{.*}} : tensor<2x8x4xf32>)
        CHECK: math.exp
        CHECK: linalg.generic {{.*}} ins(%[[E]] : tensor<2x8x4xf32>)
        CHECK: linalg.generic {{.*}} ins(%[[E]], %{{.*}} : tensor<2x8x4xf32>, tensor<2x8x6xf32>)
    """)


def test_keys_major_scores_compute_what_torch_does():
    b, l, s, d, e = (SHAPES[k] for k in "BLSDE")
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(b, l, d, generator=g), torch.randn(b, s, d, generator=g), \
        torch.randn(b, s, e, generator=g)
    payload = parse(attention(scale="0.25"))
    apply(payload, _relayout)
    out, rows = run_module(payload, [q, k, v])
    want_out, want_rows = torch_attention(q, k, v, 0.25)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-5)


def test_rejects_scores_read_by_a_non_generic():
    extra = """
  %copy = linalg.copy ins(%s : tensor<2x4x8xf32>) outs(%es : tensor<2x4x8xf32>) -> tensor<2x4x8xf32>"""
    payload = parse(attention(scores_reader_extra=extra))
    before = str(payload)
    message = apply_expect_failure(payload, _relayout)
    assert "transform_ext.store_scores_keys_major: linalg.generic" in message
    assert "linalg.copy reads the scores" in message
    assert str(payload) == before
