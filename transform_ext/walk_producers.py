"""walk_producers: the op producing operand `operand_number` of each target op, looking
through ops named in `look_through` (each followed to the producer of its first operand).

    walk_producers(contraction, 0, look_through=RESHAPES)  # the op feeding P @ V's P

The result lists each producer once, in target order. A target without such an operand, or
whose operand (after looking through) is a block argument, is a silenceable failure naming
the op. Read-only: the target handle stays valid.
"""

from typing import Sequence

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, MatchesPayload, Success, defining_op, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.walk_producers"
RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")
CASTS = ("tensor.cast", "arith.extf", "arith.truncf")


def producer_of(op: ir.Operation, operand_number: int, look_through: Sequence[str]) -> ir.Operation:
    if operand_number >= len(op.operands):
        raise Illegal(op, f"has {len(op.operands)} operands, no operand {operand_number}")
    value = op.operands[operand_number]
    seen = []
    while True:
        producer = defining_op(value)
        if producer is None:
            path = "".join(f" through {s}" for s in seen)
            raise Illegal(op, f"operand {operand_number}{path} is a block argument, not produced by an op")
        if producer.name not in look_through or not len(producer.operands):
            return producer
        seen.append(producer.name)
        value = producer.operands[0]


class WalkProducersOp(TransformExt.Operation, name="walk_producers"):
    target: ext.Operand[transform.AnyOpType]
    operand_number: ir.IntegerAttr
    look_through: ir.StringAttr  # comma-separated op names
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                n = ir.IntegerAttr(op.operand_number).value
                through = [n for n in ir.StringAttr(op.look_through).value.split(",") if n]
                found = []
                try:
                    for t in payload_ops(state, op.target):
                        p = producer_of(t, n, through)
                        if p not in found:
                            found.append(p)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.result, found)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return True

    Effects = MatchesPayload


def walk_producers(target: ir.Value, operand_number: int,
                   look_through: Sequence[str] = ()) -> ir.Value:
    """Producers of operand `operand_number` of the ops in `target`, seen through
    `look_through` ops (e.g. RESHAPES, CASTS)."""
    if operand_number < 0:
        raise ValueError(f"operand_number must be >= 0, got {operand_number}")
    i64 = ir.IntegerType.get_signless(64)
    return WalkProducersOp(target, ir.IntegerAttr.get(i64, operand_number),
                           ir.StringAttr.get(",".join(look_through))).result


__all__ = ["WalkProducersOp", "walk_producers", "producer_of", "RESHAPES", "CASTS"]
