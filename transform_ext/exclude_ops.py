"""exclude_ops: the payload ops of `target` that are not in `excluded`, in target order.

    %consumers = transform_ext.exclude_ops %class_sums, %row_max   # the sums but the max

A set difference of handles (upstream has merge_handles for the union): the result may be
empty, matching never fails. Read-only: both handles stay valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import MatchesPayload, Success, payload_ops
from .dialect import TransformExt


class ExcludeOpsOp(TransformExt.Operation, name="exclude_ops"):
    target: ext.Operand[transform.AnyOpType]
    excluded: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                excluded = payload_ops(state, op.excluded)
                kept = [t for t in payload_ops(state, op.target) if t not in excluded]
                results.set_ops(op.result, kept)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return True

    Effects = MatchesPayload


def exclude_ops(target: ir.Value, excluded: ir.Value) -> ir.Value:
    """The ops of `target` not in `excluded`."""
    return ExcludeOpsOp(target, excluded).result


__all__ = ["ExcludeOpsOp", "exclude_ops"]
