"""match_class_reductions: the reductions over the classes of a row max.

    %sums = transform_ext.match_class_reductions %row_max

The classes are the loop dims that run with the target's reduced dim (one union-find of
loop and tensor dims over the linalg ops of its block, transform_ext/analysis/dims.py). The
result holds, in block order, every linalg op of that block but the target with exactly one
reduction dim, a class dim: the exp-sum of a log_softmax, its gathers and class sums. The
target must be one op with one reduction dim; else a silenceable failure. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import loop_structure
from .common import Illegal, MatchesPayload, Success, fail, payload_ops
from .dialect import TransformExt
from .split_class_reductions import axis_of

NAME = "transform_ext.match_class_reductions"


def class_reductions(target_ops: list) -> list[ir.Operation]:
    axis, k, ops, classes = axis_of(target_ops)
    found = []
    for op in ops:
        ls = loop_structure(op)
        if op != axis and len(ls.reduction_dims) == 1 and \
                classes.same((op, ls.reduction_dims[0]), (axis, k)):
            found.append(op)
    return found


class MatchClassReductionsOp(TransformExt.Operation, name="match_class_reductions"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    found = class_reductions(targets)
                except Illegal as illegal:
                    if illegal.payload is None:
                        illegal.payload = op.operation
                    return fail(NAME, illegal)
                results.set_ops(op.result, found)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return True

    Effects = MatchesPayload


def match_class_reductions(row_max: ir.Value) -> ir.Value:
    """The reductions over the classes of `row_max` (see the module docstring)."""
    return MatchClassReductionsOp(row_max).result


__all__ = ["MatchClassReductionsOp", "match_class_reductions", "class_reductions"]
