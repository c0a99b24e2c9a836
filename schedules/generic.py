"""The generic schedule: any linalg payload, tiled for threads and vectors, correct first.

One transform script (`generic_script`), two named sequences:
@fuse:
  1. the assertions of result-producing generics are split out (`transform_ext.split_assertions`),
     matrix-vector products get k split into vector_tile lanes of partial sums per row,
     summed once at the end, and short products (x @ W^T for a batch of at most short_rows
     rows, at the top level) into one vector of lanes per pair of rows
     (`transform_ext.split_matvec_lanes`; forall tiles then split W's rows, never the
     batch: `transform_ext.analysis.tiles.splits_short_rows`), inputs read through
     windows sliced to the elements the windows reach (`transform_ext.trim_window_inputs`:
     a window of one output along a padded dim would fold to a plain dim shorter than its
     input), unit dims folded and elementwise ops fused into their consumers
     (`linalg-fold-unit-extent-dims`, `linalg-fuse-elementwise-ops`, canonicalization),
     then elementwise producers read only by reductions computed inside each of them
     (`transform_ext.inline_elementwise_producers`, whole: a norm's x widened to f64 for
     its two variance sums was stored per row block, [rows, C, H, W] f64; softmax's exp,
     also read by the division, stays stored once), and reductions of the same loops
     reading the same tensor merged into one multi-result op that reads it once
     (`transform_ext.merge_sibling_reductions`: the sums of x and x^2 of a variance),
     reshapes folded into the ops that read them (`transform_ext.fold_reshape_ops_by_expansion`:
     the merged sums then read a group norm's x without its view in between), the
     transposes read by mat-vecs folded into their indexing maps and their unit dims dropped
     (`transform_ext.fold_transposes_into_matvecs`, after the reshape folding, which would
     expand the unit dims back: a.t() @ x and torch.mv(a.t(), x) read A in place as
     y[m] += A[k, m] x[k], lanes along A's rows; x @ a.t() gets its k split as above, and
     so does a short product's x @ W^T) and the
     elementwise producers of every reduction inlined again (x widened to f64);
  2. `transform_ext.fuse_roots_into_foralls`: repeatedly, the last untiled linalg op of the
     function (a root: nothing after it reads it) has its outer parallel dims tiled into an
     `scf.forall` (enough tiles for the threads, and small enough that a tile's
     intermediates stay in L2; a row chain over a transposed input, softmax(x.t()), in
     tiles of at least a vector's lanes of rows: whole cache lines of x), and its whole
     producer chain is fused into the tile
     (`transform.structured.fuse`, use_forall). A producer that still has users outside
     becomes a root of its own in a later round.
@vectorize:
  3. a pooling over a window of 2 or 3 dims with enough taps (kh kw >= 2 (kh + kw)) is
     separated into the pooling of its outer windows over whole rows and that of its
     innermost window on the result (`transform_ext.separate_pooling_windows`: KernelBench
     45's 11 x 11 windows of stride 11 read each input row once, not once per column tap);
     a stride-1 max (min) pooling along the innermost dim becomes, per row and chunk of
     `window_lanes` outputs, one read of the inputs the chunk sees (the unpadded input, the
     padding spliced in at the edges) and ceil(log2 k) maxima of that vector and itself
     shifted (`transform_ext.sliding_window_extrema`; a window of k taps is the max of two
     overlapping windows of 2^j taps); then
     `transform_ext.interchange_lane_dims_innermost` and `transform_ext.tile_to_vector_tiles`:
     every linalg op is tiled with `scf.for` to a vector tile: contractions to an m x n
     register tile (a vector-matrix product y[m] += A[k, m] x[k]: a run of m x n lanes along
     A's rows; k = 1, lowered later to outer products / FMAs) that computes its
     accumulator's producer (a fill, an elementwise op such as a rescale) on the tile, in
     registers; an op reading a tensor transposed (y[j, i] = f(x[i, j])) to lanes x
     lanes (twice as many on a side for 16-bit elements: rows of whole cache lines), read
     in rows and transposed in registers (shuffles; its forall tiles are square blocks),
     stepped along the input's rows innermost when it reads nothing else (each input row
     one stream); every other op to 1 x ... x 1 x W along its lane dim;
     `transform_ext.split_odd_bf16_lanes` splits bf16 tiles of an odd lane count; a pooling
     op's tile (W outputs of one row, one window tap: its lanes run along the outputs, the
     window loops inside) is decomposed to a 1-D pooling (`transform.structured.decompose`),
     which the vectorizer turns into a shifted vector load and a max or add per tap; a tap
     of stride s > 1, and one of a 3-D pooling (a linalg.generic), becomes one load of
     (W-1)*s+1 lanes, a shuffle of every s-th lane and the body on W lanes
     (`transform_ext.strided_poolings_to_shuffles`);
  4. the function is vectorized (`vectorize_children_and_apply_patterns`; with
     keep_target_kernels, op by op leaving the ops marked TARGET_KERNEL, which the
     target lowers itself: `vectorize_but_target_kernels`) and loop-invariant
     accumulator reads/writes are hoisted out of the loops; a split mat-vec's step (a
     contraction elementwise along its lanes) becomes FMAs of a few rows with one vector of
     x, a split short product's FMAs of every pair of its tile's rows (all of the batch x
     up to a register tile's worth of W's: `transform_ext.analysis.tiles.shared_lane_pairs`)
     (`transform_ext.lane_contracts_to_fmas`); a copy transposing 16-bit pairs whole
     (tiles of `pair_lane_sizes`: an AMX operand's pack) becomes a transpose of 32-bit
     words (`transform_ext.transpose_pairs_as_words`); with `bf16_dot`, contractions
     of two bf16 inputs step k by pairs (register_tile's third entry) and each step becomes
     AVX512-BF16 dot products (`transform_ext.contracts_to_bf16_dot_products`). Before that, every
     tensor.insert_slice that is strided, rank-reducing or larger than a register tile
     becomes a loop of vector-tile inserts (`transform_ext.tile_insert_slices`): vectorized
     whole, it would lose its strides or become one vector as large as its source.
Forall tiles divide the extents (static shapes), and a dim is never split when a fused
producer's reduction would be computed once per tile (the row max and sum of a softmax under
column tiles). Vector tiles divide their extent when a divisor near the target exists; else
(a prime row length) the last, partial tile of the loop is peeled into a static tile of its
own; bf16 tiles of an odd lane count are split into an even part and one lane (LLVM's x86
backend cannot compile odd bf16 vectors). The tile-size analyses live in
transform_ext/analysis/tiles.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured
from torch_mlir.dialects.transform import tensor as ttensor
from torch_mlir.dialects.transform import vector as tvec

import transform_ext
from transform_ext.analysis.structure import func_ops, single_func, top_level_linalg_ops
from transform_ext.analysis.tiles import parallel_tile_sizes, vector_tile_sizes
from transform_ext.annotate_fastmath import annotate_fastmath
from transform_ext.branch_math_on_constant_lanes import branch_math_on_constant_lanes
from transform_ext.branch_math_on_small_lanes import branch_math_on_small_lanes
from transform_ext.common import largest_divisor_at_most
from transform_ext.filter_ops import filter_ops
from transform_ext.fold_reshape_ops_by_expansion import fold_reshape_ops_by_expansion
from transform_ext.fold_transposes_into_matvecs import fold_transposes_into_matvecs
from transform_ext.fuse_roots_into_foralls import fuse_roots_into_foralls
from transform_ext.inline_elementwise_producers import inline_elementwise_producers
from transform_ext.lane_contracts_to_fmas import lane_contracts_to_fmas
from transform_ext.interchange_lane_dims_innermost import interchange_lane_dims_innermost
from transform_ext.merge_sibling_reductions import merge_sibling_reductions
from transform_ext.scalarize_rank0_generics import scalarize_rank0_generics
from transform_ext.split_assertions import split_assertions
from transform_ext.split_matvec_lanes import split_matvec_lanes
from transform_ext.split_odd_bf16_lanes import split_odd_bf16_lanes
from transform_ext.separate_pooling_windows import separate_pooling_windows
from transform_ext.sliding_window_extrema import sliding_window_extrema
from transform_ext.strided_poolings_to_shuffles import strided_poolings_to_shuffles
from transform_ext.transpose_pairs_as_words import transpose_pairs_as_words
from transform_ext.trim_window_inputs import trim_window_inputs
from transform_ext.tile_insert_slices import tile_insert_slices
from transform_ext.tile_to_vector_tiles import tile_to_vector_tiles
from transform_ext.contracts_to_bf16_dot_products import contracts_to_bf16_dot_products

from transform_ext.common import TARGET_KERNEL
from transform_ext.exclude_ops import exclude_ops

from .common import (any_op, apply_passes, apply_patterns, canonicalize, foreach,
                     hoist_loop_invariant_subsets, match, vectorize_or_leave)
from .script import apply_stage, build_script

# Imported from here by the other families (matmul, attention, cross-entropy) and targets.
__all__ = ["GenericParams", "generic_script", "fuse_generic", "vectorize_generic", "func_ops",
           "register_tile_for", "single_func", "top_level_linalg_ops", "parallel_tile_sizes",
           "vector_tile_sizes", "largest_divisor_at_most"]


@dataclass(frozen=True)
class GenericParams:
    """threads: parallel tiles are sized for this many workers (times `tiles_per_thread`).
    tile_bytes: and, over the outer dims, small enough that a tile of the root's result
    holds at most this many bytes (at the widest element type the root touches), so a
    fused row block's intermediates stay in the L2 cache.
    pass_bytes: the same bound for a root whose chain passes over each contiguous row of its
    tile several times (a normalization over the innermost dim: its reductions, then the
    normalized values), so the tile stays in L1 between the passes.
    vector_tile: elements of the innermost loop dim per vector tile.
    register_tile: (m, n) accumulator tile of contractions.
    bf16_dot: contractions of two bf16 inputs step their k loop by pairs and become AVX512-BF16
      dot products (transform_ext.contracts_to_bf16_dot_products; the target must have them).
    min_parallel_work: ops of less work than this stay sequential: output elements, times
      the reduced extent for a reduction other than a contraction.
    k_chunk: rows of A per chunk of the k loop of a vector-matrix product y[m] += A[k, m] x[k]
      (A^T x, A read in place): each chunk's rows are streamed side by side across the
      register tiles instead of one register tile's column strip of A at a time (f32:
      1.05-1.15x, one thread, shared machine; not for a bf16 A, where it cost 0.85-0.99x);
      1 = no chunks.
    window_lanes: outputs per chunk of a stride-1 max (min) pooling computed by doubled
      windows (transform_ext.sliding_window_extrema).
    short_rows: a contraction with rows on both sides but at most this many on one (x @ W^T
      for a small batch, both operands read along k) is split into dot products of one
      vector of k lanes per pair of rows (transform_ext.split_matvec_lanes): W is read once,
      in place, instead of transposed and packed per call; 0 = never."""

    threads: int = 2
    tiles_per_thread: int = 4
    tile_bytes: int = 128 * 1024
    pass_bytes: int = 24 * 1024
    vector_tile: int = 64
    register_tile: tuple[int, int] = (8, 32)
    min_parallel_work: int = 4096
    bf16_dot: bool = False
    k_chunk: int = 16
    window_lanes: int = 128
    short_rows: int = 16

    def __post_init__(self):
        if self.threads < 1 or self.tiles_per_thread < 1 or min(self.tile_bytes, self.pass_bytes) < 1:
            raise ValueError("threads, tiles_per_thread, tile_bytes and pass_bytes must be >= 1")
        if self.k_chunk < 1:
            raise ValueError("k_chunk must be >= 1")
        if min(self.vector_tile, self.window_lanes) < 1 or min(self.register_tile) < 1:
            raise ValueError("vector_tile, window_lanes and register_tile must be >= 1")

    @property
    def lanes(self) -> int:
        """f32 lanes of one vector register (register_tile's n is two vectors,
        `register_tile_for`): the ForallPolicy field that transform_ext.analysis.tiles reads
        for the square blocks of a transpose."""
        return max(1, self.register_tile[1] // 2)

    @property
    def max_tile_elements(self) -> int:
        """Elements of the largest vector tile `tile_to_vector_tiles` makes: a register tile,
        or the square tile of a 16-bit transposing op, 2 x lanes on a side
        (transform_ext.analysis.tiles.transposed_side); an insert of more is tiled."""
        return max(self.register_tile[0] * self.register_tile[1], (2 * self.lanes) ** 2)

    @property
    def bf16_k(self) -> int:
        """k step of the register tiles of bf16 contractions (the VectorPolicy field that
        transform_ext.analysis.tiles reads): pairs with `bf16_dot`."""
        return 2 if self.bf16_dot else 1

    @classmethod
    def for_cpu(cls, cpu, threads: int) -> "GenericParams":
        """The parameters on a CPU described by `cpu` (lighthouse.targets.description
        CpuDescription): vector tiles of 4 vector registers, the register tile of
        `register_tile_for`, tiles of at most a sixteenth of L2 (room for a fused chain's
        intermediates and inputs beside the root's tile), or half of L1 for a chain of
        several passes over each contiguous row of its tile, and short products of up to
        twice the register tile's rows (a short side of up to as many vector accumulators as
        the register tile has, each paired with one row of the other side)."""
        register_tile = register_tile_for(cpu.f32_lanes, cpu.vector_registers)
        return cls(threads=threads, tile_bytes=cpu.l2_bytes // 16, pass_bytes=cpu.l1d_bytes // 2,
                   vector_tile=4 * cpu.f32_lanes, window_lanes=8 * cpu.f32_lanes,
                   register_tile=register_tile, short_rows=2 * register_tile[0])


def register_tile_for(lanes: int, registers: int) -> tuple[int, int]:
    """(MR, NR) accumulator tile of a contraction on `registers` vector registers of `lanes`
    f32: NR two vectors wide; MR = 8 rows (16 accumulators, 2 operand vectors, a broadcast)
    with 32 registers, else 4 (8 accumulators of 16 registers)."""
    return (8 if registers >= 32 else 4, 2 * lanes)


def split_short_products(root: ir.Value, params: GenericParams) -> None:
    """Mat-vecs split into vector_tile lanes of partial sums per row, products of at most
    short_rows rows on one side into one vector of lanes per pair of rows."""
    split_matvec_lanes(match(root, "func.func"), params.vector_tile, params.short_rows,
                       params.lanes)


def fuse_stage(params: GenericParams):
    """Steps 1-2 of the module docstring, as a stage body."""

    def body(root: ir.Value) -> None:
        split_assertions(root)
        split_short_products(root, params)
        trim_window_inputs(match(root, "func.func"))
        root = apply_passes(root, "linalg-fold-unit-extent-dims")
        canonicalize(root)
        apply_passes(match(root, "func.func"), "linalg-fuse-elementwise-ops")
        canonicalize(root)
        inline_elementwise_producers(filter_ops(match(root, "linalg.generic"),
                                                structure="reduction"), whole=True)
        canonicalize(root)
        merge_sibling_reductions(match(root, "func.func"))
        fold_reshape_ops_by_expansion(match(root, "func.func"))
        fold_transposes_into_matvecs(match(root, "func.func"), params.short_rows)
        split_short_products(root, params)
        inline_elementwise_producers(filter_ops(match(root, "linalg.generic"),
                                                structure="reductions"), whole=True)
        canonicalize(root)
        fuse_roots_into_foralls(match(root, "func.func"), threads=params.threads,
                                tiles_per_thread=params.tiles_per_thread,
                                tile_bytes=params.tile_bytes, vector_tile=params.vector_tile,
                                min_parallel_work=params.min_parallel_work,
                                pass_bytes=params.pass_bytes, lanes=params.lanes)
        canonicalize(root)

    return body


# 2-D pooling ops as torch-mlir imports them (1-D pooling too, over a unit H dim)
POOLING_2D = ("linalg.pooling_nchw_max", "linalg.pooling_nchw_sum")


def extrema_without_zero_order(func: ir.Value) -> None:
    """Every maximumf / minimumf gets `nsz`: arith's IEEE maximum orders -0 below +0 as
    well as propagating NaN, five x86 instructions per vector (a max, an or, an and, an
    unordered compare and a blend), three without the zero order (a max pooling's window
    loop: 12% of KernelBench 41's time). torch does not order the zeros either
    (torch.relu(-0.0), torch.maximum(-0.0, 0.0), the max pooling and the amax of
    [-0.0, 0.0] are all -0.0); NaN still propagates, and the values are the same numbers."""
    annotate_fastmath(match(func, ["arith.maximumf", "arith.minimumf"]), "nsz")


def vectorize_but_target_kernels(func: ir.Value) -> None:
    """What vectorize_children_and_apply_patterns does (vectorize_nd_extract, type extensions
    folded into contractions), with the linalg ops marked TARGET_KERNEL left as they are
    (the target lowers them): every other linalg op vectorized, one that cannot be staying a
    loop nest, then that op's patterns (transfer permutations lowered, reductions to
    contractions, vector ops sunk, extensions folded, tensor subsets folded into the
    transfers, canonicalization)."""
    linalg_ops = structured.MatchOp(any_op(), func,
                                    interface=structured.MatchInterfaceEnum.LinalgOp).result
    kept = structured.MatchOp(any_op(), func, op_attrs={TARGET_KERNEL: ir.UnitAttr.get()}).result
    foreach(exclude_ops(linalg_ops, kept), vectorize_or_leave)
    apply_patterns(func, tvec.ApplyTransferPermutationPatternsOp,
                   tvec.ApplyVectorReductionToContractPatternsOp, tvec.ApplySinkVectorPatternsOp,
                   tvec.ApplyFoldArithExtensionPatternsOp,
                   ttensor.ApplyFoldTensorSubsetOpsIntoVectorTransfersPatternsOp)
    canonicalize(func)


def vectorize_stage(params: GenericParams, keep_target_kernels: bool = False):
    """Steps 3-4 of the module docstring, as a stage body; with `keep_target_kernels`, the
    ops marked TARGET_KERNEL are neither tiled nor vectorized (vectorize_but_target_kernels)."""

    def body(root: ir.Value) -> None:
        func = match(root, "func.func")
        separate_pooling_windows(func)
        sliding_window_extrema(func, params.window_lanes)
        interchange_lane_dims_innermost(func)
        func = tile_to_vector_tiles(func, vector_tile=params.vector_tile,
                                    register_tile=params.register_tile + ((params.bf16_k,) if params.bf16_dot else ()),
                                    k_chunk=params.k_chunk)
        func = split_odd_bf16_lanes(func)
        structured.DecomposeOp(match(func, list(POOLING_2D)))
        strided_poolings_to_shuffles(func)
        scalarize_rank0_generics(func)
        tile_insert_slices(func, params.vector_tile, max_elements=params.max_tile_elements)
        if keep_target_kernels:
            vectorize_but_target_kernels(func)
        else:
            func = structured.VectorizeChildrenAndApplyPatternsOp(
                func, vectorize_nd_extract=True, fold_type_extensions_into_contract=True).result
        canonicalize(func)
        hoist_loop_invariant_subsets(func)
        canonicalize(func)
        lane_contracts_to_fmas(func)
        transpose_pairs_as_words(func)
        if params.bf16_dot:
            contracts_to_bf16_dot_products(func)
        branch_math_on_constant_lanes(func)
        branch_math_on_small_lanes(func)
        extrema_without_zero_order(func)

    return body


def generic_script(params: GenericParams) -> ir.Module:
    """The schedule: `@fuse` and `@vectorize` (needs an active context and location)."""
    return build_script([("fuse", fuse_stage(params)), ("vectorize", vectorize_stage(params))])


def _apply(payload: ir.Module, params: GenericParams, stage: str) -> None:
    transform_ext.load(payload.context)
    with payload.context, ir.Location.unknown():
        apply_stage(payload, generic_script(params), stage)


def fuse_generic(payload: ir.Module, params: GenericParams = GenericParams()) -> None:
    """The script's @fuse on `payload` (steps 1-2 of the module docstring)."""
    _apply(payload, params, "fuse")


def vectorize_generic(payload: ir.Module, params: GenericParams = GenericParams()) -> None:
    """The script's @vectorize on `payload` (steps 3-4 of the module docstring)."""
    _apply(payload, params, "vectorize")
