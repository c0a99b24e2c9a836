"""Non-temporal (streaming) stores for large results.

A result buffer much larger than the caches is written once and never read back by the
kernel. Ordinary stores first read each line into the cache (read-for-ownership) and evict
other data to hold it; non-temporal stores (vmovntps) write whole lines to memory without
reading them. On this project's Sapphire Rapids VM, copying [4096, 4096] f32 (64 MiB each
way) took 4.7 ms with ordinary stores and 2.6 ms with streaming ones on two threads; a
pipeline whose next kernel reads the result back broke even at 16 MiB results and lost
below 8 MiB (the result then stays in L3 for its reader). `CpuDescription.stream_bytes`
is that threshold.

`stream_large_results` rewrites the vector stores into a result buffer (an argument of an
entry function, which no other function calls, written and never read by the function:
bufferization's out-params, which the runtime allocates 64-byte aligned,
`runtime.RESULT_ALIGNMENT`) of at least `min_bytes` into `vector.store {nontemporal, alignment = 64}` when each store writes whole
64-byte lines at an offset provably a multiple of 64 bytes: an in-bounds, unmasked
`vector.transfer_write` (minor identity, unit innermost stride; its leading vector dims
unrolled) or `vector.store` whose offset, through the views (subview, cast, collapse and
expand shape) down to the argument, is a sum of index values times static strides, each
index value a multiple of what its definition shows (constants, loop induction variables
of a known lower bound and step, sums, products, affine maps). Streaming stores are weakly
ordered: `fence_streaming_stores` ends each parallel region and each function that has them
with an `sfence`, so the results are in memory before another thread or the caller reads
them.
"""

from __future__ import annotations

import itertools
import math

from torch_mlir import ir
from torch_mlir.dialects import arith, llvm, vector

from transform_ext.common import all_in_bounds, constant_value, defining_op, is_row_major, user_op

LINE_BYTES = 64
_VIEWS = ("memref.subview", "memref.cast", "memref.collapse_shape", "memref.expand_shape")
_WRITES = {"vector.transfer_write": 1, "vector.store": 1, "vector.maskedstore": 0,
           "memref.store": 1}  # op -> index of the operand that is the written buffer
_INDUCTION_OWNERS = ("scf.for", "scf.parallel", "scf.forall")
_DYNAMIC = -(1 << 63)  # MLIR's dynamic size, stride and offset


def stream_large_results(payload: ir.Module, min_bytes: int) -> int:
    """Rewrite the eligible stores into result buffers of at least `min_bytes` as streaming
    stores (see the module docstring); the number rewritten. min_bytes 0: none."""
    if min_bytes <= 0:
        return 0
    count = 0
    called = _callees(payload)
    with payload.context:
        for op in payload.body.operations:
            op = op.operation
            if op.name == "func.func" and len(op.regions[0].blocks) \
                    and ir.StringAttr(op.attributes["sym_name"]).value not in called:
                count += _stream_in_function(op, min_bytes)
    return count


def _callees(payload: ir.Module) -> set[str]:
    """Functions called within the module: their arguments may be any view, of any alignment;
    only the entry points' arguments are the runtime's result tensors."""
    names = set()

    def visit(op):
        if op.name == "func.call":
            names.add(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return names


def _stream_in_function(func: ir.Operation, min_bytes: int) -> int:
    count = 0
    for arg in func.regions[0].blocks[0].arguments:
        for store in _stores_into_result(arg, min_bytes) or ():
            if _line_aligned(store):
                _as_streaming_store(store)
                count += 1
    return count


def _stores_into_result(arg: ir.Value, min_bytes: int) -> list[ir.Operation] | None:
    """The vector stores into `arg` when it is a static, identity-layout buffer of at least
    `min_bytes` that the function writes and never reads (None otherwise)."""
    if not isinstance(arg.type, ir.MemRefType):
        return None
    t = ir.MemRefType(arg.type)
    if not is_row_major(t):
        return None
    if math.prod(t.shape) * _element_bytes(t.element_type) < min_bytes:
        return None
    stores, pending = [], [arg]
    while pending:
        value = pending.pop()
        for use in value.uses:
            user = user_op(use)
            if user.name in _VIEWS and use.operand_number == 0:
                pending.append(user.results[0])
            elif _WRITES.get(user.name) == use.operand_number:
                if user.name in ("vector.transfer_write", "vector.store"):
                    stores.append(user)
            else:
                return None  # read, or used in a way not known to be a write
    return stores


def _element_bytes(t: ir.Type) -> int:
    return max(1, getattr(t, "width", 0) // 8)


def _line_aligned(store: ir.Operation) -> bool:
    """Does `store` write whole 64-byte lines, each starting at a multiple of 64 bytes from
    its root argument?"""
    value_type = ir.VectorType(store.operands[0].type)
    buffer = store.operands[1]
    memref_type = ir.MemRefType(buffer.type)
    indices = list(store.operands[2:2 + memref_type.rank])
    if store.name == "vector.transfer_write":
        if len(store.operands) != 2 + memref_type.rank or not all_in_bounds(store):
            return False  # masked
        amap = ir.AffineMapAttr(store.attributes["permutation_map"]).value
        if amap != ir.AffineMap.get_minor_identity(memref_type.rank, value_type.rank):
            return False
    if any(d == _DYNAMIC for d in value_type.shape) or value_type.scalable:
        return False
    strides, _ = memref_type.get_strides_and_offset()
    if strides[-1] != 1 or any(s == _DYNAMIC for s in strides):
        return False
    elem = _element_bytes(memref_type.element_type)
    row = value_type.shape[-1]
    if row * elem % LINE_BYTES:
        return False
    # the leading vector dims (unrolled into rows) step the trailing memref dims before the last
    lead = value_type.shape[:-1]
    lead_strides = strides[len(strides) - len(value_type.shape):-1]
    divisor = math.gcd(*(s for n, s in zip(lead, lead_strides) if n > 1), 0)
    for index, stride in zip(indices, strides):
        divisor = math.gcd(divisor, _divisor(index) * stride)
    view_offset = _view_offset_divisor(buffer)
    if view_offset is None:
        return False
    divisor = math.gcd(divisor, view_offset)
    return divisor * elem % LINE_BYTES == 0


def _view_offset_divisor(buffer: ir.Value) -> int | None:
    """A number the element offset of `buffer`'s first element from its root argument is a
    multiple of (0: the offset is 0); None when a view on the way has dynamic strides."""
    divisor = 0
    while not isinstance(buffer, ir.BlockArgument):
        view = defining_op(buffer)
        if view is None or view.name not in _VIEWS:
            return None
        source = view.operands[0]
        if view.name == "memref.subview":
            strides, _ = ir.MemRefType(source.type).get_strides_and_offset()
            if any(s == _DYNAMIC for s in strides):
                return None
            dynamic = iter(view.opview.offsets)
            for offset, stride in zip(ir.DenseI64ArrayAttr(view.attributes["static_offsets"]),
                                      strides):
                known = _divisor(next(dynamic)) if offset == _DYNAMIC \
                    else abs(offset)
                divisor = math.gcd(divisor, known * stride)
        buffer = source
    return divisor


def _divisor(value: ir.Value) -> int:
    """A number the index `value` is known to be a multiple of (0: it is 0)."""
    if isinstance(value, ir.BlockArgument):
        return _induction_divisor(value)
    known = constant_value(value)
    if isinstance(known, ir.IntegerAttr):
        return abs(known.value)
    op = defining_op(value)
    if op is None:
        return 1
    if op.name in ("arith.addi", "arith.subi"):
        return math.gcd(_divisor(op.operands[0]), _divisor(op.operands[1]))
    if op.name == "arith.muli":
        return _divisor(op.operands[0]) * _divisor(op.operands[1])
    if op.name == "arith.index_cast":
        return _divisor(op.operands[0])
    if op.name == "affine.apply":
        amap = ir.AffineMapAttr(op.attributes["map"]).value
        if len(amap.results) == 1:
            operands = [_divisor(v) for v in op.operands]
            return _expr_divisor(amap.results[0], operands, amap.n_dims)
    return 1


def _expr_divisor(expr: ir.AffineExpr, operands: list[int], n_dims: int) -> int:
    if isinstance(expr, ir.AffineConstantExpr):
        return abs(expr.value)
    if isinstance(expr, ir.AffineDimExpr):
        return operands[expr.position]
    if isinstance(expr, ir.AffineSymbolExpr):
        return operands[n_dims + expr.position]
    if isinstance(expr, ir.AffineAddExpr):
        return math.gcd(_expr_divisor(expr.lhs, operands, n_dims),
                        _expr_divisor(expr.rhs, operands, n_dims))
    if isinstance(expr, ir.AffineMulExpr):
        return _expr_divisor(expr.lhs, operands, n_dims) * _expr_divisor(expr.rhs, operands, n_dims)
    return 1


def _induction_divisor(arg: ir.BlockArgument) -> int:
    """For an induction variable of scf.for / scf.parallel / scf.forall: gcd(lower bound,
    step); for any other block argument 1."""
    owner = arg.owner.owner
    owner = getattr(owner, "operation", owner)
    if not isinstance(owner, ir.Operation) or owner.name not in _INDUCTION_OWNERS:
        return 1
    loop = owner.opview
    if owner.name == "scf.for":
        if arg.arg_number != 0:
            return 1  # an iter_arg
        return math.gcd(_divisor(loop.lowerBound), _divisor(loop.step))
    if owner.name == "scf.parallel":
        i = arg.arg_number
        return math.gcd(_divisor(loop.lowerBound[i]), _divisor(loop.step[i]))
    if arg.arg_number >= len(ir.DenseI64ArrayAttr(owner.attributes["static_step"])):
        return 1  # a shared output
    i = arg.arg_number
    lower = ir.DenseI64ArrayAttr(owner.attributes["static_lowerBound"])[i]
    step = ir.DenseI64ArrayAttr(owner.attributes["static_step"])[i]
    if _DYNAMIC in (lower, step):
        return 1
    return math.gcd(abs(lower), abs(step))


def _as_streaming_store(store: ir.Operation) -> None:
    """One `vector.store {nontemporal, alignment = 64}` per row of the stored vector (its
    leading dims unrolled), in place of `store`."""
    value, buffer = store.operands[0], store.operands[1]
    rank = ir.MemRefType(buffer.type).rank
    indices = list(store.operands[2:2 + rank])
    shape = ir.VectorType(value.type).shape
    lead = shape[:-1]
    with ir.InsertionPoint(store), store.location:
        row_type = ir.VectorType.get([shape[-1]], ir.VectorType(value.type).element_type)
        for position in itertools.product(*(range(n) for n in lead)):
            row = vector.extract(value, [], list(position)) if lead else value
            if ir.VectorType(row.type).shape != [shape[-1]]:
                row = vector.shape_cast(row_type, row)
            at = list(indices)
            for k, p in enumerate(position):
                d = rank - len(shape) + k
                if p:
                    at[d] = arith.addi(at[d], arith.constant(ir.IndexType.get(), p))
            vector.StoreOp(row, buffer, at, nontemporal=True, alignment=LINE_BYTES)
    store.erase()


def fence_streaming_stores(payload: ir.Module) -> int:
    """After the OpenMP conversion: an sfence before the end of each omp.parallel region that
    holds a streaming store (each thread's stores are in memory before the region's closing
    barrier) and before each return of a function that has them; the number of fences.
    (Before buffer deallocation, whose analysis rejects the intrinsic's unknown effects.)"""
    count = 0
    with payload.context:
        for op in payload.body.operations:
            func = op.operation
            if func.name != "func.func" or not len(func.regions[0].blocks):
                continue
            streams, regions, returns = [], [], []

            def visit(op):
                if op.name == "vector.store" and "nontemporal" in op.attributes \
                        and ir.BoolAttr(op.attributes["nontemporal"]).value:
                    streams.append(op)
                    parent = op.parent
                    while parent.name not in ("func.func", "omp.parallel"):
                        parent = parent.parent
                    if parent.name == "omp.parallel" and parent not in regions:
                        regions.append(parent)
                elif op.name == "func.return":
                    returns.append(op)
                return ir.WalkResult.ADVANCE

            func.walk(visit)
            if not streams:
                continue
            for region in regions:
                _sfence_before(list(region.regions[0].blocks[-1].operations)[-1])
            for ret in returns:
                _sfence_before(ret)
            count += len(regions) + len(returns)
    return count


def _sfence_before(op: ir.Operation) -> None:
    with ir.InsertionPoint(op), op.location:
        llvm.call_intrinsic(None, "llvm.x86.sse.sfence", [], [], [])
