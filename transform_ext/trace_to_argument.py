"""trace_to_argument: the block argument an operand of each target op is computed from,
following first operands through elementwise linalg ops.

    v_0 = operand `operand_number` of the target;  v_{j+1} = operand 0 of v_j's producer
until v_j is a block argument (a function's input), or the result of a tensor.collapse_shape
/ expand_shape of one (one row of logits [1, C] folded to [C]: the value the ops read).
Every producer on the way must be an elementwise linalg op (a cast to f32, a scaling);
any other is a silenceable failure naming the target and that producer. The result holds
one value per target, in target order (a value handle). Read-only.

    %x = transform_ext.trace_to_argument %row_max {operand_number = 0}   # the logits
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, MatchesPayload, Success, defining_op, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.trace_to_argument"
RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")


def traced_argument(op: ir.Operation, operand_number: int) -> ir.Value:
    if operand_number >= len(op.operands):
        raise Illegal(op, f"it has {len(op.operands)} operands, no operand {operand_number}")
    value = op.operands[operand_number]
    while not isinstance(value, ir.BlockArgument):
        producer = defining_op(value)
        if producer.name in RESHAPES and isinstance(producer.operands[0], ir.BlockArgument):
            return value
        if not is_linalg_op(producer) or not loop_structure(producer).is_elementwise:
            raise Illegal(op, f"operand {operand_number} is computed by {producer.name}, not "
                              f"elementwise from a block argument")
        value = producer.operands[0]
    return value


class TraceToArgumentOp(TransformExt.Operation, name="trace_to_argument"):
    target: ext.Operand[transform.AnyOpType]
    operand_number: ir.IntegerAttr
    result: ext.Result[transform.AnyValueType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                n = ir.IntegerAttr(op.operand_number).value
                try:
                    values = [traced_argument(t, n)
                              for t in payload_ops(state, op.target)]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_values(op.result, values)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return True

    Effects = MatchesPayload


def trace_to_argument(target: ir.Value, operand_number: int = 0) -> ir.Value:
    """The block argument operand `operand_number` of each op in `target` is computed from
    elementwise (see the module docstring)."""
    if operand_number < 0:
        raise ValueError(f"operand_number must be >= 0, got {operand_number}")
    i64 = ir.IntegerType.get_signless(64)
    return TraceToArgumentOp(target, ir.IntegerAttr.get(i64, operand_number)).result


__all__ = ["TraceToArgumentOp", "trace_to_argument", "traced_argument"]
