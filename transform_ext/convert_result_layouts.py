"""convert_result_layouts: the result of each target op passes through an
xegpu.convert_layout from `layouts.input` to `layouts.target` before its readers.

    %v = op ...                    %v = op ...
    use(%v)                  =>    %c = xegpu.convert_layout %v <{input_layout = I, target_layout = T}>
                                   use(%c)

A layout conversion moves no value (the same vector, distributed another way), so the
kernel computes the same; the conversion tells XeGPU's layout propagation where one layout
ends and the next begins, where it would otherwise make the producer's layout follow the
reader's. The case it is for: a per-column vector that every subgroup computes whole from a
tile it reads whole (layout slice(#xegpu.layout<sg_layout = [1, 1], ..>, dims = [0])),
broadcast over the rows of a tile whose rows are split over the subgroups (slice(
#xegpu.layout<sg_layout = [n, 1], ..>, dims = [0])): the two layouts hold every column in
every subgroup, so the conversion needs no shared memory; without it the propagation
splits the reduced tile's rows over the subgroups.

Legal for a target when it is an op with one vector result whose rank the layouts
describe (a slice's parent rank minus its sliced dims). Rewritten: every target; an
illegal one is a silenceable failure naming it (nothing rewritten). The target handle is
only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, RewritesTargets, Success, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.convert_result_layouts"


def _rank(layout: ir.Attribute) -> int:
    """The rank of the vectors `layout` (an #xegpu.layout or #xegpu.slice) describes."""
    text = str(layout)
    if text.startswith("#xegpu.slice"):
        parent = text.split("sg_layout = [", 1)[1].split("]", 1)[0].count(",") + 1
        dims = text.rsplit("dims = [", 1)[1].split("]", 1)[0].count(",") + 1
        return parent - dims
    return text.split("sg_layout = [", 1)[1].split("]", 1)[0].count(",") + 1


def check_target(op: ir.Operation, input_layout: ir.Attribute, target_layout: ir.Attribute) -> None:
    if len(op.results) != 1 or not isinstance(op.results[0].type, ir.VectorType):
        raise Illegal(op, "it has not one vector result")
    rank = ir.VectorType(op.results[0].type).rank
    if _rank(input_layout) != rank or _rank(target_layout) != rank:
        raise Illegal(op, f"a rank-{rank} result and layouts of rank {_rank(input_layout)}, "
                          f"{_rank(target_layout)}")


def convert(op: ir.Operation, input_layout: ir.Attribute, target_layout: ir.Attribute) -> None:
    result = op.results[0]
    uses = list(result.uses)
    with ir.InsertionPoint.after(op), op.location:
        converted = ir.Operation.create(
            "xegpu.convert_layout", results=[result.type], operands=[result],
            attributes={"input_layout": input_layout, "target_layout": target_layout}).result
    for use in uses:
        owner = getattr(use.owner, "operation", use.owner)
        owner.operands[use.operand_number] = converted


class ConvertResultLayoutsOp(TransformExt.Operation, name="convert_result_layouts"):
    target: ext.Operand[transform.AnyOpType]
    layouts: ir.DictAttr       # {input = the producer's layout, target = the readers'}

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                layouts = ir.DictAttr(op.layouts)
                try:
                    if "input" not in layouts or "target" not in layouts:
                        raise Illegal(op.operation, "layouts needs `input` and `target`")
                    pair = layouts["input"], layouts["target"]
                    for target in targets:
                        check_target(target, *pair)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    convert(target, *pair)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def convert_result_layouts(target: ir.Value, input_layout: str, target_layout: str):
    """Convert the result of each op of `target` from `input_layout` to `target_layout`
    (#xegpu.layout / #xegpu.slice text) before its readers."""
    return ConvertResultLayoutsOp(target, ir.DictAttr.get({
        "input": ir.Attribute.parse(input_layout), "target": ir.Attribute.parse(target_layout)}))


__all__ = ["ConvertResultLayoutsOp", "convert_result_layouts"]
