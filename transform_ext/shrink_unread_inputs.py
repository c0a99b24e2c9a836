"""shrink_unread_inputs: an input a linalg.generic's body never reads keeps only what it is
there for, the extents of loops no other operand bounds.

For each linalg.generic in the target functions' entry blocks and each input whose block
argument has no use: when every loop dim its map names is bounded by another operand (a
plain dim of its map), the input is dropped; else it becomes a tensor.empty holding just
the loops only it bounds, read through those dims (a [V] bound of a class loop instead of
the [N, V] logits: the restructured cross-entropy keeps the logits as such a bound of the
one-hot row sum, which reads only targets). The op computes the same values; the tensor it
read may die, and no [N, V] buffer is allocated for a bound (an empty [V] is).

Targets: functions (their entry blocks). A target without a region is a silenceable failure
(nothing rewritten). Generics with a static iteration space only; the others are left
alone. The target handle stays valid; rewritten ops are replaced in other handles.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .analysis.structure import dim_positions, loop_structure
from .common import (Illegal, RewritesTargets, Success, body_of, fail, payload_ops,
                     rebuild_generic)
from .dialect import TransformExt
from .fold_gathers_through_elementwise import check_has_body, linalg_ops_of

NAME = "transform_ext.shrink_unread_inputs"


def shrink_plan(op: ir.Operation) -> list[tuple[int, list[int]]] | None:
    """(input index, the loop dims its replacement bounds; [] to drop it) per unread input
    of `op`, in order; None when nothing would change."""
    if op.name != "linalg.generic":
        return None
    ls = loop_structure(op)
    if not ls.is_static:
        return None
    block = body_of(op)
    unread = [i for i in range(ls.num_inputs) if not list(block.arguments[i].uses)
              and isinstance(op.operands[i].type, ir.RankedTensorType)]
    if not unread:
        return None
    bounded: set[int] = set()
    for i in range(ls.num_inputs + ls.num_outputs):
        if i not in unread:
            bounded.update(d for d in dim_positions(ls.maps[i]) if d is not None)
    plan = []
    for i in unread:
        needed = [d for d in dim_positions(ls.maps[i]) if d is not None and d not in bounded]
        bounded.update(needed)
        plan.append((i, needed))
    producer = lambda i: getattr(op.operands[i].owner, "name", None)
    if all(producer(i) == "tensor.empty" and dim_positions(ls.maps[i]) == needed
           for i, needed in plan):
        return None
    return plan


def rewrite(op: ir.Operation, plan: list[tuple[int, list[int]]], rewriter) -> None:
    ls = loop_structure(op)
    block = body_of(op)
    unread = {i for i, _ in plan}
    kept = [i for i in range(ls.num_inputs) if i not in unread]
    inputs = [op.operands[i] for i in kept]
    maps = [ls.maps[i] for i in kept]
    with ir.InsertionPoint(op), op.location:
        for i, needed in plan:
            if needed:
                element = ir.RankedTensorType(op.operands[i].type).element_type
                inputs.append(tensor.EmptyOp([ls.ranges[d] for d in needed], element).result)
                maps.append(ir.AffineMap.get(ls.num_loops, 0,
                                             [ir.AffineDimExpr.get(d) for d in needed]))

    def mapping_of(args):
        mapping = {block.arguments[i]: args[k] for k, i in enumerate(kept)}
        for j in range(ls.num_outputs):
            mapping[block.arguments[ls.num_inputs + j]] = args[len(inputs) + j]
        return mapping

    rebuild_generic(op, inputs, maps, mapping_of, rewriter)


class ShrinkUnreadInputsOp(TransformExt.Operation, name="shrink_unread_inputs"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        check_has_body(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    for generic in linalg_ops_of(target):
                        plan = shrink_plan(generic)
                        if plan is not None:
                            rewrite(generic, plan, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def shrink_unread_inputs(target: ir.Value) -> ShrinkUnreadInputsOp:
    """Shrink the unread inputs of the linalg.generics of `target`'s functions (see the
    module docstring)."""
    return ShrinkUnreadInputsOp(target)


__all__ = ["ShrinkUnreadInputsOp", "shrink_unread_inputs"]
