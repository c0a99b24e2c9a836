"""sink_returned_reshapes: the reshapes a function only returns move right before its return.

    %g = ...                                       (the [B * T, C] gradient)
    %r = tensor.expand_shape %g [[0, 1], [2]]      (read by func.return only)
    ...                                            (ops computing other results)
    return %loss, %r
  =>  ...; %r = tensor.expand_shape %g ...; return %loss, %r

Only the op order changes and a moved reshape still follows its operand's definition, so
the function computes the same values. Why: a kernel built later from the reshape's
operand (an scf.forall merging the gradient with the loss, placed after the loss's ops)
then still dominates the reshape.

Target: func.func ops; else a silenceable failure naming it (nothing moved). Moved: each
tensor.collapse_shape / expand_shape directly in the function's block whose every user is
its func.return, in block order. The handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import (Illegal, RewritesTargets, Success, block_ops, fail, payload_ops,
                     result_users)
from .dialect import TransformExt

NAME = "transform_ext.sink_returned_reshapes"
RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")


def returned_reshapes(func: ir.Operation) -> list[ir.Operation]:
    """The reshapes of `func`'s block read only by its return, in block order."""
    return [op for op in block_ops(func.regions[0].blocks[0]) if op.name in RESHAPES
            and all(user.name == "func.return" for user in result_users(op))]


class SinkReturnedReshapesOp(TransformExt.Operation, name="sink_returned_reshapes"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for func in targets:
                        if func.name != "func.func" or not len(func.regions[0].blocks):
                            raise Illegal(func, "not a func.func with a body")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for func in targets:
                    block = func.regions[0].blocks[0]
                    ret = block_ops(block)[-1]
                    for reshape in returned_reshapes(func):
                        reshape.move_before(ret)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def sink_returned_reshapes(func: ir.Value) -> SinkReturnedReshapesOp:
    """Move the reshapes each function of `func` only returns before its return."""
    return SinkReturnedReshapesOp(func)


__all__ = ["SinkReturnedReshapesOp", "returned_reshapes", "sink_returned_reshapes"]
