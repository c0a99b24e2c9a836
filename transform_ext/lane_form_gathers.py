"""lane_form_gathers: a per-row generic that gathers runs over [rows, lanes] and is reduced
over the identical lanes.

    %lanes = transform_ext.lane_form_gathers %ops {lanes = 16}

A target g[i] = f(a[i], .., t[idx(i)]) (one parallel loop over the rows, one result, a
`tensor.extract` in its body: the target gather x[i, y_i], the weight w[y_i]) becomes
    G[i, l] = f(a[i], .., t[clamp(idx(i))])    (a [rows, lanes] linalg.generic: every lane
                                                 of a row computes the row's value, on the
                                                 GPU one scattered load per lane)
    g'[i]   = max_l G[i, l]                    (transform_ext/lane_form.py max_over_lanes)
and g's readers read g'. The lanes are equal, so g' == g exactly. Each extract index that
is not a `linalg.index` is clamped into [0, size) (maxsi, minsi): memory safety only, for
rows whose index is out of range and whose value the payload discards (ignored targets;
counted ones are checked on the host). Targets without an extract are left alone.

Legality first: every target that gathers has one loop and one result; else a silenceable
failure naming it ("gathers inside a loop over the classes"), nothing rewritten. The
targets' handle is consumed; the result holds the new [rows, lanes] generics, in order.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, block_ops, body_of, build_generic, clone_op,
                     defining_op, fail, payload_ops, terminator)
from .dialect import TransformExt
from .lane_form import dims_map, empty, index_constant, max_over_lanes

NAME = "transform_ext.lane_form_gathers"


def gathers(op: ir.Operation) -> bool:
    return op.name == "linalg.generic" and any(
        o.operation.name == "tensor.extract" for o in body_of(op).operations)


def check(op: ir.Operation) -> None:
    ls = loop_structure(op)
    if ls.num_loops != 1:
        raise Illegal(op, "gathers inside a loop over the classes")
    if len(op.results) != 1:
        raise Illegal(op, f"a gather with {len(op.results)} results")


def clamp_indices(extract: ir.Operation) -> None:
    """Clamp the data-computed indices of `extract` into its source tensor."""
    source = ir.RankedTensorType(extract.operands[0].type)
    for j in range(source.rank):
        v = extract.operands[1 + j]
        owner = defining_op(v)
        if owner is not None and owner.name == "linalg.index":
            continue
        with ir.InsertionPoint(extract), extract.location:
            low = arith.maxsi(v, index_constant(0))
            extract.operands[1 + j] = arith.minsi(low, index_constant(source.shape[j] - 1))


def rewrite(op: ir.Operation, lanes: int, rewriter) -> ir.Operation:
    """The lane form of the gather `op`; returns the [rows, lanes] generic."""
    view = op.opview
    out_t = ir.RankedTensorType(op.results[0].type)
    inputs = list(view.inputs)
    maps = [dims_map(2, [e.position for e in m.value.results])
            for m in list(view.indexing_maps)[:len(inputs)]]
    src = body_of(op)
    with ir.InsertionPoint(op), op.location:
        lanes_out = empty([out_t.shape[0], lanes], out_t.element_type)

        def body(args):
            mapping = {src.arguments[i]: args[i] for i in range(len(inputs) + 1)}
            for inner in block_ops(src)[:-1]:
                clone = clone_op(inner, mapping)
                if clone.name == "tensor.extract":
                    clamp_indices(clone)
            return [mapping.get(v, v) for v in terminator(src).operands]

        spread = build_generic(inputs, [lanes_out], maps + [dims_map(2, [0, 1])],
                               ["parallel", "parallel"], body)
        reduced = max_over_lanes(spread.result)
    rewriter.replace_op(op, [reduced])
    return spread.operation


class LaneFormGathersOp(TransformExt.Operation, name="lane_form_gathers"):
    target: ext.Operand[transform.AnyOpType]
    lanes: ir.IntegerAttr
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = [t for t in payload_ops(state, op.target) if gathers(t)]
                lanes = ir.IntegerAttr(op.lanes).value
                try:
                    for t in targets:
                        check(t)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.result, [rewrite(t, lanes, rewriter) for t in targets])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def lane_form_gathers(ops: ir.Value, lanes: int) -> ir.Value:
    """Rewrite the gathering per-row generics of `ops` in lane form (module docstring);
    returns the [rows, lanes] generics."""
    return LaneFormGathersOp(ops, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), lanes)).result


__all__ = ["LaneFormGathersOp", "lane_form_gathers"]
