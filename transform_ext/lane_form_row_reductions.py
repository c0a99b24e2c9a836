"""lane_form_row_reductions: a reduction of per-row values to rank 0 as a reduction over
[rows, lanes] tiles that counts lane 0 only.

    transform_ext.lane_form_row_reductions %row_sums {rows = 64, lanes = 16}

A target R(acc, t_i) = combine(acc, f(t_i)) over the N = `rows` rows (one loop) becomes a
linalg.generic over [N, lanes], both loops reductions, computing
    combine(acc, lane == 0 ? f(t_i) : neutral)
(neutral: -0.0 for addf, 1 for mul, -inf for max, ...; the combiner is found through casts
as classify.reduction_combiner finds it): the same combines of the same values, so the
rewrite is exact. Its inputs (kernels of transform_ext/analysis/loss_kernels.py):
  - an [N] function argument (the targets y) is read in the body, `tensor.extract` at the
    row (a per-row gather);
  - a per-row result of the row kernel is read from a lane-form [N, lanes] f32 copy, made
    right after the op computing it (one copy per value, shared by the targets) and narrowed
    back in the body (exact);
  - rank-0 values as they are.
When no input is read in lane form, an unread [N, lanes] i8 tensor.empty bounds the loops.
The per-row results then cross kernels as [N, lanes] tiles (2-D block stores and loads)
instead of [N] vectors, which XeGPU has no lane layout for.

Legality first, for every target: a linalg.generic with one result, one loop and a known
combiner with a neutral element; each input rank-0, a function argument, or a float (up to
32 bits) result of the row kernel; a target the row kernel reads (the before kernel) reads no
result of the row kernel. Else a silenceable failure naming the op and the reason, nothing
rewritten. The targets' handle is consumed (each target is replaced).
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.body import producer_in, strip_casts
from .analysis.classify import _CASTS, reduction_combiner
from .analysis.loss_kernels import kernel_groups
from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, block_ops, body_of, build_generic, clone_op,
                     defining_op, fail, is_argument_view, payload_ops, terminator)
from .dialect import TransformExt
from .lane_form import dims_map, empty, index_constant, lane_copy, lane_copy_element_ok

NAME = "transform_ext.lane_form_row_reductions"


def neutral(name: str, t: ir.Type) -> ir.Attribute | None:
    """e with combine(x, e) == x for every x, or None."""
    if name == "arith.addf":
        return ir.FloatAttr.get(t, -0.0)          # x + -0.0 == x, also for x = -0.0
    if name in ("arith.addi", "arith.ori", "arith.xori"):
        return ir.IntegerAttr.get(t, 0)
    if name == "arith.mulf":
        return ir.FloatAttr.get(t, 1.0)
    if name == "arith.muli":
        return ir.IntegerAttr.get(t, 1)
    if name == "arith.andi":
        return ir.IntegerAttr.get(t, -1)
    if name in ("arith.maximumf", "arith.maxnumf"):
        return ir.FloatAttr.get(t, float("-inf"))
    if name in ("arith.minimumf", "arith.minnumf"):
        return ir.FloatAttr.get(t, float("inf"))
    if name == "arith.maxsi":
        return ir.IntegerAttr.get(t, -(1 << (t.width - 1)))
    if name == "arith.minsi":
        return ir.IntegerAttr.get(t, (1 << (t.width - 1)) - 1)
    return None


def _combine(op: ir.Operation) -> tuple[ir.Operation, int]:
    """The body op combining the accumulator with the new value, and the operand position
    of the new value."""
    src = body_of(op)
    acc = src.arguments[len(src.arguments) - 1]
    y = strip_casts(src, terminator(src).operands[0], _CASTS)
    combine = producer_in(src, y)
    sides = [strip_casts(src, v, _CASTS) for v in combine.operands]
    return combine, 1 - [i for i, v in enumerate(sides) if v == acc][0]


def _lane_guarded_body(op: ir.Operation, lane0: ir.Value, mapping: dict) -> list:
    """Clone a rank-0 reduction's body so that only lane 0 contributes."""
    src = body_of(op)
    combine, other = _combine(op)
    for inner in block_ops(src)[:-1]:
        clone = clone_op(inner, mapping)
        if inner == combine:
            t = clone.operands[other]
            with ir.InsertionPoint(clone), clone.location:
                value = arith.ConstantOp(t.type, neutral(combine.name, t.type)).result
                guarded = arith.select(lane0, t, value)
            clone.operands[other] = guarded
    return [mapping.get(v, v) for v in terminator(src).operands]


def _rank(value: ir.Value) -> int:
    return value.type.rank if isinstance(value.type, ir.ShapedType) else -1


def check(op: ir.Operation, groups: dict) -> None:
    """Raise Illegal unless `op` can be rewritten (module docstring)."""
    if op.name != "linalg.generic" or len(op.results) != 1:
        raise Illegal(op, "not a linalg.generic with one result")
    if groups.get(op) == "before":
        for v in op.opview.inputs:
            p = defining_op(v)
            if p is not None and groups.get(p) == "rows":
                raise Illegal(op, "reads a per-row value the row kernel has not computed yet")
    if reduction_combiner(op) is None:
        raise Illegal(op, "reduces the rows with an unknown combiner")
    ls = loop_structure(op)
    if ls.num_loops != 1:
        raise Illegal(op, f"a rank-0 result of {ls.num_loops} loops")
    combine, other = _combine(op)
    if neutral(combine.name, combine.operands[other].type) is None:
        raise Illegal(op, f"no neutral element for {combine.name}")
    for v in op.opview.inputs:
        if _rank(v) == 0 or is_argument_view(v, op.block):
            continue
        p = defining_op(v)
        if p is None or groups.get(p) != "rows":
            raise Illegal(op, "reads a per-row value no kernel writes")
        elem = ir.RankedTensorType(v.type).element_type
        if not lane_copy_element_ok(elem):
            raise Illegal(op, f"a per-row {elem} result crosses kernels (floats up to 32 bits "
                              "only)")


def rewrite(op: ir.Operation, rows: int, lanes: int, lane_inputs: dict, rewriter) -> ir.Operation:
    """The lane-form reduction replacing `op`; `lane_inputs`: the lane copies made so far."""
    block = op.block
    view = op.opview
    inputs, maps, kinds = [], [], []       # kinds: ("arg", value) | ("lanes", narrow) | ("scalar",)
    for v in view.inputs:
        if _rank(v) == 0:
            inputs.append(v)
            maps.append(ir.AffineMap.get(2, 0, []))
            kinds.append(("scalar",))
        elif is_argument_view(v, block):
            kinds.append(("arg", v))
        else:
            if v not in lane_inputs:
                lane_inputs[v] = lane_copy(v, lanes)
            inputs.append(lane_inputs[v])
            maps.append(dims_map(2, [0, 1]))
            kinds.append(("lanes", ir.RankedTensorType(v.type).element_type))
    if not any(kind[0] == "lanes" for kind in kinds):
        with ir.InsertionPoint(op), op.location:
            inputs.append(empty([rows, lanes], ir.IntegerType.get_signless(8)))
        maps.append(dims_map(2, [0, 1]))
        kinds.append(("witness",))
    outputs = list(view.outputs)
    maps.append(ir.AffineMap.get(2, 0, []))
    src = body_of(op)
    n_in = len(view.inputs)

    def body(args):
        row = linalg.IndexOp(0).result
        lane = linalg.IndexOp(1).result
        lane0 = arith.cmpi(arith.CmpIPredicate.eq, lane, index_constant(0))
        mapping, pos = {}, 0
        for i, kind in enumerate(kinds):
            if kind[0] == "arg":
                mapping[src.arguments[i]] = tensor.extract(kind[1], [row])
                continue
            value = args[pos]
            pos += 1
            if kind[0] == "witness":
                continue
            if kind[0] == "lanes" and value.type != kind[1]:
                value = arith.truncf(kind[1], value)
            mapping[src.arguments[i]] = value
        mapping[src.arguments[n_in]] = args[pos]
        return _lane_guarded_body(op, lane0, mapping)

    with ir.InsertionPoint(op), op.location:
        new = build_generic(inputs, outputs, maps, ["reduction", "reduction"], body)
    rewriter.replace_op(op, [new.results[0]])
    return new.operation


class LaneFormRowReductionsOp(TransformExt.Operation, name="lane_form_row_reductions"):
    target: ext.Operand[transform.AnyOpType]
    rows: ir.IntegerAttr
    lanes: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                rows = ir.IntegerAttr(op.rows).value
                lanes = ir.IntegerAttr(op.lanes).value
                groups = {}
                try:
                    for t in targets:
                        if t.block not in groups:
                            groups[t.block] = kernel_groups(t.block)
                        check(t, groups[t.block])
                except Illegal as illegal:
                    return fail(NAME, illegal)
                lane_inputs = {}
                for t in targets:
                    rewrite(t, rows, lanes, lane_inputs, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def lane_form_row_reductions(row_sums: ir.Value, rows: int, lanes: int) -> LaneFormRowReductionsOp:
    """Rewrite the reductions over the rows of `row_sums` in lane form (module docstring)."""
    i64 = ir.IntegerType.get_signless(64)
    return LaneFormRowReductionsOp(row_sums, ir.IntegerAttr.get(i64, rows),
                                   ir.IntegerAttr.get(i64, lanes))


__all__ = ["LaneFormRowReductionsOp", "lane_form_row_reductions", "neutral"]
