"""drop_unpack_destination_fill: an unpack into a filled tensor unpacks into the fill's init.

    %d = linalg.fill ins(%v) outs(%init)             %r = linalg.unpack %p ... into %init
    %r = linalg.unpack %p ... into %d           ->

linalg.unpack writes every element of its destination (the packed tiles cover it; their
padding is dropped), so the values of %d are never read: the unpack may write into %init
instead, and the fill, if nothing else reads it, is left dead for canonicalization. The
matmul schedule's unpack of the packed accumulator C_p would otherwise compute the zeros
of C only to overwrite them.

Targets: linalg.unpack ops whose destination is the result of a linalg.fill on tensors
(else a silenceable failure naming the op, nothing rewritten). The unpacks change in
place; the handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, RewritesTargets, Success, defining_op, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.drop_unpack_destination_fill"


def _fill_of_destination(unpack: ir.Operation) -> ir.Operation:
    if unpack.name != "linalg.unpack":
        raise Illegal(unpack, "not a linalg.unpack")
    fill = defining_op(unpack.operands[1])
    if fill is None or fill.name != "linalg.fill":
        raise Illegal(unpack, "its destination is not the result of a linalg.fill")
    if not isinstance(fill.operands[1].type, ir.RankedTensorType):
        raise Illegal(unpack, "its destination's fill does not work on tensors")
    return fill


class DropUnpackDestinationFillOp(TransformExt.Operation, name="drop_unpack_destination_fill"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    fills = [_fill_of_destination(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for unpack, fill in zip(targets, fills):
                    unpack.operands[1] = fill.operands[1]
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def drop_unpack_destination_fill(target: ir.Value) -> DropUnpackDestinationFillOp:
    """Make the unpacks in `target` write into their destination fill's init."""
    return DropUnpackDestinationFillOp(target)


__all__ = ["DropUnpackDestinationFillOp", "drop_unpack_destination_fill"]
