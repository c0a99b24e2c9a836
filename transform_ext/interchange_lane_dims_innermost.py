"""interchange_lane_dims_innermost: the vector lane dim of a generic becomes its last loop.

For a static linalg.generic (not a contraction) with two loops or more whose lane dim L
(`lane_dim`, transform_ext.analysis.tiles: the innermost dim in memory of its largest
operand) is not the last loop dim, the loops are permuted to (the others in order, L) by
upstream `transform.structured.interchange`. A permutation of parallel and reduction loops
of a generic computes the same elements (its body is a function of the indices it reads;
the reduction order along each reduction dim is unchanged). Its vector tiles are then
1 x ... x 1 x W, not an n-D vector whose innermost dim is 1 (computed one element at a
time).

Targets: every such generic nested in the target ops (not looking inside linalg ops);
others are left alone. A target that is itself a linalg.generic with dynamic loop ranges is
a silenceable failure (nothing rewritten). The handle is only read.
"""


from torch_mlir import ir
from torch_mlir.dialects import ext, transform
from torch_mlir.dialects.transform import structured

from .analysis.structure import all_linalg_ops, loop_structure
from .analysis.tiles import lane_dim
from .common import Illegal, RewritesTargets, Success, fail, payload_ops
from .dialect import TransformExt
from .nested import apply_to

NAME = "transform_ext.interchange_lane_dims_innermost"


def lane_last_order(op: ir.Operation) -> list[int] | None:
    """The interchange putting the lane dim last, or None when there is nothing to do."""
    if op.name != "linalg.generic":
        return None
    ls = loop_structure(op)
    if ls.is_contraction or not ls.is_static or ls.num_loops < 2:
        return None
    lane = lane_dim(ls)
    if lane == ls.num_loops - 1:
        return None
    return [d for d in range(ls.num_loops) if d != lane] + [lane]


class InterchangeLaneDimsInnermostOp(TransformExt.Operation,
                                     name="interchange_lane_dims_innermost"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name == "linalg.generic" and not loop_structure(target).is_static:
                            raise Illegal(target, "dynamic loop ranges")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                plan = [(g, order) for t in targets for g in all_linalg_ops(t)
                        if (order := lane_last_order(g)) is not None]
                for generic, order in plan:
                    apply_to(generic, lambda h, order=order: structured.InterchangeOp(
                        h, iterator_interchange=order))
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def interchange_lane_dims_innermost(target: ir.Value) -> InterchangeLaneDimsInnermostOp:
    """Put the lane dim of the generics nested in `target` last (see the module docstring)."""
    return InterchangeLaneDimsInnermostOp(target)


__all__ = ["InterchangeLaneDimsInnermostOp", "interchange_lane_dims_innermost", "lane_last_order"]
