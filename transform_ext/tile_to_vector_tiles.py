"""tile_to_vector_tiles: every linalg op is tiled with scf.for to one static vector tile.

Sizes from `vector_tile_sizes` (transform_ext.analysis.tiles):
- a contraction: an m x n register tile (the largest divisors of its m and n extents up to
  register_tile, n a power-of-two multiple of one vector or at most one vector, m then up
  to twice register_tile's m to keep as many accumulators: `register_lanes`), k = 1; with
  a third entry k2 in register_tile, k = k2 for a contraction whose two inputs are bf16
  (pairs of k for the bf16 dot products; an odd last k step is peeled into a static tile
  of its own); a vector-matrix product y[m] += A[k, m] x[k]
  (`is_vector_matrix`), a run of m x n lanes along A's rows, its k loop first split into
  chunks of `k_chunk` rows (`vector_matrix_k_chunk`; inside the loops over batch dims),
  each chunk walking the register tiles (which then start from the running sums of the
  chunks before). When its accumulator's producer (a fill, an elementwise generic) can be
  computed per register tile (`register_tile_init_producer`), the op has no k chunks and
  the tile is smaller than the whole output, the m/n loops come first, the producer is
  computed in each tile (transform_ext.fuse_init_into_register_tile), then the k loop;
- any other op: 1 x ... x 1 x W along its lane dim (`lane_dim`), the loops over its reduction
  dims innermost (`reductions_innermost`), W = `lane_tile`: the whole
  dim up to 2 vector_tile, else a divisor of the extent in [vector_tile / 2, vector_tile]
  (even when the op touches bf16), else vector_tile, whose last, partial tile is peeled
  (`transform.loop.peel`) into a static tile of its own; the function is canonicalized
  then, so the peeled tiles' sizes fold to constants; an op reading a tensor transposed:
  a square tile (`transposed_side`: a vector of lanes on a side, whole cache lines of
  16-bit elements), stepped along the input's rows innermost when every input is read
  transposed (`transposed_loop_innermost`). A reduction whose combined term reads
  no input (`has_step_invariant_term`) steps its reduced dims one at a time.
Ops whose tile is the whole op (or with dynamic shapes), and ops marked TARGET_KERNEL (the
target lowers them), are left alone. Tiling and peeling
split the iteration space; every element is computed as before.

Targets: func.func ops (the handle is consumed and returned, see common.RewritesNestedOps). Any other target op is a silenceable
failure, nothing rewritten.
"""


from torch_mlir import ir
from torch_mlir.dialects import ext, transform
from torch_mlir.dialects.transform import loop, structured

from .analysis.structure import all_linalg_ops, loop_structure
from .analysis.tiles import (VectorPolicy, is_vector_matrix, lane_dim, register_tile_init_producer,
                             transposed_loop_innermost, vector_matrix_k_chunk, vector_tile_sizes)
from .common import TARGET_KERNEL, Illegal, RewritesNestedOps, Success, fail, payload_ops
from .dialect import TransformExt
from .fuse_init_into_register_tile import fuse_init_into_register_tile
from .nested import any_op, apply_to, canonicalize

NAME = "transform_ext.tile_to_vector_tiles"


def partial_tile_loops(tiled, ranges: list[int], sizes: list[int],
                       order: list[int] | None = None) -> list[ir.Value]:
    """The loops of `tiled` (a TileUsingForOp with `sizes` and loop `order`, the identity
    by default, on an op of loop `ranges`) whose tile does not divide the extent: their last
    iteration is a partial tile (of dynamic shape, which would not vectorize) until the loop
    is peeled."""
    loops = list(tiled.loops)
    tiled_dims = [d for d in (order or range(len(sizes))) if sizes[d]]
    return [loops[k] for k, d in enumerate(tiled_dims) if ranges[d] % sizes[d]]


def reductions_innermost(ls) -> list[int] | None:
    """The loop order that runs the parallel dims first and the reduction dims innermost
    (None when it is already so, or for an op of several results): a reduction over a dim
    outside the vector lanes (a sum over the middle dim of [B, K, N], lanes along N) then
    keeps each lane tile's accumulator in registers over the whole reduction, instead of
    reading and writing it once per reduced row (4x faster for a sum). An argmax's value and
    index, a compare and two selects per step, stay interleaved across the lane tiles (one
    tile's chain alone ran 2x slower)."""
    order = ls.parallel_dims + ls.reduction_dims
    if ls.num_outputs != 1 or order == list(range(ls.num_loops)):
        return None
    return order


def _fuses_init(op: ir.Operation, sizes: list[int]) -> bool:
    """Is `op` a contraction whose register tile computes its accumulator's producer?"""
    if register_tile_init_producer(op) is None:
        return False
    ls = loop_structure(op)
    dims = ls.contraction_dims()
    return bool(dims["m"] and dims["n"] or is_vector_matrix(ls, lane_dim(ls))) and any(
        s < r for d, (s, r) in enumerate(zip(sizes, ls.ranges)) if d in ls.parallel_dims)


def tile_plan(func: ir.Operation, policy: VectorPolicy):
    """(op, sizes, fuses its init, k chunk, loop dim stepped innermost) per op to tile; the
    producers computed per register tile are not tiled on their own, ops marked
    TARGET_KERNEL not at all."""
    ops = [op for op in all_linalg_ops(func) if TARGET_KERNEL not in op.attributes]
    sizes = [vector_tile_sizes(op, policy) for op in ops]
    chunks = [vector_matrix_k_chunk(op, policy) for op in ops]
    fused = [s is not None and c is None and _fuses_init(op, s)
             for op, s, c in zip(ops, sizes, chunks)]
    producers = [register_tile_init_producer(op) for op, f in zip(ops, fused) if f]
    return [(op, s, f, c, transposed_loop_innermost(op, policy))
            for op, s, f, c in zip(ops, sizes, fused, chunks)
            if s is not None and op not in producers]


def tile(op: ir.Operation, sizes: list[int], fuses_init: bool, k_chunk: int | None,
         across: int | None = None) -> bool:
    """Tile `op` (see the module docstring), stepping loop dim `across` innermost when given
    (`transposed_loop_innermost`); True when a partial tile was peeled."""
    ls = loop_structure(op)
    ranges, k_dims = ls.ranges, ls.reduction_dims
    peeled = []

    def body(handle):
        step = sizes
        if k_chunk is not None:
            # the dims of unit tiles (batch) outermost, then the k chunks
            outer = [k_chunk if d in k_dims else int(s == 1) for d, s in enumerate(sizes)]
            handle = structured.TileUsingForOp(handle, sizes=outer,
                                               interchange=reductions_innermost(ls)).tiled_linalg_op
            step = [s if d in k_dims or s != 1 else 0 for d, s in enumerate(sizes)]
        if fuses_init:
            register = structured.TileUsingForOp(
                handle, sizes=[0 if d in k_dims else s for d, s in enumerate(sizes)])
            handle = register.tiled_linalg_op
            fuse_init_into_register_tile(handle)
            step = [s if d in k_dims else 0 for d, s in enumerate(sizes)]
            order = None
        else:
            order = reductions_innermost(ls) if across is None else \
                [d for d in range(ls.num_loops) if d != across] + [across]
        tiled = structured.TileUsingForOp(handle, sizes=step, interchange=order)
        # innermost first: peeling an outer loop clones the loops inside it, whose handles
        # would then be invalidated (a transpose's tiles are partial along two dims)
        for partial in reversed(partial_tile_loops(tiled, ranges, step, order)):
            loop.LoopPeelOp(any_op(), any_op(), partial)
            peeled.append(partial)

    apply_to(op, body)
    return bool(peeled)


class TileToVectorTilesOp(TransformExt.Operation, name="tile_to_vector_tiles"):
    target: ext.Operand[transform.AnyOpType]
    vector_tile: ir.IntegerAttr
    register_tile: ir.ArrayAttr
    k_chunk: ir.IntegerAttr
    transformed: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                entries = [ir.IntegerAttr(a).value for a in ir.ArrayAttr(op.register_tile)]
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "func.func":
                            raise Illegal(target, "not a func.func")
                    if len(entries) not in (2, 3) or min(entries) < 1:
                        raise Illegal(targets[0], "register_tile must hold (m, n) or (m, n, bf16 k)")
                    k_chunk = ir.IntegerAttr(op.k_chunk).value
                    if k_chunk < 1:
                        raise Illegal(targets[0], f"k_chunk = {k_chunk} must be >= 1")
                    policy = VectorPolicy(ir.IntegerAttr(op.vector_tile).value, tuple(entries[:2]),
                                          entries[2] if len(entries) == 3 else 1, k_chunk)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                plans = [tile_plan(func, policy) for func in targets]
                peeled = False
                for plan in plans:
                    for payload_op, sizes, fuses_init, k_chunk, across in plan:
                        peeled |= tile(payload_op, sizes, fuses_init, k_chunk, across)
                if peeled:
                    for func in targets:
                        apply_to(func, canonicalize)
                results.set_ops(op.transformed, targets)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesNestedOps


def tile_to_vector_tiles(func: ir.Value, *, vector_tile: int,
                         register_tile: tuple[int, ...], k_chunk: int = 1) -> ir.Value:
    """Tile every linalg op in the functions of `func` to a vector tile (register_tile: (m, n)
    or (m, n, k of bf16 contractions); k_chunk: rows of A per chunk of a vector-matrix
    product's k loop, 1 for none)."""
    i64 = ir.IntegerType.get_signless(64)
    return TileToVectorTilesOp(func, ir.IntegerAttr.get(i64, vector_tile),
                               ir.ArrayAttr.get([ir.IntegerAttr.get(i64, s) for s in register_tile]),
                               ir.IntegerAttr.get(i64, k_chunk)).transformed


__all__ = ["TileToVectorTilesOp", "tile_to_vector_tiles", "partial_tile_loops"]
