"""Builders of "lane form" IR, shared by the cross-entropy loss ops (lane_form_row_reductions,
load_rows_in_lane_form, lane_form_gathers).

After a reduction over the classes every lane of a GPU subgroup holds the row's value; per-row
data meets memory as a [rows, lanes] tile holding the row's value in each of its lanes.
`max_over_lanes` reduces such a tile back to [rows] (the lanes are equal: exact);
`lane_copy` writes a per-row float result as a [rows, lanes] f32 tile (widened exactly).
All build at the current insertion point and location.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, linalg, tensor

from .common import build_generic, defining_op


def dims_map(n: int, dims) -> ir.AffineMap:
    """(d0, .., d{n-1}) -> (d{dims[0]}, ..)."""
    return ir.AffineMap.get(n, 0, [ir.AffineDimExpr.get(d) for d in dims])


def index_constant(value: int) -> ir.Value:
    t = ir.IndexType.get()
    return arith.ConstantOp(t, ir.IntegerAttr.get(t, value)).result


def empty(shape, element) -> ir.Value:
    return tensor.EmptyOp(list(shape), element).result


def max_identity(t: ir.Type) -> ir.Attribute:
    if isinstance(t, ir.FloatType):
        return ir.FloatAttr.get(t, float("-inf"))
    return ir.IntegerAttr.get(t, -(1 << (t.width - 1)))


def fill(value_attr: ir.Attribute, out: ir.Value) -> ir.Value:
    c = arith.ConstantOp(value_attr.type, value_attr).result
    return linalg.fill(c, outs=[out])


def max_over_lanes(lanes: ir.Value) -> ir.Value:
    """[n, lanes] -> [n]: max over the lanes (they hold one value: exact). f16/bf16 lanes
    are compared in f32 (the device has no 16-bit float max) and rounded back, exactly."""
    t = ir.RankedTensorType(lanes.type)
    elem = t.element_type
    narrow = isinstance(elem, ir.FloatType) and elem.width < 32
    acc = ir.F32Type.get() if narrow else elem
    init = fill(max_identity(acc), empty([t.shape[0]], acc))

    def body(args):
        if isinstance(elem, ir.FloatType):
            value = arith.extf(acc, args[0]) if narrow else args[0]
            return [arith.maximumf(value, args[1])]
        return [arith.maxsi(args[0], args[1])]

    reduced = build_generic([lanes], [init], [dims_map(2, [0, 1]), dims_map(2, [0])],
                            ["parallel", "reduction"], body).result
    if not narrow:
        return reduced
    return build_generic([reduced], [empty([t.shape[0]], elem)], [dims_map(1, [0])] * 2,
                         ["parallel"], lambda args: [arith.truncf(elem, args[0])]).result


def lane_copy_element_ok(elem: ir.Type) -> bool:
    """Can a per-row value of this element type be written as an f32 lane tile exactly?"""
    return isinstance(elem, ir.FloatType) and elem.width <= 32


def lane_copy(value: ir.Value, lanes: int) -> ir.Value:
    """A per-row float result [N] as a lane-form [N, lanes] f32 tile (widened exactly), built
    right after the op computing it."""
    t = ir.RankedTensorType(value.type)
    elem = t.element_type
    owner = defining_op(value)
    f32 = ir.F32Type.get()
    with ir.InsertionPoint.after(owner), owner.location:
        out = empty([t.shape[0], lanes], f32)

        def body(args):
            return [args[0] if elem == f32 else arith.extf(f32, args[0])]

        return build_generic([value], [out], [dims_map(2, [0]), dims_map(2, [0, 1])],
                             ["parallel", "parallel"], body).result
