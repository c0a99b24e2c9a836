"""match_row_max_reductions: the row max of a row forall, its sibling reductions and the
elementwise chain computing its input - what fuse_dependent_reduction_ops fuses into one
online loop over column tiles.

A row forall is an scf.forall (not nested in another) whose body holds a linalg max
reduction directly (match_row_max_reductions finds the first, in pre-order, under each
target). In its body: `row_max` is the first linalg reduction (not linalg.fill) with a max
combiner, `dependent` the other linalg reductions in block order (the exp-sum of a softmax),
`data` the elementwise linalg ops of the body that the row max reads through operand 0,
transitively, closest first (a widening of the input). A target without a row forall is a
silenceable failure naming it. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.classify import reduction_combiner
from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, MatchesPayload, Success, block_ops, defining_op, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.match_row_max_reductions"


def _reductions(block_owner: ir.Operation) -> list[ir.Operation]:
    return [o for o in block_ops(block_owner) if is_linalg_op(o) and o.name != "linalg.fill"
            and loop_structure(o).reduction_dims]


def has_row_max(block_owner: ir.Operation) -> bool:
    """A linalg max reduction directly in the body of `block_owner`."""
    return any(reduction_combiner(o) == "max" for o in _reductions(block_owner))


def row_foralls(root: ir.Operation) -> list[ir.Operation]:
    """The scf.forall ops under `root`, not nested in another, with a row max in their body."""
    found = []

    def visit(op):
        if op.name == "scf.forall":
            if has_row_max(op):
                found.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    getattr(root, "operation", root).walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def row_max_reductions(forall: ir.Operation):
    """(row max, dependent reductions, data chain) of a row forall's body."""
    ops = [o for o in block_ops(forall) if is_linalg_op(o)]
    reductions = _reductions(forall)
    row_max = next(o for o in reductions if reduction_combiner(o) == "max")
    dependent = [o for o in reductions if o != row_max]
    data = []
    producer = defining_op(row_max.operands[0])
    while (producer is not None and is_linalg_op(producer)
           and loop_structure(producer).is_elementwise and producer in ops):
        data.append(producer)
        producer = defining_op(producer.operands[0])
    return row_max, dependent, data


class MatchRowMaxReductionsOp(TransformExt.Operation, name="match_row_max_reductions"):
    target: ext.Operand[transform.AnyOpType]
    row_max: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    dependent: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    data: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = []
                try:
                    for target in payload_ops(state, op.target):
                        foralls = row_foralls(target)
                        if not foralls:
                            raise Illegal(target, "no scf.forall with a max reduction in its body")
                        found.append(row_max_reductions(foralls[0]))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.row_max, [m for m, _, _ in found])
                results.set_ops(op.dependent, [o for _, dependent, _ in found for o in dependent])
                results.set_ops(op.data, [o for _, _, data in found for o in data])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_row_max_reductions(target: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(row max, dependent reductions, data chain) of the first row forall under each op of
    `target` (see the module docstring)."""
    op = MatchRowMaxReductionsOp(target)
    return op.row_max, op.dependent, op.data


__all__ = ["MatchRowMaxReductionsOp", "has_row_max", "match_row_max_reductions",
           "row_foralls", "row_max_reductions"]
