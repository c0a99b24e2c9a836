"""gathers_to_masked_class_sums: the target logit S[n, y_n] of S = h W^T becomes a masked sum
over S's classes, sum_c (c == y_n ? S[n, c] : 0), a reduction reading S along its columns
(IR, and numerics against torch, also with non-finite logits elsewhere in the row); a
reader with a reduction loop and a gather whose row is not a loop index are refused."""

import torch

from schedules.common import match
from transform_ext.gathers_to_masked_class_sums import gathers_to_masked_class_sums
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module
from tests.transform_ext.test_fold_gathers_through_contraction import PAYLOAD as FOLD_PAYLOAD

# the gather of fold_gathers_through_contraction's test, its row index ROW
PAYLOAD = (FOLD_PAYLOAD
           .replace("(n, k) -> (n)>, affine_map<(n, k) -> (k)>, affine_map<(n, k) -> (n)>",
                    "(n) -> (n)>, affine_map<(n) -> (n)>, affine_map<(n) -> (n)>")
           .replace('["parallel", "%KIND"]', '["parallel"]')
           .replace("%s[%n, %j]", "%s[ROW, %j]"))


def _rewritten():
    payload = parse(PAYLOAD.replace("ROW", "%n"))
    apply(payload, lambda root: gathers_to_masked_class_sums(match(root, "func.func")))
    return payload


def test_the_gather_reads_a_masked_class_sum():
    payload = _rewritten()
    check(str(payload), """
        CHECK: %[[S:.*]] = linalg.matmul
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]{{.*}} ins(%arg2, %[[S]] : tensor<8xi64>, tensor<8x40xf32>)
        CHECK:   %[[J:.*]] = arith.minsi
        CHECK:   %[[C:.*]] = linalg.index 1
        CHECK:   %[[HIT:.*]] = arith.cmpi eq, %[[C]], %[[J]]
        CHECK:   arith.select %[[HIT]]
        CHECK:   arith.addf
        CHECK: linalg.generic
        CHECK-NOT: tensor.extract
        CHECK:   arith.mulf %[[X:.*]], %[[X]]
    """)


def test_masked_sums_match_torch_with_non_finite_logits_elsewhere():
    """The select keeps inf / NaN logits of other classes out of the target's sum."""
    payload = _rewritten()
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(8, 16, generator=g), torch.randn(40, 16, generator=g)
    w[3] = float("inf")          # S[:, 3] non-finite; no row targets class 3
    y = torch.tensor([0, 39, 5, 7, -100, 12, 1, 30])
    got = run_module(payload, [h, w, y], cleanup=False)[0]
    want = (h @ w.T)[torch.arange(8), y.clamp(0, 39)] ** 2
    torch.testing.assert_close(got, want)


def test_a_gather_not_at_a_loop_row_is_refused():
    payload = parse(PAYLOAD.replace("ROW", "%c0"))
    message = apply_expect_failure(payload, lambda root: gathers_to_masked_class_sums(
        match(root, "func.func")))
    assert "row index is not a loop index of its reader" in message
