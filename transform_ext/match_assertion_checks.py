"""match_assertion_checks: the result-less linalg.generic ops that only check assertions.

A check is a linalg.generic with no results whose body holds a `cf.assert` (what
split_assertions leaves in front of the op it split, and what the bounds checks of
clamped gathers are): it computes nothing, it only evaluates its assertions once per
point of its iteration space.

Result: the checks among the ops of each target function's entry block (not nested
deeper), in block order. The result may be empty (matching never fails). Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import MatchesPayload, Success, block_ops, payload_ops
from .dialect import TransformExt


def holds_assert(op: ir.Operation) -> bool:
    """Does linalg op `op`'s body hold a cf.assert?"""
    return any(o.operation.name == "cf.assert" for o in op.regions[0].blocks[0].operations)


def is_assertion_check(op: ir.Operation) -> bool:
    return op.name == "linalg.generic" and not op.results and holds_assert(op)


def assertion_checks(func: ir.Operation) -> list[ir.Operation]:
    """The checks in the entry block of `func` (none for a declaration or another op)."""
    if func.name != "func.func" or not len(func.regions[0].blocks):
        return []
    return [op for op in block_ops(func) if is_assertion_check(op)]


class MatchAssertionChecksOp(TransformExt.Operation, name="match_assertion_checks"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = [c for t in payload_ops(state, op.target) for c in assertion_checks(t)]
                results.set_ops(op.result, found)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_assertion_checks(target: ir.Value) -> ir.Value:
    """The assertion checks at the top level of the functions in `target`."""
    return MatchAssertionChecksOp(target).result


__all__ = ["MatchAssertionChecksOp", "match_assertion_checks", "assertion_checks",
           "is_assertion_check", "holds_assert"]
