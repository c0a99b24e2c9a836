"""fuse_attention_backward: the FA2 backward found in a joint SDPA graph is replaced by a
call of the fused kernel; payloads without one are refused with the reason."""

import torch
import torch.nn.functional as F

from lighthouse.compile import cleanup
from lighthouse.ingress import import_joint
from schedules.attention.fuse import _apply_steps, _normalize_layout
from schedules.common import match
from tests.transform_ext.attention_payloads import attention
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from transform_ext.fuse_attention_backward import fuse_attention_backward


class _Sdpa(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _joint(causal: bool):
    torch.manual_seed(0)
    imported = import_joint(_Sdpa(causal), tuple(torch.randn(1, 2, 32, 16) for _ in range(3)))
    payload = imported.module
    cleanup(payload)
    _apply_steps(payload, [_normalize_layout])
    return payload


def test_the_backward_becomes_one_call_of_the_fused_kernel():
    payload = _joint(causal=True)
    apply(payload, lambda root: fuse_attention_backward(
        match(root, "func.func"), query_tile=16, key_tile=8, causal_delta=0))
    # the forward's lse = m + log l computed beside O and passed to the kernel
    check(str(payload), """
        CHECK: func.func private @[[K:attention_backward_[0-9]+]](%{{.*}}: tensor<2x32x16xf32>, {{.*}}, %{{.*}}: tensor<2x32xf32>)
        CHECK:   linalg.transpose
        CHECK:   scf.forall (%{{.*}}) in (2)
        CHECK:     scf.for %{{.*}} = %{{.*}} to %{{.*}} step %c16
        CHECK:       affine.min
        CHECK:       tensor.extract_slice %{{.*}}[%{{.*}}, %{{.*}}] [1, 16] [1, 1] : tensor<2x32xf32> to tensor<16xf32>
        CHECK:       scf.for %{{.*}} step %c8
        CHECK:         math.exp
        CHECK:   } {lh.fused_kernel}
        CHECK: func.func @main
        CHECK:   math.log
        CHECK:   %[[R:.*]]:3 = call @[[K]](
        CHECK:   return
    """)


def test_a_mask_needs_the_causal_delta():
    payload = _joint(causal=True)
    message = apply_expect_failure(payload, lambda root: fuse_attention_backward(
        match(root, "func.func"), query_tile=16, key_tile=8))
    assert "the scores are masked but no causal delta is given" in message


def test_tiles_that_do_not_divide_the_lengths_pad_them():
    """L = S = 32 in query tiles of 12 and key tiles of 24: the kernel runs over 36 query and
    48 key rows (zeros, the padded keys masked out: a key index compared with 32), and its
    results are sliced back to 32."""
    payload = _joint(causal=False)
    apply(payload, lambda root: fuse_attention_backward(
        match(root, "func.func"), query_tile=12, key_tile=24))
    check(str(payload), """
        CHECK: func.func private @[[K:attention_backward_[0-9]+]](%{{.*}}: tensor<2x36x16xf32>, %{{.*}}: tensor<2x48x16xf32>
        CHECK:   %[[KEYS:.*]] = arith.constant 32 : index
        CHECK:   scf.forall
        CHECK:     arith.cmpi ult, %{{.*}}, %[[KEYS]] : index
        CHECK: func.func @main
        CHECK:   tensor.insert_slice %{{.*}} into %{{.*}}[0, 0, 0] [2, 32, 16] [1, 1, 1] : tensor<2x32x16xf32> into tensor<2x36x16xf32>
        CHECK:   %[[R:.*]]:3 = call @[[K]](
        CHECK:   tensor.extract_slice %[[R]]#0[0, 0, 0] [2, 32, 16] [1, 1, 1] : tensor<2x36x16xf32> to tensor<2x32x16xf32>
    """)


def test_a_forward_attention_is_refused():
    payload = parse(attention(scale="0.25"))
    message = apply_expect_failure(payload, lambda root: fuse_attention_backward(
        match(root, "func.func"), query_tile=4, key_tile=4))
    assert "expected one dS read by dQ = dS K and dK = dS^T Q, found 0" in message
