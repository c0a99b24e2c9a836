"""match_query_block_ops: the attention output op and the ops computing its query rows.

For the attention in each target function (transform_ext/analysis/attention.py
attention_in, or elementwise_attention_in for one without a softmax: the op whose result is
the attention output O, and its loop dim q running with P V's rows), `output` is that op and `producers` the linalg ops of the function that
O depends on and that have a loop dim running with q (propagate_loop_dim: S, m, E, l, the
mask, Q's scale - not K's or V's chains), in reverse block order (consumers first): the
ops to fuse, one at a time, into the scf.forall that tiles O into query blocks. A target
without one attention is a silenceable failure naming it and the reason. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.attention import (NotAttention, attention_in, depends_into,
                                 elementwise_attention_in, propagate_loop_dim)
from .analysis.structure import is_linalg_op
from .common import Illegal, MatchesPayload, block_ops, match_op_and_producers
from .dialect import TransformExt

NAME = "transform_ext.match_query_block_ops"


def query_block_ops(func: ir.Operation) -> tuple[ir.Operation, list[ir.Operation]]:
    try:
        ops = attention_in(func)
    except NotAttention as exc:
        try:
            ops = elementwise_attention_in(func)
        except NotAttention:
            raise Illegal(func, str(exc))
    query = propagate_loop_dim(ops.output, ops.query_dim)
    producers = [op for op in reversed([op for op in block_ops(func) if is_linalg_op(op)])
                 if op is not ops.output and op in query and depends_into(ops.output, op)]
    return ops.output, producers


class MatchQueryBlockOpsOp(TransformExt.Operation, name="match_query_block_ops"):
    target: ext.Operand[transform.AnyOpType]
    output: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    producers: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return match_op_and_producers(NAME, op, results, state, query_block_ops,
                                          op.output, op.producers)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_query_block_ops(func: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(the attention output op, the ops computing its query rows) of each function of
    `func` (see the module docstring)."""
    op = MatchQueryBlockOpsOp(func)
    return op.output, op.producers


__all__ = ["MatchQueryBlockOpsOp", "match_query_block_ops"]
