"""match_attention: handles to the ops of the softmax attention in each target's body.

For every target (a function, or a query block's scf.forall), among the linalg ops directly
in its body:
    S = Q K^T [then elementwise: scale, mask],  m = max_j S,  E = exp(S - m),  O = E V ...
`row_max` is m (the body's one max reduction), `scores` the one contraction m reads through
elementwise ops (S), `values` the one other contraction depending on m (P V or E V). The
results list one op per target, in target order. A target whose body does not hold exactly
these is a silenceable failure naming it and the reason. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.attention import NotAttention, attention_ops
from .common import Illegal, MatchesPayload, Success, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.match_attention"


class MatchAttentionOp(TransformExt.Operation, name="match_attention"):
    target: ext.Operand[transform.AnyOpType]
    row_max: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    scores: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    values: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = []
                try:
                    for target in payload_ops(state, op.target):
                        if len(target.regions) == 0 or len(target.regions[0].blocks) == 0:
                            raise Illegal(target, "has no body")
                        try:
                            found.append(attention_ops(target))
                        except NotAttention as exc:
                            raise Illegal(target, str(exc))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for i, result in enumerate((op.row_max, op.scores, op.values)):
                    results.set_ops(result, [ops[i] for ops in found])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_attention(target: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(row max, scores contraction, P V contraction) of the attention in each target's
    body (see the module docstring)."""
    op = MatchAttentionOp(target)
    return op.row_max, op.scores, op.values


__all__ = ["MatchAttentionOp", "match_attention"]
