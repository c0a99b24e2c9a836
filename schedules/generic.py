"""The generic schedule: any linalg payload, tiled for threads and vectors, correct first.

fuse (`fuse_generic`):
  1. elementwise ops are fused into their consumers (`linalg-fuse-elementwise-ops`);
  2. repeatedly, the last untiled linalg op of the function (a root: nothing after it reads
     it) has its outer parallel dims tiled into an `scf.forall`, and its whole producer chain
     is fused into the tile (`transform.structured.fuse`, use_forall). A producer that still
     has users outside becomes a root of its own in a later round.
vectorize (`vectorize_generic`):
  3. every linalg op is tiled with `scf.for` to a vector tile: contractions to an
     m x n register tile (k = 1, lowered later to outer products / FMAs), every other op to
     1 x ... x 1 x W along its innermost loop dim;
  4. the function is vectorized (`vectorize_children_and_apply_patterns`) and loop-invariant
     accumulator reads/writes are hoisted out of the loops.
Tile sizes always divide the extents (the largest divisor not above the target), so every
tile has a static shape and vectorizes; schedules that care about speed peel instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects.transform import structured

from transform_ext.analysis.structure import is_linalg_op, loop_structure

from .prepare import split_assertions
from .common import (canonicalize, clear_tags, hoist_loop_invariant_subsets, match, match_id,
                     run_passes, run_schedule, tag_ops)


_SEQUENTIAL = "lh.sequential"


@dataclass(frozen=True)
class GenericParams:
    """threads: parallel tiles are sized for this many workers (times `tiles_per_thread`).
    vector_tile: elements of the innermost loop dim per vector tile.
    register_tile: (m, n) accumulator tile of contractions.
    min_parallel_work: ops with fewer output elements than this stay sequential."""

    threads: int = 2
    tiles_per_thread: int = 4
    vector_tile: int = 64
    register_tile: tuple[int, int] = (8, 32)
    min_parallel_work: int = 4096

    def __post_init__(self):
        if self.threads < 1 or self.tiles_per_thread < 1:
            raise ValueError("threads and tiles_per_thread must be >= 1")
        if self.vector_tile < 1 or min(self.register_tile) < 1:
            raise ValueError("vector_tile and register_tile must be >= 1")


def largest_divisor_at_most(n: int, limit: int) -> int:
    limit = max(1, min(n, limit))
    for d in range(limit, 0, -1):
        if n % d == 0:
            return d
    return 1


def smallest_divisor_at_least(n: int, low: int) -> int:
    for d in range(max(1, low), n + 1):
        if n % d == 0:
            return d
    return n


def func_ops(payload: ir.Module):
    for op in payload.body.operations:
        if op.operation.name == "func.func":
            yield op.operation


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

    Outer parallel dims are split first so producers are never recomputed across tiles of
    the inner dims; the innermost loop dim is split only when the rows alone are too few."""
    ls = loop_structure(op)
    if not ls.is_static or not ls.parallel_dims or ls.num_outputs == 0:
        return None
    work = 1
    for d in ls.parallel_dims:
        work *= ls.ranges[d]
    if work < params.min_parallel_work:
        return None
    wanted = params.threads * params.tiles_per_thread
    sizes = [0] * ls.num_loops
    last = ls.num_loops - 1
    rows = [d for d in ls.parallel_dims if d != last]
    for d in rows:
        if wanted <= 1:
            break
        extent = ls.ranges[d]
        if extent <= wanted:
            sizes[d] = 1
            wanted = -(-wanted // extent)
        else:
            count = smallest_divisor_at_least(extent, wanted)
            sizes[d] = extent // count
            wanted = 1
    if wanted > 1 and last in ls.parallel_dims:
        extent = ls.ranges[last]
        chunk = largest_divisor_at_most(extent, max(params.vector_tile, extent // wanted))
        if chunk < extent:
            sizes[last] = chunk
    if not any(sizes):
        return None
    return sizes


def vector_tile_sizes(op: ir.Operation, params: GenericParams) -> list[int] | None:
    """scf.for tile sizes that leave a vector-sized static tile (0 = keep whole)."""
    ls = loop_structure(op)
    if not ls.is_static or ls.num_loops == 0 or ls.num_outputs == 0:
        return None
    sizes = [1] * ls.num_loops
    if ls.is_contraction:
        dims = ls.contraction_dims()
        if len(dims["m"]) and len(dims["n"]):
            m, n = dims["m"][-1], dims["n"][-1]
            sizes[m] = largest_divisor_at_most(ls.ranges[m], params.register_tile[0])
            sizes[n] = largest_divisor_at_most(ls.ranges[n], params.register_tile[1])
            return sizes
    last = ls.num_loops - 1
    extent = ls.ranges[last]
    sizes[last] = extent if extent <= 2 * params.vector_tile else largest_divisor_at_most(
        extent, params.vector_tile)
    if all(s == r for s, r in zip(sizes, ls.ranges)):
        return None
    return sizes


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
    plan = []
    for op in all_linalg_ops(payload):
        sizes = vector_tile_sizes(op, params)
        if sizes is not None:
            plan.append((op, sizes))
    tag_ops([op for op, _ in plan])

    def body(root):
        for i, (_, sizes) in enumerate(plan):
            structured.TileUsingForOp(match_id(root, i), sizes=sizes)
        func = match(root, "func.func")
        func = structured.VectorizeChildrenAndApplyPatternsOp(
            func, vectorize_nd_extract=True, fold_type_extensions_into_contract=True).result
        canonicalize(func)
        hoist_loop_invariant_subsets(func)
        canonicalize(func)

    run_schedule(payload, body)
    clear_tags(payload)
