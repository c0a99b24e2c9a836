"""drop_overwritten_fills: a fill whose every element is overwritten is not computed.

    transform_ext.drop_overwritten_fills %func

In the entry block of each target function, a `linalg.fill` F whose result is used once, as
the destination of a chain of `tensor.insert_slice`s (each the destination of the next,
each used once but the last), is replaced by F's destination when the chain's static,
unit-stride regions cover F's result: all of it along every dim but one, and intervals that
tile that dim exactly. No element of F is then read: the rewrite is exact, and the pass over
the whole tensor writing F's value goes (the parts of an op split along a dim,
transform.structured.split, each starting from a fill of its own:
transform_ext.fill_slices_of_fills). Other fills are left alone. Targets: func.func ops
(else a silenceable failure naming the op); the handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import RewritesTargets, block_ops, rewrite_functions, static_region, user_op
from .dialect import TransformExt

NAME = "transform_ext.drop_overwritten_fills"


def _covers(shape: list[int], regions: list[list[tuple[int, int]]]) -> bool:
    """Do `regions` tile a tensor of `shape`: whole along every dim but one, along which
    their intervals are disjoint and cover it?"""
    if not regions or any(len(r) != len(shape) for r in regions):
        return False
    split = [d for d in range(len(shape))
             if any(r[d] != (0, shape[d]) for r in regions)]
    if len(split) > 1:
        return False
    if not split:
        return True
    d = split[0]
    end = 0
    for offset, size in sorted(r[d] for r in regions):
        if offset != end:
            return False
        end = offset + size
    return end == shape[d]


def _overwritten(fill: ir.Operation) -> bool:
    """Do the inserts chained on `fill`'s result (module docstring) cover all of it?"""
    regions, uses = [], list(fill.results[0].uses)
    while len(uses) == 1 and user_op(uses[0]).name == "tensor.insert_slice" \
            and uses[0].operand_number == 1:
        insert = user_op(uses[0])
        region = static_region(insert)
        if region is None:
            return False
        regions.append(region)
        uses = list(insert.results[0].uses)
    shape = ir.RankedTensorType(fill.results[0].type)
    return shape.has_static_shape and _covers(list(shape.shape), regions)


def drop_fills(block: ir.Block) -> None:
    for op in block_ops(block):
        if op.name == "linalg.fill" and _overwritten(op):
            op.results[0].replace_all_uses_with(op.operands[1])
            op.erase()


class DropOverwrittenFillsOp(TransformExt.Operation, name="drop_overwritten_fills"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return rewrite_functions(NAME, op, rewriter, state,
                                     lambda func, _: drop_fills(func.regions[0].blocks[0]))

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def drop_overwritten_fills(func: ir.Value) -> DropOverwrittenFillsOp:
    """Drop the fills of `func` that inserts overwrite entirely (module docstring)."""
    return DropOverwrittenFillsOp(func)


__all__ = ["DropOverwrittenFillsOp", "drop_overwritten_fills", "drop_fills"]
