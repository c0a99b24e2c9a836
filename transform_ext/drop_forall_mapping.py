"""drop_forall_mapping: scf.forall loops lose their device mapping attribute.

    scf.forall (%i) in (N) { .. } {mapping = [#gpu.block<x>]}
  =>
    scf.forall (%i) in (N) { .. }

The loop computes the same; only the placement of its iterations on processors is no longer
fixed. transform.loop.forall_to_parallel carries a forall's mapping over to the scf.parallel
it makes, where `gpu-map-parallel-loops` (which maps only unmapped loops) would keep it in
place of the scf.parallel mapping it assigns; so the mapping is dropped before that
conversion. Legal for scf.forall ops (one without a mapping
is left as it is).

Rewritten: the target ops, in place (handles to them stay valid); a target that is not an
scf.forall is a silenceable failure (nothing rewritten).
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, RewritesTargets, Success, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.drop_forall_mapping"


class DropForallMappingOp(TransformExt.Operation, name="drop_forall_mapping"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "scf.forall":
                            raise Illegal(target, "not an scf.forall")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for forall in targets:
                    if "mapping" in forall.attributes:
                        del forall.attributes["mapping"]
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def drop_forall_mapping(target: ir.Value) -> DropForallMappingOp:
    """Drop the mapping of the scf.forall loops in `target` (in place)."""
    return DropForallMappingOp(target)


__all__ = ["DropForallMappingOp", "drop_forall_mapping"]
