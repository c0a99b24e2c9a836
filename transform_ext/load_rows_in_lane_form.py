"""load_rows_in_lane_form: the target ops read each per-row function argument through a
lane-form gather reduced over the lanes.

    %lanes = transform_ext.load_rows_in_lane_form %row_ops {rows = 64, lanes = 16}

For each argument y of the function (in argument order, then each collapse_shape /
expand_shape of an argument: a [B, T] y read as [B * T]) that is a rank-1 tensor of `rows`
elements and that target ops read as an operand: before the first of those readers,
    Y[i, l] = y[i]                       (a [rows, lanes] linalg.generic, tensor.extract at
                                           the row: every lane gathers the row's value)
    y'[i]   = max_l Y[i, l]              (transform_ext/lane_form.py max_over_lanes; f16/bf16
                                           compared in f32)
and the readers read y' instead of y. All lanes hold y[i], so y' == y exactly; on the GPU the
per-row value then has the layout of a reduction over the classes (held by every lane of the
row), which XeGPU has for [rows] vectors, unlike a [rows] vector loaded from memory.

A target nested in an op of the function's block (a kernel's scf.forall reading a slice of
y) gets the gather before that op (a producer the kernel's fusion pulls in).
Legality first: every target is in a func.func; else a silenceable failure naming it. Other
arguments and ops are left alone. The targets stay valid (their operands change); the
result holds the new [rows, lanes] generics, in argument order.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, tensor, transform

from .common import (Illegal, RewritesTargets, Success, block_ops, build_generic, fail,
                     is_argument_view, payload_ops)
from .dialect import TransformExt
from .lane_form import dims_map, empty, max_over_lanes

NAME = "transform_ext.load_rows_in_lane_form"
RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")


def _top(op: ir.Operation) -> ir.Operation:
    """`op`, or its ancestor directly in a func.func's block."""
    while op.parent is not None and op.parent.operation.name != "func.func":
        op = op.parent.operation
    return op


def load_argument(value: ir.Value, readers: list, lanes: int) -> ir.Operation:
    """Make `readers` read the [N] argument `value` through a lane-form gather; returns the
    gather."""
    t = ir.RankedTensorType(value.type)
    block = _top(readers[0]).block
    tops = [_top(op) for op in readers]
    first = next(op for op in block_ops(block) if op in tops)
    with ir.InsertionPoint(first), first.location:
        out = empty([t.shape[0], lanes], t.element_type)

        def body(args):
            row = linalg.IndexOp(0).result
            return [tensor.extract(value, [row])]

        gathered = build_generic([], [out], [dims_map(2, [0, 1])], ["parallel", "parallel"], body)
        rows = max_over_lanes(gathered.result)
    for op in readers:
        for i, v in enumerate(op.operands):
            if v == value:
                op.operands[i] = rows
    return gathered.operation


class LoadRowsInLaneFormOp(TransformExt.Operation, name="load_rows_in_lane_form"):
    target: ext.Operand[transform.AnyOpType]
    rows: ir.IntegerAttr
    lanes: ir.IntegerAttr
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                rows = ir.IntegerAttr(op.rows).value
                lanes = ir.IntegerAttr(op.lanes).value
                try:
                    for t in targets:
                        parent = _top(t).parent
                        if parent is None or parent.operation.name != "func.func":
                            raise Illegal(t, "not in a func.func")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                created = []
                blocks = []
                for t in targets:
                    if _top(t).block not in blocks:
                        blocks.append(_top(t).block)
                for block in blocks:
                    ops = [t for t in targets if _top(t).block == block]
                    views = [o.results[0] for o in block_ops(block)
                             if o.name in RESHAPES and is_argument_view(o.results[0], block)]
                    for arg in list(block.arguments) + views:
                        if not isinstance(arg.type, ir.RankedTensorType):
                            continue
                        if arg.type.rank != 1 or arg.type.shape[0] != rows:
                            continue
                        readers = [o for o in ops if any(v == arg for v in o.operands)]
                        if readers:
                            created.append(load_argument(arg, readers, lanes))
                results.set_ops(op.result, created)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def load_rows_in_lane_form(row_ops: ir.Value, rows: int, lanes: int) -> ir.Value:
    """Read the [rows] function arguments of `row_ops` in lane form (module docstring);
    returns the lane-form gathers."""
    i64 = ir.IntegerType.get_signless(64)
    return LoadRowsInLaneFormOp(row_ops, ir.IntegerAttr.get(i64, rows),
                                ir.IntegerAttr.get(i64, lanes)).result


__all__ = ["LoadRowsInLaneFormOp", "load_rows_in_lane_form"]
