"""fill_slices_of_fills: a slice of a filled tensor is filled itself.

    transform_ext.fill_slices_of_fills %func

In the entry block of each target function, a `tensor.extract_slice` S of a value V, where V
is a `linalg.fill` F's result, or a `tensor.insert_slice` into such a value of a region that
S does not overlap (statically: the two regions are disjoint along some dim, unit strides),
becomes
    linalg.fill ins(F's value) outs(tensor.extract_slice of F's destination, as S)
Exact: S reads only elements F wrote (a disjoint insert leaves them as they were). Each part
of an op split along a dim (transform.structured.split on an op whose init is a fill: the
first part's start is a slice of the fill, the second's a slice of the first's result
inserted into it) then starts from a fill of its own, which a schedule can compute per
tile instead of in a pass over the whole tensor. Other slices are left alone. Targets:
func.func ops (else a silenceable failure naming the op); the handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, tensor, transform

from .common import RewritesTargets, block_ops, defining_op, rewrite_functions, static_region
from .dialect import TransformExt

NAME = "transform_ext.fill_slices_of_fills"


def _disjoint(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(o1 + s1 <= o2 or o2 + s2 <= o1 for (o1, s1), (o2, s2) in zip(a, b))


def _filling(slice_op: ir.Operation) -> ir.Operation | None:
    """The fill whose values `slice_op` reads (module docstring), else None."""
    region = static_region(slice_op)
    if region is None:
        return None
    source = defining_op(slice_op.operands[0])
    while source is not None and source.name == "tensor.insert_slice":
        inserted = static_region(source)
        if inserted is None or len(inserted) != len(region) or not _disjoint(region, inserted):
            return None
        source = defining_op(source.operands[1])
    if source is None or source.name != "linalg.fill":
        return None
    return source


def fill_slices(block: ir.Block) -> None:
    for op in block_ops(block):
        if op.name != "tensor.extract_slice":
            continue
        fill = _filling(op)
        if fill is None:
            continue
        view = op.opview
        with ir.InsertionPoint(op), op.location:
            part = tensor.ExtractSliceOp(
                op.results[0].type, fill.operands[1], [], [], [],
                view.static_offsets, view.static_sizes, view.static_strides)
            filled = linalg.fill(fill.operands[0], outs=[part.result])
        op.results[0].replace_all_uses_with(filled)
        op.erase()


class FillSlicesOfFillsOp(TransformExt.Operation, name="fill_slices_of_fills"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return rewrite_functions(NAME, op, rewriter, state,
                                     lambda func, _: fill_slices(func.regions[0].blocks[0]))

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fill_slices_of_fills(func: ir.Value) -> FillSlicesOfFillsOp:
    """Fill the slices of filled tensors in `func` (module docstring)."""
    return FillSlicesOfFillsOp(func)


__all__ = ["FillSlicesOfFillsOp", "fill_slices_of_fills", "fill_slices"]
