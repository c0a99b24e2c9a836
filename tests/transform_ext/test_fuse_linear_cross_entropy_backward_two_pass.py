"""fuse_linear_cross_entropy_backward_two_pass: the joint graph's d logits and what reads it
(dh, dW, db) become two foralls, dh per block of rows over class tiles and dW, db per block
of classes over row tiles, every product a [block, k] x [k, n] tile product with no [N, V]
tensor; what it cannot take is refused with the reason, nothing rewritten. (The numerics of
the whole GPU-form schedule: tests/schedules/test_linear_cross_entropy_two_pass.py.)"""

import torch
import torch.nn.functional as F

from lighthouse.compile import cleanup
from lighthouse.ingress import import_joint
from schedules.common import match, run_schedule
from schedules.linear_cross_entropy.fuse import (fold_casts, fold_gathers, normalize, restructure,
                                                 shrink_bounds)
from tests.transform_ext.helpers import apply, apply_expect_failure, check
from tests.transform_ext.test_fuse_linear_cross_entropy_backward import _joint
from transform_ext.fuse_linear_cross_entropy_backward_two_pass import (
    fuse_linear_cross_entropy_backward_two_pass)


def test_the_backward_becomes_two_passes():
    """N = 20, V = 40, D = 16: dh over 5 blocks of 4 rows (classes in tiles of 4, the logits
    tile [4, 4] rows-major), dW and db over 10 blocks of 4 classes (rows in steps of 4, the
    logits tile transposed [classes, rows]); db starts from its own init; no [20, 40] tensor
    is in the passes."""
    payload = _joint()
    apply(payload, lambda root: fuse_linear_cross_entropy_backward_two_pass(
        match(root, "func.func"), block=4, step=4))
    check(str(payload), """
        CHECK: scf.forall (%[[B:.*]]) in (5) shared_outs(%{{.*}} = %{{.*}}) -> (tensor<20x16xf32>)
        CHECK:   %[[S0:.*]] = arith.muli %[[B]], %{{.*}} : index
        CHECK:   tensor.extract_slice %arg0[%[[S0]], 0] [4, 16]
        CHECK:   scf.for %[[C:.*]] = %{{.*}} to %{{.*}} step %{{.*}} iter_args(%{{.*}} = %{{.*}}) -> (tensor<4x16xf32>)
        CHECK:     tensor.extract_slice %{{.*}}[%[[C]], 0] [4, 16]
        CHECK:     linalg.generic {{.*}}["parallel", "parallel", "reduction"]{{.*}} outs(%{{.*}} : tensor<4x4xf32>)
        CHECK:     math.exp
        CHECK:     linalg.index 1
        CHECK:     linalg.generic {{.*}}["parallel", "parallel", "reduction"]{{.*}} outs(%{{.*}} : tensor<4x16xf32>)
        CHECK:   tensor.parallel_insert_slice %{{.*}}[%[[S0]], 0] [4, 16] [1, 1] : tensor<4x16xf32> into tensor<20x16xf32>
        CHECK: } {lh.linear_ce_backward_pass = 1 : i64}
        CHECK: scf.forall (%[[K:.*]]) in (10) shared_outs({{.*}}) -> (tensor<40x16xf32>, tensor<40xf32>)
        CHECK:   scf.for %{{.*}} iter_args({{.*}}) -> (tensor<4x16xf32>, tensor<4xf32>)
        CHECK:     linalg.generic {{.*}}["parallel", "parallel", "reduction"]{{.*}} outs(%{{.*}} : tensor<4x4xf32>)
        CHECK:     linalg.index 0
        CHECK:     linalg.generic {{.*}}["parallel", "parallel", "reduction"]{{.*}} outs(%{{.*}} : tensor<4x16xf32>)
        CHECK:     linalg.generic {{.*}}["parallel", "reduction"]{{.*}} outs(%{{.*}} : tensor<4xf32>)
        CHECK: } {lh.linear_ce_backward_pass = 2 : i64}
        CHECK: return
    """)
    text = str(payload)
    passes = text[text.index("scf.forall"):text.index("lh.linear_ce_backward_pass = 2")]
    assert "20x40" not in passes and "40x20" not in passes


def test_blocks_that_do_not_divide_are_refused():
    """No remainder blocks in this form: a tile that divides neither N nor V is refused
    naming the extent, the payload unchanged."""
    payload = _joint()
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: fuse_linear_cross_entropy_backward_two_pass(
        match(root, "func.func"), block=8, step=4))
    assert "the rows (20) are not a multiple of the block (8) of the two-pass backward" \
        in message
    assert str(payload) == before


def test_a_gradient_read_by_another_op_is_refused():
    payload = _joint(returns_logits=True)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: fuse_linear_cross_entropy_backward_two_pass(
        match(root, "func.func"), block=4, step=4))
    assert "fuse_linear_cross_entropy_backward_two_pass" in message
    assert str(payload) == before


class _WeightedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 40)
        self.register_buffer("w", torch.rand(40) + 0.5)

    def forward(self, h, y):
        return F.cross_entropy(self.head(h), y, weight=self.w)


def _weighted_joint():
    torch.manual_seed(0)
    y = torch.randint(0, 40, (20,))
    y[::3] = -100
    imported = import_joint(_WeightedHead(), (torch.randn(20, 16), y))
    payload = imported.module
    cleanup(payload)
    for step in (normalize(False), fold_casts, restructure, shrink_bounds, fold_gathers):
        with payload.context:
            run_schedule(payload, step)
    return payload


def test_class_weights_are_gathered_per_row_and_the_bias_per_block():
    """With class weights and a bias: w[y_n] is gathered once per row, not per element of a
    tile (hoisted out of G and db's column sum): pass 1 gathers its block's rows before its
    class loop, pass 2 the tile's rows (its columns) in its row loop; pass 2 slices the bias
    of its classes once, before its loop; no gather is left in a 2-D tile's body."""
    payload = _weighted_joint()
    apply(payload, lambda root: fuse_linear_cross_entropy_backward_two_pass(
        match(root, "func.func"), block=4, step=4))
    text = str(payload)
    check(text, """
        CHECK: scf.forall (%{{.*}}) in (5)
        CHECK:   linalg.generic {{.*}}iterator_types = ["parallel"]} ins(%{{.*}} : tensor<4xi64>) outs(%{{.*}} : tensor<4xf32>)
        CHECK:     tensor.extract %{{.*}}[%{{.*}}] : tensor<40xf32>
        CHECK:   scf.for
        CHECK: } {lh.linear_ce_backward_pass = 1 : i64}
        CHECK: scf.forall (%[[K:.*]]) in (10)
        CHECK:   %[[C0:.*]] = arith.muli %[[K]]
        CHECK:   tensor.extract_slice %arg{{.*}}[%[[C0]]] [4] [1] : tensor<40xf32> to tensor<4xf32>
        CHECK:   scf.for
        CHECK:     linalg.generic {{.*}}iterator_types = ["parallel"]} ins(%{{.*}} : tensor<4xi64>) outs(%{{.*}} : tensor<4xf32>)
        CHECK:       tensor.extract %{{.*}}[%{{.*}}] : tensor<40xf32>
        CHECK: } {lh.linear_ce_backward_pass = 2 : i64}
    """)
    passes = text[text.index("scf.forall"):]
    assert passes.count("tensor.extract %cst") == 3   # pass 1 once, pass 2 for G and db
    for body in passes.split("linalg.generic")[1:]:
        header, _, rest = body.partition("^bb0")
        block = rest.split("linalg.yield")[0]
        if '"parallel", "parallel"' in header or '"parallel", "reduction"' in header:
            assert "tensor.extract " not in block, header[:200]
