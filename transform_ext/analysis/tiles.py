"""Tile sizes of the generic schedule, read from a linalg op's loops and its producers.

`parallel_tile_sizes`: the forall tiles of a root op (threads, cache, recomputed
reductions); `vector_tile_sizes`: the scf.for tiles that leave one vector-sized static tile
(a register tile for contractions); `lane_dim`: the loop dim the vector lanes run along;
`register_tile_init_producer`: a contraction's accumulator producer computed per register
tile. Their `policy` argument is any object with the fields they read (the transform ops'
`ForallPolicy` / `VectorPolicy`, or the schedule's GenericParams, which has them all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_mlir import ir

from ..common import defining_op, largest_divisor_at_most
from .classify import is_contraction
from .structure import dim_positions, is_linalg_op, loop_structure


@dataclass(frozen=True)
class ForallPolicy:
    """threads x tiles_per_thread forall tiles, a tile's share of the result at most
    tile_bytes (pass_bytes for a root whose fused chain passes over each contiguous row of
    the tile several times, see `parallel_tile_sizes`), inner chunks of at least vector_tile
    elements, ops of less than min_parallel_work work sequential: output elements, times the
    reduced extent for a reduction other than a contraction (see `parallel_tile_sizes`)."""

    threads: int
    tiles_per_thread: int
    tile_bytes: int
    vector_tile: int
    min_parallel_work: int
    pass_bytes: int
    lanes: int = 1


@dataclass(frozen=True)
class VectorPolicy:
    """vector_tile elements along the lane dim; (m, n) register tiles of contractions;
    bf16_k: k step of the register tiles of contractions whose two inputs are bf16 (2: a
    pair of k per step, the form of transform_ext.contracts_to_bf16_dot_products);
    k_chunk: rows of A per chunk of a vector-matrix product's k loop (1: no chunks, see
    `vector_matrix_k_chunk`)."""

    vector_tile: int
    register_tile: tuple[int, int]
    bf16_k: int = 1
    k_chunk: int = 1


def smallest_divisor_at_least(n: int, low: int) -> int:
    for d in range(max(1, low), n + 1):
        if n % d == 0:
            return d
    return n


def parallel_tile_sizes(op: ir.Operation, policy) -> list[int] | None:
    """Forall tile sizes over the loop dims (0 = not tiled), or None to stay sequential.

    Sequential below `min_parallel_work`: output elements, or for a reduction other than a
    contraction its iteration points (a row max of [1023, 128256] has 1023 results; on 2
    threads it ran at 0.64x torch when it stayed sequential, 1.16x split). A contraction
    counts its results: a small one split for the threads would get tiles thinner than its
    register tiles.

    Only dims whose split recomputes no reduction of the fused producer chain are split
    (`recomputed_reductions`: splitting the columns of a row-reduction chain would repeat
    every row's reductions per column tile); with too few such rows for the threads, fewer
    threads are busy. Outer dims first, into threads x tiles_per_thread tiles, or more so
    that a tile's share of the result stays under `tile_bytes`, or under `pass_bytes` when
    the innermost dim cannot be split: then the chain reduces each contiguous row of the
    tile before an op reads the row again (a softmax's max, its sum, its quotient), and the
    tile should stay in L1 between those passes (KernelBench's softmax, 2048 rows of 1536,
    1.5x faster in tiles of two rows than of eight; an instance norm 1.7x). A reduction over
    an outer dim (an RMS norm over the channels of [N, C, H, W]) keeps `tile_bytes`: its
    smaller tiles read shorter runs of each channel (0.75x); the innermost loop dim then,
    when the outer dims alone give too few tiles, in chunks of at least `vector_tile` that
    divide it (forall tiles keep static shapes; a prime extent stays whole). A chain
    reading a tensor transposed gets square blocks (`transposed_blocks`), or, when its lanes
    cannot be split, rows in whole cache lines of that tensor (`_whole_lines_across`). A
    vector-matrix product (`is_vector_matrix`: each tile streams its strip of every row of A,
    its result is small) gets one tile per thread: more tiles only cut A's rows into shorter
    runs (x [1, 4096] @ A [4096, 4096] on one thread: 1.09x torch in one tile, 0.89x in four)."""
    ls = loop_structure(op)
    if not ls.is_static or not ls.parallel_dims or ls.num_outputs == 0:
        return None
    work = 1
    for d in ls.parallel_dims:
        work *= ls.ranges[d]
    if (work if is_contraction(op) else math.prod(ls.ranges)) < policy.min_parallel_work:
        return None
    splittable = [d for d in ls.parallel_dims
                  if not recomputed_reductions(op, d) and not splits_short_rows(op, d)]
    for_threads = policy.threads * policy.tiles_per_thread
    streams = is_vector_matrix(ls, lane_dim(ls))
    if streams:
        for_threads = policy.threads
    sizes = [0] * ls.num_loops
    last = _innermost_parallel(ls)
    rows = [d for d in splittable if d != last]
    chunks = ls.ranges[last] // policy.vector_tile if last in splittable else 1
    most = max(1, chunks)
    for d in rows:
        most *= ls.ranges[d]
    budget = policy.tile_bytes if last in splittable or last not in ls.parallel_dims \
        else policy.pass_bytes
    for_cache = 1 if streams else -(-work * widest_element_bytes(op) // budget)
    wanted, tiles = max(for_threads, min(for_cache, most)), 1
    for d in rows:
        if wanted <= 1:
            break
        extent = ls.ranges[d]
        if extent <= wanted:
            sizes[d] = 1
            tiles *= extent
            wanted = -(-wanted // extent)
        else:
            count = smallest_divisor_at_least(extent, wanted)
            sizes[d] = extent // count
            tiles *= count
            wanted = 1
    if wanted > 1 and chunks > 1:
        extent = ls.ranges[last]
        chunk = largest_divisor_at_most(extent, max(policy.vector_tile, extent // wanted))
        if policy.vector_tile <= chunk < extent:
            sizes[last] = chunk
    lane = lane_dim(ls)
    across = transposed_dim(ls, lane, policy.lanes, depth=CHAIN_DEPTH)
    pairs = pair_dims(op, ls, lane) if across is None else None
    if pairs is not None:  # pairs transposed as words
        across, lane = pairs
    if across is not None and across in splittable and lane in splittable:
        sizes = transposed_blocks(ls, sizes, across, lane, policy, widest_element_bytes(op))
    elif across is not None and across in splittable and sizes[across]:
        sizes = _whole_lines_across(ls, sizes, across, policy)
    if not any(sizes):
        return None
    return sizes


def _whole_lines_across(ls, sizes: list[int], across: int, policy) -> list[int]:
    """`sizes` with the rows of a chain that reads its input transposed (`across`, the
    input's contiguous dim) but cannot split its lanes (a softmax or norm over the rows of
    x.t(): each row is reduced whole) tiled in at least policy.lanes rows, a divisor of the
    extent, while the tiles still cover the threads: a tile then reads whole cache lines of
    the input. Tiles of two rows used two elements of every line they read (softmax(x.t())
    of 2048 x 2048: 0.36x torch)."""
    extent = ls.ranges[across]
    rows = smallest_divisor_at_least(extent, max(sizes[across], policy.lanes))
    tiles = 1
    for d, size in enumerate(sizes):
        if size and d != across:
            tiles *= ls.ranges[d] // size
    if tiles * (extent // rows) < policy.threads:
        return sizes
    return sizes[:across] + [rows] + sizes[across + 1:]


def transposed_blocks(ls, sizes: list[int], across: int, lane: int, policy,
                      element_bytes: int) -> list[int]:
    """`sizes` with dims `across` and `lane` of a transposing op (`transposed_dim`; or a
    copy of pairs transposed as words, `pair_dims`, its nxt as `lane`) tiled in
    square blocks, multiples of policy.lanes where one divides the extent (else the largest
    divisor of at least policy.lanes, else whole: the vector tiles peel their partial last
    tile): a block's input rows and result rows both stay in cache, where rows of the result
    read the input a few elements per row (2048 x 2048: 2.2 ms in blocks of 128, 3.5 ms in
    tiles of 8 whole rows). A tile holds no more elements than `sizes` gave it (nor than
    tile_bytes): a block of 16 x 16 channels and columns under whole depth and rows of a
    3-D pooling's layout change doubled its channels-last intermediate past L2 (KernelBench
    46, 2x slower), so such a root keeps `sizes`; as many tiles as `sizes` gave, for the
    threads."""
    tile = rest = 1
    for d in ls.parallel_dims:
        tile *= sizes[d] or ls.ranges[d]
        rest *= (sizes[d] or ls.ranges[d]) if d not in (across, lane) else 1
    side = math.isqrt(min(tile, policy.tile_bytes // element_bytes) // rest)
    if side < policy.lanes:
        return sizes

    def block(extent: int, high: int) -> int:
        multiple = largest_multiple_dividing(extent, high, policy.lanes)
        if multiple:
            return multiple
        divisor = largest_divisor_at_most(extent, high)
        return divisor if divisor >= policy.lanes else 0

    out = list(sizes)
    for d in (across, lane):
        out[d] = block(ls.ranges[d], side)
    return out


CHAIN_DEPTH = 4  # producers up a root's chain whose transposed reads set its forall tiles


def largest_multiple_dividing(extent: int, high: int, unit: int) -> int:
    """The largest multiple of `unit` at most `high` (at least `unit`) that divides
    `extent`; 0 when none does."""
    return next((d for d in range(max(unit, high - high % unit), 0, -unit) if extent % d == 0), 0)


def _innermost_parallel(ls) -> int:
    """The loop dim split last, in chunks of vector_tile: the last loop dim, or for a window
    (a pooling: taps innermost, input 0 indexed by ow + kw) the output's innermost dim: split
    as an outer row dim it took the smallest divisor above the tiles wanted (KernelBench
    41's rows of 65523 = 3 x 21841 outputs into forall tiles of 3, 0.28x torch)."""
    last = ls.num_loops - 1
    if last in ls.parallel_dims or not ls.num_inputs or not ls.num_outputs \
            or isinstance(ls.maps[0].results[-1], ir.AffineDimExpr):
        return last
    lane = dim_positions(ls.output_map(0))[-1]
    return lane if lane in ls.parallel_dims else last


def recomputed_reductions(root: ir.Operation, dim: int) -> list[ir.Operation]:
    """The reductions in `root`'s producer chain (the linalg ops `transform.structured.fuse`
    pulls into its tiles) that splitting loop dim `dim` into t tiles computes t times over.

    A tile of the root indexes the operand dims whose map results use a split dim; through
    a producer's output map those are its loop dims split in turn. A producer whose slice
    depends on no split dim is the whole tensor: fuse leaves it outside, computed once. One
    whose slice depends on the root's other parallel dims (which may be split too) but not
    on `dim` is computed whole along `dim` once per tile of `dim`: if it reduces, it is
    returned."""
    found = []
    seen = set()
    others = frozenset(d for d in loop_structure(root).parallel_dims if d != dim)
    stack = [(root, frozenset([dim]), others)]
    while stack:
        op, tiled, other = stack.pop()
        if (op, tiled, other) in seen:
            continue
        seen.add((op, tiled, other))
        ls = loop_structure(op)
        for value, amap in zip(op.operands, ls.maps):
            producer = defining_op(value)
            if producer is None or not is_linalg_op(producer) \
                    or not isinstance(value.type, ir.ShapedType):
                continue
            pls = loop_structure(producer)
            out = dim_positions(pls.output_map(ir.OpResult(value).result_number))

            def through(dims):
                return frozenset(out[a] for a, expr in enumerate(amap.results)
                                 if expr_dims(expr) & dims and out[a] is not None)

            ptiled, pother = through(tiled), through(other)
            if not ptiled and not pother:
                continue
            if not ptiled and pls.reduction_dims and producer not in found:
                found.append(producer)
            stack.append((producer, ptiled, pother))
    return found


def splits_short_rows(root: ir.Operation, dim: int) -> bool:
    """Does splitting loop dim `dim` of `root` split the short side of a product in its
    producer chain that pairs rows of both sides on shared lanes (`short_side`)? Each tile
    would then read the whole of the long side's operand again (a linear layer's W once
    per row of a small batch)."""
    seen, stack = set(), [(root, frozenset([dim]))]
    while stack:
        op, tiled = stack.pop()
        if (op, tiled) in seen:
            continue
        seen.add((op, tiled))
        ls = loop_structure(op)
        if tiled & short_side(ls):
            return True
        for value, amap in zip(op.operands, ls.maps):
            producer = defining_op(value)
            if producer is None or not is_linalg_op(producer) \
                    or not isinstance(value.type, ir.ShapedType):
                continue
            out = dim_positions(loop_structure(producer).output_map(
                ir.OpResult(value).result_number))
            ptiled = frozenset(out[a] for a, expr in enumerate(amap.results)
                               if expr_dims(expr) & tiled and out[a] is not None)
            if ptiled:
                stack.append((producer, ptiled))
    return False


def expr_dims(expr) -> set[int]:
    """The loop dims an affine expression reads."""
    if isinstance(expr, ir.AffineDimExpr):
        return {expr.position}
    if isinstance(expr, ir.AffineBinaryExpr):
        return expr_dims(expr.lhs) | expr_dims(expr.rhs)
    return set()


def element_bytes(t: ir.Type) -> int:
    """Bytes of a shaped type's element (4 when it has no bit width)."""
    element = ir.ShapedType(t).element_type
    return (element.width + 7) // 8 if hasattr(element, "width") else 4


def widest_element_bytes(op: ir.Operation) -> int:
    widths = [ir.ShapedType(v.type).element_type for v in list(op.operands) + list(op.results)
              if isinstance(v.type, ir.ShapedType)]
    return max([(t.width + 7) // 8 for t in widths if hasattr(t, "width")] or [4])


def vector_tile_sizes(op: ir.Operation, policy) -> list[int] | None:
    """scf.for tile sizes that leave a vector-sized static tile (0 = keep whole). The vector
    lanes run along the loop dim that is innermost in memory (`lane_dim`)."""
    ls = loop_structure(op)
    if not ls.is_static or ls.num_loops == 0 or ls.num_outputs == 0:
        return None
    sizes = [1] * ls.num_loops
    shared = shared_lane_pairs(ls, policy)
    if shared is not None:
        return shared
    if ls.is_contraction:
        dims = ls.contraction_dims()
        if len(dims["m"]) and len(dims["n"]):
            rows, lanes = dims["m"][-1], dims["n"][-1]
            out_last = dim_positions(ls.output_map(0))[-1:]
            rows_last = any(dim_positions(m)[-1:] == [rows] for m in ls.maps[:ls.num_inputs])
            # the accumulator is stored m-innermost, or n is a unit dim and m the contiguous
            # dim of its operand (A^T x with A read in place: the vector x matrix form)
            if out_last == [rows] or ls.ranges[lanes] == 1 and rows_last:
                rows, lanes = lanes, rows
            mr, nr = policy.register_tile
            sizes[rows] = largest_divisor_at_most(ls.ranges[rows], mr)
            taller = largest_divisor_at_most(ls.ranges[rows], 3 * mr // 2)
            if sizes[rows] < mr < taller:
                # 9-12 rows (an LSTM step's batch of 10): all in one tile of up to 1.5 mr
                # rows, not two of 5 (half the accumulators, B's vectors read twice)
                sizes[rows] = taller
            # fewer rows than the register tile has (a vector-matrix product x^T A): wider
            # lanes keep as many accumulators and read longer runs of each row of A
            widen = max(1, mr // sizes[rows])
            sizes[lanes] = register_lanes(ls.ranges[lanes], nr * widen, max(1, nr // 2))
            if sizes[lanes] < nr:
                # fewer lanes than the register tile has: more rows (at most 2 mr) keep
                # as many accumulators, each k step sharing one vector of B across them
                sizes[rows] = largest_divisor_at_most(ls.ranges[rows],
                                                      min(2 * mr, mr * nr // sizes[lanes]))
            if len(dims["k"]) == 1 and all(isinstance(v.type.element_type, ir.BF16Type)
                                           for v in op.operands[:ls.num_inputs]):
                sizes[dims["k"][0]] = min(policy.bf16_k, ls.ranges[dims["k"][0]])
            return sizes
    lane = lane_dim(ls)
    if is_vector_matrix(ls, lane):
        # y[m] += A[k, m] x[k]: a register tile's worth of accumulators along A's rows, the
        # whole row when it fits, else a divisor of at least half of it, else peeled
        run, extent = policy.register_tile[0] * policy.register_tile[1], ls.ranges[lane]
        sizes[lane] = extent if extent <= run else largest_divisor_at_most(extent, run)
        if 2 * sizes[lane] < run:
            sizes[lane] = min(run, extent)
        return sizes
    hardware = max(1, policy.register_tile[1] // 2)
    pairs = pair_lane_sizes(op, ls, lane, hardware)
    if pairs is not None:
        return pairs
    across = transposed_dim(ls, lane, hardware)
    if across is not None:
        sizes[lane] = sizes[across] = transposed_side(ls, lane, across, hardware,
                                                      widest_element_bytes(op))
        return sizes
    # the register tile is two vectors wide (schedules.generic.register_tile_for)
    sizes[lane] = lane_tile(ls.ranges[lane], policy.vector_tile, even=touches_bf16(op),
                            lanes=max(1, policy.register_tile[1] // 2))
    rows = shared_lane_rows(ls, lane)
    if rows is not None:
        accumulators = policy.register_tile[0] * policy.register_tile[1] // sizes[lane]
        sizes[rows] = largest_divisor_at_most(ls.ranges[rows], max(1, accumulators))
    if ls.reduction_dims and has_step_invariant_term(op):
        for d in ls.reduction_dims:
            sizes[d] = 1
    if all(s == r for s, r in zip(sizes, ls.ranges)):
        return None
    return sizes


def pair_dims(op: ir.Operation, ls, lane: int) -> tuple[int, int] | None:
    """For a copy that transposes 16-bit pairs whole (an AMX operand's VNNI pack,
    [R, K/2, 2] -> [K/2, R, 2]: no reductions, 16-bit elements only, the lane dim of extent 2
    innermost in the output and in a tensor it reads), (across, nxt): nxt is the output's
    next dim, across the one that tensor holds next; the pairs move as 32-bit words
    transposed across x nxt. None for other ops."""
    if ls.reduction_dims or ls.ranges[lane] != 2 or ls.num_outputs != 1 or any(
            not isinstance(v.type, ir.ShapedType) or element_bytes(v.type) != 2
            for v in list(op.operands)[:ls.num_inputs + 1]):
        return None
    written = dim_positions(ls.output_map(0))
    if len(written) < 2 or written[-1] != lane or written[-2] is None:
        return None
    nxt = written[-2]
    for dims in _tensors_read(ls, 0):
        across = dims[-2] if len(dims) >= 2 and dims[-1] == lane else None
        if across not in (None, nxt) and across in ls.parallel_dims:
            return across, nxt
    return None


def pair_lane_sizes(op: ir.Operation, ls, lane: int, hardware: int) -> list[int] | None:
    """Vector tile sizes of a copy transposing pairs (`pair_dims`): `hardware` x `hardware`
    pairs, transposed in registers as words (transform_ext.transpose_pairs_as_words; one
    pair per step ran a 2048 x 1024-pair bf16 copy at 1.00x torch, 2.18x so). None when
    the extents are smaller or for other ops. (Two rows interleaved, [K/2, 2, N] ->
    [K/2, N, 2], keep their tiles: 2.69x torch, 0.76x as a [2, 32] vector transpose.)"""
    found = pair_dims(op, ls, lane)
    if found is None:
        return None
    across, nxt = found
    if min(ls.ranges[across], ls.ranges[nxt]) < hardware:
        return None
    sizes = [1] * ls.num_loops
    sizes[lane] = 2
    sizes[across] = sizes[nxt] = hardware
    return sizes


def transposed_side(ls, lane: int, across: int, hardware: int, element_bytes: int) -> int:
    """Side of the square vector tile of a transposing op (`transposed_dim`): `hardware`
    lanes, or twice as many for 16-bit elements when both extents are multiples of that
    (no partial tiles beside whole ones of another shape), so that each
    row read and written is a whole vector register (a cache line with 64-byte vectors;
    lighthouse.targets.transpose_blocks moves such a tile in 32-bit pairs). A 16 x 16 tile
    of bf16 read and wrote half lines, whose other halves were evicted before the next tile
    used them: rows 8 KiB apart share an L1 set (a 4096^2 transpose at 29% of the streaming
    bandwidth, against 62% in f32)."""
    if element_bytes == 2 and ls.ranges[lane] % (2 * hardware) == 0 \
            and ls.ranges[across] % (2 * hardware) == 0:
        return 2 * hardware
    return hardware


def transposed_dim(ls, lane: int, hardware: int, depth: int = 0) -> int | None:
    """For an op without reductions whose lanes run along `lane`: the loop dim that a tensor
    it reads holds innermost while also reading `lane` (a transpose: y[j, i] = f(x[i, j])),
    when both extents hold at least `hardware` lanes; the tensors read by its elementwise
    producers count too, up to `depth` producers up the chain (the ops a forall tile of it
    fuses). A tile of hardware x hardware elements then reads that tensor in rows and
    transposes them in registers (cpu target: vector.transpose by shuffles; a partial last
    tile is peeled), where lanes along `lane` alone gathered one element per cache line
    (x.t().contiguous() of 2048 x 2048 ran at 0.19x torch in f32, 0.15x in bf16)."""
    if hardware < 2 or ls.reduction_dims or ls.ranges[lane] < hardware:
        return None
    for dims in _tensors_read(ls, depth):
        # unit dims hold no stride: a 1 x 1 filter's [F, C, 1] is read along C
        wide = [d for d in dims if d is None or ls.ranges[d] != 1]
        inner = wide[-1] if len(wide) >= 2 else None
        if inner is not None and inner != lane and lane in dims \
                and inner in ls.parallel_dims and ls.ranges[inner] >= hardware:
            return inner
    return None


def transposed_loop_innermost(op: ir.Operation, policy) -> int | None:
    """For a transposing op (`transposed_dim`) whose every tensor input is read transposed
    (its innermost wide dim the one `transposed_dim` names, never the lane dim): that loop
    dim, to be stepped innermost over the vector tiles. Each input row is then read as one
    stream, line after line, which the hardware prefetcher follows, and each tile writes
    one whole line of each of its result rows (a 4096^2 bf16 transpose on 2 threads:
    7.15 -> 5.81 ms, f32 9.95 -> 7.60 ms, where every tile read a line of 32 new rows). None
    for other ops, and when an input is read along the lanes (its rows stay the stream)."""
    ls = loop_structure(op)
    if not ls.is_static or ls.num_loops == 0 or ls.num_outputs != 1:
        return None
    lane = lane_dim(ls)
    across = transposed_dim(ls, lane, max(1, policy.register_tile[1] // 2))
    if across is None:
        return None
    for dims in _tensors_read(ls, 0):
        wide = [d for d in dims if d is None or ls.ranges[d] != 1]
        if wide and wide[-1] != across:
            return None
    return across


def _tensors_read(ls, depth: int):
    """For each ranked tensor the op reads: the loop dim of `ls` each of its dims is indexed
    by (None for another expression); and, `depth` producers deep, the same for those its
    elementwise producers read (a producer's loop dims mapped to the op's through the tensor
    between them)."""
    for i in range(ls.num_inputs):
        operand = ls.op.operands[i]
        if not isinstance(operand.type, ir.ShapedType) or operand.type.rank == 0:
            continue
        dims = dim_positions(ls.maps[i])
        yield dims
        producer = defining_op(operand)
        if depth < 1 or producer is None or not is_linalg_op(producer) \
                or len(producer.results) != 1:
            continue
        pls = loop_structure(producer)
        written = dim_positions(pls.output_map(0))
        if pls.reduction_dims or None in written or len(set(written)) != pls.num_loops:
            continue
        to_op = dict(zip(written, dims))
        for pdims in _tensors_read(pls, depth - 1):
            yield [to_op.get(d) for d in pdims]


def has_step_invariant_term(op: ir.Operation) -> bool:
    """Does a result of linalg op `op` combine its accumulator with a term that reads none of
    the op's inputs and no loop index (sum_j 1: a count whose ones were folded into the body
    as a constant)? Upstream's vectorizer combines such a term once, not once per step of
    the reduced dims (the count of 2 ones came out 1: a group norm's input gradient was
    wrong); with those dims tiled by 1 each step is a tile of its own."""
    block = op.regions[0].blocks[0]
    num_inputs = len(op.operands) - len(op.results)
    yielded = block.operations[len(block.operations) - 1]

    known: dict = {}  # body op -> does it read an input or a loop index

    def reads_inputs(value) -> bool:
        owner = defining_op(value)
        if owner is None:  # a block argument: of this body (an input or an accumulator)?
            return value.owner == block and ir.BlockArgument(value).arg_number < num_inputs
        if owner.parent != op:  # defined outside the body: the same at every step
            return False
        if owner not in known:
            known[owner] = owner.name == "linalg.index" or any(
                reads_inputs(v) for v in owner.operands)
        return known[owner]

    return any(not reads_inputs(v) for v in yielded.operands)


def is_vector_matrix(ls, lane: int) -> bool:
    """Is the op a contraction with rows on one side only (no n dims, or no m dims) whose
    lane dim is one of those rows, innermost in the output and in the operand holding
    them, and read by no other operand: y[b.., m] = sum_k A[b.., k, m] x[b.., k] (A^T x or
    x^T A with A read in place; dims of extent 1 do not count, such as the row dim of x
    [1, K] @ A that linalg.matmul keeps)? Each k step is then an FMA of a run of A's row
    with one broadcast element of x."""
    if not ls.is_contraction or ls.num_outputs != 1:
        return False
    dims = {kind: [d for d in ds if ls.ranges[d] != 1] for kind, ds in ls.contraction_dims().items()}
    rows = dims["m"] or dims["n"]
    if (dims["m"] and dims["n"]) or lane not in rows or len(dims["k"]) < 1:
        return False
    readers = [m for m in ls.maps[:ls.num_inputs] if lane in dim_positions(m)]
    return dim_positions(ls.output_map(0))[-1:] == [lane] and len(readers) == 1 \
        and dim_positions(readers[0])[-1:] == [lane]


def vector_matrix_k_chunk(op: ir.Operation, policy) -> int | None:
    """For a vector-matrix product (`is_vector_matrix`) of one k dim: the rows of A per
    chunk of its k loop (the largest divisor of K up to policy.k_chunk, at least half of
    it), run outside the register tiles: a chunk's rows are read side by side, each as a
    sequential stream across the tiles, instead of one run per row down a column strip of
    A. None when the op is not such a product, K has no such divisor above it, or A is
    narrower than the running sums (bf16 A, f32 sums: its runs are half as long for the
    same sums to load and store per chunk; 0.85-0.99x measured, one thread)."""
    ls = loop_structure(op)
    if not ls.is_static or not is_vector_matrix(ls, lane_dim(ls)):
        return None
    lane = lane_dim(ls)
    rows = next(i for i, m in enumerate(ls.maps[:ls.num_inputs]) if lane in dim_positions(m))
    if element_bytes(op.operands[rows].type) < element_bytes(op.results[0].type):
        return None
    k_dims = ls.contraction_dims()["k"]
    target = policy.k_chunk
    if len(k_dims) != 1 or target < 2 or ls.ranges[k_dims[0]] <= target:
        return None
    chunk = largest_divisor_at_most(ls.ranges[k_dims[0]], target)
    return chunk if 2 * chunk >= target else None


def shared_lane_rows(ls, lane: int) -> int | None:
    """For a contraction whose lane dim every operand reads (a mat-vec's split k,
    transform_ext.split_matvec_lanes: P[m, l] += A[m, k1, l] x[k1, l]), its innermost row
    dim of extent > 1 (m, or n for x @ A^T): a tile of several rows shares each vector of x
    and keeps a register tile's worth of running sums. Else None."""
    if not ls.is_contraction or any(lane not in dim_positions(m) for m in ls.maps):
        return None
    dims = ls.contraction_dims()
    rows = [d for d in dims["m"] if ls.ranges[d] > 1] or [d for d in dims["n"] if ls.ranges[d] > 1]
    return rows[-1] if rows else None


def short_side(ls) -> frozenset[int]:
    """For a contraction with rows on both sides whose lane dim every operand reads
    innermost (a short product's split k, transform_ext.split_matvec_lanes:
    P[m, n, l] += A[m, k1, l] B[n, k1, l]): the dims of extent > 1 of its side with fewer
    rows. Else empty."""
    if not ls.is_contraction or not ls.is_static or ls.num_outputs != 1:
        return frozenset()
    lane = (dim_positions(ls.output_map(0)) or [None])[-1]
    if lane is None or ls.iterators[lane] != "parallel" or \
            any(dim_positions(m)[-1:] != [lane] for m in ls.maps):
        return frozenset()
    dims = ls.contraction_dims()
    rows = [[d for d in dims[side] if ls.ranges[d] > 1] for side in ("m", "n")]
    if not all(rows):
        return frozenset()
    return frozenset(min(rows, key=lambda r: math.prod(ls.ranges[d] for d in r)))


def shared_lane_pairs(ls, policy) -> list[int] | None:
    """For a short product's split k (`short_side`): the lanes whole, the short side's
    innermost rows up to half a register tile's worth of vector accumulators (a batch of up
    to 8 whole; 16 in tiles of 8, which its loops walk inside each tile of the other side's
    rows: transform_ext.split_matvec_lanes orders them so) and as many of the other side's
    as fill the register tile (each step loads one vector per row of either side and takes
    an FMA per pair). Else None."""
    short = short_side(ls)
    if not short:
        return None
    lane = dim_positions(ls.output_map(0))[-1]
    dims = ls.contraction_dims()
    short_row, other_row = (
        [d for d in dims[side] if ls.ranges[d] > 1][-1]
        for side in sorted(("m", "n"), key=lambda side: not set(dims[side]) & short))
    hardware = max(1, policy.register_tile[1] // 2)
    accumulators = max(1, policy.register_tile[0] * policy.register_tile[1] // hardware)
    vectors = -(-ls.ranges[lane] // hardware)
    sizes = [1] * ls.num_loops
    sizes[lane] = ls.ranges[lane]
    sizes[short_row] = largest_divisor_at_most(ls.ranges[short_row],
                                               max(1, accumulators // (2 * vectors)))
    sizes[other_row] = largest_divisor_at_most(
        ls.ranges[other_row], max(1, accumulators // (vectors * sizes[short_row])))
    return sizes


def register_lanes(extent: int, limit: int, vector: int) -> int:
    """Lanes of a contraction's register tile along a dim of `extent`, at most `limit`:
    the widest power-of-two multiple of one `vector` (register_tile's n is two vectors,
    schedules.generic.register_tile_for) that divides the extent; else the largest divisor
    of the extent that fits in one vector. Never another width: the accumulators are
    carried across the k loop, and LLVM's x86 backend takes a loop-carried <24 x float>
    or <48 x float> apart element by element on every k step (a 12800x256x48 product ran
    20x slower in 5 x 24 tiles than in 10 x 16 ones)."""
    width = vector
    while 2 * width <= limit and extent % (2 * width) == 0:
        width *= 2
    if width <= limit and extent % width == 0:
        return width
    return largest_divisor_at_most(extent, min(vector, limit))


def lane_tile(extent: int, vector_tile: int, even: bool = False, lanes: int = 1) -> int:
    """Elements of a lane dim of `extent` per vector tile: the whole dim up to twice
    `vector_tile`; else the largest divisor of the extent in [vector_tile / 2, vector_tile]
    that is a multiple of the hardware's `lanes` (a tile of 27 or 17 f32 is legalized into
    whole vectors plus single lanes, each time: KernelBench 47's sum over a dim of 255 ran
    0.67x torch on 8 lanes) and even if `even` (odd bf16 vectors are split later, see
    transform_ext.split_odd_bf16_lanes); else (no such divisor) `vector_tile` itself, and
    the loop's last partial tile is peeled off into a static tile of its own."""
    if extent <= 2 * vector_tile:
        return extent
    unit = max(lanes, 2 if even else 1)
    return next((d for d in range(vector_tile, (vector_tile + 1) // 2 - 1, -1)
                 if extent % d == 0 and d % unit == 0), vector_tile)


def lane_dim(ls) -> int:
    """The loop dim that is the innermost dim of the op's largest operand (the output on a
    tie): vector lanes along it read and write contiguous memory. When that operand's
    innermost index is not a plain dim (a pooling window's input, indexed by ow + kw), the
    output's innermost dim (lanes along the outputs, each window tap a shifted load); else
    the last loop dim."""
    best, best_size = None, -1
    order = list(range(ls.num_inputs, len(ls.maps))) + list(range(ls.num_inputs))
    for i in order:
        t = ls.op.operands[i].type
        if not isinstance(t, ir.ShapedType) or not t.has_static_shape or t.rank == 0:
            continue
        size = 1
        for d in t.shape:
            size *= d
        if size > best_size:
            best, best_size = i, size
    if best is not None:
        last = dim_positions(ls.maps[best])[-1]
        if last is not None:
            return last
    if ls.num_outputs:
        last = dim_positions(ls.output_map(0))[-1:]
        if last and last[0] is not None:
            return last[0]
    return ls.num_loops - 1


def touches_bf16(op: ir.Operation) -> bool:
    return any(isinstance(v.type, ir.ShapedType)
               and isinstance(ir.ShapedType(v.type).element_type, ir.BF16Type)
               for v in list(op.operands) + list(op.results))


def register_tile_init_producer(op: ir.Operation) -> ir.Operation | None:
    """For a contraction, the op producing its init (accumulator) if it can be computed per
    register tile instead of in a pass of its own: a linalg.fill, or an elementwise
    linalg.generic with an identity output map whose inputs are slices of the tile (projected
    permutations) and not its own init, used only by the contraction."""
    ls = loop_structure(op)
    if not ls.is_contraction or ls.num_outputs != 1:
        return None
    init = op.operands[ls.num_inputs]
    producer = defining_op(init)
    if producer is None or len(list(init.uses)) != 1 or not per_tile_producer(producer):
        return None
    return producer


def per_tile_producer(producer: ir.Operation) -> bool:
    """A one-result linalg.fill, or an elementwise linalg.generic with an identity output
    map whose inputs are projected permutations of its loops and not its own init: a tile of
    its result is the producer applied to the same tile of its operands."""
    if not is_linalg_op(producer) or len(producer.results) != 1:
        return False
    if producer.name == "linalg.fill":
        return True
    pls = loop_structure(producer)
    if producer.name != "linalg.generic" or not pls.is_elementwise or \
            not pls.output_map(0).is_permutation or \
            dim_positions(pls.output_map(0)) != list(range(pls.num_loops)):
        return False
    dest = producer.operands[pls.num_inputs]
    if any(producer.operands[j] == dest for j in range(pls.num_inputs)):
        return False
    return not any(None in dim_positions(pls.maps[j]) for j in range(pls.num_inputs)
                   if isinstance(producer.operands[j].type, ir.ShapedType))
