"""outline_into_forall: the target ops move into a new scf.forall, one kernel of workgroups.

    %forall = transform_ext.outline_into_forall %ops {rows = 8, total_rows = 64,
                                                      mapping = [#gpu.block<x>]}

The targets (linalg ops of one block, in block order) are cloned, in order, into the body
of a new 1-d scf.forall inserted before the first op of the block reading a result when
every reader comes after the targets (a later kernel reading this one's), else before the
block's terminator, with `mapping`:
  - rows > 0: total_rows / rows iterations; iteration k computes rows [k * rows, (k + 1) *
    rows): every operand a target reads through a map whose first result is d0 (and every
    operand of a linalg.fill) is sliced to those rows (a tensor.empty is made anew at the
    tile's shape), each `linalg.index 0` in a body is offset by k * rows;
  - rows = 0: one iteration computing the ops as they are.
The forall yields (tensor.parallel_insert_slice into new tensor.empty shared outputs) the
target results read by ops outside the targets, and those readers read the forall's
results instead; the targets are erased. In a cloned linalg.generic, a rank-0 input from
outside the forall is read once per iteration as a scalar (`tensor.extract`) at the top
of the body and used in the generic's body directly (no 0-d vectors on the GPU). Each row
of the result is computed by the same ops from the same values: exact.

Legality first: the targets are linalg ops of one block, some target result is read outside
them, and total_rows is a multiple of rows; else a silenceable failure naming the op and the reason,
nothing rewritten. The targets' handle is consumed; the result is the new scf.forall.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, scf, tensor, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import (Illegal, ReplacesTargets, Success, block_ops, body_of, defining_op, fail,
                     payload_ops, terminator, user_op, users)
from .dialect import TransformExt
from .lane_form import empty, index_constant

NAME = "transform_ext.outline_into_forall"
DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


def _rank(value: ir.Value) -> int:
    return value.type.rank if isinstance(value.type, ir.ShapedType) else -1


def outputs_of(ops: list) -> list[ir.Value]:
    """The results of `ops` read by other ops, in order."""
    out = []
    for op in ops:
        for r in op.results:
            if any(user not in ops for user in users(r)):
                out.append(r)
    return out


def _slice_rows(value: ir.Value, r0: ir.Value, rows: int) -> ir.Value:
    t = ir.RankedTensorType(value.type)
    shape = [rows] + list(t.shape[1:])
    owner = defining_op(value)
    if owner is not None and owner.name == "tensor.empty":
        return empty(shape, t.element_type)
    result = ir.RankedTensorType.get(shape, t.element_type)
    return tensor.ExtractSliceOp(result, value, [r0], [], [], [DYNAMIC] + [0] * (t.rank - 1),
                                 shape, [1] * t.rank).result


def _read_scalars(result: ir.Value, scalars: dict) -> None:
    """Rank-0 inputs from outside the forall of the generic computing `result`: read once as
    scalars and used in its body."""
    op = defining_op(result)
    if op.name != "linalg.generic":
        return
    view = op.opview
    block = body_of(op)
    for i, v in enumerate(view.inputs):
        if _rank(v) != 0 or (defining_op(v) is not None and defining_op(v).parent == op.parent):
            continue
        if v not in scalars:
            with ir.InsertionPoint.at_block_begin(op.parent.regions[0].blocks[0]), op.location:
                scalars[v] = tensor.extract(v, [])
        block.arguments[i].replace_all_uses_with(scalars[v])


def _clone_into(op: ir.Operation, mapping: dict, r0, rows) -> None:
    ls = loop_structure(op) if op.name != "linalg.fill" else None
    n_operands = len(op.operands)
    maps = ls.maps if ls is not None else None
    operands = []
    for k in range(n_operands):
        v = op.operands[k]
        if v in mapping:
            operands.append(mapping[v])
            continue
        if rows is None or not isinstance(v.type, ir.RankedTensorType) or v.type.rank == 0:
            operands.append(v)
            continue
        if op.name == "linalg.fill":
            sliced = True
        else:
            results = list(maps[k].results)
            sliced = bool(results) and isinstance(results[0], ir.AffineDimExpr) and \
                results[0].position == 0
        operands.append(_slice_rows(v, r0, rows) if sliced else v)
    clone = op.clone()
    for k, v in enumerate(operands):
        clone.operands[k] = v
    n_out = len(op.results)
    outs = list(clone.operands)[n_operands - n_out:]
    for r, o in zip(clone.results, outs):
        r.set_type(o.type)
    for old, new in zip(op.results, clone.results):
        mapping[old] = new
    if rows is not None and op.name == "linalg.generic":
        for inner in block_ops(body_of(clone)):
            if inner.name == "linalg.index" and ir.IntegerAttr(inner.attributes["dim"]).value == 0:
                with ir.InsertionPoint.after(inner), inner.location:
                    shifted = arith.addi(inner.results[0], r0)
                for use in list(inner.results[0].uses):
                    user = user_op(use)
                    if user != defining_op(shifted):
                        user.operands[use.operand_number] = shifted


def check(ops: list, rows: int, total_rows: int) -> None:
    first = ops[0]
    for op in ops:
        if not is_linalg_op(op):
            raise Illegal(op, "not a linalg op")
        if op.block != first.block:
            raise Illegal(op, "not in the block of the first target")
    if rows and total_rows % rows:
        raise Illegal(first, f"{total_rows} rows are not a multiple of {rows} per iteration")
    if not outputs_of(ops):
        raise Illegal(first, "the kernel computes nothing used")


def _before(ops: list, outputs: list) -> ir.Operation:
    """The op the forall is inserted before: the first op of the block reading an output
    when every reader comes after the targets (a later kernel reading this one's results),
    else the block's terminator."""
    block_list = block_ops(ops[0].block)
    order = {op: i for i, op in enumerate(block_list)}

    def in_block(op):
        while op is not None and op not in order:
            op = op.parent
        return op

    readers = [in_block(u) for v in outputs for u in users(v)]
    readers = [order[r] for r in readers if r is not None and r not in ops]
    if readers and min(readers) > max(order[op] for op in ops):
        return block_list[min(readers)]
    return terminator(ops[0].block)


def outline(ops: list, rows: int | None, total_rows: int, mapping_attr, rewriter) -> ir.Operation:
    """The forall computing `ops` (module docstring); rows None: one iteration."""
    outputs = outputs_of(ops)
    grid = total_rows // rows if rows else 1
    with ir.InsertionPoint(_before(ops, outputs)), ops[0].location:
        inits = [empty(list(v.type.shape), v.type.element_type) for v in outputs]
        forall = scf.ForallOp([0], [grid], [1], shared_outs=inits, mapping=mapping_attr)
        shared = list(forall.body.arguments)[1:]
        iv = forall.body.arguments[0]
        mapping = {}
        with ir.InsertionPoint(forall.body):
            r0 = arith.muli(iv, index_constant(rows)) if rows else None
            scalars = {}
            for op in ops:
                _clone_into(op, mapping, r0, rows)
                _read_scalars(mapping[op.results[0]], scalars)
            parallel = scf.InParallelOp()
        with ir.InsertionPoint(parallel.region.blocks[0]):
            for v, dest in zip(outputs, shared):
                t = ir.RankedTensorType(v.type)
                if rows:
                    sizes = [rows] + list(t.shape[1:])
                    tensor.ParallelInsertSliceOp(mapping[v], dest, [r0], [], [],
                                                 [DYNAMIC] + [0] * (t.rank - 1), sizes, [1] * t.rank)
                else:
                    tensor.ParallelInsertSliceOp(mapping[v], dest, [], [], [], [0] * t.rank,
                                                 list(t.shape), [1] * t.rank)
    for v, r in zip(outputs, forall.results):
        v.replace_all_uses_with(r)
    for op in reversed(ops):
        rewriter.erase_op(op)
    return forall.operation


class OutlineIntoForallOp(TransformExt.Operation, name="outline_into_forall"):
    target: ext.Operand[transform.AnyOpType]
    rows: ir.IntegerAttr
    total_rows: ir.IntegerAttr
    mapping: ir.ArrayAttr
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                rows = ir.IntegerAttr(op.rows).value
                total_rows = ir.IntegerAttr(op.total_rows).value
                if not targets:
                    results.set_ops(op.result, [])
                    return Success
                try:
                    check(targets, rows, total_rows)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                forall = outline(targets, rows or None, total_rows, ir.ArrayAttr(op.mapping),
                                 rewriter)
                results.set_ops(op.result, [forall])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def outline_into_forall(ops: ir.Value, *, rows: int, total_rows: int,
                        mapping: ir.ArrayAttr) -> ir.Value:
    """Move `ops` into a new scf.forall (module docstring); rows=0: one iteration."""
    i64 = ir.IntegerType.get_signless(64)
    return OutlineIntoForallOp(ops, ir.IntegerAttr.get(i64, rows), ir.IntegerAttr.get(i64, total_rows),
                               mapping).result


__all__ = ["OutlineIntoForallOp", "outline_into_forall", "outputs_of"]
