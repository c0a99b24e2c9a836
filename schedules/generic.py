"""The generic schedule: any linalg payload, tiled for threads and vectors, correct first.

fuse (`fuse_generic`):
  1. elementwise ops are fused into their consumers (`linalg-fuse-elementwise-ops`);
  2. repeatedly, the last untiled linalg op of the function (a root: nothing after it reads
     it) has its outer parallel dims tiled into an `scf.forall` (enough tiles for the
     threads, and small enough that a tile's intermediates stay in L2), and its whole
     producer chain is fused into the tile (`transform.structured.fuse`, use_forall). A producer that still
     has users outside becomes a root of its own in a later round.
vectorize (`vectorize_generic`):
  3. every linalg op is tiled with `scf.for` to a vector tile: contractions to an
     m x n register tile (k = 1, lowered later to outer products / FMAs) that computes its
     accumulator's producer (a fill, an elementwise op such as a rescale) on the tile, in
     registers; every other op to 1 x ... x 1 x W along its innermost loop dim;
  4. the function is vectorized (`vectorize_children_and_apply_patterns`) and loop-invariant
     accumulator reads/writes are hoisted out of the loops. Before that, every
     tensor.insert_slice that is strided, rank-reducing or larger than a register tile
     becomes a loop of vector-tile inserts (`transform_ext.tile_insert_slices`): vectorized
     whole, it would lose its strides or become one vector as large as its source.
Forall tiles divide the extents (static shapes), and a dim is never split when a fused
producer's reduction would be computed once per tile (the row max and sum of a softmax under
column tiles). Vector tiles divide their extent when a divisor near the target exists; else
(a prime row length) the last, partial tile of the loop is peeled into a static tile of its
own; bf16 tiles of an odd lane count are split into an even part and one lane (LLVM's x86
backend cannot compile odd bf16 vectors).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects.transform import loop, structured

import transform_ext
from transform_ext.analysis.structure import dim_positions, is_linalg_op, loop_structure
from transform_ext.common import defining_op, largest_divisor_at_most, walk_ops
from transform_ext.scalarize_rank0_generics import scalarize_rank0_generics
from transform_ext.tile_insert_slices import tile_insert_slices

from .prepare import split_assertions
from .common import (ID_ATTR, any_op, canonicalize, clear_tags, hoist_loop_invariant_subsets, match,
                     match_id, run_passes, run_schedule, tag_ops)


_SEQUENTIAL = "lh.sequential"
_DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


@dataclass(frozen=True)
class GenericParams:
    """threads: parallel tiles are sized for this many workers (times `tiles_per_thread`).
    tile_bytes: and, over the outer dims, small enough that a tile of the root's result
    holds at most this many bytes (at the widest element type the root touches), so a
    fused row block's intermediates stay in the L2 cache between its passes.
    vector_tile: elements of the innermost loop dim per vector tile.
    register_tile: (m, n) accumulator tile of contractions.
    min_parallel_work: ops with fewer output elements than this stay sequential."""

    threads: int = 2
    tiles_per_thread: int = 4
    tile_bytes: int = 128 * 1024
    vector_tile: int = 64
    register_tile: tuple[int, int] = (8, 32)
    min_parallel_work: int = 4096

    def __post_init__(self):
        if self.threads < 1 or self.tiles_per_thread < 1 or self.tile_bytes < 1:
            raise ValueError("threads, tiles_per_thread and tile_bytes must be >= 1")
        if self.vector_tile < 1 or min(self.register_tile) < 1:
            raise ValueError("vector_tile and register_tile must be >= 1")


def smallest_divisor_at_least(n: int, low: int) -> int:
    for d in range(max(1, low), n + 1):
        if n % d == 0:
            return d
    return n


def func_ops(payload: ir.Module):
    for op in payload.body.operations:
        if op.operation.name == "func.func":
            yield op.operation


def single_func(payload: ir.Module, error: type[Exception] = ValueError) -> ir.Operation:
    """The payload's one function; `error` when there are none or several."""
    funcs = list(func_ops(payload))
    if len(funcs) != 1:
        raise error(f"expected one function, found {len(funcs)}")
    return funcs[0]


def top_level_linalg_ops(func: ir.Operation) -> list[ir.Operation]:
    return [op.operation for op in func.regions[0].blocks[0].operations if is_linalg_op(op)]


def all_linalg_ops(payload: ir.Module) -> list[ir.Operation]:
    found = []

    def visit(op):
        if is_linalg_op(op):
            found.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def parallel_tile_sizes(op: ir.Operation, params: GenericParams) -> list[int] | None:
    """Forall tile sizes over the loop dims (0 = not tiled), or None to stay sequential.

    Only dims whose split recomputes no reduction of the fused producer chain are split
    (`recomputed_reductions`: splitting the columns of a row-reduction chain would repeat
    every row's reductions per column tile); with too few such rows for the threads, fewer
    threads are busy. Outer dims first, into threads x tiles_per_thread tiles, or more so
    that a tile's share of the result stays under `tile_bytes`; the innermost loop dim then,
    when the outer dims alone give too few tiles, in chunks of at least `vector_tile` that
    divide it (forall tiles keep static shapes; a prime extent stays whole)."""
    ls = loop_structure(op)
    if not ls.is_static or not ls.parallel_dims or ls.num_outputs == 0:
        return None
    work = 1
    for d in ls.parallel_dims:
        work *= ls.ranges[d]
    if work < params.min_parallel_work:
        return None
    splittable = [d for d in ls.parallel_dims if not recomputed_reductions(op, d)]
    for_threads = params.threads * params.tiles_per_thread
    sizes = [0] * ls.num_loops
    last = ls.num_loops - 1
    rows = [d for d in splittable if d != last]
    chunks = ls.ranges[last] // params.vector_tile if last in splittable else 1
    most = max(1, chunks)
    for d in rows:
        most *= ls.ranges[d]
    for_cache = -(-work * _widest_element_bytes(op) // params.tile_bytes)
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
        chunk = largest_divisor_at_most(extent, max(params.vector_tile, extent // wanted))
        if params.vector_tile <= chunk < extent:
            sizes[last] = chunk
    if not any(sizes):
        return None
    return sizes


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
                                 if _expr_dims(expr) & dims and out[a] is not None)

            ptiled, pother = through(tiled), through(other)
            if not ptiled and not pother:
                continue
            if not ptiled and pls.reduction_dims and producer not in found:
                found.append(producer)
            stack.append((producer, ptiled, pother))
    return found


def _expr_dims(expr) -> set[int]:
    """The loop dims an affine expression reads."""
    if isinstance(expr, ir.AffineDimExpr):
        return {expr.position}
    if isinstance(expr, ir.AffineBinaryExpr):
        return _expr_dims(expr.lhs) | _expr_dims(expr.rhs)
    return set()


def _widest_element_bytes(op: ir.Operation) -> int:
    widths = [ir.ShapedType(v.type).element_type for v in list(op.operands) + list(op.results)
              if isinstance(v.type, ir.ShapedType)]
    return max([(t.width + 7) // 8 for t in widths if hasattr(t, "width")] or [4])


def vector_tile_sizes(op: ir.Operation, params: GenericParams) -> list[int] | None:
    """scf.for tile sizes that leave a vector-sized static tile (0 = keep whole). The vector
    lanes run along the loop dim that is innermost in memory (`lane_dim`)."""
    ls = loop_structure(op)
    if not ls.is_static or ls.num_loops == 0 or ls.num_outputs == 0:
        return None
    sizes = [1] * ls.num_loops
    if ls.is_contraction:
        dims = ls.contraction_dims()
        if len(dims["m"]) and len(dims["n"]):
            rows, lanes = dims["m"][-1], dims["n"][-1]
            out_last = dim_positions(ls.output_map(0))[-1:]
            if out_last == [rows]:  # the accumulator is stored m-innermost
                rows, lanes = lanes, rows
            sizes[rows] = largest_divisor_at_most(ls.ranges[rows], params.register_tile[0])
            sizes[lanes] = largest_divisor_at_most(ls.ranges[lanes], params.register_tile[1])
            return sizes
    lane = lane_dim(ls)
    sizes[lane] = lane_tile(ls.ranges[lane], params.vector_tile, even=_touches_bf16(op))
    if all(s == r for s, r in zip(sizes, ls.ranges)):
        return None
    return sizes


def lane_tile(extent: int, vector_tile: int, even: bool = False) -> int:
    """Elements of a lane dim of `extent` per vector tile: the whole dim up to twice
    `vector_tile`; else the largest divisor of the extent in [vector_tile / 2, vector_tile]
    (an even one if `even`: odd bf16 vectors are split later, see `_split_odd_bf16_lanes`);
    else (a prime or nearly prime extent) `vector_tile` itself, and the loop's last partial
    tile is peeled off into a static tile of its own."""
    if extent <= 2 * vector_tile:
        return extent
    divisor = largest_divisor_at_most(extent, vector_tile)
    if even and divisor % 2:
        divisor = 2 * largest_divisor_at_most(extent // 2, vector_tile // 2) if extent % 2 == 0 \
            else 1
    return divisor if 2 * divisor >= vector_tile else vector_tile


def _lane_dims_innermost(payload: ir.Module) -> None:
    """Interchange the loops of generics (not contractions) whose lane dim is not their last
    loop dim, so their vector tiles are 1 x ... x 1 x W (an n-D vector whose innermost dim is
    1 would be computed one element at a time)."""
    plan = []
    for op in all_linalg_ops(payload):
        if op.name != "linalg.generic":
            continue
        ls = loop_structure(op)
        if ls.is_contraction or not ls.is_static or ls.num_loops < 2:
            continue
        lane = lane_dim(ls)
        if lane != ls.num_loops - 1:
            plan.append((op, [d for d in range(ls.num_loops) if d != lane] + [lane]))
    if not plan:
        return
    tag_ops([op for op, _ in plan])
    run_schedule(payload, lambda root: [structured.InterchangeOp(
        match_id(root, i), iterator_interchange=order) for i, (_, order) in enumerate(plan)])
    clear_tags(payload)


def lane_dim(ls) -> int:
    """The loop dim that is the innermost dim of the op's largest operand (the output on a
    tie): vector lanes along it read and write contiguous memory. The last loop dim when
    that operand's innermost index is not a plain dim."""
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
    return ls.num_loops - 1


def fuse_generic(payload: ir.Module, params: GenericParams = GenericParams()) -> None:
    """Steps 1-2 of the module docstring."""
    split_assertions(payload)
    run_passes(payload, "linalg-fold-unit-extent-dims, canonicalize, cse, "
                        "func.func(linalg-fuse-elementwise-ops), canonicalize, cse")
    for func in list(func_ops(payload)):
        while True:
            roots = [op for op in top_level_linalg_ops(func) if _SEQUENTIAL not in op.attributes]
            if not roots:
                break
            root = roots[-1]
            sizes = parallel_tile_sizes(root, params)
            if sizes is None:
                root.attributes[_SEQUENTIAL] = ir.UnitAttr.get(payload.context)
                continue
            tag_ops([root])
            run_schedule(payload, lambda r, s=sizes: structured.FuseOp(
                match_id(r, 0), tile_sizes=s, use_forall=True, apply_cleanup=True))
            clear_tags(payload)
    clear_tags(payload, _SEQUENTIAL)
    run_passes(payload, "canonicalize, cse")


def vectorize_generic(payload: ir.Module, params: GenericParams = GenericParams()) -> None:
    """Steps 3-4 of the module docstring."""
    _lane_dims_innermost(payload)
    ops = all_linalg_ops(payload)
    init_of = {}  # contraction index in ops -> index of its init's producer in ops
    for c, op in enumerate(ops):
        producer = register_tile_init_producer(op)
        sizes = vector_tile_sizes(op, params)
        if producer is None or sizes is None:
            continue
        ls = loop_structure(op)
        dims = ls.contraction_dims()
        if dims["m"] and dims["n"] and any(s < r for d, (s, r) in enumerate(zip(sizes, ls.ranges))
                                           if d in ls.parallel_dims):
            init_of[c] = next(i for i, o in enumerate(ops) if o == producer)
    plan, fused, producers = [], [], {}
    for i, op in enumerate(ops):
        sizes = vector_tile_sizes(op, params)
        if sizes is None or i in init_of.values():
            continue
        if i in init_of:
            fused.append(len(plan))
            producers[len(plan)] = ops[init_of[i]]
        plan.append((op, sizes))
    k_dims = {i: loop_structure(plan[i][0]).reduction_dims for i in fused}
    extents = [loop_structure(op).ranges for op, _ in plan]  # before register tiling
    tag_ops([op for op, _ in plan])
    if fused:
        # register tiles (m x n) first; each takes its init's producer; then k
        run_schedule(payload, lambda root: [structured.TileUsingForOp(
            match_id(root, i), sizes=[0 if d in k_dims[i] else s
                                      for d, s in enumerate(plan[i][1])]) for i in fused])
        for i in fused:
            _fuse_init_into_tile(_tagged(payload, i)[0], producers[i])
    k_only = {i: [s if d in k_dims[i] else 0 for d, s in enumerate(plan[i][1])] for i in fused}

    def tile(root):
        peeled = False
        for i, (_, sizes) in enumerate(plan):
            tiled = structured.TileUsingForOp(match_id(root, i), sizes=k_only.get(i, sizes))
            for partial in _partial_tile_loops(tiled, extents[i], k_only.get(i, sizes)):
                loop.LoopPeelOp(any_op(), any_op(), partial)
                peeled = True
        if peeled:  # the partial tiles' sizes fold to constants
            canonicalize(match(root, "func.func"))

    run_schedule(payload, tile)
    clear_tags(payload)
    _split_odd_bf16_lanes(payload)

    def body(root):
        func = match(root, "func.func")
        scalarize_rank0_generics(func)
        tile_insert_slices(func, params.vector_tile,
                           max_elements=params.register_tile[0] * params.register_tile[1])
        func = structured.VectorizeChildrenAndApplyPatternsOp(
            func, vectorize_nd_extract=True, fold_type_extensions_into_contract=True).result
        canonicalize(func)
        hoist_loop_invariant_subsets(func)
        canonicalize(func)

    transform_ext.load(payload.context)
    run_schedule(payload, body)


def _split_odd_bf16_lanes(payload: ir.Module) -> None:
    """LLVM's x86 backend cannot compile bf16 vectors of an odd lane count > 1: a vector
    tile of an odd lane extent E that touches bf16 is tiled into E - 1 lanes and a peeled
    single lane."""
    plan = []
    for op in all_linalg_ops(payload):
        ls = loop_structure(op)
        if ls.is_contraction or not ls.is_static or ls.num_loops == 0 or not _touches_bf16(op):
            continue
        lane = lane_dim(ls)
        if ls.ranges[lane] > 1 and ls.ranges[lane] % 2:
            plan.append((op, [ls.ranges[lane] - 1 if d == lane else 0
                              for d in range(ls.num_loops)]))
    if not plan:
        return
    tag_ops([op for op, _ in plan])

    def body(root):
        for i, (_, sizes) in enumerate(plan):
            tiled = structured.TileUsingForOp(match_id(root, i), sizes=sizes)
            loop.LoopPeelOp(any_op(), any_op(), tiled.loops[0])
        canonicalize(match(root, "func.func"))

    run_schedule(payload, body)
    clear_tags(payload)


def _touches_bf16(op: ir.Operation) -> bool:
    return any(isinstance(v.type, ir.ShapedType)
               and isinstance(ir.ShapedType(v.type).element_type, ir.BF16Type)
               for v in list(op.operands) + list(op.results))


def _partial_tile_loops(tiled, ranges: list[int], sizes: list[int]) -> list[ir.Value]:
    """The loops of `tiled` (a TileUsingForOp with `sizes` on an op of loop `ranges`) whose
    tile does not divide the extent: their last iteration is a partial tile (of dynamic
    shape, which would not vectorize) until the loop is peeled."""
    loops = list(tiled.loops)
    tiled_dims = [d for d, s in enumerate(sizes) if s]
    return [loops[k] for k, d in enumerate(tiled_dims) if ranges[d] % sizes[d]]


def _tagged(payload: ir.Module, i: int) -> list[ir.Operation]:
    return walk_ops(payload, lambda op: ID_ATTR in op.attributes
                    and ir.IntegerAttr(op.attributes[ID_ATTR]).value == i)


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
    if producer is None or not is_linalg_op(producer) or len(producer.results) != 1 \
            or len(list(init.uses)) != 1:
        return None
    pls = loop_structure(producer)
    if producer.name == "linalg.fill":
        return producer
    if producer.name != "linalg.generic" or not pls.is_elementwise or \
            not pls.output_map(0).is_permutation or \
            dim_positions(pls.output_map(0)) != list(range(pls.num_loops)):
        return None
    dest = producer.operands[pls.num_inputs]
    if any(producer.operands[j] == dest for j in range(pls.num_inputs)):
        return None
    if any(None in dim_positions(pls.maps[j]) for j in range(pls.num_inputs)
           if isinstance(producer.operands[j].type, ir.ShapedType)):
        return None
    return producer


def _fuse_init_into_tile(tiled: ir.Operation, producer: ir.Operation) -> None:
    """`tiled` (a contraction tiled over its m/n dims) reads its accumulator tile as
    `extract_slice %iter[offsets][sizes]`; that tile of the accumulator is still the value of
    `producer`'s destination (tiles are disjoint), so the producer is computed on the tile
    right there and the loops start from the producer's destination."""
    from torch_mlir.dialects import tensor

    ls = loop_structure(tiled)
    acc = tiled.operands[ls.num_inputs]
    slice_op = defining_op(acc)
    if slice_op is None or slice_op.name != "tensor.extract_slice":
        raise AssertionError(f"tiled contraction's accumulator is not a slice: {slice_op}")
    view = slice_op.opview
    dynamic = iter(view.offsets)
    offsets = [next(dynamic) if o == _DYNAMIC else o for o in view.static_offsets]
    sizes, strides = list(view.static_sizes), list(view.static_strides)
    if _DYNAMIC in strides:
        raise AssertionError(f"tiled contraction's accumulator slice has dynamic strides: {slice_op}")
    pls = loop_structure(producer)
    with ir.InsertionPoint(tiled), tiled.location:
        tile = producer.clone()
        for j in range(pls.num_inputs):
            value = producer.operands[j]
            if not isinstance(value.type, ir.ShapedType):
                continue
            dims = dim_positions(pls.maps[j])
            offs = [offsets[d] for d in dims]
            szs = [sizes[d] for d in dims]
            static = [o if isinstance(o, int) else _DYNAMIC for o in offs]
            dyn = [o for o in offs if not isinstance(o, int)]
            t = value.type
            tile.operands[j] = tensor.ExtractSliceOp(
                ir.RankedTensorType.get(szs, t.element_type, t.encoding), value, dyn, [], [],
                static, szs, [strides[d] for d in dims]).result
        tile.operands[pls.num_inputs] = acc
        tile.results[0].set_type(acc.type)
    tiled.operands[ls.num_inputs] = tile.results[0]
    producer.results[0].replace_all_uses_with(producer.operands[pls.num_inputs])
    producer.erase()
