"""The attention's CPU vectorize stage: the key loop's ops tiled to register tiles and
vectorized (schedules/generic.py's vectorize stage: contractions as outer products, each
starting from its accumulator's producer in registers), after the key tiles of queries-major
scores are read from a tile-packed copy (transform_ext.pack_key_tiles); then the k loops of
the register tiles are unrolled `unroll` times so consecutive outer products overlap.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects.transform import loop

from transform_ext.match_register_tile_loops import match_register_tile_loops
from transform_ext.pack_key_tiles import pack_key_tiles

from ..common import match
from ..generic import GenericParams
from ..generic import vectorize_stage as generic_vectorize_stage

UNROLL = 4


def vectorize_stage(params: GenericParams, unroll: int = UNROLL):
    """@vectorize of the attention script, as a stage body."""
    generic = generic_vectorize_stage(params)

    def body(root: ir.Value) -> None:
        pack_key_tiles(match(root, "func.func"))
        generic(root)
        if unroll > 1:
            loop.LoopUnrollOp(match_register_tile_loops(root), factor=unroll)

    return body
