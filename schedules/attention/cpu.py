"""The attention's CPU vectorize stage: the key loop's ops tiled to register tiles and
vectorized (schedules/generic.py's vectorize stage: contractions as outer products, each
starting from its accumulator's producer in registers), after the key tiles of queries-major
scores are read from a tile-packed copy (transform_ext.pack_key_tiles) and the exps of the
key loops (softmax weights exp(s - m) and their corrections exp(m_old - m_new), all of
non-positive numbers; not a peeled last key tile's, nor an epilogue's fused after the
loop) take the short flushing expansion (transform_ext.expand_fast_exp,
`short`: 7 fmas a vector where the general one has 9; the exp pass is bound by its fmas,
1.5% of the kernel at [1, 8, 1024, 64]); after the vectorization the row sum of the
weights runs in the loop that writes them (transform_ext.fuse_reading_loops: one pass over
each key tile less); then the k loops of the register tiles are unrolled `unroll` times so
consecutive outer products overlap.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects.transform import loop, structured

from transform_ext.expand_fast_exp import expand_fast_exp
from transform_ext.fuse_reading_loops import fuse_reading_loops
from transform_ext.match_register_tile_loops import match_register_tile_loops
from transform_ext.pack_key_tiles import pack_key_tiles
from transform_ext.remove_annotation import remove_annotation

from ..common import any_op, foreach, match
from ..generic import GenericParams
from ..generic import vectorize_stage as generic_vectorize_stage
from .fuse import QUERY_BLOCKS

UNROLL = 4


def vectorize_stage(params: GenericParams, unroll: int = UNROLL):
    """@vectorize of the attention script, as a stage body."""
    generic = generic_vectorize_stage(params)

    def body(root: ir.Value) -> None:
        pack_key_tiles(match(root, "func.func"))
        blocks = structured.MatchOp(any_op(), root, op_attrs={QUERY_BLOCKS: ir.UnitAttr.get()})
        foreach(blocks.result, lambda block: expand_fast_exp(
            structured.MatchOp(any_op(), block, ops=["scf.for"]).result, short=True))
        generic(root)
        blocks = structured.MatchOp(any_op(), root, op_attrs={QUERY_BLOCKS: ir.UnitAttr.get()})
        fuse_reading_loops(blocks.result)
        remove_annotation(root, QUERY_BLOCKS)
        if unroll > 1:
            loop.LoopUnrollOp(match_register_tile_loops(root), factor=unroll)

    return body
