"""match_key_loop_ops: in each query block, the contraction over the keys of an attention
without a softmax and the ops computing its key tiles.

For every target (a query block's scf.forall), among the linalg ops directly in its body:

    S = Q K^T,  P = f(S) elementwise (scale, mask, ReLU),  O = P V

(transform_ext/analysis/attention.py elementwise_attention_pairs: exactly one such pair).
`values` is O's contraction and `producers` the ops O depends on that have a loop dim
running with its key dim (propagate_loop_dim: f's ops, S and its fill, a mask computed
from indices, K's chain when it is in the body - not Q's chain or O's fill; in a query
block K and V are read from outside), in reverse block order (consumers first): the ops
to fuse, one at a time, into the loop that tiles O's reduction over the keys, so that S
exists one key tile at a time. A target without one such pair is a silenceable failure
naming it. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.attention import depends_into, elementwise_attention_pairs, propagate_loop_dim
from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, MatchesPayload, block_ops, match_op_and_producers
from .dialect import TransformExt

NAME = "transform_ext.match_key_loop_ops"


def key_loop_ops(block: ir.Operation) -> tuple[ir.Operation, list[ir.Operation]]:
    if len(block.regions) == 0 or len(block.regions[0].blocks) == 0:
        raise Illegal(block, "has no body")
    ops = [op for op in block_ops(block) if is_linalg_op(op)]
    pairs = elementwise_attention_pairs(ops)
    if len(pairs) != 1:
        raise Illegal(block, f"expected one contraction over the keys of an elementwise map "
                             f"of Q K^T, found {len(pairs)}")
    values = pairs[0][1]
    keys = propagate_loop_dim(values, loop_structure(values).reduction_dims[0])
    producers = [op for op in reversed(ops)
                 if op != values and op in keys and depends_into(values, op)]
    return values, producers


class MatchKeyLoopOpsOp(TransformExt.Operation, name="match_key_loop_ops"):
    target: ext.Operand[transform.AnyOpType]
    values: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    producers: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return match_op_and_producers(NAME, op, results, state, key_loop_ops,
                                          op.values, op.producers)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_key_loop_ops(target: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(the contraction over the keys, the ops computing its key tiles) of the attention
    without a softmax in each target's body (see the module docstring)."""
    op = MatchKeyLoopOpsOp(target)
    return op.values, op.producers


__all__ = ["MatchKeyLoopOpsOp", "match_key_loop_ops"]
