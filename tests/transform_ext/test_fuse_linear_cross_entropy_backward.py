"""fuse_linear_cross_entropy_backward: the joint graph's d logits and what reads it (dh,
dW, and db: after the loss's restructure a reduction over the rows of the logits with the
d logits' body inlined) become one loop over row blocks (a fused kernel) of foralls over
the threads' class tiles; what it cannot take is refused with the reason, nothing
rewritten."""

import torch
import torch.nn.functional as F

from lighthouse.compile import cleanup
from lighthouse.ingress import import_joint
from schedules.common import match, run_schedule
from schedules.linear_cross_entropy.fuse import (fold_casts, fold_gathers, normalize, restructure,
                                                 shrink_bounds)
from tests.transform_ext.helpers import apply, apply_expect_failure, check
from transform_ext.fuse_linear_cross_entropy_backward import fuse_linear_cross_entropy_backward


class _Head(torch.nn.Module):
    def __init__(self, returns_logits=False, d=16, v=40, dtype=torch.float32):
        super().__init__()
        self.head = torch.nn.Linear(d, v, dtype=dtype)
        self.returns_logits = returns_logits

    def forward(self, h, y):
        logits = self.head(h)
        loss = F.cross_entropy(logits, y, label_smoothing=0.1)
        return (loss, logits * 2) if self.returns_logits else loss


def _joint(returns_logits=False, n=20, d=16, v=40, dtype=torch.float32):
    torch.manual_seed(0)
    imported = import_joint(_Head(returns_logits, d, v, dtype),
                            (torch.randn(n, d).to(dtype), torch.randint(0, v, (n,))))
    payload = imported.module
    cleanup(payload)
    for step in (normalize(False), fold_casts, restructure, shrink_bounds, fold_gathers):
        with payload.context:
            run_schedule(payload, step)
    return payload


def test_the_backward_becomes_one_loop_nest():
    payload = _joint()
    apply(payload, lambda root: fuse_linear_cross_entropy_backward(
        match(root, "func.func"), row_tile=8, class_tile=16, threads=2, panel=0))
    check(str(payload), """
        CHECK: linalg.fill {{.*}} -> tensor<40x16xf32>
        CHECK: scf.for %[[S:.*]] = %{{.*}} to %{{.*}} step %{{.*}} iter_args({{.*}}) -> (tensor<20x16xf32>, tensor<40x16xf32>, tensor<40xf32>)
        CHECK:   tensor.extract_slice %arg0[%[[S]], 0] [8, 16]
        CHECK:   linalg.transpose
        CHECK:   scf.forall (%{{.*}}) in (2) shared_outs({{.*}}) -> (tensor<2x8x16xf32>, tensor<40x16xf32>, tensor<40xf32>)
        CHECK:     scf.for {{.*}} -> (tensor<8x16xf32>, tensor<?x16xf32>, tensor<?xf32>)
        CHECK:       linalg.generic {{.*}}["parallel", "parallel", "reduction"]{{.*}} outs(%{{.*}} : tensor<16x8xf32>)
        CHECK:       math.exp
        CHECK:       linalg.index 0
        CHECK:       linalg.generic {{.*}}["parallel", "reduction"]{{.*}} outs(%{{.*}} : tensor<16xf32>)
        CHECK:   } {lh.fused_kernel}
        CHECK: return
    """)
    text = str(payload)
    assert "tensor<20x40xf32>" not in text.split("scf.for", 1)[1]


def test_stored_logits_are_read_per_tile():
    """stored_logits: S^T [V, N] is S read transposed once before the loop nest, and each
    class tile reads its [classes, rows] slice of it (the last class tile, 40 mod 16, and
    the last row block, 20 mod 8, too) instead of recomputing W_c h_s^T: the only products
    over D left are dh's and dW's."""
    payload = _joint()
    apply(payload, lambda root: fuse_linear_cross_entropy_backward(
        match(root, "func.func"), row_tile=8, class_tile=16, threads=2, panel=0,
        stored_logits=True))
    check(str(payload), """
        CHECK: %[[S:.*]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<20x40xf32>)
        CHECK: %[[ST:.*]] = linalg.generic {{.*}} ins(%[[S]] : tensor<20x40xf32>) outs(%{{.*}} : tensor<40x20xf32>)
        CHECK: scf.for %[[R:.*]] = %{{.*}} to %{{.*}} step %{{.*}} iter_args
        CHECK:   scf.forall
        CHECK:     scf.for %[[C:.*]] = %{{.*}} to %{{.*}} step
        CHECK:       tensor.extract_slice %[[ST]][%[[C]], %[[R]]] [16, 8]
        CHECK:   } {lh.fused_kernel}
        CHECK: tensor.extract_slice %[[ST]][%{{.*}}, %{{.*}}] [16, 4]
        CHECK: tensor.extract_slice %[[ST]][%{{.*}}, %{{.*}}] [8, 4]
        CHECK: return
    """)
    def reductions(module) -> int:  # in the loop over the row blocks
        return str(module).split("linalg.generic", 1)[1].split("{lh.fused_kernel}", 1)[0].count(
            '"reduction"]')

    # the threads' class tiles and the last class tile each read S^T instead of a product
    assert reductions(payload) == reductions(_recomputed()) - 2


def _recomputed():
    payload = _joint()
    apply(payload, lambda root: fuse_linear_cross_entropy_backward(
        match(root, "func.func"), row_tile=8, class_tile=16, threads=2, panel=0))
    return payload


def test_bf16_products_in_pairs_for_amx_tiles():
    """With bf16_pairs and amx, the three products of a class tile whose extents are
    multiples of 32 read bf16 pairs and are marked lh.amx_product: S^T from W's rows in
    place and h_s^T in pairs, dW from G^T's rows in place and h_s's pairs of rows, dh from
    G's rows in place and W's pairs of classes, packed once before the row blocks."""
    payload = _joint(n=64, d=64, v=128, dtype=torch.bfloat16)
    apply(payload, lambda root: fuse_linear_cross_entropy_backward(
        match(root, "func.func"), row_tile=32, class_tile=32, threads=2, bf16_pairs=True,
        amx=True))
    check(str(payload), """
        CHECK: %[[WP:.*]] = linalg.transpose ins(%{{.*}} : tensor<64x2x64xbf16>) outs(%{{.*}} : tensor<64x64x2xbf16>) permutation = [0, 2, 1]
        CHECK: scf.for
        CHECK:   linalg.transpose ins(%{{.*}} : tensor<32x32x2xbf16>) outs(%{{.*}} : tensor<32x32x2xbf16>) permutation = [1, 0, 2]
        CHECK:   linalg.transpose ins(%{{.*}} : tensor<16x2x64xbf16>) outs(%{{.*}} : tensor<16x64x2xbf16>) permutation = [0, 2, 1]
        CHECK:   scf.forall
        CHECK:     linalg.generic {{.*}}["parallel", "parallel", "reduction", "reduction"]{{.*}} ins(%{{.*}}, %{{.*}} : tensor<32x32x2xbf16>, tensor<32x32x2xbf16>) outs(%{{.*}} : tensor<32x32xf32>) attrs =  {lh.amx_product}
        CHECK:     tensor.extract_slice %[[WP]]
        CHECK:     linalg.generic {{.*}}["parallel", "parallel", "reduction", "reduction"]{{.*}} ins(%{{.*}}, %{{.*}} : tensor<32x16x2xbf16>, tensor<16x64x2xbf16>) outs(%{{.*}} : tensor<32x64xf32>) attrs =  {lh.amx_product}
        CHECK:     linalg.generic {{.*}}["parallel", "parallel", "reduction", "reduction"]{{.*}} ins(%{{.*}}, %{{.*}} : tensor<32x16x2xbf16>, tensor<16x64x2xbf16>) outs(%{{.*}} : tensor<32x64xf32>) attrs =  {lh.amx_product}
    """)
    plain = _joint(n=64, d=64, v=128, dtype=torch.bfloat16)
    apply(plain, lambda root: fuse_linear_cross_entropy_backward(
        match(root, "func.func"), row_tile=32, class_tile=32, threads=2, bf16_pairs=True))
    assert "lh.amx_product" not in str(plain)


def test_a_gradient_read_by_another_op_is_refused():
    payload = _joint(returns_logits=True)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: fuse_linear_cross_entropy_backward(
        match(root, "func.func"), row_tile=8, class_tile=16, threads=2))
    assert "fuse_linear_cross_entropy_backward" in message
    assert str(payload) == before
