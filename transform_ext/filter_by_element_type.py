"""filter_by_element_type: the payload ops of a handle that work on tensors of one element type.

Keeps, in order, the ops of `target` (not their nested ops) with an operand or a result
that is a ranked tensor of element type `element_type`, e.g. the linalg ops on i1 tensors,
which widen_bool_tensors wants as generics. The result may be empty (matching never
fails). Read-only: the target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import MatchesPayload, Success, payload_ops
from .dialect import TransformExt


def works_on(op: ir.Operation, element_type: ir.Type) -> bool:
    """Has `op` a ranked tensor operand or result of `element_type`?"""
    return any(isinstance(v.type, ir.RankedTensorType) and v.type.element_type == element_type
               for v in list(op.operands) + list(op.results))


class FilterByElementTypeOp(TransformExt.Operation, name="filter_by_element_type"):
    target: ext.Operand[transform.AnyOpType]
    element_type: ir.TypeAttr
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                element_type = ir.TypeAttr(op.element_type).value
                kept = [t for t in payload_ops(state, op.target) if works_on(t, element_type)]
                results.set_ops(op.result, kept)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return True

    Effects = MatchesPayload


def filter_by_element_type(target: ir.Value, element_type: ir.Type) -> ir.Value:
    """The ops of `target` with a ranked tensor operand or result of `element_type`."""
    return FilterByElementTypeOp(target, element_type=ir.TypeAttr.get(element_type)).result


__all__ = ["FilterByElementTypeOp", "filter_by_element_type", "works_on"]
