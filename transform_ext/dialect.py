"""The `transform_ext` dialect and its idempotent loading into an MLIR context.

Each op lives in its own module (`transform_ext/<op_name>.py`) and defines an op class with
nested `Apply` (TransformOpInterface) and `Effects` (MemoryEffectsOpInterface) models.
`load()` registers the dialect in a context and attaches every op's models there.
"""

from __future__ import annotations

import importlib

from torch_mlir import ir
from torch_mlir.dialects import ext

OP_MODULES: list[str] = [
    "drop_unused_results",
    "fold_scalar_or_splat_constant",
    "fold_reshape_ops_by_expansion",
    "sink_normalization_past_contraction",
    "narrow_vector_contract_operands",
    "annotate_fastmath",
    "filter_ops",
    "walk_producers",
    "fuse_dependent_reduction_ops",
    "rewrite_attention_row_mask",
    "fuse_elementwise_producers",
    "drop_broadcast_dims",
    "fold_empty_iteration_spaces",
    "expand_integer_powers",
    "scalarize_rank0_generics",
    "tile_insert_slices",
    "expand_fast_exp",
    "fold_gathers_through_elementwise",
    "promote_indexed_extracts",
    "trace_to_argument",
    "inline_elementwise_producers",
    "merge_elementwise",
    "split_reduction_lanes",
    "split_class_reductions",
    "split_affine_reductions",
    "exclude_ops",
    "match_class_reductions",
    "add_unread_input",
    "sink_sibling_readers",
]


class TransformExt(ext.Dialect, name="transform_ext"):
    """Python-defined transform ops of lighthouse."""


def load(context: ir.Context | None = None) -> None:
    """Register the dialect and its interface models in `context` (default: the current one).

    Safe to call repeatedly and with several contexts in one process."""
    for name in OP_MODULES:
        importlib.import_module(f"transform_ext.{name}")
    context = context or ir.Context.current
    with context:
        if context.is_dialect_loaded(TransformExt.DIALECT_NAMESPACE):
            return
        TransformExt.load()
        for op in TransformExt.operations:
            for model in ("Apply", "Effects"):
                if hasattr(op, model):
                    getattr(op, model).attach(op.OPERATION_NAME, context=context)
