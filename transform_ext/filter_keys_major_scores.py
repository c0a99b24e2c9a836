"""filter_keys_major_scores: the scores contractions store_scores_keys_major accepts.

Keeps, in order, the ops of the target handle that meet store_scores_keys_major's
preconditions (a linalg.generic contraction S = Q K^T over [..., queries, keys], Q read as
[..., queries, d], every reader of S and of the elementwise values computed from it a
linalg.generic reading it as an input, computed into tensor.empty or fills of one). The
result may be empty (filtering never fails), so a schedule can relayout the scores where
the keys-major layout applies and leave the queries-major layout, which works for every
attention, elsewhere. Read-only: the target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, MatchesPayload, Success, payload_ops
from .dialect import TransformExt
from .store_scores_keys_major import plan


def accepts(scores: ir.Operation) -> bool:
    try:
        plan(scores)
    except Illegal:
        return False
    return True


class FilterKeysMajorScoresOp(TransformExt.Operation, name="filter_keys_major_scores"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                results.set_ops(op.result, [t for t in targets if accepts(t)])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def filter_keys_major_scores(scores: ir.Value) -> ir.Value:
    """The ops of `scores` that store_scores_keys_major can relayout (see the module
    docstring)."""
    return FilterKeysMajorScoresOp(scores).result


__all__ = ["FilterKeysMajorScoresOp", "filter_keys_major_scores"]
