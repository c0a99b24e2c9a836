"""filter_iterators: the linalg.generic ops of a handle with exactly the given iterator types.

    %sums = transform_ext.filter_iterators %ops {iterators = "reduction,reduction"}

Keeps, in order, the ops of `target` (not their nested ops: use structured.match to walk)
that are linalg.generic ops whose iterator_types are `iterators` (comma-separated
"parallel"/"reduction", one per loop; "" keeps the generics without loops). The result may be
empty (matching never fails). Read-only: the target handle stays valid.
"""

from typing import Sequence

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import MatchesPayload, Success, iterator_kinds, payload_ops
from .dialect import TransformExt

KINDS = ("parallel", "reduction")


class FilterIteratorsOp(TransformExt.Operation, name="filter_iterators"):
    target: ext.Operand[transform.AnyOpType]
    iterators: ir.StringAttr
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                want = [k for k in ir.StringAttr(op.iterators).value.split(",") if k]
                kept = [t for t in payload_ops(state, op.target)
                        if t.name == "linalg.generic" and iterator_kinds(t) == want]
                results.set_ops(op.result, kept)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return True

    Effects = MatchesPayload


def filter_iterators(target: ir.Value, iterators: Sequence[str]) -> ir.Value:
    """The generics of `target` whose iterator types are `iterators` (module docstring)."""
    if any(k not in KINDS for k in iterators):
        raise ValueError(f"iterators must be {' or '.join(KINDS)}, got {list(iterators)}")
    return FilterIteratorsOp(target, ir.StringAttr.get(",".join(iterators))).result


__all__ = ["FilterIteratorsOp", "filter_iterators"]
