"""forall_results_in_lane_form: the per-row results of an scf.forall over row blocks leave it
in lane form.

    %forall2 = transform_ext.forall_results_in_lane_form %forall {lanes = 16, read = "max"}

A result r [N] (float, up to 32 bits) of the target forall, written by
    tensor.parallel_insert_slice %v into %out[%off] [rows] [1]
and read after it, becomes a result R [N, lanes] f32 written by
    V[i, l] = v[i]    (a [rows, lanes] linalg.generic, widened to f32: exact)
    tensor.parallel_insert_slice %V into %OUT[%off, 0] [rows, lanes] [1, 1]
and its readers read r' = max_l R[i, l] (read = "max": transform_ext/lane_form.py
max_over_lanes; a kernel reading a block of rows gets the layout of a reduction over its
lanes) or r'[i] = R[i, 0] (read = "first": a gather, a kernel reading the values along its
lanes, one per column of a tile), rounded back to r's type: every lane holds v[i], so
r' == r exactly. On a GPU a per-row value after a
reduction over the classes is held by every lane of its row; XeGPU distributes it as a
[rows, lanes] tile (a 2-D block store and load) but has no lane layout that writes or reads
it as a [rows] vector. The other results are kept as they are.

Legality first: the target is an scf.forall with static bounds; `read` is max or first;
for each converted result, the terminator's one insert writes it (a [rows] slice at one
offset, stride 1), and what else reads its shared output in the body reads contents that
can be rebuilt there: an init that is a tensor.empty or a linalg.fill of one (rebuilt at
the top of the body), else only extract_slices whose users are outputs of linalg.fill or
of generics that never read them (overwritten). Else a
silenceable failure naming the forall and the reason, nothing rewritten. A forall without
such results is left as it is. The target handle is consumed; the result holds the new
forall (or the target, unchanged).
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, scf, tensor, transform

from .common import (Illegal, ReplacesTargets, Success, body_of, build_generic,
                     defining_op, fail, payload_ops, terminator, user_op)
from .dialect import TransformExt
from .lane_form import dims_map, empty, index_constant, max_over_lanes

NAME = "transform_ext.forall_results_in_lane_form"
DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


def _inserts(forall: ir.Operation) -> list[ir.Operation]:
    return [op.operation for op in terminator(forall.regions[0].blocks[0]).regions[0]
            .blocks[0].operations]


def _per_row_results(forall: ir.Operation) -> list[int]:
    """Result numbers to convert: rank-1 float results (up to 32 bits) read after the forall."""
    found = []
    for k, r in enumerate(forall.results):
        t = ir.RankedTensorType(r.type)
        if t.rank == 1 and isinstance(t.element_type, ir.FloatType) \
                and t.element_type.width <= 32 and list(r.uses):
            found.append(k)
    return found


def _overwrites(use) -> bool:
    """Is `use` the output of a linalg.fill, or of a linalg.generic whose body never reads
    it (its value is overwritten whole)?"""
    user = user_op(use)
    if user.name == "linalg.fill":
        return use.operand_number == 1
    if user.name != "linalg.generic":
        return False
    inputs = len(user.operands) - len(user.results)
    return use.operand_number >= inputs and \
        not list(body_of(user).arguments[use.operand_number].uses)


def _check(forall: ir.Operation, converted: list[int]) -> dict[int, ir.Operation]:
    """The insert writing each converted result (module docstring's legality), else Illegal."""
    if forall.name != "scf.forall":
        raise Illegal(forall, "not an scf.forall")
    for name in ("staticLowerBound", "staticUpperBound", "staticStep"):
        if any(v == DYNAMIC for v in ir.DenseI64ArrayAttr(forall.attributes[name])):
            raise Illegal(forall, "dynamic bounds")
    block = forall.regions[0].blocks[0]
    ivs = len(ir.DenseI64ArrayAttr(forall.attributes["staticUpperBound"]))
    inserts = _inserts(forall)
    found = {}
    for k in converted:
        out = block.arguments[ivs + k]
        writes = [op for op in inserts if op.operands[1] == out]
        if len(writes) != 1 or writes[0].name != "tensor.parallel_insert_slice":
            raise Illegal(forall, f"result {k} is not written by one parallel_insert_slice")
        write = writes[0]
        sizes = list(ir.DenseI64ArrayAttr(write.attributes["static_sizes"]))
        strides = list(ir.DenseI64ArrayAttr(write.attributes["static_strides"]))
        if sizes == [DYNAMIC] or strides != [1]:
            raise Illegal(forall, f"result {k} is written by a dynamic or strided slice")
        init = list(forall.operands)[-len(forall.results) + k]
        for use in out.uses:
            user = user_op(use)
            if user == write or _initial_is_known(init):
                continue
            if user.name != "tensor.extract_slice" or not all(
                    _overwrites(u) for u in user.results[0].uses):
                raise Illegal(forall, f"result {k}'s shared output is read in the body by "
                              f"{user.name} (its contents would be lost)")
        found[k] = write
    return found


def _first_lane(lanes: ir.Value) -> ir.Value:
    """[n, lanes] -> [n]: each row's lane 0 (a gather: a scattered load along the GPU lanes)."""
    t = ir.RankedTensorType(lanes.type)

    def body(args):
        return [tensor.extract(lanes, [linalg.IndexOp(0).result, index_constant(0)])]

    return build_generic([], [empty([t.shape[0]], t.element_type)], [dims_map(1, [0])],
                         ["parallel"], body).result


def _initial(init: ir.Value) -> ir.Value:
    """The shared output's initial contents, rebuilt in the body: a tensor.empty, or a
    linalg.fill of one (the contents every iteration starts from)."""
    t = ir.RankedTensorType(init.type)
    fresh = empty(list(t.shape), t.element_type)
    owner = defining_op(init)
    if owner is not None and owner.name == "linalg.fill":
        return linalg.fill(owner.operands[0], outs=[fresh])
    return fresh


def _initial_is_known(init: ir.Value) -> bool:
    owner = defining_op(init)
    if owner is not None and owner.name == "linalg.fill":
        owner = defining_op(owner.operands[1])
    return owner is not None and owner.name == "tensor.empty"


def _lane_tile(value: ir.Value, lanes: int) -> ir.Value:
    """[rows] float -> [rows, lanes] f32, each row's value in every lane."""
    t = ir.RankedTensorType(value.type)
    f32 = ir.F32Type.get()
    widen = (lambda x: x) if t.element_type == f32 else (lambda x: arith.extf(f32, x))
    return build_generic([value], [empty([t.shape[0], lanes], f32)],
                         [dims_map(2, [0]), dims_map(2, [0, 1])], ["parallel", "parallel"],
                         lambda args: [widen(args[0])]).result


def rewrite(forall: ir.Operation, writes: dict[int, ir.Operation], lanes: int, read: str,
            rewriter) -> ir.Operation:
    block = forall.regions[0].blocks[0]
    ivs = len(ir.DenseI64ArrayAttr(forall.attributes["staticUpperBound"]))
    outs = list(forall.operands)[-len(forall.results):]
    kept = [k for k in range(len(outs)) if k not in writes]
    f32 = ir.F32Type.get()
    with ir.InsertionPoint(forall), forall.location:
        lane_outs = [empty([ir.RankedTensorType(outs[k].type).shape[0], lanes], f32)
                     for k in writes]
        new = scf.ForallOp(list(ir.DenseI64ArrayAttr(forall.attributes["staticLowerBound"])),
                           list(ir.DenseI64ArrayAttr(forall.attributes["staticUpperBound"])),
                           list(ir.DenseI64ArrayAttr(forall.attributes["staticStep"])),
                           shared_outs=[outs[k] for k in kept] + lane_outs,
                           mapping=forall.attributes["mapping"]
                           if "mapping" in forall.attributes else None)
    for attr in forall.attributes:
        name = getattr(attr, "name", attr)
        if name not in new.operation.attributes:
            new.operation.attributes[name] = forall.attributes[name]
    new_block = new.body
    new_args = list(new_block.arguments)
    with ir.InsertionPoint(new_block), forall.location:
        in_parallel = scf.InParallelOp()
    body_ops = [op.operation for op in block.operations][:-1]
    with ir.InsertionPoint(in_parallel), forall.location:
        scratch = {k: _initial(outs[k]) for k in writes}
    for op in body_ops:
        op.move_before(in_parallel)
    for i in range(ivs):
        block.arguments[i].replace_all_uses_with(new_args[i])
    for place, k in enumerate(kept):
        block.arguments[ivs + k].replace_all_uses_with(new_args[ivs + place])
    for k, value in scratch.items():
        block.arguments[ivs + k].replace_all_uses_with(value)
    target = in_parallel.region.blocks[0]
    for op in _inserts(forall):
        if op not in writes.values():
            _append(op, target)
    for place, (k, write) in enumerate(writes.items()):
        with ir.InsertionPoint(in_parallel), forall.location:
            tile = _lane_tile(write.operands[0], lanes)
        offset = list(write.operands)[2:3]
        static = list(ir.DenseI64ArrayAttr(write.attributes["static_offsets"]))
        rows = list(ir.DenseI64ArrayAttr(write.attributes["static_sizes"]))[0]
        with ir.InsertionPoint(target), forall.location:
            tensor.ParallelInsertSliceOp(tile, new_args[ivs + len(kept) + place], offset, [], [],
                                         static + [0], [rows, lanes], [1, 1])
    with ir.InsertionPoint.after(new.operation), forall.location:
        for place, k in enumerate(kept):
            forall.results[k].replace_all_uses_with(new.results[place])
        for place, k in enumerate(writes):
            old = forall.results[k]
            element = ir.RankedTensorType(old.type).element_type
            lanes_value = new.results[len(kept) + place]
            value = max_over_lanes(lanes_value) if read == "max" else _first_lane(lanes_value)
            if element != f32:
                value = build_generic([value], [empty(list(old.type.shape), element)],
                                      [dims_map(1, [0])] * 2, ["parallel"],
                                      lambda args: [arith.truncf(element, args[0])]).result
            old.replace_all_uses_with(value)
    rewriter.erase_op(forall)
    return new.operation


def _append(op: ir.Operation, block: ir.Block) -> None:
    """Move `op` to the end of `block` (a terminator-less in_parallel block)."""
    ops = list(block.operations)
    if ops:
        op.move_after(ops[-1].operation)
    else:
        with ir.InsertionPoint(block):
            anchor = arith.ConstantOp(ir.IndexType.get(), 0)
        op.move_before(anchor.operation)
        anchor.operation.erase()


class ForallResultsInLaneFormOp(TransformExt.Operation, name="forall_results_in_lane_form"):
    target: ext.Operand[transform.AnyOpType]
    lanes: ir.IntegerAttr
    read: ir.StringAttr
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                lanes = ir.IntegerAttr(op.lanes).value
                read = ir.StringAttr(op.read).value
                if read not in ("max", "first"):
                    return fail(NAME, Illegal(targets[0], f"read = {read!r}, not max or first"))
                plans = []
                try:
                    for t in targets:
                        plans.append(_check(t, _per_row_results(t)) if t.name == "scf.forall"
                                     else _check(t, []))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                rewritten = [rewrite(t, writes, lanes, read, rewriter) if writes else t
                             for t, writes in zip(targets, plans)]
                results.set_ops(op.result, rewritten)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def forall_results_in_lane_form(forall: ir.Value, lanes: int, read: str = "max") -> ir.Value:
    """The per-row results of `forall` in lane form (module docstring; `read`: how readers
    read them back); returns the new forall."""
    i64 = ir.IntegerType.get_signless(64)
    return ForallResultsInLaneFormOp(forall, ir.IntegerAttr.get(i64, lanes),
                                     ir.StringAttr.get(read)).result


__all__ = ["ForallResultsInLaneFormOp", "forall_results_in_lane_form"]
