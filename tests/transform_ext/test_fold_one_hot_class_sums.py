"""fold_one_hot_class_sums: the cross-entropy backward's one-hot row sum (a sum over the
classes of select(c != y_n or y_n == ignore_index, 0, -1/count)) becomes an op over the rows
reading y_n (the count read as a scalar in its body); sums whose terms do not vanish off the target class (label smoothing's) are
left alone. (Numerics
inside the whole GPU-form schedule: tests/schedules/test_linear_cross_entropy_two_pass.py.)"""

import torch
import torch.nn.functional as F

from lighthouse.compile import cleanup
from lighthouse.ingress import import_joint
from schedules.common import match, run_schedule
from schedules.linear_cross_entropy.fuse import normalize, restructure
from tests.transform_ext.helpers import apply, check
from tests.transform_ext.test_fuse_linear_cross_entropy_backward import _joint
from transform_ext.fold_one_hot_class_sums import fold_one_hot_class_sums


class _Head(torch.nn.Module):
    def forward(self, h, w, y):
        return F.cross_entropy(F.linear(h, w), y)


def _plain_joint():
    """The restructured joint graph of a mean loss over [20, 40] logits (no smoothing)."""
    torch.manual_seed(0)
    imported = import_joint(_Head(), (torch.randn(20, 16), torch.randn(40, 16),
                                      torch.randint(0, 40, (20,))))
    payload = imported.module
    cleanup(payload)
    for step in (normalize(False), restructure):
        with payload.context:
            run_schedule(payload, step)
    return payload


def _reductions_over_the_classes(text: str) -> int:
    return text.count('iterator_types = ["parallel", "reduction"]')


def test_the_one_hot_row_sum_becomes_a_per_row_op():
    payload = _plain_joint()
    before = str(payload)
    apply(payload, lambda root: fold_one_hot_class_sums(match(root, "func.func")))
    after = str(payload)
    # the one-hot sum is gone; the max and the exp-sum stay (they read S)
    assert _reductions_over_the_classes(after) == _reductions_over_the_classes(before) - 1
    check(after, """
        CHECK: linalg.generic {indexing_maps = [#{{.*}}, #{{.*}}, #{{.*}}], iterator_types = ["parallel"]} ins(%arg2, %{{.*}} : tensor<20xi64>, tensor<20xf32>) outs(%{{.*}} : tensor<20xf32>)
        CHECK:   %[[COUNT:.*]] = tensor.extract %{{.*}}[] : tensor<f32>
        CHECK:   %[[Y:.*]] = arith.index_cast %{{.*}} : i64 to index
        CHECK:   arith.divf %{{.*}}, %[[COUNT]]
        CHECK:   arith.cmpi eq, %[[Y]], %c-100
        CHECK:   arith.select
        CHECK:   arith.cmpi sge, %[[Y]]
        CHECK:   arith.cmpi slt, %[[Y]], %{{.*}}
        CHECK:   arith.andi
        CHECK:   arith.select
        CHECK:   arith.addf
    """)



def test_sums_whose_terms_do_not_vanish_are_left_alone():
    """With label smoothing the one-hot row sum adds the smoothing term at every class
    (sum_c (s_n + onehot)): not foldable, left as it is, as are the sums reading S."""
    payload = _joint()
    before = str(payload)
    apply(payload, lambda root: fold_one_hot_class_sums(match(root, "func.func")))
    assert str(payload) == before
