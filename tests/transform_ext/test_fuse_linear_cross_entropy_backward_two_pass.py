"""fuse_linear_cross_entropy_backward_two_pass: the joint graph's d logits and what reads it
(dh, dW, db) become two foralls, dh per block of rows over class tiles and dW, db per block
of classes over row tiles, every product a [block, k] x [k, n] tile product with no [N, V]
tensor; what it cannot take is refused with the reason, nothing rewritten. (The numerics of
the whole GPU-form schedule: tests/schedules/test_linear_cross_entropy_two_pass.py.)"""

from schedules.common import match
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
