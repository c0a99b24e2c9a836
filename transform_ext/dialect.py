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
    "deduplicate_generics",
    "fold_scalar_or_splat_constant",
    "fold_reshape_ops_by_expansion",
    "sink_normalization_past_contraction",
    "annotate_fastmath",
    "filter_ops",
    "walk_producers",
    "fuse_dependent_reduction_ops",
    "rewrite_attention_row_mask",
    "fuse_elementwise_producers",
    "collapse_reduction_dims",
    "collapse_contraction_parallel_dims",
    "fold_result_transposes_into_contractions",
    "order_contract_multiplicands",
    "drop_unit_reduction_dims_of_contracts",
    "drop_unit_result_dims",
    "clamp_window_loops",
    "pad_image_rows",
    "version_full_tiles",
    "drop_broadcast_dims",
    "fold_empty_iteration_spaces",
    "unit_dim_transposes_to_reshapes",
    "expand_integer_powers",
    "compute_elementwise_in_f32",
    "scalarize_rank0_generics",
    "tile_insert_slices",
    "split_assertions",
    "fuse_roots_into_foralls",
    "interchange_lane_dims_innermost",
    "fuse_init_into_register_tile",
    "tile_to_vector_tiles",
    "fold_transposes_into_matvecs",
    "split_matvec_lanes",
    "lane_contracts_to_fmas",
    "branch_math_on_constant_lanes",
    "branch_math_on_small_lanes",
    "split_odd_bf16_lanes",
    "match_attention",
    "fuse_attention_backward",
    "fuse_attention_backward_two_pass",
    "store_scores_keys_major",
    "filter_keys_major_scores",
    "fold_key_transpose",
    "match_register_tile_loops",
    "bound_causal_key_loops",
    "widen_softmax",
    "pack_key_tiles",
    "append_lse_result",
    "fuse_key_loops",
    "match_kv_chains",
    "match_query_block_ops",
    "match_key_loop_ops",
    "match_foldable_collapse",
    "expand_fast_exp",
    "fuse_reading_loops",
    "fold_gathers_through_elementwise",
    "promote_indexed_extracts",
    "trace_to_argument",
    "inline_elementwise_producers",
    "merge_elementwise",
    "merge_sibling_reductions",
    "split_reduction_lanes",
    "split_class_reductions",
    "split_affine_reductions",
    "exclude_ops",
    "match_class_reductions",
    "add_unread_input",
    "sink_sibling_readers",
    "sink_returned_reshapes",
    "match_attention_kernel_ops",
    "match_attention_forall",
    "match_sliced_producers",
    "match_contraction_group",
    "match_row_kernel",
    "match_row_max_reductions",
    "match_column_sweep_ops",
    "match_loss_kernels",
    "split_shared_fills",
    "clone_shared_fills",
    "accumulate_in_unpacked_output",
    "fill_slices_of_fills",
    "drop_overwritten_fills",
    "inline_argument_producers",
    "lane_form_row_reductions",
    "load_rows_in_lane_form",
    "hoist_row_gathers",
    "lane_form_gathers",
    "outline_into_forall",
    "forall_results_in_lane_form",
    "match_elementwise_producers",
    "filter_iterators",
    "read_checks_on_host",
    "scalarize_rank0_writes",
    "forward_reshaped_writes",
    "carry_collapsed_loop_tensors",
    "fold_reads_of_splat_writes",
    "transpose_contract_operands",
    "split_row_dot_contracts",
    "split_transposed_loads",
    "scattered_stores_in_lane_form",
    "convert_result_layouts",
    "narrow_contracts_for_dpas",
    "write_results_in_place",
    "allocs_to_device",
    "drop_forall_mapping",
    "insert_loop_prefetches",
    "refresh_function_type",
    "match_assertion_checks",
    "checks_to_error_code",
    "filter_by_element_type",
    "widen_bool_tensors",
    "widen_contraction_operands",
    "drop_unpack_destination_fill",
    "remove_annotation",
    "clamp_gather_indices",
    "match_narrow_reductions",
    "promote_reductions_to_f32",
    "constants_to_arguments",
    "expand_math",
    "convolution_to_contraction",
    "drop_contraction_masks",
    "split_transposed_convolution",
    "split_strided_convolution",
    "move_output_channels_innermost",
    "unmask_extremum_reductions",
    "strided_poolings_to_shuffles",
    "separate_pooling_windows",
    "trim_window_inputs",
    "sliding_window_extrema",
    "match_logits_contraction",
    "fold_gathers_through_contraction",
    "gathers_to_masked_class_sums",
    "fuse_linear_cross_entropy_backward",
    "fuse_linear_cross_entropy_backward_two_pass",
    "fold_one_hot_class_sums",
    "shrink_unread_inputs",
    "fold_casts_into_contractions",
    "read_reduction_constants",
    "forward_masked_writes",
    "contracts_to_bf16_dot_products",
    "contraction_loops_to_amx_tiles",
    "contraction_in_vnni_pairs",
    "match_loop_accumulators",
    "forall_allocs_to_function",
    "flatten_contiguous_writes",
    "transpose_pairs_as_words",
    "outline_contraction_chunks",
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
