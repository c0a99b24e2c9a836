"""match_narrow_reductions: the linalg ops that reduce into an f16 or bf16 result.

A linalg op with results, a reduction loop and an f16/bf16 result (a sum, a max, a
contraction such as batch_matmul in the narrow type): torch's CPU kernels accumulate those
in f32 and round once, which promote_reductions_to_f32 does for generics (a named one is
generalized first: structured.generalize). For a linalg.generic the reduction loop is one
of its iterator types; for a named op, one its indexing maps make a reduction
(analysis.structure).

Result: those ops nested in the target ops, in pre-order (not inside linalg bodies). The
result may be empty (matching never fails). Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import loop_structure
from .common import MatchesPayload, Success, iterator_kinds, payload_ops
from .compute_elementwise_in_f32 import is_narrow
from .dialect import TransformExt


def _narrow_result(op: ir.Operation) -> bool:
    return any(is_narrow(r.type.element_type) for r in op.results)


def is_narrow_generic_reduction(op: ir.Operation) -> bool:
    """A linalg.generic with a reduction iterator and an f16/bf16 result."""
    return (op.name == "linalg.generic" and len(op.results) > 0
            and "reduction" in iterator_kinds(op) and _narrow_result(op))


def _is_narrow_named_reduction(op: ir.Operation) -> bool:
    try:
        ls = loop_structure(op)
    except Exception:
        return False
    return bool(ls.reduction_dims) and _narrow_result(op)


def narrow_reductions(root: ir.Operation) -> list[ir.Operation]:
    """The narrow reductions under `root` (see the module docstring)."""
    found = []

    def visit(op):
        if op.name == "linalg.generic" and len(op.results):
            if is_narrow_generic_reduction(op):
                found.append(op)
            return ir.WalkResult.SKIP
        if op.name.startswith("linalg.") and op.name not in ("linalg.generic", "linalg.yield",
                                                            "linalg.index") and len(op.results):
            if _is_narrow_named_reduction(op):
                found.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    root.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


class MatchNarrowReductionsOp(TransformExt.Operation, name="match_narrow_reductions"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = [r for t in payload_ops(state, op.target) for r in narrow_reductions(t)]
                results.set_ops(op.result, found)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_narrow_reductions(target: ir.Value) -> ir.Value:
    """The linalg ops nested in `target` that reduce into an f16/bf16 result."""
    return MatchNarrowReductionsOp(target).result


__all__ = ["MatchNarrowReductionsOp", "match_narrow_reductions", "narrow_reductions",
           "is_narrow_generic_reduction"]
