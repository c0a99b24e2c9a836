"""add_unread_input: each target op that does not read `value` gets it as one more input,
read through the loops that run with its dims and unread by the body.

For a linalg.generic over loops (d_0, .., d_n) and a value V of rank r whose dim p runs with
loop l_p (one union-find of loop and tensor dims over the linalg ops of the op's block,
transform_ext/analysis/dims.py), the op becomes the same op with V through
    (d_0, .., d_n) -> (d_{l_0}, .., d_{l_{r-1}})
as a last input: it computes the same values (the body ignores the new argument), and its
loops are now visibly bounded by V. The cross-entropy's row sum of a one-hot gradient reads
only the targets and loop indices; with the logits as an unread input the class-loop fusion
sees that it runs over the logits' classes.

Legality first: every target op not reading V is a linalg.generic, and for every dim of V
one of its loops runs with it; V is one ranked tensor. Else a silenceable failure naming
the op (nothing rewritten). The target handle is consumed (the ops are rebuilt; discardable
attributes are kept).
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.dims import DimClasses
from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, Success, append_input, block_ops, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.add_unread_input"


def input_map(op: ir.Operation, value: ir.Value, classes: DimClasses) -> ir.AffineMap:
    if op.name != "linalg.generic":
        raise Illegal(op, "not a linalg.generic")
    ls = loop_structure(op)
    dims = []
    for p in range(value.type.rank):
        loop = next((l for l in range(ls.num_loops) if classes.same((op, l), (value, p))), None)
        if loop is None:
            raise Illegal(op, f"none of its loops runs with dim {p} of the value")
        dims.append(ir.AffineDimExpr.get(loop))
    return ir.AffineMap.get(ls.num_loops, 0, dims)


class AddUnreadInputOp(TransformExt.Operation, name="add_unread_input"):
    target: ext.Operand[transform.AnyOpType]
    value: ext.Operand[transform.AnyValueType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                values = list(state.get_payload_values(op.value))
                plan = []
                try:
                    if len(values) != 1 or not isinstance(values[0].type, ir.RankedTensorType):
                        raise Illegal(targets[0] if targets else op.operation,
                                      f"the value must be one ranked tensor, got "
                                      f"{[str(v.type) for v in values]}")
                    value = values[0]
                    classes = {}
                    for t in targets:
                        if any(v == value for v in t.operands):
                            continue
                        if t.block not in classes:
                            classes[t.block] = DimClasses(
                                [o for o in block_ops(t.block) if is_linalg_op(o)])
                        plan.append((t, input_map(t, value, classes[t.block])))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for t, amap in plan:
                    append_input(t, value, amap, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    class Effects(ir.MemoryEffectsOpInterface):
        @staticmethod
        def get_effects(op, effects):
            transform.consumes_handle(op.op_operands[:1], effects)
            transform.only_reads_handle(op.op_operands[1:], effects)
            transform.modifies_payload(effects)


def add_unread_input(target: ir.Value, value: ir.Value) -> AddUnreadInputOp:
    """Give the ops of `target` that do not read `value` an unread input `value` (see the
    module docstring)."""
    return AddUnreadInputOp(target, value)


__all__ = ["AddUnreadInputOp", "add_unread_input", "input_map"]
