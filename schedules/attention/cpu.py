"""The attention's CPU vectorize stage: the key loop's ops tiled to register tiles and
vectorized (schedules/generic.py vectorize_generic: contractions as outer products, each
starting from its accumulator's producer in registers), after the key tiles of queries-major
scores are read from a tile-packed copy (transform_ext.pack_key_tiles); then the k loops of
the register tiles are unrolled so consecutive outer products overlap.
"""

from __future__ import annotations

from torch_mlir import ir

from transform_ext.match_register_tile_loops import match_register_tile_loops
from transform_ext.pack_key_tiles import pack_key_tiles

from ..common import match, run_schedule
from ..generic import GenericParams, vectorize_generic


def vectorize_attention(payload: ir.Module, params: GenericParams, unroll: int = 4) -> None:
    run_schedule(payload, lambda root: pack_key_tiles(match(root, "func.func")))
    vectorize_generic(payload, params)
    _unroll_register_loops(payload, unroll)


def _unroll_register_loops(payload: ir.Module, factor: int) -> None:
    """Unroll the k loops of register tiles (scf.for carrying only vectors, holding a
    vector.contract) so the outer products of consecutive k overlap."""
    if factor <= 1:
        return
    from torch_mlir.dialects.transform import loop as tloop

    run_schedule(payload, lambda root: tloop.LoopUnrollOp(match_register_tile_loops(root),
                                                          factor=factor))
