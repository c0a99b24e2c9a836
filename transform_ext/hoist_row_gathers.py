"""hoist_row_gathers: in an op over [rows, classes], a gather whose indices depend on the row
only becomes a per-row generic that the op reads.

    %new = transform_ext.hoist_row_gathers %ops

For a target linalg.generic over two loops (d0 the rows) whose body holds v = tensor.extract
%t[idx(i)], where idx reads only inputs indexed by d0 alone (or rank 0), `linalg.index 0`
and values from outside the body (the target's weight w[y_i] in the cross-entropy gradient):
    g[i] = t[idx(i)]                     (a new [rows] linalg.generic before the target,
                                           computing idx and the extract)
and the target reads g through (d0, d1) -> (d0) instead of extracting: one gather per row
instead of one per element, the same values (exact). Repeated for each extract of the body,
first first. Other targets (not two loops, or no extract) are left alone.

Legality first: every index of every extract of a two-loop target depends on the row only;
else a silenceable failure naming the op ("gathers at an index that varies along the
classes"), nothing rewritten. The targets' handle is consumed; the result holds the targets,
rewritten ones replaced by their new versions.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, append_input, block_ops, body_of,
                     build_generic, clone_op, defining_op, fail, payload_ops)
from .dialect import TransformExt
from .lane_form import dims_map, empty

NAME = "transform_ext.hoist_row_gathers"
VARYING = "gathers at an index that varies along the classes"


def _extracts(op: ir.Operation) -> list[ir.Operation]:
    return [o for o in block_ops(body_of(op)) if o.name == "tensor.extract"]


def applies(op: ir.Operation) -> bool:
    return op.name == "linalg.generic" and loop_structure(op).num_loops == 2 and bool(_extracts(op))


def _row_args(op: ir.Operation) -> set:
    view = op.opview
    maps = [m.value for m in view.indexing_maps]
    return {i for i in range(len(view.inputs))
            if all(isinstance(e, ir.AffineDimExpr) and e.position == 0 for e in maps[i].results)}


def row_slice(op: ir.Operation, values: list, row_args: set) -> list:
    """The body ops computing `values` (block order), when they depend only on per-row
    inputs, `linalg.index 0` and values from outside the body; else Illegal."""
    block = body_of(op)
    needed, pending = [], list(values)
    while pending:
        v = pending.pop()
        if isinstance(v, ir.BlockArgument):
            if v.owner == block and v.arg_number not in row_args:
                raise Illegal(op, VARYING)
            continue
        owner = defining_op(v)
        if owner is None or owner.parent != op or owner in needed:
            continue
        if owner.name == "linalg.index" and ir.IntegerAttr(owner.attributes["dim"]).value != 0:
            raise Illegal(op, VARYING)
        needed.append(owner)
        pending.extend(owner.operands)
    return [o for o in block_ops(block) if o in needed]


def check(op: ir.Operation) -> None:
    row_args = _row_args(op)
    for extract in _extracts(op):
        row_slice(op, list(extract.operands)[1:], row_args)


def hoist(op: ir.Operation, rewriter) -> ir.Operation:
    """Hoist every gather of `op` (module docstring); returns the rewritten op."""
    while True:
        view = op.opview
        block = body_of(op)
        n_in = len(view.inputs)
        maps = [m.value for m in view.indexing_maps]
        extracts = _extracts(op)
        if not extracts:
            return op
        extract = extracts[0]
        ordered = row_slice(op, list(extract.operands)[1:], _row_args(op))
        used = sorted({v.arg_number for o in ordered + [extract] for v in o.operands
                       if isinstance(v, ir.BlockArgument) and v.owner == block})
        rows = loop_structure(op).ranges[0]
        elem = extract.results[0].type
        with ir.InsertionPoint(op), op.location:
            inputs = [view.inputs[i] for i in used]
            in_maps = [dims_map(1, [0] if maps[i].results else []) for i in used]

            def body(args):
                mapping = {block.arguments[i]: a for i, a in zip(used, args)}
                for inner in ordered + [extract]:
                    clone_op(inner, mapping)
                return [mapping[extract.results[0]]]

            gathered = build_generic(inputs, [empty([rows], elem)], in_maps + [dims_map(1, [0])],
                                     ["parallel"], body).result
        new = append_input(op, gathered, dims_map(2, [0]), rewriter)
        nblock = body_of(new)
        first = next(o for o in block_ops(nblock) if o.name == "tensor.extract")
        first.results[0].replace_all_uses_with(nblock.arguments[n_in])
        first.erase()
        op = new


class HoistRowGathersOp(TransformExt.Operation, name="hoist_row_gathers"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for t in targets:
                        if applies(t):
                            check(t)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                out = [hoist(t, rewriter) if applies(t) else t for t in targets]
                results.set_ops(op.result, out)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def hoist_row_gathers(ops: ir.Value) -> ir.Value:
    """Hoist the per-row gathers of the two-loop ops of `ops` (module docstring)."""
    return HoistRowGathersOp(ops).result


__all__ = ["HoistRowGathersOp", "hoist_row_gathers"]
