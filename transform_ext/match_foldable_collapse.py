"""match_foldable_collapse: the first collapse that fold_reshape_ops_by_expansion can fold
into every one of its readers.

In each target, walking in post-order: the first tensor.collapse_shape for which
fold_reshape_ops_by_expansion has a fold into each reader (plan_fold with several readers
allowed: grouped-query attention collapses its [kv heads, group] scores for the softmax,
read by the max, the exp and the mask). At most one op per target; the result may be empty
(matching never fails), so a schedule can fold shared collapses one per round until none is
left. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import MatchesPayload, Success, payload_ops
from .dialect import TransformExt
from .fold_reshape_ops_by_expansion import CannotFold, plan_fold


def first_foldable_collapse(root: ir.Operation) -> ir.Operation | None:
    found = []

    def visit(op):
        if not found and op.name == "tensor.collapse_shape":
            try:
                plan_fold(op, multi_use=True)
                found.append(op)
            except CannotFold:
                pass
        return ir.WalkResult.ADVANCE

    root.walk(visit)
    return found[0] if found else None


class MatchFoldableCollapseOp(TransformExt.Operation, name="match_foldable_collapse"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = [first_foldable_collapse(t)
                         for t in payload_ops(state, op.target)]
                results.set_ops(op.result, [c for c in found if c is not None])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_foldable_collapse(target: ir.Value) -> ir.Value:
    """The first collapse in each target foldable into all its readers (see the module
    docstring)."""
    return MatchFoldableCollapseOp(target).result


__all__ = ["MatchFoldableCollapseOp", "match_foldable_collapse", "first_foldable_collapse"]
