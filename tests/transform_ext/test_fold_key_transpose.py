"""fold_key_transpose: keys-major scores read K in place of transpose(K) and the scale of
the scores moves to Q^T (FileCheck), the same results as torch, a scores op without such a
transpose left as it is, and the rejection of a target that is not a contraction."""

import torch

from schedules.common import match
from transform_ext.fold_key_transpose import fold_key_transpose
from transform_ext.match_attention import match_attention
from transform_ext.store_scores_keys_major import store_scores_keys_major
from tests.transform_ext.attention_payloads import SHAPES, attention, torch_attention
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module


def _keys_major_reading_k(root):
    scores = match_attention(match(root, "func.func"))[1]
    store_scores_keys_major(scores)
    fold_key_transpose(scores)


def test_k_is_read_in_place_and_the_scale_moves_to_q():
    payload = parse(attention(scale="0.25"))
    apply(payload, _keys_major_reading_k)
    check(payload, """
        CHECK-DAG: #[[QT:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d3, d1)>
        CHECK-DAG: #[[K:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>
        CHECK-DAG: #[[ST:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d2, d1)>
        CHECK: func.func @main(%[[Q:.*]]: tensor<2x4x16xf32>, %[[KV:.*]]: tensor<2x8x16xf32>
        CHECK: %[[QTV:.*]] = linalg.transpose ins(%[[Q]] : tensor<2x4x16xf32>)
        CHECK: %[[QS:.*]] = linalg.generic {{.*}} ins(%[[QTV]] : tensor<2x16x4xf32>)
        CHECK: %[[C:.*]] = arith.constant 2.500000e-01 : f32
        CHECK: arith.mulf %{{.*}}, %[[C]] : f32
        CHECK: %[[S:.*]] = linalg.generic {indexing_maps = [#[[QT]], #[[K]], #[[ST]]]
        CHECK-SAME: ins(%[[QS]], %[[KV]] : tensor<2x16x4xf32>, tensor<2x8x16xf32>)
        CHECK: linalg.generic {{.*}} ins(%[[S]] : tensor<2x8x4xf32>)
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.maximumf
        CHECK: linalg.generic {{.*}} ins(%[[S]], %{{.*}} : tensor<2x8x4xf32>, tensor<2x4xf32>)
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.subf
    """)


def test_folded_scores_compute_what_torch_does():
    b, l, s, d, e = (SHAPES[k] for k in "BLSDE")
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(b, l, d, generator=g), torch.randn(b, s, d, generator=g), \
        torch.randn(b, s, e, generator=g)
    payload = parse(attention(scale="0.25"))
    apply(payload, _keys_major_reading_k)
    out, rows = run_module(payload, [q, k, v])
    want_out, want_rows = torch_attention(q, k, v, 0.25)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-5)


def test_scores_without_a_transposed_k_are_left_alone():
    text = attention().replace(
        "%kt = linalg.transpose ins(%k : tensor<2x8x16xf32>) outs(%ekt : tensor<2x16x8xf32>) permutation = [0, 2, 1]",
        "%kt = linalg.copy ins(%k2 : tensor<2x16x8xf32>) outs(%ekt : tensor<2x16x8xf32>) -> tensor<2x16x8xf32>")
    text = text.replace("%v: tensor<2x8x6xf32>)", "%v: tensor<2x8x6xf32>, %k2: tensor<2x16x8xf32>)")
    payload = parse(text)
    apply(payload, lambda root: store_scores_keys_major(match_attention(match(root, "func.func"))[1]))
    before = str(payload)
    apply(payload, lambda root: fold_key_transpose(match_attention(match(root, "func.func"))[1]))
    assert str(payload) == before


def test_rejects_a_target_that_is_not_a_contraction():
    payload = parse(attention())
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: fold_key_transpose(match_attention(match(root, "func.func"))[0]))
    assert "transform_ext.fold_key_transpose: linalg.generic" in message
    assert "not a linalg.generic contraction" in message
    assert str(payload) == before
