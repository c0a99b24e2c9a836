"""match_logits_contraction: the logits contraction S = h W^T that a function's loss reads.

    %logits = transform_ext.match_logits_contraction %func

For every target (a function, or a loop whose body holds the loss: a row block's
scf.forall), the contraction that the one row max over the classes (the loss's
log-softmax) directly in its body reads through elementwise ops (a bias add, a rounding to
bf16): S = h W^T, written [rows, classes] or, once stored classes-major, [classes, rows]
(transform_ext/analysis/logits.py: row_max_contraction). One op per target, in target
order. A target without one is a silenceable failure naming it and the reason. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.logits import NotLogits, row_max_contraction
from .common import Illegal, MatchesPayload, Success, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.match_logits_contraction"


class MatchLogitsContractionOp(TransformExt.Operation, name="match_logits_contraction"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = []
                try:
                    for target in payload_ops(state, op.target):
                        if len(target.regions) != 1 or len(target.regions[0].blocks) != 1:
                            raise Illegal(target, "has no body")
                        try:
                            found.append(row_max_contraction(target.regions[0].blocks[0]))
                        except NotLogits as exc:
                            raise Illegal(target, str(exc))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.result, found)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_logits_contraction(target: ir.Value) -> ir.Value:
    """The logits contraction of each target function (see the module docstring)."""
    return MatchLogitsContractionOp(target).result


__all__ = ["MatchLogitsContractionOp", "match_logits_contraction"]
