"""match_kv_chains: the elementwise chains computing the K and V operands of an attention.

For the attention in each target (transform_ext/analysis/attention.py attention_ops: row max
m, scores S = Q K^T, P V), the linalg.generic ops that are elementwise and compute operand 0
or 1 of S or of P V, transitively through such ops, except m and the ops depending on m:
K's transpose and scale, and with grouped-query attention the repeat of K and V per query
head (what fuse_elementwise_producers merges, so drop_broadcast_dims can read K and V once
per kv head). Q's scale matches too (it is such a chain of S's other operand). Listed once
each, in the order of a depth-first walk from S's operands, then P V's. The result may be
empty. A target without one attention is a silenceable failure naming it. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.attention import NotAttention, attention_ops, depends_on
from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, MatchesPayload, Success, defining_op, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.match_kv_chains"


def kv_chains(block_owner: ir.Operation) -> list[ir.Operation]:
    try:
        row_max, scores, values = attention_ops(block_owner)
    except NotAttention as exc:
        raise Illegal(block_owner, str(exc))
    chain = []
    for contraction in (scores, values):
        pending = [defining_op(v) for v in contraction.operands[:2]]
        while pending:
            op = pending.pop()
            if op is None or op in chain or not is_linalg_op(op) or op is row_max:
                continue
            if op.name != "linalg.generic" or not loop_structure(op).is_elementwise:
                continue
            if depends_on(op, row_max.results[0]):
                continue
            chain.append(op)
            pending.extend(defining_op(v) for v in op.operands)
    return chain


class MatchKvChainsOp(TransformExt.Operation, name="match_kv_chains"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = []
                try:
                    for target in payload_ops(state, op.target):
                        found += kv_chains(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.result, found)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_kv_chains(target: ir.Value) -> ir.Value:
    """The elementwise chains computing the attention's K and V operands in each target
    (see the module docstring)."""
    return MatchKvChainsOp(target).result


__all__ = ["MatchKvChainsOp", "match_kv_chains"]
