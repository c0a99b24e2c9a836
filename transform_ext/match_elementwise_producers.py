"""match_elementwise_producers: the elementwise ops a target reads over its own iteration
space, in the order to fuse them into a loop over the target's tiles.

    %chain = transform_ext.match_elementwise_producers %gradient

For each target op T: the linalg ops P of T's block, not linalg.fill, that are elementwise
(every loop parallel, outputs through permutations) with T's loop ranges and that T reads
through its operands, directly or through other such P; in reverse block order (the last
producer first), so that fusing them one by one into a loop tiling T
(transform.structured.fuse_into_containing_op) always fuses a producer after its readers.
The cross-entropy gradient's [rows, C] operands (x - m, exp, ...) then run per column tile
with it, no [rows, C] temporary. Results of several targets are concatenated in target
order. A target that is not a linalg op is a silenceable failure naming it. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, MatchesPayload, Success, block_ops, defining_op, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.match_elementwise_producers"


def elementwise_producers(op: ir.Operation) -> list[ir.Operation]:
    """The producers of `op` (module docstring), last in block order first."""
    ranges = loop_structure(op).ranges
    chain, pending = [], [op]
    while pending:
        for v in pending.pop().operands:
            p = defining_op(v)
            if (p is not None and p.parent == op.parent and is_linalg_op(p)
                    and p.name != "linalg.fill" and p not in chain
                    and loop_structure(p).is_elementwise and loop_structure(p).ranges == ranges):
                chain.append(p)
                pending.append(p)
    order = block_ops(op.block)
    chain.sort(key=lambda p: order.index(p), reverse=True)
    return chain


class MatchElementwiseProducersOp(TransformExt.Operation, name="match_elementwise_producers"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for t in targets:
                        if not is_linalg_op(t):
                            raise Illegal(t, "not a linalg op")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.result, [p for t in targets for p in elementwise_producers(t)])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return True

    Effects = MatchesPayload


def match_elementwise_producers(target: ir.Value) -> ir.Value:
    """The elementwise producers of `target` in fusion order (module docstring)."""
    return MatchElementwiseProducersOp(target).result


__all__ = ["MatchElementwiseProducersOp", "match_elementwise_producers", "elementwise_producers"]
