"""fuse_roots_into_foralls: tile every root of a function into an scf.forall with its
producer chain fused in (the generic schedule's parallel tiling).

Repeatedly, the last linalg op at the top level of the function that is not yet tiled nor
left sequential (a root: nothing after it reads it) gets forall tile sizes from
`parallel_tile_sizes` (transform_ext.analysis.tiles): over the parallel dims whose split
recomputes no reduction of its producer chain, threads x tiles_per_thread tiles or more,
so that a tile's share of the result holds at most tile_bytes (pass_bytes when the chain
reduces each contiguous row of the tile before reading it again: its innermost dim cannot
be split); the innermost dim, if the
outer ones give too few tiles, in chunks of at least vector_tile that divide it; a root
whose chain reads a tensor transposed (`transposed_dim`: y[j, i] = f(x[i, j])) in square
blocks of multiples of `lanes` (the vector tiles then transpose lanes x lanes in registers). Then
upstream `transform.structured.fuse` (use_forall, cleanup) tiles the root and fuses its
whole producer chain into the tile. A root with fewer than min_parallel_work output
elements, dynamic shapes or nothing to split stays sequential. A producer that still has
users outside the forall is the root of a later round. Exact: tiling and fusion recompute
no value differently, they split the iteration space.

Targets: func.func ops (the handle is consumed and returned, common.RewritesNestedOps: the
functions stay, their bodies are
rewritten). Any other target op is a silenceable failure, nothing rewritten.
"""


from torch_mlir import ir
from torch_mlir.dialects import ext, transform
from torch_mlir.dialects.transform import structured

from .analysis.structure import top_level_linalg_ops
from .analysis.tiles import ForallPolicy, parallel_tile_sizes
from .common import Illegal, RewritesNestedOps, Success, fail, payload_ops
from .dialect import TransformExt
from .nested import apply_to

NAME = "transform_ext.fuse_roots_into_foralls"
_FIELDS = ("threads", "tiles_per_thread", "tile_bytes", "vector_tile", "min_parallel_work",
           "pass_bytes", "lanes")


def fuse_roots(func: ir.Operation, policy: ForallPolicy) -> None:
    sequential = []
    while True:
        roots = [op for op in top_level_linalg_ops(func) if op not in sequential]
        if not roots:
            return
        root = roots[-1]
        sizes = parallel_tile_sizes(root, policy)
        if sizes is None:
            sequential.append(root)
            continue
        apply_to(root, lambda r: structured.FuseOp(r, tile_sizes=sizes, use_forall=True,
                                                   apply_cleanup=True))


class FuseRootsIntoForallsOp(TransformExt.Operation, name="fuse_roots_into_foralls"):
    target: ext.Operand[transform.AnyOpType]
    threads: ir.IntegerAttr
    tiles_per_thread: ir.IntegerAttr
    tile_bytes: ir.IntegerAttr
    vector_tile: ir.IntegerAttr
    min_parallel_work: ir.IntegerAttr
    pass_bytes: ir.IntegerAttr
    lanes: ir.IntegerAttr
    transformed: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                policy = ForallPolicy(*(ir.IntegerAttr(getattr(op, f)).value for f in _FIELDS))
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "func.func":
                            raise Illegal(target, "not a func.func")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for func in targets:
                    fuse_roots(func, policy)
                results.set_ops(op.transformed, targets)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesNestedOps


def fuse_roots_into_foralls(func: ir.Value, *, threads: int, tiles_per_thread: int,
                            tile_bytes: int, vector_tile: int,
                            min_parallel_work: int, pass_bytes: int, lanes: int = 1) -> ir.Value:
    """Tile the roots of the functions in `func` into foralls (see the module docstring)."""
    i64 = ir.IntegerType.get_signless(64)
    values = dict(threads=threads, tiles_per_thread=tiles_per_thread, tile_bytes=tile_bytes,
                  vector_tile=vector_tile, min_parallel_work=min_parallel_work,
                  pass_bytes=pass_bytes, lanes=lanes)
    return FuseRootsIntoForallsOp(func, *(ir.IntegerAttr.get(i64, values[f]) for f in _FIELDS)).transformed


__all__ = ["FuseRootsIntoForallsOp", "fuse_roots_into_foralls"]
