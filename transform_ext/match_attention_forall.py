"""match_attention_forall: the query-block forall of a fused attention and its key loops.

For each target (a function after the attention family's fuse), `forall` is the first
scf.forall directly in its body whose body holds scf.for key loops (at least one), each with
two contractions directly in its body (S = Q K^T and P V; linalg.fill aside), and
`key_loops` are those loops in block order (a causal attention has two: the key tiles below
the diagonal, then the diagonal band). A target without such a forall is a silenceable
failure naming it. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, MatchesPayload, Success, block_ops, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.match_attention_forall"


def key_loops(forall: ir.Operation) -> list[ir.Operation]:
    """The scf.for ops directly in the body of `forall`, in block order."""
    return [op for op in block_ops(forall) if op.name == "scf.for"]


def contractions(loop: ir.Operation) -> list[ir.Operation]:
    """The contractions directly in the body of `loop` (not linalg.fill), in block order."""
    return [op for op in block_ops(loop)
            if is_linalg_op(op) and op.name != "linalg.fill" and loop_structure(op).is_contraction]


def attention_forall(func: ir.Operation) -> ir.Operation | None:
    """The query-block forall of `func` (see the module docstring), or None."""
    for op in block_ops(func):
        if op.name != "scf.forall":
            continue
        loops = key_loops(op)
        if loops and all(len(contractions(loop)) == 2 for loop in loops):
            return op
    return None


class MatchAttentionForallOp(TransformExt.Operation, name="match_attention_forall"):
    target: ext.Operand[transform.AnyOpType]
    forall: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    key_loops: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                foralls = []
                try:
                    for target in payload_ops(state, op.target):
                        forall = attention_forall(target)
                        if forall is None:
                            raise Illegal(target, "no scf.forall whose key loops each hold two "
                                                  "contractions (S = Q K^T and P V)")
                        foralls.append(forall)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.forall, foralls)
                results.set_ops(op.key_loops, [loop for f in foralls for loop in key_loops(f)])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_attention_forall(func: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(the query-block forall, its key loops) of each function of `func` (see the module
    docstring)."""
    op = MatchAttentionForallOp(func)
    return op.forall, op.key_loops


__all__ = ["MatchAttentionForallOp", "attention_forall", "contractions", "key_loops",
           "match_attention_forall"]
