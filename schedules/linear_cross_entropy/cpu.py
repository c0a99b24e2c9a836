"""The linear cross-entropy's CPU vectorize stage: the constant terms of reductions read from
splat tensors (transform_ext.read_reduction_constants: linalg's vectorizer would add the
coefficient sum of label smoothing's sum_c 1 once per vector), schedules/generic.py's
vectorize stage (the
contractions of the logits tiles, of dW and dh as register tiles of outer products; the
class sums and the gradient tile along the rows' lanes), then the k loops of the register
tiles unrolled `unroll` times so consecutive outer products overlap. With AMX products
(plan.amx_products), those are first cut into 32 x 32 steps of 16 pairs marked
TARGET_KERNEL, which the generic stage neither tiles nor vectorizes."""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import loop, structured

from transform_ext.common import AMX_PRODUCT, AMX_SIDE, TARGET_KERNEL
from transform_ext.match_register_tile_loops import match_register_tile_loops
from transform_ext.read_reduction_constants import read_reduction_constants

from ..common import match
from ..generic import GenericParams
from ..generic import vectorize_stage as generic_vectorize_stage
from ..matmul import AMX_PAIRS

UNROLL = 4


def vectorize_stage(params: GenericParams, unroll: int = UNROLL, amx: bool = False):
    """@vectorize of the linear cross-entropy script, as a stage body. With `amx` (the
    plan's amx_products), the products marked AMX_PRODUCT (the forward's S^T tiles in
    pairs, fuse.py: logits_in_pairs; the fused backward's S^T, dW and dh) are first cut
    into 32 x 32 output tiles stepping over the depth by 16 pairs, each step marked
    TARGET_KERNEL: the generic stage leaves it, the CPU target runs its loop on AMX tiles
    (transform_ext.contraction_loops_to_amx_tiles)."""
    generic = generic_vectorize_stage(params, keep_target_kernels=amx)

    def body(root: ir.Value) -> None:
        read_reduction_constants(match(root, "func.func"))
        if amx:
            marked = structured.MatchOp(transform.AnyOpType.get(), root,
                                        op_attrs={AMX_PRODUCT: ir.UnitAttr.get()}).result
            steps = structured.TileUsingForOp(marked, sizes=[AMX_SIDE, AMX_SIDE, AMX_PAIRS, 0])
            transform.AnnotateOp(steps.tiled_linalg_op, TARGET_KERNEL)
        generic(root)
        if unroll > 1:
            loop.LoopUnrollOp(match_register_tile_loops(root), factor=unroll)

    return body
