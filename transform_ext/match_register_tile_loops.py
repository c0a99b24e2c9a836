"""match_register_tile_loops: the k loops of vector register tiles nested in the targets.

Matched: every scf.for nested in (or equal to) a target that carries only vectors (at least
one: the register tile's accumulators, C_k+1 = C_k + A_k B_k) and holds a vector.contract
(or the bf16 dot products it became, x86.avx512.dot) directly in its body, in post-order (inner loops first), once each. These are the loops
whose unrolling lets the outer products of consecutive k overlap (`transform.loop.unroll`).
The result may be empty: matching never fails. Read-only: the target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import MatchesPayload, Success, payload_ops
from .dialect import TransformExt


def is_register_tile_loop(op: ir.Operation) -> bool:
    if op.name != "scf.for" or not len(op.results) or \
            not all(isinstance(r.type, ir.VectorType) for r in op.results):
        return False
    return any(o.operation.name in ("vector.contract", "x86.avx512.dot")
               for o in op.regions[0].blocks[0].operations)


def register_tile_loops(root: ir.Operation) -> list[ir.Operation]:
    found = []

    def visit(op):
        if is_register_tile_loop(op):
            found.append(op)
        return ir.WalkResult.ADVANCE

    root.walk(visit, ir.WalkOrder.POST_ORDER)
    return found


class MatchRegisterTileLoopsOp(TransformExt.Operation, name="match_register_tile_loops"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = []
                for target in payload_ops(state, op.target):
                    found += [loop for loop in register_tile_loops(target)
                              if loop not in found]
                results.set_ops(op.result, found)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_register_tile_loops(target: ir.Value) -> ir.Value:
    """The register tiles' k loops nested in `target` (see the module docstring)."""
    return MatchRegisterTileLoopsOp(target).result


__all__ = ["MatchRegisterTileLoopsOp", "match_register_tile_loops", "is_register_tile_loop"]
