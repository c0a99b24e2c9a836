"""The cross-entropy's CPU vectorize stage: the class sums of the fused loops tiled for
vectors (the step tile_class_sums: lane-split sums one chunk of lanes at a time, the others
into partial vector results; exp expanded by transform_ext.expand_fast_exp), then
schedules/generic.py's vectorize stage.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

from transform_ext.expand_fast_exp import expand_fast_exp
from transform_ext.inline_elementwise_producers import inline_elementwise_producers
from transform_ext.remove_annotation import remove_annotation
from transform_ext.split_reduction_lanes import LANE_DIM

from ..generic import GenericParams
from ..generic import vectorize_stage as generic_vectorize_stage
from ..script import include_step
from .fuse import CLASS_SUM, match_attr, split_handle
from .params import CrossEntropyPlan


def tile_class_sums(plan: CrossEntropyPlan):
    """Each class reduction of the fused loops reads its elementwise producers in its own
    body (nothing per tile is materialized) and runs as the plan's `vector` says; exp
    becomes transform_ext.expand_fast_exp's expansion (its short form for 16-bit results:
    `short_exp`); the marks go. A step of its own: the
    handles it leaves end with it (the generic stage's ops rewrite their ops through nested
    sequences, which the handles of this one would not see)."""
    def body(root: ir.Value) -> ir.Value:
        inline_elementwise_producers(match_attr(root, CLASS_SUM))
        if plan.vector:  # (the inlining keeps the sums' loops: the plan holds for the rebuilt ops)
            matched = match_attr(root, CLASS_SUM)
            targets = split_handle(matched, len(plan.vector))
            for target, (outer, partial) in zip(targets, plan.vector):
                if any(outer):
                    target = structured.TileUsingForOp(target, sizes=list(outer)).tiled_linalg_op
                if partial is not None:
                    any_op = transform.AnyOpType.get()
                    structured.TileReductionUsingForOp([any_op], any_op, any_op, any_op, target,
                                                       tile_sizes=list(partial))
        expand_fast_exp(root, short=plan.short_exp)
        remove_annotation(root, CLASS_SUM)
        remove_annotation(root, LANE_DIM)
        return root

    return body


def vectorize_stage(params: GenericParams):
    """@vectorize: the class sums tiled for vectors (`tile_class_sums`), then the generic
    vectorize stage."""
    generic = generic_vectorize_stage(params)

    def body(root: ir.Value) -> None:
        generic(include_step("tile_class_sums", root))

    return body
