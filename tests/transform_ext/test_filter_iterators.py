"""filter_iterators: of the loss's generics, the two reductions over the classes, the count
and loss sum over the rows, and the mean (no loops), each by its iterator types (FileCheck on
the annotated payload); unknown iterator kinds are refused by the builder."""

import pytest
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.filter_iterators import filter_iterators
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.loss_payloads import LOSS


def test_generics_by_iterator_types():
    payload = parse(LOSS)

    def body(root):
        generics = match(root, "linalg.generic")
        transform.AnnotateOp(filter_iterators(generics, ["parallel", "reduction"]), "class_sum")
        transform.AnnotateOp(filter_iterators(generics, ["reduction"]), "row_sum")
        transform.AnnotateOp(filter_iterators(generics, []), "scalar")

    apply(payload, body)
    text = str(payload)
    check(text, """
        CHECK: iterator_types = ["parallel", "reduction"]{{.*}} attrs =  {class_sum}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.maximumf
        CHECK: iterator_types = ["parallel", "reduction"]{{.*}} attrs =  {class_sum}
        CHECK: iterator_types = ["reduction"]{{.*}} attrs =  {row_sum}
        CHECK: iterator_types = ["reduction"]{{.*}} attrs =  {row_sum}
        CHECK: iterator_types = []{{.*}} attrs =  {scalar}
    """)
    assert (text.count("class_sum"), text.count("row_sum"), text.count("scalar")) == (2, 2, 1)


def test_rejects_unknown_iterator_kinds():
    payload = parse(LOSS)
    with pytest.raises(ValueError, match="iterators must be parallel or reduction"):
        apply(payload, lambda root: filter_iterators(match(root, "linalg.generic"), ["window"]))
