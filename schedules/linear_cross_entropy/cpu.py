"""The linear cross-entropy's CPU vectorize stage: the constant terms of reductions read from
splat tensors (transform_ext.read_reduction_constants: linalg's vectorizer would add the
coefficient sum of label smoothing's sum_c 1 once per vector), schedules/generic.py's
vectorize stage (the
contractions of the logits tiles, of dW and dh as register tiles of outer products; the
class sums and the gradient tile along the rows' lanes), then the k loops of the register
tiles unrolled `unroll` times so consecutive outer products overlap."""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects.transform import loop

from transform_ext.match_register_tile_loops import match_register_tile_loops
from transform_ext.read_reduction_constants import read_reduction_constants

from ..common import match
from ..generic import GenericParams
from ..generic import vectorize_stage as generic_vectorize_stage

UNROLL = 4


def vectorize_stage(params: GenericParams, unroll: int = UNROLL):
    """@vectorize of the linear cross-entropy script, as a stage body."""
    generic = generic_vectorize_stage(params)

    def body(root: ir.Value) -> None:
        read_reduction_constants(match(root, "func.func"))
        generic(root)
        if unroll > 1:
            loop.LoopUnrollOp(match_register_tile_loops(root), factor=unroll)

    return body
