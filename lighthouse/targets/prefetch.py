"""Software prefetch of the next register tile's accumulators, of streams that cross a
page every step, and of the next tile of an input passed over several times per tile.

A register tile's loop (an scf.for over k carrying vector accumulators) starts from a
`vector.transfer_read` of its output tile and ends in a `vector.transfer_write` of the same
tile (or, a tile of packed C panels of a product in bf16 pairs, a `vector.store` of its rows
flattened into the tile's collapse_shape). When that tile is not in cache (a matmul's
output tile larger than L2, read and written once per k block), the loop waits for its
first loads: 6-16% of a 1024^3 f32 matmul on this Sapphire Rapids host. `prefetch_next_accumulators` issues, before each such read, a
`memref.prefetch` of every cache line of the tile the next iteration of the enclosing loops
will read: the view of the output tile is recomputed with the innermost loop's induction
variable one step on (or, on its last iteration, the next outer one's and the inner loop's
first), so the lines arrive while this tile's loop runs. The last tile of the nest prefetches
itself: every view stays in bounds (runtime checks verify subviews). bf16 2048^3 on one
thread of a Zen 5 host, C panels of 64 x 2048 f32 (512 KiB, evicted from L2 by B's 2 MiB
of panels): 16% of the time in the accumulator loads without, 0.6% with; 37.3 -> 33.6 ms.

A register tile loop that loads one vector per step from rows a page or more apart (a 1 x 1
convolution's image: one channel plane per input channel, 128 planes per channel block)
runs as many streams as steps, more than the hardware prefetcher follows; its first pass
over a tile of lanes waits on memory. `prefetch_next_page_strided_loads` prefetches into L2,
with each such load, the same step's vector of the next tile along the nearest enclosing
loop that moves it (the next tile of lanes). Conv2d(256, 64, 1) over [8, 256, 56, 56] on one
thread: 5.69 -> 4.99 ms (torch 4.38).

A loop whose body passes over the same tile of a large input two or more times (the fused
cross-entropy's class tile: its max, then its exp-sum; a softmax's or a layer norm's rows:
their reductions, then their exps) waits on memory in its first pass and leaves the memory
idle in the others, which run from cache: the hardware prefetcher only follows demand
misses. `prefetch_next_reread_tiles` prefetches into L2, with each read of those passes, the
same lines of the next iteration's tile, so the memory streams while the later passes
compute. For inputs larger than L2 and tiles of at most a quarter of it (a next tile of
half of L2 would evict the current one before its last pass). On 2 threads, one process
alternating with and without: cross-entropy [1023, 128256] 36.1 -> 30.2 ms, layer norm
[4096, 4096] 6.16 -> 5.18 ms, softmax 5.84 -> 5.41 ms."""

from __future__ import annotations

import math

from torch_mlir import ir
from torch_mlir.dialects import arith, memref

from transform_ext.common import (all_in_bounds, clone_op, constant_value, defining_op, is_nested_in,
                                  is_zero)

CACHE_LINE_BYTES = 64
MAX_LINES = 64  # per tile: a register tile of at most 32 rows of two lines
_KERNEL_OPS = ("vector.fma", "vector.contract", "x86.avx512.dot")
_VIEW_OPS = ("memref.subview", "affine.apply", "memref.cast", "memref.reinterpret_cast")
# a group norm's tile: a channel block's linearized index, the block expanded into groups
_RESHAPE_OPS = ("memref.expand_shape", "memref.collapse_shape", "affine.linearize_index",
                "affine.delinearize_index")


def _line_elements(element_type: ir.Type) -> int:
    """Elements of `element_type` in one cache line."""
    return max(1, CACHE_LINE_BYTES * 8 // getattr(element_type, "width", 32))


def _has_kernel_ops(loop: ir.Operation) -> bool:
    found = []

    def visit(op):
        if op.name in _KERNEL_OPS:
            found.append(op)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    loop.walk(visit)
    return bool(found)


def _accumulator_reads(loop: ir.Operation) -> list[ir.Operation]:
    """The transfer_reads initializing `loop`'s iter_args whose loop result is written back
    to the same view at the same indices."""
    reads = []
    inits = list(loop.operands)[3:]
    for i, init in enumerate(inits):
        read = defining_op(init)
        if read is None or read.name != "vector.transfer_read":
            continue
        source = read.operands[0]
        if not isinstance(source.type, ir.MemRefType):
            continue
        indices = list(read.operands)[1:1 + ir.MemRefType(source.type).rank]
        if _written_back(_carried(loop.results[i]), source, indices):
            reads.append(read)
    return reads


_ROW_OPS = ("vector.extract", "vector.insert_strided_slice", "vector.shape_cast")


def _written_back(result: ir.Value, source: ir.Value, indices: list[ir.Value]) -> bool:
    """Is loop result `result` written to `source` at `indices`: by a transfer_write, or, a
    tile read at its origin, by a vector.store of the tile flattened (its rows extracted and
    inserted into one vector, stored into a collapse_shape of `source` at its origin)?"""
    at_origin = all(is_zero(v) for v in indices)
    pending, seen = [result], []
    while pending:
        for use in pending.pop().uses:
            op = use.owner
            if op.name == "vector.transfer_write":
                if op.operands[1] == source and list(op.operands)[2:2 + len(indices)] == indices:
                    return True
            elif op.name == "vector.store" and use.operand_number == 0 and at_origin:
                base = defining_op(op.operands[1])
                if base is not None and base.name == "memref.collapse_shape" \
                        and base.operands[0] == source \
                        and all(is_zero(v) for v in list(op.operands)[2:]):
                    return True
            elif op.name in _ROW_OPS and op not in seen:
                seen.append(op)
                pending.append(op.results[0])
    return False


def _carried(value: ir.Value) -> ir.Value:
    """`value`, or the result of the loops it initializes one after the other (a k loop
    unrolled by 4 and its remainder loop)."""
    for _ in range(4):
        uses = list(value.uses)
        if len(uses) != 1 or uses[0].owner.name != "scf.for" or uses[0].operand_number < 3:
            break
        value = uses[0].owner.results[uses[0].operand_number - 3]
    return value


def _reads_minor_rows_in_bounds(read: ir.Operation) -> bool:
    """Does `read` take whole rows of its view's minor dims, in bounds (so that every
    prefetched element is inside the view)?"""
    amap = ir.AffineMapAttr(read.attributes["permutation_map"]).value
    return all_in_bounds(read) and \
        amap == ir.AffineMap.get_minor_identity(amap.n_dims, len(amap.results))


def _iv(loop: ir.Operation) -> ir.Value:
    return loop.regions[0].blocks[0].arguments[0]


def _ivs(loop: ir.Operation) -> list[ir.Value]:
    """The induction variables of an scf.for (its one; the other block arguments are
    iter_args) or an scf.parallel (one per dim)."""
    args = list(loop.regions[0].blocks[0].arguments)
    return args if loop.name == "scf.parallel" else args[:1]


def _moving_iv(loop: ir.Operation) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(induction variable, upper bound, step) of `loop`'s innermost dim: an scf.for's own,
    an scf.parallel's last (a thread's consecutive iterations step along it)."""
    ivs = _ivs(loop)
    n, operands = len(ivs), list(loop.operands)
    return ivs[-1], operands[2 * n - 1], operands[3 * n - 1]


def _slice(value: ir.Value, loops: list[ir.Operation], order: list[ir.Operation],
           ivs: list[ir.Value], reshapes: bool = False) -> bool:
    """Collect in `order` (operands first) the ops inside the outermost of `loops` that
    compute `value`, and in `ivs` the loops' induction variables they read; False when one
    of them is not a pure view or index computation (with `reshapes`, _RESHAPE_OPS count
    as such), or reads another block argument."""
    op = defining_op(value)
    if op is None:
        if any(value == iv for loop in loops for iv in _ivs(loop)):
            if not any(value == iv for iv in ivs):
                ivs.append(value)
            return True
        owner = ir.BlockArgument(value).owner.owner
        return not (owner == loops[-1] or is_nested_in(owner, loops[-1]))
    if not is_nested_in(op, loops[-1]) or op in order:
        return True
    if op.name not in _VIEW_OPS and not op.name.startswith("arith.") \
            and not (reshapes and op.name in _RESHAPE_OPS):
        return False
    if not all(_slice(v, loops, order, ivs, reshapes) for v in op.operands):
        return False
    order.append(op)
    return True


def _next_ivs(loops: list[ir.Operation]) -> dict:
    """The induction variables of the next iteration of `loops` (innermost first, at most
    two), each mapped from the current one: the inner one a step on, or on its last
    iteration its lower bound and the outer one a step on; the current ones on the nest's
    last iteration."""
    lb, ub, step = list(loops[0].operands)[:3]
    iv = _iv(loops[0])
    ahead = arith.addi(iv, step)
    wrap = arith.cmpi(arith.CmpIPredicate.sge, ahead, ub)
    if len(loops) == 1:
        return {iv: arith.select(wrap, iv, ahead)}
    _, outer_ub, outer_step = list(loops[1].operands)[:3]
    outer_iv = _iv(loops[1])
    outer_ahead = arith.addi(outer_iv, outer_step)
    last = arith.andi(wrap, arith.cmpi(arith.CmpIPredicate.sge, outer_ahead, outer_ub))
    return {iv: arith.select(last, iv, arith.select(wrap, lb, ahead)),
            outer_iv: arith.select(arith.cmpi(arith.CmpIPredicate.ne, wrap, last), outer_ahead, outer_iv)}


def _enclosing_loops(read: ir.Operation) -> list[ir.Operation]:
    """The scf.for directly around `read` and the one directly around that (at most two)."""
    loops = []
    parent = read.parent
    while parent is not None and parent.name == "scf.for" and len(loops) < 2:
        loops.append(parent)
        parent = parent.parent
    return loops


def _prefetch_next(read: ir.Operation) -> bool:
    """Prefetch before `read` every cache line of the view the next iteration reads."""
    source = read.operands[0]
    mtype = ir.MemRefType(source.type)
    vtype = ir.VectorType(read.results[0].type)
    if vtype.rank not in (1, 2) or not _reads_minor_rows_in_bounds(read):
        return False
    line = _line_elements(mtype.element_type)
    rows, cols = (vtype.shape[0] if vtype.rank == 2 else 1), vtype.shape[-1]
    if rows * -(-cols // line) > MAX_LINES:
        return False
    indices = list(read.operands)[1:1 + mtype.rank]
    loops = _enclosing_loops(read)
    order, ivs = [], []
    if not loops or not all(_slice(v, loops, order, ivs) for v in [source] + indices):
        return False
    if not any(iv == _iv(loops[0]) for iv in ivs):
        return False  # the same view every iteration
    if len(loops) == 2 and not any(iv == _iv(loops[1]) for iv in ivs):
        loops = loops[:1]
    with ir.InsertionPoint(read), read.location:
        mapping = _next_ivs(loops)
        for op in order:
            clone_op(op, mapping)
        view, at = mapping.get(source, source), [mapping.get(v, v) for v in indices]
        index = ir.IndexType.get()

        def plus(value, offset):
            return arith.addi(value, arith.constant(index, offset)) if offset else value

        for r in range(rows):
            for c in range(0, cols, line):
                where = list(at)
                if vtype.rank == 2:
                    where[-2] = plus(where[-2], r)
                where[-1] = plus(where[-1], c)
                memref.prefetch(view, where, True, 3, True)  # for writing, into L1
    return True


def prefetch_next_accumulators(payload: ir.Module) -> int:
    """Prefetch, before each register tile's accumulator read, the tile of the next
    iteration of its enclosing loops (see the module docstring). Returns the reads served."""
    reads = []

    def visit(op):
        if op.name == "scf.for" and _has_kernel_ops(op):
            reads.extend(_accumulator_reads(op))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        return sum(_prefetch_next(read) for read in reads)


# A stream the hardware prefetcher loses: a register tile's loop reads one vector per step
# from rows at least this many bytes apart (each step a new page: a 1 x 1 convolution's
# image, one channel plane per input channel).
PAGE_BYTES = 4096


def _page_strided_loads(loop: ir.Operation) -> list[ir.Operation]:
    """The 1-D `vector.load`s in `loop`'s body from a subview whose offset along a dim of
    PAGE_BYTES stride or more is `loop`'s induction variable."""
    iv = _iv(loop)
    found = []
    for op in loop.regions[0].blocks[0].operations:
        if op.name != "vector.load" or ir.VectorType(op.results[0].type).rank != 1:
            continue
        view = defining_op(op.operands[0])
        if view is None or view.name != "memref.subview":
            continue
        source = ir.MemRefType(view.operands[0].type)
        strides, _ = source.get_strides_and_offset()
        width = getattr(source.element_type, "width", 32) // 8
        offsets = iter(list(view.operands)[1:])
        for dim, static in enumerate(view.opview.static_offsets):
            value = next(offsets) if static == ir.ShapedType.get_dynamic_stride_or_offset() else None
            if value is not None and value == iv and strides[dim] * width >= PAGE_BYTES:
                found.append(op)
                break
    return found


def _prefetch_next_stream(load: ir.Operation, loop: ir.Operation) -> bool:
    """Prefetch into L2, before `load` (in register tile loop `loop`), the lines of the same
    step of the next tile along the nearest enclosing loop that moves the loaded view;
    the nest's last such tile prefetches itself."""
    outer = _enclosing_loops(loop)
    source, indices = load.operands[0], list(load.operands)[1:]
    for moving in outer:
        order, ivs = [], []
        if not all(_slice(v, [loop, moving], order, ivs) for v in [source] + indices):
            return False
        if any(iv == _iv(moving) for iv in ivs):
            break
    else:
        return False
    _prefetch_ahead(load, moving, order, source, indices)
    return True


def _prefetch_ahead(read: ir.Operation, moving: ir.Operation, order: list[ir.Operation],
                    source: ir.Value, indices: list[ir.Value], iterations: int = 1) -> None:
    """Before `read` (a vector read of `source` at `indices`, computed by the ops `order`),
    prefetch into L2 every line it would read `iterations` iterations of `moving` on (on
    the last ones, its own)."""
    vtype = ir.VectorType(read.results[0].type)
    line = _line_elements(vtype.element_type)
    with ir.InsertionPoint(read), read.location:
        iv, ub, step = _moving_iv(moving)
        distance = step if iterations == 1 else \
            arith.muli(step, arith.constant(ir.IndexType.get(), iterations))
        ahead = arith.addi(iv, distance)
        mapping = {iv: arith.select(arith.cmpi(arith.CmpIPredicate.slt, ahead, ub), ahead, iv)}
        for op in order:
            clone_op(op, mapping)
        view, at = mapping.get(source, source), [mapping.get(v, v) for v in indices]
        index = ir.IndexType.get()
        for c in range(0, vtype.shape[-1], line):
            where = list(at)
            if c:
                where[-1] = arith.addi(where[-1], arith.constant(index, c))
            memref.prefetch(view, where, False, 2, True)  # for reading, into L2


def prefetch_next_page_strided_loads(payload: ir.Module) -> int:
    """Prefetch, in each register tile loop that loads a vector from a new page every step
    (`_page_strided_loads`), the next tile's vector of the same step (see
    `_prefetch_next_stream`). Returns the loads served."""
    pairs = []

    def visit(op):
        if op.name == "scf.for" and _has_kernel_ops(op):
            pairs.extend((load, op) for load in _page_strided_loads(op))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        return sum(_prefetch_next_stream(load, loop) for load, loop in pairs)


# views of a function argument, and the loops of passes over its tiles
_VIEW_CHAIN = ("memref.subview", "memref.expand_shape", "memref.collapse_shape", "memref.cast",
               "memref.reinterpret_cast")
_LOOPS = ("scf.for", "scf.parallel")


def _argument_base(source: ir.Value) -> ir.Value | None:
    """The function argument `source` is a view of (through subviews, reshapes and casts),
    or None."""
    while True:
        op = defining_op(source)
        if op is None:
            owner = ir.BlockArgument(source).owner.owner
            return source if getattr(owner, "operation", owner).name == "func.func" else None
        if op.name not in _VIEW_CHAIN:
            return None
        source = op.operands[0]


def _static_bytes(value: ir.Value) -> int:
    mtype = ir.MemRefType(value.type)
    if not mtype.has_static_shape:
        return 0
    return math.prod(mtype.shape) * getattr(mtype.element_type, "width", 32) // 8


def _reread_sites(payload: ir.Module, min_bytes: int) -> list[tuple[ir.Operation, ir.Value]]:
    """(read, base): in-bounds vector reads of whole rows from a function argument of at
    least min_bytes, with unit leading vector dims."""
    sites = []

    def visit(op):
        if op.name == "vector.transfer_read" and isinstance(op.operands[0].type, ir.MemRefType):
            vtype = ir.VectorType(op.results[0].type)
            base = _argument_base(op.operands[0])
            if base is not None and _static_bytes(base) >= min_bytes \
                    and all(s == 1 for s in vtype.shape[:-1]) and _reads_minor_rows_in_bounds(op):
                sites.append((op, base))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return sites


def _loops_around(op: ir.Operation) -> list[ir.Operation]:
    """The scf.for / scf.parallel ops around `op`, innermost first, up to the function."""
    loops, parent = [], op.parent
    while parent is not None and parent.name != "func.func":
        if parent.name in _LOOPS:
            loops.append(parent)
        parent = parent.parent
    return loops


def _child_of(op: ir.Operation, loop: ir.Operation) -> ir.Operation:
    """The op of `loop`'s body that holds `op`."""
    while op.parent != loop:
        op = op.parent
    return op


def _tile_bytes(read: ir.Operation, inner: list[ir.Operation]) -> int | None:
    """Bytes `read` reads over one iteration of the outermost of `inner` (the loops between
    it and the read, constant bounds), or None."""
    vtype = ir.VectorType(read.results[0].type)
    total = vtype.shape[-1] * getattr(vtype.element_type, "width", 32) // 8
    for loop in inner[:-1]:
        if len(_ivs(loop)) != 1:
            return None
        bounds = [constant_value(v) for v in list(loop.operands)[:3]]
        if not all(isinstance(b, ir.IntegerAttr) for b in bounds):
            return None
        lb, ub, step = (ir.IntegerAttr(b).value for b in bounds)
        if step <= 0:
            return None
        total *= max(0, -(-(ub - lb) // step))
    return total


def _index_signature(read: ir.Operation, loop: ir.Operation) -> tuple:
    """How `read` indexes its view in one iteration of `loop`: the view, then per index
    "constant", "moves" (computed from a loop inside `loop`) or "fixed" (set outside it)."""
    def kind(value):
        op = defining_op(value)
        if op is not None and op.name == "arith.constant":
            return "constant"
        pending, seen = [value], set()
        while pending:
            v = pending.pop()
            op = defining_op(v)
            if op is None:
                owner = ir.BlockArgument(v).owner.owner
                owner = getattr(owner, "operation", owner)
                if owner.name in _LOOPS and (owner == loop or is_nested_in(owner, loop)):
                    return "moves"
                continue
            if op in seen or not is_nested_in(op, loop):
                continue
            seen.add(op)
            pending.extend(op.operands)
        return "fixed"

    return (read.operands[0],) + tuple(kind(v) for v in _read_indices(read))


def _splits(a: tuple, b: tuple) -> bool:
    """Do two reads of one view split its tile instead of both passing over it (a loop over
    a row's whole vectors and its remainder loop: one index moves in the first, is a
    constant in the second)? Reads of different views are taken as passes over the same
    tile (a class loop over a reshaped view of the rows, then a sweep of the rows)."""
    if a[0] != b[0] or len(a) != len(b):
        return False
    return any({x, y} == {"constant", "moves"} for x, y in zip(a[1:], b[1:]))


def _moving_pass_loop(read: ir.Operation, base: ir.Value, sites, max_tile_bytes: int):
    """(loop, ops computing the read's view and indices in it, the read's tile bytes): the
    innermost loop around `read` whose body holds two or more loops reading the tile `read`
    reads (`_splits`: not a main loop and its remainder), one of them holding `read`, and
    whose induction variable (an scf.parallel's innermost) moves what `read` reads, when
    the loops between have constant bounds (the next iteration runs the same steps) and its
    tile (what `read` reads in one iteration) is at most max_tile_bytes (and, for an
    scf.parallel over several dims, over MIN_PARALLEL_TILE_BYTES); None otherwise."""
    loops = _loops_around(read)
    for depth, loop in enumerate(loops):
        if depth == 0:
            continue
        mine = _index_signature(read, loop)
        passes = {_child_of(other, loop) for other, b in sites
                  if b == base and is_nested_in(other, loop)
                  and not _splits(mine, _index_signature(other, loop))}
        if len(passes) < 2 or not all(p.name in _LOOPS for p in passes):
            continue
        inner = loops[:depth + 1]
        order, ivs = [], []
        if not all(_slice(v, inner, order, ivs, reshapes=True)
                   for v in [read.operands[0]] + _read_indices(read)):
            return None
        if not any(iv == _moving_iv(loop)[0] for iv in ivs):
            continue
        tile = _tile_bytes(read, inner)
        least = 0 if len(_ivs(loop)) == 1 else MIN_PARALLEL_TILE_BYTES
        return (loop, order, tile) if tile is not None and least < tile <= max_tile_bytes else None
    return None


def _read_indices(read: ir.Operation) -> list[ir.Value]:
    return list(read.operands)[1:1 + ir.MemRefType(read.operands[0].type).rank]


# How far ahead a pass over a reread tile prefetches, at least: a tile of 2 KiB (the fused
# cross-entropy's class tile of a row) prefetched one tile ahead arrived late (one thread on
# AMD Zen 5, [1023, 128256]: 28-35 ms one tile ahead, 21.4-21.8 ms four tiles ahead, 21.5-29
# eight; on 2 threads 15.1 -> 13.0-13.3 ms four ahead).
REREAD_AHEAD_BYTES = 8192

# Tiles of a parallel loop over several dims (a group or instance norm's [batch, groups]):
# its next tile follows in memory, and below this the hardware prefetcher keeps up. One
# thread on AMD Zen 5, [56, 32, 32, 64] f32: a group norm's 32 KiB tiles 0.98 -> 0.87 ms
# prefetched, an instance norm's 8 KiB ones 0.51 -> 0.55 ms; its 16 KiB tiles ([28, 32,
# 32, 128]) 1.06 -> 0.71 ms.
MIN_PARALLEL_TILE_BYTES = 8192


def prefetch_next_reread_tiles(payload: ir.Module, l2_bytes: int) -> int:
    """Prefetch into L2, before each vector read of a function argument larger than L2 in a
    pass over a tile of at most a quarter of L2 that is passed over again
    (`_moving_pass_loop`), the same lines of the tile REREAD_AHEAD_BYTES on (the next
    iteration's, or further for tiles smaller than that); the last iterations prefetch
    their own. Returns the reads served. (A log-softmax's row block of half of L2,
    read again by its output sweep, is left alone: its next block would evict it.)"""
    if l2_bytes <= 0:
        return 0
    sites = _reread_sites(payload, l2_bytes)
    chosen = [(read, found) for read, base in sites
              if (found := _moving_pass_loop(read, base, sites, l2_bytes // 4)) is not None]
    with payload.context:
        for read, (loop, order, tile) in chosen:
            _prefetch_ahead(read, loop, order, read.operands[0], _read_indices(read),
                            max(1, -(-REREAD_AHEAD_BYTES // tile)))
    return len(chosen)
