"""The matmul family: contraction-dominated payloads (matmul, batch_matmul, x @ w.T as
nn.Linear imports it, MLPs with bias/activation epilogues) on the CPU.

Math, per contraction: C[b, m, n] = sum_k A[b, m, k] B[b, k, n], optionally followed by an
elementwise epilogue E (bias add, GELU, the f32 -> bf16 rounding torch-mlir emits, ...).
Preconditions: static shapes, f32/f16/bf16 operands with an f32 accumulator, one m, one n
and one k dim of extent > 1, any batch dims. f16/bf16 keep torch-mlir's f32 accumulator
(torch accumulates in f32 and rounds the result once): a 16-bit operand is widened to f32
(exactly) while it is packed, so the kernel itself is f32. With `MatmulParams.bf16_dot` (a
CPU with AVX512-BF16) two bf16 operands are packed as they are, k in pairs innermost
(A_p[b, m1, k/2, m0, 2], B_p[b, n1, k/2, n0, 2], an odd k padded with a zero; a bf16 linear
layer's f32 widenings of x and W^T folded into its contraction first), and the kernel's
step over a pair of k is MR x NR/16 vdpbf16ps (transform_ext.contracts_to_bf16_dot_products)
on f32 accumulators. With `MatmulParams.amx` (a CPU with AMX) such a product whose A is
k-contiguous packs A by rows instead (A_p[b, m, k/2, 1, 2], m and k padded with zeros to
multiples of 32 first), takes 32 x 32 register tiles over 16 pairs of k per step, and
leaves that loop a linalg op, which the CPU target runs on AMX tiles
(transform_ext.contraction_loops_to_amx_tiles: 2 x 2 f32 accumulator tiles, tdpbf16ps).

fuse (the script's @fuse: steps recorded on a trial copy by `plan_matmul`): the payload
normalized (`_normalize`: unit dims folded, elementwise ops fused; transposes and 1-D
poolings that reshape propagation expanded with unit dims folded back,
`_fold_unit_dims_of_named_ops`; a product read only through a transpose of its lanes,
(A @ B)^T, computed as the product B^T A^T of its own,
transform_ext.fold_result_transposes_into_contractions); mat-vecs and short products
(x @ W^T for a batch of at most GenericParams.short_rows rows, at the top level; in
bf16, their f32 widenings folded into them first, `_short_widened_products`) read their transposed operands in place and get
their k split into lanes as in the generic schedule (`_split_short_products`:
W read once, not packed; their partial sums are tiled and vectorized as the generic
schedule does, below, and stay in this family when no other contraction is left); a
payload of more than CHUNK_CONTRACTIONS contractions is split into functions of that many
(`transform_ext.outline_contraction_chunks`, inlined back at the end of the stage: an
upstream fusion costs its function's size per call); then per
contraction, last first (the packed ones in batches sharing one recorded step per phase,
`_packed_batch`):
  1. data tiling (`transform.structured.pack` + `pack_transpose`): A is packed into panels
     A_p[b, m1, k, m0] and B into B_p[b, n1, k, n0] with m = m1 MR + m0, n = n1 NR + n0
     (zero-padded at the edges); C accumulates in C_p[b, m1, n1, m0, n0] and is unpacked
     at the end. The zero fill of C and transposes feeding A or B fold into the packs; a
     transpose consuming C that keeps C's innermost dim (one moving batch dims) folds
     into the unpack (the tiles below follow the dims of the unpack's destination). When C
     has other uses besides such a transpose (or a slice at offset 0), C would be unpacked
     twice: nothing is folded then (transposes of A or B stay separate ops, C is unpacked
     once for all its uses).
  2. threads: the epilogue (or the unpack) is tiled into an `scf.forall` of
     tile_m x tile_n output tiles; unpack, contraction, fill and packs are fused into it.
  3. cache blocking inside a tile: for each k block of tile_k, B's panel is packed; for
     each block_m rows, A's panel is packed; then for every (n1, m1) the MR x NR register
     tile accumulates over the block's k (k loop innermost, one outer product per k). A
     tile of one block of rows (at most PANEL_ROWS) packs a k-contiguous B's micro-panel
     n1 inside the n1 loop instead, right before the register tiles that read it (f32).
  4. the packs are tiled to pack_k-deep slices (packed in pairs: A pack_k / 2 pairs when
     k is its contiguous dim, else one pair; B one pair), the unpack (with the epilogue
     fused) and the C_p fill to MR x NR tiles.
  With one k block (k <= tile_k) and no reduction after C, steps 3-4 tile the output
  instead: its root (epilogue or unpack) is tiled to register tiles (n outer, in row
  blocks that pack A), with the unpack, the kernel and C_p's init fused into each, so
  the accumulator starts in registers and goes from them to C: C_p is never written (a
  small-k product, 32 x 2048 @ 2048 x 32, went from 0.50x to 0.88x torch).
  With several k blocks of an f32 product from zero that nothing reads but through the
  unpack (no epilogue, no reduction) and tiles that need no padding, C_p is dropped
  before step 2 (transform_ext.accumulate_in_unpacked_output: the kernel's output map
  reads C at m1 MR + m0, n1 NR + n0): the kernel is the forall's root, C's tile is zeroed
  a register tile at a time, and each register tile loads and stores its accumulator in C
  itself per k block (its unit loops dropped first, so that its maps are permutations
  again): no C_p buffer, no unpack pass.
  A reduction of C (or of its epilogue) over m or n, read with the identity map, becomes
  the root instead: the forall splits the dim it keeps, an scf.for inside walks the reduced
  dim in tile_m or tile_n steps, everything above is fused into that loop, and each MR x NR
  tile of C is unpacked and reduced in registers (no [M, N] buffer). A pooling between
  them, C's m or n dim in windows of S with stride S (a 1-D max or average pool of
  `y.unsqueeze(1)`, `find_window_pooling`), is computed on the same tiles: the reduction's
  tiles over the pooled dim are C's divided by S, and each register tile of C is pooled
  by a loop nest (its windowed read has no vector form) before it is reduced.
  Any other linalg op of the payload is tiled for threads as the generic schedule does.
vectorize (@vectorize): every op of steps 1-4 is vectorized with its nominal tile as
vector sizes (edge tiles become masked transfers), the contraction becomes an MR x NR x 1
vector.contract (lowered by the target to outer products, i.e. MR x NR/lanes FMAs with
broadcast A; an MR x NR x 2 bf16 one becomes dot products), the f32 pack transposes are
left to the target (which lowers them to shuffles in 16 x 16 blocks); with bf16 pairs, they
are lowered here, one shuffle per 2-D transpose, for every transpose of the function (A's
[MR, pack_k / 2 pairs, 2] as a transpose of 32-bit words,
transform_ext.transpose_pairs_as_words; B's two rows interleaved), a packing step's
write of whole trailing panel dims becomes one 1-D write (transform_ext.
flatten_contiguous_writes: not one 4-byte store per pair), the accumulator is hoisted
into registers across the k loop, and that loop is unrolled by K_STEPS_UNROLL.

`MatmulParams.for_shape` picks the parameters from the shapes; `pack=False` keeps the
operands in place (register tiles read A and B directly: for skinny shapes, where packing
does not pay; but a k-contiguous B is packed all the same, `contraction_params`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured
from torch_mlir.dialects.transform import loop as tloop
from torch_mlir.dialects.transform import tensor as ttensor
from torch_mlir.dialects.transform import vector as tvec

from transform_ext.accumulate_in_unpacked_output import (accumulate_in_unpacked_output,
                                                         check_unpacked_accumulation)
from transform_ext.analysis.structure import dim_positions, is_linalg_op, loop_structure
from transform_ext.analysis.tiles import VectorPolicy, short_side
from transform_ext.collapse_contraction_parallel_dims import collapse_contraction_parallel_dims
from transform_ext.collapse_reduction_dims import collapse_reduction_dims
from transform_ext.common import (AMX_SIDE, Illegal, defining_op, largest_divisor_at_most, user_op,
                                  users)
from transform_ext.contracts_to_bf16_dot_products import contracts_to_bf16_dot_products
from transform_ext.drop_unpack_destination_fill import drop_unpack_destination_fill
from transform_ext.drop_unused_results import drop_unused_results
from transform_ext.flatten_contiguous_writes import flatten_contiguous_writes
from transform_ext.fold_reshape_ops_by_expansion import fold_reshape_ops_by_expansion
from transform_ext.fuse_elementwise_producers import fuse_elementwise_producers
from transform_ext.forward_masked_writes import forward_masked_writes
from transform_ext.fold_casts_into_contractions import fold_casts_into_contractions, is_widening
from transform_ext.fold_result_transposes_into_contractions import fold_result_transposes_into_contractions
from transform_ext.fold_transposes_into_matvecs import (fold_transposes_into_matvecs,
                                                        foldable_inputs)
from transform_ext.lane_contracts_to_fmas import lane_contracts_to_fmas
from transform_ext.split_matvec_lanes import split_plan
from transform_ext.outline_contraction_chunks import outline_contraction_chunks
from transform_ext.remove_annotation import remove_annotation
from transform_ext.tile_to_vector_tiles import reductions_innermost
from transform_ext.transpose_pairs_as_words import transpose_pairs_as_words
from transform_ext.version_full_tiles import version_full_tiles
from transform_ext.widen_contraction_operands import widen_contraction_operands

import transform_ext
from transform_ext.split_assertions import split_assertions

from .common import (Place, annotate, any_op, apply_passes, apply_patterns, at_place, at_places,
                     canonicalize, hoist_loop_invariant_subsets, match, place_of, places_of,
                     tile_to_vector_tile, vectorize_marked)
from .generic import (POOLING_2D, GenericParams, func_ops, generic_script, parallel_tile_sizes,
                      register_tile_for, split_short_products, top_level_linalg_ops,
                      vector_tile_sizes)
from .generic import vectorize_stage as generic_vectorize_stage
from .script import StepRecorder, recorded_script

ROLE = "lh.mm_role"            # string attribute: the part of the matmul schedule an op plays
VECTOR_SIZES = "lh.mm_vector"  # i64 array: vector sizes of the op's nominal tile
_DONE = "lh.mm_done"           # contraction already scheduled (its kernel op)
_WIDEN = "lh.mm_widen"          # markers between the tiling and the widening fusion
_K_STEPS = "lh.mm_k_steps"      # a register tile's loop over k (unrolled by the vectorize stage)
_OTHER = "lh.mm_other"          # an op outside the contractions' tiles, vectorized last
ANNOTATIONS = (ROLE, VECTOR_SIZES, _DONE, _K_STEPS)  # what the vectorize stage removes at its end

FLOAT_TYPES = ("f32", "f16", "bf16")
CHUNK_CONTRACTIONS = 16  # a longer payload is scheduled in chunks of this many (plan_matmul)
# An output tile of at most this many rows packs A's k block whole (one block of rows, 128 KiB
# at most) and a k-contiguous B's micro-panels one at a time, each right before the register
# tiles that read it (x [128, 8192] @ W^T [8192, 8192]: the k block's panels of a 2048-column
# tile, 2 MiB, left L2 before they were read; 0.96x -> 1.09x torch)
PANEL_ROWS = 128


class NotApplicable(Exception):
    """The payload is not one this schedule takes; the message is the one-line reason."""


@dataclass(frozen=True)
class MatmulParams:
    """Parameters of one contraction's schedule.

    register: (MR, NR) accumulator tile; NR a multiple of the f32 vector width; MR x NR/lanes
      accumulators plus NR/lanes operand vectors must fit the vector registers.
    tile_m, tile_n: output tile of one scf.forall iteration (multiples of MR, NR).
    tile_k: k block; the packed panels of one block are tile_k deep.
    block_m: rows of A packed at once inside a k block (multiple of MR); a tile of at most
      PANEL_ROWS rows is one block, and then a k-contiguous B is packed one micro-panel at
      a time.
    pack_k: k extent of one packing step (a pack_k x MR transpose for A; in bf16 pairs, an
      [MR, pack_k / 2] transpose of pairs).
    pack: pack A and B into panels (False: register tiles read the operands in place).
    threads: the forall tiles are sized so that every thread gets work.
    bf16_dot: two bf16 operands are packed as they are, k in pairs innermost (A_p[m1, k1,
      m0, 2], B_p[n1, k1, n0, 2], odd k zero-padded), and each register tile's step over a
      pair of k becomes AVX512-BF16 dot products (the target must have them); else 16-bit
      operands are widened to f32 while packed.
    pair_tiles: (tile_m, tile_n) of a contraction packed in bf16 pairs (`for_pairs`), None:
      the same tiles.
    amx: with bf16_dot, a contraction packed in pairs whose A is k-contiguous runs on AMX
      tiles (`for_amx`, tiles that divide the shape; m and k that are no multiples of
      AMX_TILE padded with zeros to them, A copied once; n padded by B's pack): m is packed
      by 1
      (A_p[m, k/2, 1, 2]: A's rows as they are, each 16 pairs a 64-byte tile row), a
      register tile is AMX_TILE rows x AMX_TILE columns (2 x 2 accumulator tiles) and
      steps over k by AMX_PAIRS pairs; the CPU target runs that loop on the tiles
      (transform_ext.contraction_loops_to_amx_tiles).
    amx_tile, amx_tile_k: on AMX tiles, the largest output tile side (its f32 accumulator
      tile stays in L2 across the k blocks) and k block in pairs (a block of A's rows and
      B's micro-panel stay in L1: the tile loads feed tdpbf16ps at L1's rate only)."""

    register: tuple[int, int] = (8, 32)
    tile_m: int = 256
    tile_n: int = 256
    tile_k: int = 256
    block_m: int = 64
    pack_k: int = 16
    pack: bool = True
    threads: int = 2
    bf16_dot: bool = False
    pair_tiles: tuple[int, int] | None = None
    amx: bool = False
    amx_tile: int = 512
    amx_tile_k: int = 128

    def __post_init__(self):
        mr, nr = self.register
        if mr < 1 or nr < 1:
            raise ValueError(f"register tile must be positive, got {self.register}")
        for name, value, unit in (("tile_m", self.tile_m, mr), ("tile_n", self.tile_n, nr),
                                  ("block_m", self.block_m, mr)):
            if value < unit or value % unit:
                raise ValueError(f"{name}={value} must be a positive multiple of {unit}")
        if self.tile_k < 1 or self.pack_k < 1 or self.threads < 1:
            raise ValueError("tile_k, pack_k and threads must be >= 1")
        self.for_pairs()  # the pair tiles are checked as tiles too

    def for_pairs(self) -> "MatmulParams":
        """The parameters of a contraction packed in bf16 pairs: its own output tiles."""
        if self.pair_tiles is None:
            return self
        tile_m, tile_n = self.pair_tiles
        return dataclasses.replace(self, tile_m=tile_m, tile_n=tile_n,
                                   block_m=min(tile_m, self.block_m), pair_tiles=None)

    def for_amx(self, m: int, n: int, k: int) -> "MatmulParams":
        """The parameters of a contraction on AMX tiles (`amx`; m, n, k multiples of
        AMX_TILE): AMX_TILE x AMX_TILE register tiles; output tiles, row blocks and k blocks
        (in pairs) the largest whole numbers of them up to the planned ones that divide m,
        n, the output tile and k / 2, so that every tile is static (the tile loops need
        static shapes)."""
        side = AMX_TILE

        def dividing(extent, unit, planned):
            return unit * largest_divisor_at_most(extent // unit, max(1, planned // unit))

        tile_m = dividing(m, side, min(self.tile_m, self.amx_tile))
        tile_n = dividing(n, side, min(self.tile_n, self.amx_tile))
        return dataclasses.replace(self, register=(side, side), tile_m=tile_m, tile_n=tile_n,
                                   block_m=dividing(tile_m, side, self.block_m),
                                   tile_k=dividing(k // 2, AMX_PAIRS, self.amx_tile_k))

    @staticmethod
    def for_cpu(batch: int, m: int, n: int, k: int, cpu, threads: int) -> "MatmulParams":
        """`for_shape` on a CPU described by `cpu` (lighthouse.targets.description
        CpuDescription): its f32 lanes and vector registers; max_tile (`max_output_tile`)
        the largest power of two up to MAX_OUTPUT_TILE whose square f32 accumulator tile
        fills at most a quarter of the thread's share of L3 (else half of L2); max_tile_k the
        largest power of two whose B micro-panel (max_tile_k x NR f32) fits in L1. With
        bf16 dot products, the tiles of a contraction packed in pairs (`pair_tiles`) are
        planned with twice max_tile: its kernel runs at twice the f32 rate on panels of half
        the bytes, so each repacking of A (per column of tiles) and of B (per row) costs
        twice as much against it; larger tiles pack each panel fewer times (the f32
        accumulator tile then fills L2: it is read and written once per k block)."""
        nr = register_tile_for(cpu.f32_lanes, cpu.vector_registers)[1]
        max_tile = max_output_tile(cpu, threads)

        def plan(tile):
            return MatmulParams.for_shape(
                batch, m, n, k, threads=threads, lanes=cpu.f32_lanes, registers=cpu.vector_registers,
                max_tile=tile, max_tile_k=_power_of_two_at_most(cpu.l1d_bytes // (4 * nr)))

        params = plan(max_tile)
        if not cpu.bf16_dot:
            return params
        pairs = plan(2 * max_tile)
        params = dataclasses.replace(params, bf16_dot=True, pair_tiles=(pairs.tile_m, pairs.tile_n))
        if not cpu.amx:
            return params
        # on AMX tiles: the f32 output tile in half of L2; a row block (block_m rows) of A
        # and B's micro-panel (AMX_TILE columns), 2 + 2 bytes per pair each, in L1
        return dataclasses.replace(
            params, amx=True,
            amx_tile=max(AMX_TILE, _power_of_two_at_most(math.isqrt(cpu.l2_bytes // 2 // 4))),
            amx_tile_k=max(AMX_PAIRS, _power_of_two_at_most(
                cpu.l1d_bytes // (4 * (params.block_m + AMX_TILE)))))

    @staticmethod
    def for_shape(batch: int, m: int, n: int, k: int, *, threads: int = 2, lanes: int = 16,
                  registers: int = 32, max_tile: int = 512, max_tile_k: int = 256) -> "MatmulParams":
        """Parameters for C[batch, m, n] += A[batch, m, k] B[batch, k, n] (f32 accumulator,
        `lanes` f32 per vector register, `registers` vector registers).

        k blocks of at most max_tile_k (a max_tile_k x NR micro-panel of B stays in L1);
        output tiles of at most max_tile x max_tile elements (the accumulator tile stays in
        L2; up to 2 max_tile wide when there are fewer rows), both split evenly; then tiles
        are split further until every thread gets the same number of tiles (or there are
        plenty), along N when that repacks less than along M. Fewer rows than MR or fewer
        columns than a vector: no packing (it would not pay), one register tile of rows."""
        mr, nr = register_tile_for(lanes, registers)
        pack = m >= mr and n >= lanes
        if not pack:  # skinny: one register tile covers all rows, without masked rows
            mr = max(1, min(mr, m))
        tile_k = -(-k // -(-k // max_tile_k))
        # Few rows (an MLP's batch): wider tiles, so A is repacked for fewer column tiles.
        wide = min(2 * max_tile, max(max_tile, max_tile * max_tile // _round_up(min(m, max_tile), mr)))
        counts = [-(-m // max_tile), -(-n // wide)]

        def tiles(cm, cn):
            return _round_up(-(-m // cm), mr), _round_up(-(-n // cn), nr)

        for _ in range(16):
            mt, nt = tiles(*counts)
            total = batch * -(-m // mt) * -(-n // nt)
            if total % threads == 0 or total >= 4 * threads:
                break
            # Another column of tiles repacks A once more (m k), another row B (k n); on a
            # tie the rows split: A's pack transposes, B's copies (1024^3 on 2 threads:
            # tiles of 512 x 1024 ran in 6.08 ms, 1024 x 512 in 6.68 ms)
            if nt > nr and (m < n or mt <= mr):
                counts[1] += 1
            elif mt > mr:
                counts[0] += 1
            else:
                break
        mt, nt = tiles(*counts)
        return MatmulParams(register=(mr, nr), tile_m=mt, tile_n=nt, tile_k=tile_k,
                            block_m=mt if mt <= PANEL_ROWS else min(mt, 64),
                            pack_k=min(16, tile_k), pack=pack, threads=threads)


AMX_TILE = AMX_SIDE  # rows and columns of an AMX register tile: 2 x 2 tiles of 16 x 16 f32
AMX_PAIRS = 16  # bf16 pairs of k per AMX step: one 64-byte tile row


# The largest output tile side: a tile of 1024 x 1024 repacks A and B a quarter as often as
# one of 256 x 256 (each is packed once per column, resp. row, of tiles), 5-7% faster on an
# AVX2 host (L2 512 KiB) at 1024^3 to 2048^3; at 2048 a small-k product (k = 64, whose time
# is the accumulator's traffic) was 4% slower, and 2048^3 no faster.
MAX_OUTPUT_TILE = 1024


def max_output_tile(cpu, threads: int) -> int:
    """The side of the largest square output tile: the accumulator tile is read and written
    once per k block (8 bytes per tile_k multiply-adds), so it may stream from L3; its
    panels of A and B are packed once per tile, so larger tiles pack less. The largest
    power of two up to MAX_OUTPUT_TILE whose f32 tile fills at most a quarter of the
    thread's share of L3, and at least the one filling half of L2."""
    share = cpu.l3_bytes // max(1, threads) // 4
    from_l2 = _power_of_two_at_most(math.isqrt(cpu.l2_bytes // 2 // 4))
    return max(from_l2, min(MAX_OUTPUT_TILE, _power_of_two_at_most(math.isqrt(share // 4))))


def _power_of_two_at_most(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _round_up(x: int, unit: int) -> int:
    return max(unit, -(-x // unit) * unit)


# ----------------------------------------------------------------------------- analysis

@dataclass
class Contraction:
    """A contraction op of the payload and its roles, read from its indexing maps."""

    op: ir.Operation
    batch: list[int]
    m: int
    n: int
    k: int
    ranges: list[int]
    a_index: int          # the input holding m (A); the other input holds n (B)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b = 1
        for d in self.batch:
            b *= self.ranges[d]
        return b, self.ranges[self.m], self.ranges[self.n], self.ranges[self.k]


def _element_type_name(value) -> str:
    return str(value.type.element_type)


def analyze_contraction(op: ir.Operation) -> Contraction:
    """The contraction's dims, or NotApplicable with the reason. Unit dims do not count:
    the fuse stage folds them away (`linalg-fold-unit-extent-dims`) before scheduling."""
    name = f"{op.name} at {op.location}"
    ls = loop_structure(op)
    if not ls.is_contraction:
        raise NotApplicable(f"{name} is not a contraction")
    if not ls.is_static:
        raise NotApplicable(f"{name} has dynamic shapes")
    if ls.num_inputs != 2 or ls.num_outputs != 1:
        raise NotApplicable(f"{name} does not have two inputs and one output")
    if short_side(ls):
        raise NotApplicable(f"{name} pairs rows of both sides on shared lanes (a short "
                            "product's split k, tiled like the generic schedule)")
    all_dims = ls.contraction_dims()
    dims = {role: [d for d in ds if ls.ranges[d] != 1] for role, ds in all_dims.items()}
    if len(dims["m"]) != 1 or len(dims["n"]) != 1 or len(dims["k"]) != 1:
        raise NotApplicable(f"{name} has {len(dims['m'])} m, {len(dims['n'])} n and "
                            f"{len(dims['k'])} k dims of extent > 1 (the schedule wants one each)")
    if len(all_dims["m"]) + len(all_dims["n"]) + len(all_dims["k"]) != 3:
        raise NotApplicable(f"{name} has unit m, n or k dims")
    for v in op.operands:
        if _element_type_name(v) not in FLOAT_TYPES:
            raise NotApplicable(f"{name} has element type {_element_type_name(v)} (wants f32, f16 or bf16)")
    if _element_type_name(op.results[0]) != "f32":
        raise NotApplicable(f"{name} accumulates in {_element_type_name(op.results[0])} (wants f32)")
    for i in (0, 1):
        if not all(p is not None for p in dim_positions(ls.maps[i])):
            raise NotApplicable(f"{name} indexes operand {i} with non-dim expressions")
    m, n = dims["m"][0], dims["n"][0]
    a_index = 0 if m in dim_positions(ls.maps[0]) else 1
    return Contraction(op, all_dims["batch"], m, n, dims["k"][0], ls.ranges, a_index)


def _contraction_ops(payload: ir.Module) -> list[ir.Operation]:
    """Top-level contractions not scheduled yet. Ops with a role belong to a scheduled
    contraction (its packs and unpack stay top-level when its forall has one iteration)."""
    return [op for func in func_ops(payload) for op in top_level_linalg_ops(func)
            if _DONE not in op.attributes and ROLE not in op.attributes
            and loop_structure(op).is_contraction]


def find_contractions(payload: ir.Module) -> list[Contraction]:
    """The contractions this schedule takes (others are tiled like the generic schedule)."""
    found = []
    for op in _contraction_ops(payload):
        try:
            found.append(analyze_contraction(op))
        except NotApplicable:
            pass
    return found


def _work(op: ir.Operation) -> int:
    ls = loop_structure(op)
    w = 1
    for r in ls.ranges:
        w *= r or 1
    return w


def _feeds_contraction(op: ir.Operation) -> bool:
    """A transpose or a widening (`is_widening`) whose only user is a contraction, or a
    widening whose only user is another such widening: they fold into the operand's packing
    or the contraction's body."""
    if op.name != "linalg.transpose" and not is_widening(op):
        return False
    user = _single_use(op.results[0])
    if user is None or not is_linalg_op(user):
        return False
    return loop_structure(user).is_contraction or (is_widening(user) and _feeds_contraction(user))


def recognize(payload: ir.Module) -> bool:
    """The payload's heavy ops are contractions: their multiply-adds outnumber the loop
    iterations of all other linalg ops together (transposes feeding them not counted)."""
    contraction, other = 0, 0
    for func in func_ops(payload):
        for op in top_level_linalg_ops(func):
            if loop_structure(op).is_contraction:
                contraction += _work(op)
            elif not _feeds_contraction(op):
                other += _work(op)
    return contraction > 0 and contraction >= other


def check(payload: ir.Module) -> str | None:
    """None when the schedule applies (some contraction fits it, or a bf16 one of few rows
    on a side that the schedule splits, `_short_widened_products`; none has dynamic
    shapes), else the reason (one line)."""
    reasons, fits = [], 0
    for op in _contraction_ops(payload):
        try:
            analyze_contraction(op)
            fits += 1
        except NotApplicable as exc:
            if not loop_structure(op).is_static:
                return str(exc)
            reasons.append(str(exc))
    if fits or _short_widened_products(payload, GenericParams()):
        return None
    return reasons[0] if reasons else "the payload has no contraction"


def _single_use(value) -> ir.Operation | None:
    uses = list(value.uses)
    if len(uses) != 1:
        return None
    return user_op(uses[0])


def find_epilogue(value: ir.Value) -> ir.Operation | None:
    """The elementwise generic consuming `value` (C, or C's unpack; its only use) over its
    iteration space with an identity map, if any."""
    user = _single_use(value)
    if user is None or user.name != "linalg.generic" or len(user.results) != 1:
        return None
    ls = loop_structure(user)
    if ls.reduction_dims or not ls.is_static or not ls.is_elementwise:
        return None
    out_type = value.type
    if list(user.results[0].type.shape) != list(out_type.shape):
        return None
    identity = ir.AffineMap.get_identity(len(out_type.shape))
    if ls.output_map(0) != identity:
        return None
    for operand, amap in zip(user.operands[: ls.num_inputs], ls.maps):
        if operand == value and amap != identity:
            return None
    return user


def reducing_reader(value: ir.Value) -> ir.Operation | None:
    """The generic that is `value`'s only use, with one static result, reducing over some
    of its loops, one loop per dim of `value`, which it reads with the identity map; else
    None."""
    user = _single_use(value)
    if user is None or user.name != "linalg.generic" or len(user.results) != 1:
        return None
    ls = loop_structure(user)
    rank = len(value.type.shape)
    if not ls.reduction_dims or not ls.is_static or ls.num_loops != rank:
        return None
    identity = ir.AffineMap.get_identity(rank)
    reads = [amap for operand, amap in zip(user.operands[: ls.num_inputs], ls.maps) if operand == value]
    if not reads or any(amap != identity for amap in reads):
        return None
    return user


def find_reduction(value: ir.Value, roles: list[str]) -> ir.Operation | None:
    """The generic consuming `value` (C's unpack or its epilogue; its only use) that reduces
    it over some of its m and n dims, if any: one result, static, `value` read with the
    identity map of its loops (each loop is a dim of C, `roles[d]` its role), the result
    indexed by the other loops in order, and at least one m or n dim left parallel (the
    threads split those)."""
    user = reducing_reader(value)
    if user is None:
        return None
    ls = loop_structure(user)
    if dim_positions(ls.output_map(0)) != ls.parallel_dims:
        return None
    if any(roles[d] == "batch" for d in ls.reduction_dims):
        return None
    if all(roles[d] == "batch" for d in ls.parallel_dims):
        return None
    return user


def find_window_pooling(value: ir.Value, roles: list[str]) -> tuple[ir.Operation, int, int] | None:
    """The generic that is `value`'s only use pooling one m or n dim p of it in windows of
    S (stride S, no dilation or padding: a 1-D max or sum pooling as linalg generalizes it,
    unit dims folded), P[.., j, ..] = reduce_{w < S} value[.., S j + w, ..], its loops the
    dims of P then w, `value` read through (.., S d_p + d_w, ..) and the identity on the
    other dims, P written with the identity map, its other inputs (the window's shape) not
    read; (op, p, S) or None."""
    user = _single_use(value)
    if user is None or user.name != "linalg.generic" or len(user.results) != 1:
        return None
    ls = loop_structure(user)
    rank = len(value.type.shape)
    if not ls.is_static or ls.num_loops != rank + 1 or ls.reduction_dims != [rank]:
        return None
    if dim_positions(ls.output_map(0)) != list(range(rank)):
        return None
    block = user.regions[0].blocks[0]
    reads = [amap for operand, amap in zip(user.operands[: ls.num_inputs], ls.maps) if operand == value]
    others = [arg for i, arg in enumerate(block.arguments[: ls.num_inputs]) if user.operands[i] != value]
    if len(reads) != 1 or any(list(arg.uses) for arg in others):
        return None
    window = ls.ranges[rank]
    dims = [ir.AffineDimExpr.get(d) for d in range(rank + 1)]
    for p in range(rank):
        expected = ir.AffineMap.get(rank + 1, 0, dims[:p] + [dims[p] * window + dims[rank]] + dims[p + 1: rank])
        if reads[0] == expected and roles[p] in ("m", "n"):
            return user, p, window
    return None


def _is_transpose(op: ir.Operation) -> bool:
    """linalg.transpose, or a generic that only permutes its one input (what linalg's
    unpack folding takes for a transpose)."""
    if op.name == "linalg.transpose":
        return True
    if op.name != "linalg.generic" or len(op.operands) != 2:
        return False
    ls = loop_structure(op)
    body = op.regions[0].blocks[0].operations
    return (not ls.reduction_dims and all(m.is_permutation for m in ls.maps)
            and ls.maps[0] != ls.maps[1] and len(body) == 1)


def _transpose_permutation(op: ir.Operation) -> list[int]:
    """perm of a transpose (`_is_transpose`): its result's dim i is its input's dim perm[i]."""
    if op.name == "linalg.transpose":
        return list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
    ls = loop_structure(op)
    read, written = dim_positions(ls.maps[0]), dim_positions(ls.maps[1])
    return [read.index(d) for d in written]


def _folds_into_unpack(op: ir.Operation) -> bool:
    """A consumer of C that linalg's pack/unpack folding turns into an unpack of its own:
    a transpose, or a slice at offset 0 with unit strides."""
    if op.name == "tensor.extract_slice":
        offsets = ir.DenseI64ArrayAttr(op.attributes["static_offsets"])
        strides = ir.DenseI64ArrayAttr(op.attributes["static_strides"])
        same_rank = len(op.results[0].type.shape) == len(op.operands[0].type.shape)
        return same_rank and all(o == 0 for o in offsets) and all(s == 1 for s in strides)
    return is_linalg_op(op) and _is_transpose(op)


def _folding_leaves_one_unpack(c: Contraction) -> bool:
    """Folding transposes and slices into the packs leaves one unpack of C, its only use,
    unless C has several uses and one of them folds into an unpack of its own (then the
    packed C would be unpacked twice)."""
    readers = users(c.op.results[0])
    return len(readers) <= 1 or not any(_folds_into_unpack(u) for u in readers)


# ----------------------------------------------------------------------------- fuse

def _unpacks_exactly(unpack: ir.Operation) -> bool:
    """Can the packed contraction `unpack` reads accumulate in its output instead
    (transform_ext.accumulate_in_unpacked_output's preconditions)?"""
    try:
        check_unpacked_accumulation(unpack)
    except Illegal:
        return False
    return True


def _tile(handle, sizes, interchange=None):
    t = structured.TileUsingForOp(handle, sizes=sizes, interchange=interchange)
    return t.tiled_linalg_op, list(t.loops)


def _fuse_into(producer, containing):
    f = structured.FuseIntoContainingOp(producer, containing)
    return f.fused_op, f.new_containing_op


def _set_role(handle, role: str, vector_sizes: list[int] | None = None) -> None:
    """Annotate the ops of `handle` with their ROLE (and VECTOR_SIZES) for the vectorize stage."""
    annotate(handle, ROLE, ir.StringAttr.get(role))
    if vector_sizes is not None:
        annotate(handle, VECTOR_SIZES, ir.DenseI64ArrayAttr.get(vector_sizes))


def _outer_perm(amap, order: dict[int, int]) -> list[int] | None:
    """Permutation putting an operand's outer dims in (batch, m|n, k) order, None if already."""
    dims = dim_positions(amap)
    perm = sorted(range(len(dims)), key=lambda i: order[dims[i]])
    return None if perm == list(range(len(dims))) else perm


def bf16_pairs(c: Contraction, params: MatmulParams) -> bool:
    """Are c's operands packed in bf16 pairs of k (MatmulParams.bf16_dot)?"""
    return params.bf16_dot and all(isinstance(c.op.operands[i].type.element_type, ir.BF16Type)
                                   for i in (0, 1))


def contraction_params(c: Contraction, params: MatmulParams) -> MatmulParams:
    """c's own parameters: packed when `for_shape` leaves a product of fewer rows than MR
    unpacked but B is k-contiguous (`_k_contiguous`: x @ W^T, a small batch through an
    nn.Linear), whose register tiles would otherwise read B through a transposed copy of
    the whole of it; those of bf16 pairs when it packs them (`for_pairs`), on AMX tiles
    (`for_amx`, for its shape padded to AMX_TILE: `amx_shape`) when A is k-contiguous,
    else without AMX."""
    _, m, n, _ = c.shape
    if not params.pack and m > 1 and n >= params.register[1] // 2 and \
            _k_contiguous(c, 1 - c.a_index, _folding_leaves_one_unpack(c)):
        params = dataclasses.replace(params, pack=True)
    if not bf16_pairs(c, params):
        return params
    params = params.for_pairs()
    amx = params.amx and params.pack and _k_contiguous(c, c.a_index, _folding_leaves_one_unpack(c))
    return params.for_amx(*amx_shape(c)) if amx else dataclasses.replace(params, amx=False)


def amx_shape(c: Contraction) -> tuple[int, int, int]:
    """c's m, n and k rounded up to multiples of AMX_TILE: the product on AMX tiles is
    computed on operands padded with zeros to them (`_Packed.pack`; n by the pack of B)."""
    _, m, n, k = c.shape
    return _round_up(m, AMX_TILE), _round_up(n, AMX_TILE), _round_up(k, AMX_TILE)


def _kernel_dims(kernel: ir.Operation, c: Contraction, a_index: int) -> dict[str, list[int] | int]:
    """Loop dims of the packed contraction: batch, m1, n1, k, m0, n0 (k: the pairs of k when
    they are packed in pairs, the pair's dim innermost and left whole)."""
    ls = loop_structure(kernel)
    a = dim_positions(ls.maps[a_index])
    b = dim_positions(ls.maps[1 - a_index])
    nb = len(c.batch)
    return {"batch": a[:nb], "m1": a[nb], "k": a[nb + 1], "m0": a[nb + 2],
            "n1": b[nb], "n0": b[nb + 2], "rank": ls.num_loops}


def _sizes(rank: int, **dims) -> list[int]:
    out = [0] * rank
    for d, s in dims.values():
        if isinstance(d, list):
            for x in d:
                out[x] = s
        else:
            out[d] = s
    return out


def _unpack_dest_roles(unpack: ir.Operation, c_dims: list[int], dims: dict) -> list[str]:
    """"batch", "m" or "n" for each dim of the unpack's destination. Packed C's outer dim j
    (loop dim c_dims[j] of the kernel) lands on destination dim outer_dims_perm[j]."""
    rank = len(unpack.results[0].type.shape)
    perm = (list(ir.DenseI64ArrayAttr(unpack.attributes["outer_dims_perm"]))
            if "outer_dims_perm" in unpack.attributes else list(range(rank)))
    role_of = {dims["m1"]: "m", dims["n1"]: "n"}
    roles = ["batch"] * rank
    for j, dest_dim in enumerate(perm):
        roles[dest_dim] = role_of.get(c_dims[j], "batch")
    return roles


def _k_contiguous(c: Contraction, index: int, fold_transposes: bool) -> bool:
    """Is k the contiguous dim of what the pack of operand `index` reads: the operand, or
    the input of a transpose producing it that folds into the pack (A^T given as A [K, M]:
    m contiguous, each k row of a panel in another cache line)? The transpose may be a
    generic (unit-dim folding generalizes linalg.transpose: KernelBench's nn.Linear before
    a pooling); the pack folds either."""
    positions = dim_positions(loop_structure(c.op).maps[index])
    k_at = positions.index(c.k)
    producer = defining_op(c.op.operands[index])
    if fold_transposes and producer is not None and _is_transpose(producer):
        permutation = _transpose_permutation(producer)
        return permutation[k_at] == len(permutation) - 1
    return k_at == len(positions) - 1


class _Packed:
    """Steps 1-4 of the module docstring for one contraction, in the three phases a batch of
    contractions shares (`_schedule_packed`): its packing (`pack`), then, read from
    the packed trial (`read_packed`), its roles (`roles`), then its tiles (`read_roled`,
    `tile`). The phases emit no whole-function cleanup: the batch's step does that once."""

    def __init__(self, c: Contraction, params: MatmulParams):
        self.c, self.params, self.base_params = c, params, params
        mr, nr = params.register
        self.nb = len(c.batch)
        self.folds = _folding_leaves_one_unpack(c)
        self.k_contiguous = {"a": _k_contiguous(c, c.a_index, self.folds),
                             "b": _k_contiguous(c, 1 - c.a_index, self.folds)}
        pairs = self.pairs = bf16_pairs(c, params)
        # on AMX tiles: m packed by 1 (A's rows as they are), MR rows per register tile
        self.amx = pairs and params.amx
        # on AMX tiles, m and k that are no multiples of AMX_TILE are padded with zeros to
        # them (`pack`; n is: B's pack pads its panels, C_p's unpack drops the padding)
        _, m, _, k = c.shape
        self.amx_padded = [d for d, size in ((c.m, m), (c.k, k)) if size % AMX_TILE] if self.amx else []
        self.element_types = [str(v.type.element_type) for v in c.op.operands]  # A, B, C
        self.m0 = 1 if self.amx else mr
        self.rows = mr if self.amx else 1
        # packed in pairs: B one pair of k per packing step (its two rows interleaved into
        # [NR, 2]: one shuffle); A, when k is its contiguous dim, pack_k / 2 pairs per step
        # (an [MR, pack_k / 2] transpose of 32-bit pairs), else one pair per step
        # ([2, MR] -> [MR, 2]); on AMX tiles a row's AMX_PAIRS pairs per step (a copy), and
        # as many of B's when k is its contiguous dim (nn.Linear's W^T: an [NR, AMX_PAIRS]
        # transpose of pairs, each of W's rows one 64-byte line; one pair per step gathered
        # NR words from NR rows, 43% of a bf16 Linear's time)
        if self.amx:
            self.pack_k = {"a": AMX_PAIRS, "b": AMX_PAIRS if self.k_contiguous["b"] else 1}
        elif pairs:
            self.pack_k = {"a": max(1, params.pack_k // 2) if self.k_contiguous["a"] else 1, "b": 1}
        else:
            self.pack_k = {"a": params.pack_k, "b": params.pack_k}
        self.widened = [] if pairs else [
            name for index, name in sorted({c.a_index: "a", 1 - c.a_index: "b"}.items())
            if c.op.operands[index].type.element_type != ir.F32Type.get()]
        # step 1's packed sizes and outer/inner permutations
        sizes = [0] * len(c.ranges)
        sizes[c.m], sizes[c.n] = self.m0, nr
        if pairs:
            sizes[c.k] = 2
        self.packed_sizes = sizes
        ls = self.ls = loop_structure(c.op)
        order = {d: 0 for d in c.batch} | {c.m: 1, c.n: 1, c.k: 2}
        self.perms = [_outer_perm(ls.maps[i], order) for i in (0, 1)]
        # packed inner tiles follow the loop dims' order: k's pair goes innermost
        self.inner = [[1, 0] if pairs and c.k < (c.m if i == c.a_index else c.n) else None
                      for i in (0, 1)]
        self.operand_tile = {d: 1 for d in c.batch} | {c.m: mr, c.n: nr, c.k: params.pack_k}

    def pack(self, contraction: ir.Value, index: int) -> None:
        """Step 1 on the handle to the contraction: a 16-bit operand is first widened
        (transform_ext.widen_contraction_operands: the contraction reads its f32 extension,
        role convert_a or convert_b, vector sizes of a register tile's slice of it), unless
        both are bf16 packed in pairs of k (`bf16_pairs`: k packed by 2, its inner tile
        moved after m0 / n0). The kernel is marked _DONE with `index`."""
        c = self.c
        if self.amx_padded:
            padded = self.amx_padded
            zeros = [ir.FloatAttr.get(ir.Type.parse(t), 0.0) for t in self.element_types]
            # the padded operands' pads kept whole (folded into the packs, k's would be
            # lost); B is padded only along k
            b_padded = int(c.k in padded)
            nofold = [1, b_padded, 0] if c.a_index == 0 else [b_padded, 1, 0]
            contraction = structured.PadOp(
                contraction, padding_values=zeros, padding_dimensions=padded,
                pad_to_multiple_of=[AMX_TILE] * len(padded), nofold_flags=nofold,
                copy_back_op="none").padded
        if self.widened:
            contraction, *extensions = widen_contraction_operands(contraction)
            for i in (0, 1):
                name = "a" if i == c.a_index else "b"
                if name in self.widened:
                    _set_role(extensions[i], f"convert_{name}",
                              [self.operand_tile[d] for d in dim_positions(self.ls.maps[i])])
        kernel = structured.PackOp(transform.OperationType.get("linalg.generic"), contraction,
                                   [], static_packed_sizes=self.packed_sizes).packed_op
        for i, (perm, inner_perm) in enumerate(zip(self.perms, self.inner)):
            if perm is None and inner_perm is None:
                continue
            pack = transform.GetProducerOfOperand(transform.OperationType.get("linalg.pack"),
                                                  kernel, i).producer
            kernel = structured.PackTransposeOp(
                transform.OperationType.get("linalg.generic"), transform.OperationType.get("linalg.pack"),
                any_op(), pack, kernel, outer_perm=perm, inner_perm=inner_perm).packed_op
        self.index = index
        annotate(kernel, _DONE, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), index))

    def read_packed(self, kernel: ir.Operation) -> list:
        """What the packing left around the kernel: its packs, init, unpack, epilogue,
        reduction and pooling; returns the ops `roles` takes handles to (None: absent)."""
        c, params = self.c, self.base_params
        mr, nr = params.register
        self.kernel, self.params = kernel, params
        a_index = c.a_index
        pack_a = defining_op(kernel.operands[a_index])
        pack_b = defining_op(kernel.operands[1 - a_index])
        init = defining_op(kernel.operands[2])
        unpack = self.unpack = _single_use(kernel.results[0])
        if unpack is None or unpack.name != "linalg.unpack":
            raise NotApplicable(f"packing {kernel.name} at {kernel.location} left no unpack")
        dims = self.dims = _kernel_dims(kernel, c, a_index)
        # C's tile in the packed layout, and the role of each dim of the unpack's
        # destination: C itself, or C transposed when a transpose of C folded into the unpack.
        c_dims = dim_positions(loop_structure(kernel).output_map(0))
        self.c_tile = [{dims["m1"]: self.rows, dims["m0"]: self.m0, dims["n0"]: nr}.get(d, 1)
                       for d in c_dims]
        roles = self.dest_roles = _unpack_dest_roles(unpack, c_dims, dims)
        epilogue = self.epilogue = find_epilogue(unpack.results[0])
        # A reduction of C (or of its epilogue) over m or n is computed tile by tile: the
        # forall splits its parallel dims, a loop inside walks the reduced ones, and C's tile
        # is reduced as it is unpacked (register tiles; no [M, N] product in memory). A
        # pooling in windows of S between them (`find_window_pooling`) is computed on the
        # same tiles: the reduction's tiles over the pooled dim are C's divided by S (a
        # register tile of C holds whole windows).
        pooling, pooled, window = find_window_pooling((epilogue or unpack).results[0], roles) \
            or (None, 0, 1)
        if pooling is not None and ({"m": mr, "n": nr}[roles[pooled]] % window
                                    or find_reduction(pooling.results[0], roles) is None):
            pooling, window = None, 1
        self.pooled, self.window = pooled, window
        reduction = self.reduction = find_reduction((pooling or epilogue or unpack).results[0], roles)
        pooling_fill = defining_op(pooling.operands[-1]) if pooling is not None else None
        if pooling_fill is not None and (pooling_fill.name != "linalg.fill"
                                         or _single_use(pooling_fill.results[0]) is None):
            pooling_fill = None
        self.pooling, self.pooling_fill = pooling, pooling_fill
        self.reduced = set(loop_structure(reduction).reduction_dims) if reduction is not None else set()
        if reduction is not None:
            self.params = _split_parallel_dims_for_threads(params, c, roles, self.reduced)
        # A packed constant operand is folded to a packed constant: nothing to tile then.
        self.pack_a = pack_a if pack_a is not None and pack_a.name == "linalg.pack" else None
        self.pack_b = pack_b if pack_b is not None and pack_b.name == "linalg.pack" else None
        self.init_is_fill = init is not None and init.name == "linalg.fill"
        if not self.init_is_fill and (init is None or init.name != "linalg.pack"):
            init = None
        self.init = init
        # The unpack overwrites all of its destination: do not compute what it writes into.
        dest = defining_op(unpack.operands[1])
        self.dest_is_fill = dest is not None and dest.name == "linalg.fill"
        self.register_tile = [{"m": mr, "n": nr}.get(r, 1) for r in roles]
        # Several k blocks of an f32 product from zero, unpadded, nothing after C: the
        # register tiles accumulate in C itself (no C_p, no unpack pass). (An epilogue's
        # tiles could not take the kernel in: its output map is no longer a permutation.)
        self.in_place = (self._k_blocks() and epilogue is None and reduction is None and not self.pairs
                         and not self.widened and self.init_is_fill and _unpacks_exactly(unpack))
        return self._ops(None, None)

    def _k_blocks(self) -> bool:
        """Does k take more than one block (tile_k; packed in pairs, a block of tile_k pairs
        holds as many bytes as tile_k widened k)?"""
        k = self.c.shape[3]
        return (-(-k // 2) if self.pairs else k) > self.params.tile_k

    def _ops(self, convert_b, convert_a) -> list:
        return [self.epilogue, self.unpack, self.kernel, self.pack_b, self.pack_a, self.init,
                convert_b, convert_a, self.reduction, self.pooling, self.pooling_fill]

    def pooled_sizes(self, sizes: list[int]) -> list[int]:
        """Sizes over C's dims as sizes over the pooled tensor's (the pooled dim's by S)."""
        return [size // self.window if d == self.pooled else size for d, size in enumerate(sizes)]

    def roles(self, h: dict[int, ir.Value]) -> None:
        """The vectorize stage's roles on the handles to `read_packed`'s ops (by index)."""
        nb, mr, nr = self.nb, *self.params.register
        pairs, pack_k = self.pairs, self.pack_k
        # on AMX tiles the kernel stays a linalg op for the target (not vectorized)
        _set_role(h[2], "amx_kernel" if self.amx else "kernel")
        if self.pack_a is not None:
            _set_role(h[4], "pack_a", [1] * nb + [1, pack_k["a"], self.m0] + ([2] if pairs else []))
        if self.pack_b is not None:
            _set_role(h[3], "pack_b", [1] * nb + [1, pack_k["b"], nr] + ([2] if pairs else []))
        _set_role(h[1], "unpack", self.c_tile)
        if self.init_is_fill:
            _set_role(h[5], "fill")
        elif self.init is not None:
            _set_role(h[5], "pack_c", self.c_tile)
        if self.dest_is_fill:
            drop_unpack_destination_fill(h[1])
        if self.epilogue is not None:
            _set_role(h[0], "epilogue", self.register_tile)
        if self.reduction is not None:
            _set_role(h[8], "epilogue", self.pooled_sizes(self.register_tile))
        if self.pooling is not None:
            _set_role(h[9], "pooling")
        if self.pooling_fill is not None:
            _set_role(h[10], "fill_tile", self.pooled_sizes(self.register_tile))

    def read_roled(self) -> list:
        """After the roles: the f32 widenings of 16-bit operands that feed the packs
        (fused into them after the tiling, `_fuse_widening_into_packs`); returns the ops
        `tile` takes handles to."""
        # A 16-bit operand is widened to f32 while it is packed (the kernel then runs on
        # f32): its extension feeds the pack, unless folded away (e.g. a constant).
        self.converts = {}
        for name in self.widened:
            pack = self.pack_a if name == "a" else self.pack_b
            source = defining_op(pack.operands[0]) if pack is not None else None
            if source is not None and source.name == "linalg.generic":
                self.converts[name] = source
        return self._ops(self.converts.get("b"), self.converts.get("a"))

    def tile(self, h: dict[int, ir.Value]) -> list[ir.Value]:
        """Steps 2-4 on the handles to `read_roled`'s ops (by index); returns the k and row
        block loops, whose packs' destinations the batch's step hoists out of them."""
        c, params, nb, dims = self.c, self.params, self.nb, self.dims
        roles, reduced = self.dest_roles, self.reduced
        mr, _ = params.register
        rank = dims["rank"]
        kb = params.tile_k
        _, m, _, k = c.shape
        k_blocks = self._k_blocks()
        m_blocks = -(-min(params.tile_m, _round_up(m, mr)) // mr) > params.block_m // mr
        epilogue, reduction, pooling = self.epilogue, self.reduction, self.pooling
        unpack_h, kernel_h, pb, pa = (h.get(i) for i in range(1, 5))
        root_op = h[8] if reduction is not None else h[0] if epilogue is not None else unpack_h
        tiles = [{"m": params.tile_m, "n": params.tile_n}.get(r, 1) for r in roles]
        if reduction is not None:
            tiles = self.pooled_sizes(tiles)
        forall_sizes = [0 if d in reduced else s for d, s in enumerate(tiles)]
        init_h = h[5]
        if self.in_place:  # the kernel writes C: it is the root, its output tiles over its loops
            root_op, init_h = accumulate_in_unpacked_output(unpack_h)
            _set_role(init_h, "fill_tile", self.register_tile)
            forall_sizes = _sizes(rank, batch=(dims["batch"], 1), m1=(dims["m1"], params.tile_m // mr),
                                  n1=(dims["n1"], params.tile_n // params.register[1]))
        t = structured.TileUsingForallOp(root_op, tile_sizes=forall_sizes)
        forall, tiled_root = t.forall_op, t.tiled_op
        epilogue_h = pooling_h = pooling_fill_h = None
        reduced_loops = []
        if reduction is not None:
            # the reduced dims in tiles of the output tile's extent, inside the forall
            tiled_root, loops = _tile(tiled_root, [s if d in reduced else 0 for d, s in enumerate(tiles)])
            if loops:  # the threads' forall and these loops: levels of the widening
                reduced_loops = [forall] + loops[:-1]
            # the loops then slice C directly, not the forall's slice of it
            apply_patterns(forall, ttensor.ApplyMergeConsecutiveInsertExtractSlicePatternsOp)
            forall = loops[-1] if loops else forall
            if pooling is not None:
                pooling_h, forall = _fuse_into(h[9], forall)
                if self.pooling_fill is not None:
                    pooling_fill_h, forall = _fuse_into(h[10], forall)
            if epilogue is not None:
                epilogue_h, forall = _fuse_into(h[0], forall)
        if self.in_place:
            kernel_h = tiled_root
        else:
            if epilogue is not None or reduction is not None:
                unpack_h, forall = _fuse_into(unpack_h, forall)
            kernel_h, forall = _fuse_into(kernel_h, forall)
        if self.init is not None:
            init_h, forall = _fuse_into(init_h, forall)
        else:
            init_h = None
        packs = {"b": pb if self.pack_b is not None else None,
                 "a": pa if self.pack_a is not None else None}

        def fuse_packs(names, loop):
            for name in names:
                if packs[name] is not None:
                    packs[name], loop = _fuse_into(packs[name], loop)
            return loop

        forall = fuse_packs("ba", forall)
        if not k_blocks and reduction is None and not self.converts:
            return self._tile_through_registers(forall, tiled_root, unpack_h, kernel_h, init_h,
                                                packs, fuse_packs, m_blocks)
        # k blocks: B's panel per block, A's panel per block of rows. (Tiling a dim by its
        # full extent makes no loop; the packs then stay where they are.)
        block_loops = []
        if k_blocks:
            kernel_h, (lk,) = _tile(kernel_h, _sizes(rank, k=(dims["k"], kb)))
            block_loops.insert(0, fuse_packs("ba", lk))
        if m_blocks:
            kernel_h, (lm,) = _tile(kernel_h, _sizes(rank, m1=(dims["m1"], params.block_m // self.m0)))
            block_loops.insert(0, fuse_packs("a", lm))
        # Register tiles: n1 outer (B's micro-panel stays in L1 across the rows), m1, then k.
        kernel_h, n1_loops = _tile(kernel_h, _sizes(rank, n1=(dims["n1"], 1)))
        if k_blocks and not m_blocks and n1_loops and packs["b"] is not None \
                and self.k_contiguous["b"] and not (self.amx or self.pairs or self.converts):
            # one block of rows and B's k contiguous (W of x @ W^T): B's micro-panel packed
            # right before the register tiles that read it (in L1), not the whole k block
            # of the output tile's columns (an n-contiguous B keeps the whole-tile pack,
            # which reads each of its rows across all panels at once)
            packs["b"], _ = _fuse_into(packs["b"], n1_loops[0])
        kernel_h, (register_loop,) = _tile(kernel_h, _sizes(rank, m1=(dims["m1"], self.rows)))
        if self.in_place:
            self._tile_k_steps(self._drop_unit_loops(register_loop), *self._register_kernel_dims())
        else:
            self._tile_k_steps(kernel_h, rank, dims["k"], self.amx)
        tiled_packs = self._tile_packs(packs)
        if self.converts:  # the widening is fused level by level below, after cleanup
            for i, loop in enumerate(reduced_loops):
                transform.AnnotateOp(loop, f"{_WIDEN}_outer{len(reduced_loops) - i}")
            transform.AnnotateOp(forall, f"{_WIDEN}_forall")
            for loop, name in zip(block_loops, ("m", "k") if m_blocks else ("k",)):
                transform.AnnotateOp(loop, f"{_WIDEN}_{name}")
            for name, tiled in tiled_packs.items():
                transform.AnnotateOp(tiled, f"{_WIDEN}_{name}_pack")
        register_tile = self.register_tile
        if self.in_place:  # C's zero start, a register tile at a time
            _tile(init_h, register_tile)
            return block_loops
        if init_h is not None:
            _tile(init_h, [1] * nb + [self.rows, 1] + ([0, 0] if self.init_is_fill else []))
        if epilogue is not None or reduction is not None:
            tiled, loops = _tile(tiled_root, self.pooled_sizes(register_tile)
                                 if reduction is not None else register_tile)
            if loops:
                if pooling_h is not None:
                    pooling_h, _ = _fuse_into(pooling_h, loops[-1])
                    if pooling_fill_h is not None:
                        _fuse_into(pooling_fill_h, loops[-1])
                if epilogue_h is not None:
                    _fuse_into(epilogue_h, loops[-1])
                _fuse_into(unpack_h, loops[-1])
            if reduction is None:
                version_full_tiles(tiled)
        else:
            version_full_tiles(_tile(tiled_root, register_tile)[0])
        return block_loops

    def _register_kernel_dims(self) -> tuple[int, int]:
        """(rank, k) of a register tile's kernel once its unit loops (batch, m1, n1) are
        dropped (`_drop_unit_loops`)."""
        dims = self.dims
        dropped = set(dims["batch"]) | {dims["m1"], dims["n1"]}
        kept = [d for d in range(dims["rank"]) if d not in dropped]
        return len(kept), kept.index(dims["k"])

    def _drop_unit_loops(self, register_loop) -> ir.Value:
        """The kernel of a register tile that accumulates in C (accumulate_in_unpacked_output:
        its output map reads C at m1 MR + m0, n1 NR + n0) without its unit loops, so that its
        maps are projected permutations again (the vectorizer's precondition); returns the
        handle to it, its marks set again (the rebuilt op has none)."""
        apply_patterns(register_loop, structured.ApplyFoldUnitExtentDimsViaSlicesPatternsOp)
        kernel = match(register_loop, "linalg.generic")
        annotate(kernel, _DONE, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), self.index))
        _set_role(kernel, "kernel")
        return kernel

    def _tile_packs(self, packs: dict) -> dict:
        """Step 4's packs: slices of pack_k along k, the slices of one operand visited in
        the order of its memory (k innermost when k is its contiguous dim, else the panel
        index), not across rows (a page per row)."""
        nb, tiled = self.nb, {}
        for name in ("a", "b"):
            if packs[name] is not None:
                interchange = list(range(nb)) + [nb + 1, nb] if not self.k_contiguous[name] else None
                tiled[name], _ = _tile(packs[name], [1] * nb + [1, self.pack_k[name]],
                                       interchange=interchange)
                if not self.converts:
                    version_full_tiles(tiled[name])
        return tiled

    def _tile_through_registers(self, forall, root, unpack_h, kernel_h, init_h, packs: dict,
                                fuse_packs, m_blocks: bool) -> list[ir.Value]:
        """Steps 3-4 for a contraction of one k block (no reduction after it, no widened
        operand): the output tile's root (epilogue or unpack) is tiled to register tiles,
        n outer (B's micro-panel stays in L1 across the rows), and the unpack and the kernel
        are fused into each, then C_p's init (a fill: the accumulator starts in registers;
        or a pack of C): C_p never goes through memory. With row blocks, the root is first
        tiled to blocks of block_m rows, A's panel packed in each."""
        params, dims, roles = self.params, self.dims, self.dest_roles

        def fuse_tile_ops(loop):
            nonlocal unpack_h, kernel_h
            if self.epilogue is not None:
                unpack_h, loop = _fuse_into(unpack_h, loop)
            kernel_h, loop = _fuse_into(kernel_h, loop)
            return loop

        block_loops = []
        if m_blocks:
            root, (lm,) = _tile(root, [params.block_m if r == "m" else 0 for r in roles])
            block_loops.append(fuse_packs("a", fuse_tile_ops(lm)))
        order = [d for want in ("batch", "n", "m") for d, r in enumerate(roles) if r == want]
        root, loops = _tile(root, self.register_tile, interchange=order)
        register_loop = fuse_tile_ops(loops[-1])
        if init_h is not None:
            # the register tile's slice of the init read directly (not through the row
            # block's slice of it), so that the init fuses into the register tile
            apply_patterns(forall, ttensor.ApplyMergeConsecutiveInsertExtractSlicePatternsOp)
            _fuse_into(init_h, register_loop)
        self._tile_k_steps(kernel_h, dims["rank"], dims["k"], self.amx)
        self._tile_packs(packs)
        version_full_tiles(root)
        return block_loops

    @staticmethod
    def _tile_k_steps(kernel_h, rank: int, k: int, amx: bool = False) -> None:
        """Step 3's innermost loop: a register tile's steps over k (loop k of `rank`: one k,
        or one pair), marked for the vectorize stage to unroll; on AMX tiles, AMX_PAIRS
        pairs per step, left for the target."""
        for loop in _tile(kernel_h, _sizes(rank, k=(k, AMX_PAIRS if amx else 1)))[1]:
            if not amx:
                transform.AnnotateOp(loop, _K_STEPS)


def _packed_batch(contractions: list[Contraction], params_for) -> list[_Packed]:
    """The contractions, last first, that one batch of steps packs and tiles (with their
    params): the first packed one, then each further packed one that folds transposes as it
    does and is not read by another member through views only (packed side by side, the
    pack of a reader would fold into the unpack of the product it reads); a 16-bit operand
    widened while it is packed keeps its contraction alone (its widening is fused into the
    packs by markers of its own)."""
    batch, members, read = [], set(), []
    for c in reversed(contractions):
        params = contraction_params(c, params_for(*c.shape))
        if not params.pack:
            continue
        packed = _Packed(c, params)
        if batch and (packed.widened or batch[0].widened or packed.folds != batch[0].folds):
            continue
        sources = _view_sources(c.op)
        if sources & members or any(c.op in r for r in read):
            continue
        batch.append(packed)
        members.add(c.op)
        read.append(sources)
    return batch


_VIEWS = ("linalg.transpose", "linalg.copy", "linalg.broadcast", "tensor.expand_shape",
          "tensor.collapse_shape", "tensor.extract_slice", "tensor.cast")


def _view_sources(op: ir.Operation) -> set:
    """The ops whose results `op` reads through views only (transposes, copies, reshapes,
    slices, and generics whose body only yields an input)."""
    found, work = set(), [op]
    while work:
        for value in work.pop().operands:
            producer = defining_op(value)
            if producer is None or producer in found:
                continue
            found.add(producer)
            if producer.name in _VIEWS or (
                    producer.name == "linalg.generic"
                    and [o.operation.name for o in producer.regions[0].blocks[0].operations] == ["linalg.yield"]):
                work.append(producer)
    return found


def _schedule_packed(rec: StepRecorder, batch: list[_Packed]) -> None:
    """Steps 1-4 for a batch of contractions (`_packed_batch`), in three recorded steps
    for all of them: the packing, the roles, the tiles (each step's cost is the payload's
    size: a step per contraction made a model's fuse stage quadratic in its layers). Ops
    that two members' tiles would both take (none, but for a pack's fill CSE would share)
    go to a later round of roles and tiles."""
    places = places_of(rec.trial.operation, [p.c.op for p in batch])
    folds = batch[0].folds

    def pack_body(root):
        for i, (p, h) in enumerate(zip(batch, at_places(root, places))):
            p.pack(h, i)
        func = match(root, "func.func")
        if folds or any(p.amx_padded for p in batch):  # (the padded product's slice of C too)
            apply_patterns(func, structured.ApplyFoldIntoPackAndUnpackPatternsOp)
        # no CSE yet: the members' equal packs and fills stay apart for their own tiles
        apply_patterns(func, transform.ApplyCanonicalizationPatternsOp)

    rec.step("pack", pack_body)
    pending = list(range(len(batch)))
    while pending:
        kernels = _packed_kernels(rec.trial)
        wave, later, taken = [], [], set()
        for i in pending:
            ops = [op for op in batch[i].read_packed(kernels[i]) if op is not None]
            if taken.intersection(ops):
                later.append(i)
                continue
            taken.update(ops)
            wave.append(batch[i])
        _roles_and_tiles(rec, wave)
        pending = later


def _packed_kernels(payload: ir.Module) -> dict[int, ir.Operation]:
    """The packed contractions without roles yet, by their index in the batch (_DONE)."""
    return {ir.IntegerAttr(op.attributes[_DONE]).value: op
            for func in func_ops(payload) for op in top_level_linalg_ops(func)
            if _DONE in op.attributes and ROLE not in op.attributes}


def _roles_and_tiles(rec: StepRecorder, wave: list[_Packed]) -> None:
    """The roles step, then the tile step, of the members of `wave` (disjoint ops)."""
    def places_of_members(ops_of):
        return places_of(rec.trial.operation, [op for ops in ops_of for op in ops if op is not None])

    role_ops = [p._ops(None, None) for p in wave]
    role_places = places_of_members(role_ops)

    def roles_body(root):
        for p, h in zip(wave, _member_handles(root, role_ops, role_places)):
            p.roles(h)
        return apply_passes(root, "canonicalize")

    rec.step("roles", roles_body)
    tile_ops = [p.read_roled() for p in wave]
    tile_places = places_of_members(tile_ops)

    def tile_body(root):
        block_loops = []
        for p, h in zip(wave, _member_handles(root, tile_ops, tile_places)):
            block_loops += p.tile(h)
        # One buffer per panel, reused by every block: the packs' destinations become
        # block-sized tensor.empty ops hoisted out of the block loops.
        func = match(root, "func.func")
        apply_patterns(func, ttensor.ApplyFoldTensorEmptyPatternsOp)
        for loop in block_loops:
            transform.ApplyLoopInvariantCodeMotionOp(loop)
        return apply_passes(root, "canonicalize", "cse")

    rec.step("tile", tile_body)
    for p in wave:
        if p.converts:
            _fuse_widening_into_packs(rec, p.converts)


def _member_handles(root: ir.Value, ops_of: list[list], places: list[Place]) -> list[dict[int, ir.Value]]:
    """Handles to each member's ops (`places`, in order, of those not None), by the op's
    index in its list."""
    handles = iter(at_places(root, places))
    return [{i: next(handles) for i, op in enumerate(ops) if op is not None} for ops in ops_of]


def _split_parallel_dims_for_threads(params: MatmulParams, c: Contraction, roles: list[str],
                                     reduced: set[int]) -> MatmulParams:
    """The forall of a reduced product splits only the m or n dim it keeps: its tile is
    shrunk (to a multiple of the register tile) until every thread gets a tile."""
    mr, nr = params.register
    b, m, n, _ = c.shape
    kept = "m" if "m" not in {roles[d] for d in reduced} else "n"
    extent, tile, unit = (m, params.tile_m, mr) if kept == "m" else (n, params.tile_n, nr)
    if b * -(-extent // tile) >= params.threads:
        return params
    tile = _round_up(-(-extent // -(-params.threads // b)), unit)
    if kept == "m":
        return dataclasses.replace(params, tile_m=tile, block_m=min(params.block_m, tile))
    return dataclasses.replace(params, tile_n=tile)


def _fuse_widening_into_packs(rec: StepRecorder, converts: dict[str, ir.Operation]) -> None:
    """Each pack slice widens its own source slice: the extension is fused, level by level
    (the forall, the k block loop, for A the row block loop, the packing loop), down to
    the tiled pack, so 16-bit data is read once and written packed as f32."""
    present = set()

    def visit(op):
        names = [a if isinstance(a, str) else a.name for a in op.attributes]
        present.update(n for n in names if n.startswith(_WIDEN))
        return ir.WalkResult.ADVANCE

    rec.trial.operation.walk(visit)
    # the loops around a reduced product's forall level (its threads' forall, then the loops
    # over the reduced dims but the last, `outer2`, `outer1`), outermost first
    outer = sorted((n[len(_WIDEN) + 1:] for n in present if n.startswith(f"{_WIDEN}_outer")),
                   key=lambda n: -int(n[len("outer"):]))
    levels = {"b": outer + ["forall", "k"], "a": outer + ["forall", "k", "m"]}
    # a packing loop of one iteration (a panel of one slice: tiny shapes) is folded away;
    # then the widening stays at the outer levels
    in_loop = {name: _marked_op_in_for(rec.trial, f"{_WIDEN}_{name}_pack") for name in converts}
    places = [place_of(rec.trial.operation, op) for op in converts.values()]

    def marked(root, name):
        return structured.MatchOp(any_op(), root, op_attrs={f"{_WIDEN}_{name}": ir.UnitAttr.get()}).result

    def body(root):
        widens = [at_place(root, place) for place in places]
        for widen, name in zip(widens, converts):
            for level in levels[name]:
                if f"{_WIDEN}_{level}" in present:
                    widen, _ = _fuse_into(widen, marked(root, level))
            if not in_loop[name]:
                continue
            loop = transform.GetParentOp(any_op(), marked(root, f"{name}_pack"), op_name="scf.for",
                                         deduplicate=True).result
            _fuse_into(widen, loop)
        canonicalize(match(root, "func.func"))
        for name in converts:
            if f"{_WIDEN}_{name}_pack" in present:
                version_full_tiles(marked(root, f"{name}_pack"))
        for attr in sorted(present):
            remove_annotation(root, attr)

    rec.step("fuse_widening", body)


def _marked_op_in_for(payload: ir.Module, attr: str) -> bool:
    """Does every op carrying the unit attribute `attr` sit inside an scf.for?"""
    found = []

    def visit(op):
        if attr in op.attributes:
            parent = op.parent
            while parent is not None and parent.name not in ("scf.for", "func.func"):
                parent = parent.parent
            found.append(parent is not None and parent.name == "scf.for")
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return bool(found) and all(found)


def _schedule_unpacked(rec: StepRecorder, c: Contraction, params: MatmulParams) -> None:
    """pack=False: tiles read A and B in place; edge tiles are masked at vectorization."""
    mr, nr = params.register
    nb = len(c.batch)
    epilogue = find_epilogue(c.op.results[0])
    init = defining_op(c.op.operands[2])
    rank = len(c.ranges)
    # A fill shared with another contraction (CSE merges equal fills) stays whole for it:
    # fusing would leave the original behind with this tile's role.
    if not (init is not None and init.name == "linalg.fill" and _single_use(init.results[0]) is not None):
        init = None
    places = _places(rec, [epilogue, c.op, init])

    def body(root):
        h = {i: at_place(root, place) for i, place in places.items()}
        mm = h[1]
        _set_role(mm, "register", _sizes(rank, batch=(c.batch, 1), m=(c.m, mr), n=(c.n, nr), k=(c.k, 1)))
        annotate(mm, _DONE)
        if init is not None:
            _set_role(h[2], "fill_tile", [1] * nb + [mr, nr])
        if epilogue is not None:
            _set_role(h[0], "epilogue", [1] * nb + [mr, nr])
        root_op = h[0] if epilogue is not None else mm
        if epilogue is not None:
            t = structured.TileUsingForallOp(root_op, tile_sizes=[1] * nb + [params.tile_m, params.tile_n])
            forall = t.forall_op
            mm, forall = _fuse_into(mm, forall)
        else:
            sizes = _sizes(rank, batch=(c.batch, 1), m=(c.m, params.tile_m), n=(c.n, params.tile_n))
            t = structured.TileUsingForallOp(root_op, tile_sizes=sizes)
            forall, mm = t.forall_op, t.tiled_op
        fill_h = None
        if init is not None:
            fill_h, forall = _fuse_into(h[2], forall)
            _tile(fill_h, [1] * nb + [mr, nr])
        if epilogue is not None:
            _tile(t.tiled_op, [1] * nb + [mr, nr])
        mm, _ = _tile(mm, _sizes(rank, k=(c.k, params.tile_k)))
        mm, _ = _tile(mm, _sizes(rank, batch=(c.batch, 1), m=(c.m, mr), n=(c.n, nr)))
        _tile(mm, _sizes(rank, k=(c.k, 1)))
        canonicalize(match(root, "func.func"))

    rec.step("tile_in_place", body)


def _schedule_others(rec: StepRecorder, params: GenericParams, scheduled: tuple = ()) -> None:
    """Linalg ops outside the contractions' tiles (and those of ops with an attribute in
    `scheduled`, another schedule's): tiled for threads like the generic schedule."""
    for func in list(func_ops(rec.trial)):
        while True:
            # the last op with parallel tiles (one without stays sequential, as it is); the
            # ops are scanned from the end, not all sized per step (quadratic in a model)
            root = next(((op, sizes) for op in reversed(top_level_linalg_ops(func))
                         if ROLE not in op.attributes
                         and not any(a in op.attributes for a in scheduled)
                         and (sizes := parallel_tile_sizes(op, params)) is not None), None)
            if root is None:
                break
            if _reaches_a_reshaped_loop(root[0]):
                chain = [root[0]] + _fused_producers(root[0])
                rec.step("tile_other", _tile_chain(places_of(rec.trial.operation, chain), root[1]))
            else:
                rec.step("tile_other", _tile_other(place_of(rec.trial.operation, root[0]), root[1]))


_RESHAPES = ("tensor.expand_shape", "tensor.collapse_shape")
_LOOPS = ("scf.forall", "scf.for")


def _reaches_a_reshaped_loop(root: ir.Operation) -> bool:
    """Does `root` read, through linalg ops without a role and reshapes, a reshape of a
    loop's result (a scheduled contraction's scf.forall, or its scf.for once a forall of one
    tile folded away)? structured.fuse follows such a path into the loop and everything
    before it: tiling a model's last layer norm by batch rows recomputed every layer per row
    (a SwinMLP's fuse stage grew its payload tenfold in one step; a ViT's layer norm after a
    single-tile linear layer, fivefold, and its compile took over 15 minutes)."""
    seen, work = set(), [root]
    while work:
        op = work.pop()
        for value in op.operands:
            producer = defining_op(value)
            if producer is None or producer in seen:
                continue
            seen.add(producer)
            if producer.name in _RESHAPES:
                source = defining_op(producer.operands[0])
                if source is not None and source.name in _LOOPS:
                    return True
                work.append(producer)
            elif is_linalg_op(producer) and ROLE not in producer.attributes:
                work.append(producer)
    return False


def _fused_producers(root: ir.Operation) -> list[ir.Operation]:
    """The linalg ops of `root`'s block without a role that its tiles compute: its
    producers, and theirs, that only ops of this chain read (no result computed twice) and
    that initialize their result from a value no op of the chain writes into (a shared
    tensor.empty; fused, their tiles would be written in place of each other's),
    consumers before producers; not through a reshape or a loop."""
    block = root.parent.regions[0].blocks[0]
    position = {op.operation: i for i, op in enumerate(block.operations)}
    inits = set(list(root.operands)[loop_structure(root).num_inputs:])
    chain, found, work = {root}, [], [root]
    while work:
        op = work.pop(0)
        for value in op.operands:
            producer = defining_op(value)
            if (producer is None or producer in chain or producer not in position
                    or not is_linalg_op(producer) or ROLE in producer.attributes
                    or _DONE in producer.attributes):
                continue
            outs = list(producer.operands)[loop_structure(producer).num_inputs:]
            if any(v in inits for v in outs):
                continue
            if all(user in chain for result in producer.results for user in users(result)):
                chain.add(producer)
                inits.update(outs)
                found.append(producer)
                work.append(producer)
    return sorted(found, key=lambda op: -position[op])


def _tile_other(place: Place, sizes: list[int]):
    def body(root: ir.Value) -> None:
        structured.FuseOp(at_place(root, place), tile_sizes=sizes, use_forall=True,
                          apply_cleanup=True)

    return body


def _tile_chain(places: list[Place], sizes: list[int]):
    """The op at places[0] tiled into an scf.forall of `sizes`, the ops at the others
    (`_fused_producers`) fused into it in turn."""
    def body(root: ir.Value) -> None:
        handles = at_places(root, places)
        forall = structured.TileUsingForallOp(handles[0], tile_sizes=sizes).forall_op
        for producer in handles[1:]:
            _, forall = _fuse_into(producer, forall)
        canonicalize(match(root, "func.func"))

    return body


def _places(rec: StepRecorder, ops: list) -> dict[int, Place]:
    """The places (schedules.common.place_of) of the ops that are not None, by index."""
    return {i: place_of(rec.trial.operation, op) for i, op in enumerate(ops) if op is not None}


def _normalize(root: ir.Value) -> ir.Value:
    """Assertions split out, unused results dropped, unit dims folded, reshapes propagated
    (never into a contraction's reduction loops: the flatten before a linear layer stays a reshape of its
    input, and the weight's transpose folds into its packing) and elementwise ops fused into
    elementwise consumers (a contraction's reduction loops that an expansion split
    nonetheless collapsed back, and its parallel ones, a linear layer over [B, S, D]). Never into a contraction: upstream's
    linalg-fuse-elementwise-ops would fuse a layer norm or the GELU of the layer before
    into the contraction reading it (once its reshapes made it a generic), its body
    recomputed for every output column and no contraction left for this schedule."""
    split_assertions(root)
    # the i64 argmax torch-mlir's max.dim computes beside a row max (amax, softmax,
    # logsumexp) that nothing reads: it kept the max from vectorizing (a scalar loop)
    drop_unused_results(match(root, "func.func"))
    root = apply_passes(root, "linalg-fold-unit-extent-dims", "canonicalize", "cse")
    fold_reshape_ops_by_expansion(match(root, "func.func"), keep_reduction_loops=True)
    fuse_elementwise_producers(match(root, "func.func"))
    collapse_reduction_dims(match(root, "func.func"))
    collapse_contraction_parallel_dims(match(root, "func.func"))
    fold_result_transposes_into_contractions(match(root, "func.func"))
    return apply_passes(root, "linalg-fold-unit-extent-dims", "canonicalize", "cse")


def _named_ops_with_unit_dims(payload: ir.Module) -> tuple[list[ir.Operation], list[ir.Operation]]:
    """The linalg.transpose ops with a unit dim that permute their other dims and the 2-D
    poolings over a unit height (a 1-D pooling of `y.unsqueeze(1)`). Reshape propagation (linalg-fuse-elementwise-ops)
    expands a linear layer's W^T along with its product when the product is reshaped
    (before such a pooling: W^T [K, 1, 1, N] from W [1, 1, N, K]), and
    linalg-fold-unit-extent-dims only folds generics: such a transpose would stay behind a
    collapse_shape, which no pack folds it through, and the pooling behind an expand_shape
    of the product."""
    transposes, poolings = [], []

    def visit(op):
        if op.name == "linalg.transpose" and _moves_unit_and_other_dims(op):
            transposes.append(op)
        elif op.name in POOLING_2D and op.operands[0].type.shape[2] == 1 \
                and op.operands[1].type.shape[0] == 1:
            poolings.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return transposes, poolings


def _moves_unit_and_other_dims(transpose: ir.Operation) -> bool:
    """Does the linalg.transpose have a unit dim and still permute its other dims without
    them (not a copy then: its generic form keeps a permutation when unit dims fold)?"""
    shape = list(transpose.operands[0].type.shape)
    perm = list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"]))
    others = [d for d in perm if shape[d] != 1]
    return 1 in shape and others != sorted(others)


def _fold_unit_dims_of_named_ops(transposes: list[Place], poolings: list[Place]):
    """The transposes and poolings at these places without their unit dims: generalized,
    unit dims folded (reshapes around the op, which fold into the reshapes already there),
    the transposes linalg.transpose again (so that the packing of the operand they feed
    folds them in), the poolings generics reading the product in windows
    (`find_window_pooling`)."""
    def body(root):
        func = match(root, "func.func")
        handles = [at_place(root, place) for place in transposes + poolings]
        generics = [structured.GeneralizeOp(h).transformed for h in handles]
        apply_patterns(func, structured.ApplyFoldUnitExtentDimsViaReshapesPatternsOp,
                       transform.ApplyCanonicalizationPatternsOp)
        for generic in generics[: len(transposes)]:
            structured.SpecializeOp(any_op(), generic)
        return apply_passes(root, "canonicalize", "cse")

    return body


def _reads_widened_bf16(op: ir.Operation) -> bool:
    """Does contraction `op` read both operands as f32 widenings (arith.extf generics) of bf16
    tensors, as torch-mlir imports a bf16 linear layer (A and W^T widened to f32 copies)?"""
    for value in list(op.operands)[:2]:
        producer = defining_op(value)
        if producer is None or producer.name != "linalg.generic" or len(producer.operands) != 2 \
                or not isinstance(producer.operands[0].type.element_type, ir.BF16Type):
            return False
        body = [o.operation.name for o in producer.regions[0].blocks[0].operations]
        if body != ["arith.extf", "linalg.yield"]:
            return False
    return True


def _fold_widenings(places: list[Place]):
    """The contractions at `places` generalized, reading their bf16 operands in place
    (transform_ext.fold_casts_into_contractions: the widenings, and a transpose before one,
    folded into the contraction's body and maps), so that they pack bf16 pairs."""
    def body(root):
        # every handle taken first: generalizing one changes the places of the others
        for handle in [at_place(root, place) for place in places]:
            fold_casts_into_contractions(structured.GeneralizeOp(handle).transformed)
        return apply_passes(root, "canonicalize", "cse")

    return body


def _has_short_products(payload: ir.Module, generic: GenericParams) -> bool:
    """Does `payload` hold a mat-vec or a product of at most generic.short_rows rows on one
    side that `_split_short_products` rewrites?"""
    return any(split_plan(op, generic.vector_tile, generic.short_rows, generic.lanes)
               or foldable_inputs(op, generic.short_rows)
               for func in func_ops(payload) for op in top_level_linalg_ops(func))


def _short_widened_products(payload: ir.Module, generic: GenericParams) -> list[ir.Operation]:
    """The top-level contractions reading an f32 widening of a bf16 tensor (`is_widening`)
    with at most generic.short_rows rows on one side (a bf16 linear layer over a small
    batch, or one row: its W^T widened): split by `_split_short_products` once their
    widenings are folded (a one-row x widened behind a reshape stays an f32 copy)."""
    found = []
    for func in func_ops(payload):
        for op in top_level_linalg_ops(func):
            ls = loop_structure(op)
            if ls.is_contraction and ls.is_static and ls.fewest_rows() <= generic.short_rows \
                    and any(_widened_from_bf16(v) for v in list(op.operands)[:ls.num_inputs]):
                found.append(op)
    return found


def _widened_from_bf16(value: ir.Value) -> bool:
    producer = defining_op(value)
    return is_widening(producer) and isinstance(producer.operands[0].type.element_type,
                                                ir.BF16Type)


def _split_short_products(generic: GenericParams):
    """Mat-vecs and short products (x @ W^T for a small batch) read their transposed
    operands in place and get their k split into lanes, as in the generic schedule
    (schedules.generic.split_short_products): W is read once, in place, not packed."""
    def body(root):
        fold_transposes_into_matvecs(match(root, "func.func"), generic.short_rows)
        split_short_products(root, generic)
        return apply_passes(root, "canonicalize", "cse")

    return body


def _outline_chunks(root: ir.Value) -> None:
    outline_contraction_chunks(match(root, "func.func"), CHUNK_CONTRACTIONS)


@dataclass(frozen=True)
class MatmulPlan:
    """The script's steps as recorded on a trial of the payload (schedules.script
    StepRecorder); None when elementwise fusion left no contraction (the generic script)."""

    fuse: tuple | None
    vectorize: object | None


def schedule_contractions(rec: StepRecorder, params_for) -> None:
    """Steps 1-4 of the module docstring for every contraction of `rec.trial` this schedule
    takes (`find_contractions`), last first (the packed ones in batches, `_packed_batch`);
    `params_for(batch, m, n, k)` gives each one's MatmulParams."""
    while True:
        found = find_contractions(rec.trial)
        if not found:
            return
        c = found[-1]
        params = contraction_params(c, params_for(*c.shape))
        if params.pack:
            _schedule_packed(rec, _packed_batch(found, params_for))
        else:
            _schedule_unpacked(rec, c, params)


def without_bf16_pairs(params_for):
    """`params_for` (a contraction's (batch, m, n, k) -> MatmulParams) with f32 kernels only:
    for the convolution family's @vectorize, which packs no bf16 pairs."""
    def f32_kernels(*shape):
        return dataclasses.replace(params_for(*shape), bf16_dot=False)

    return f32_kernels


def plan_matmul(payload: ir.Module, params_for, generic: GenericParams,
                convolution_params=None) -> MatmulPlan:
    """The fuse stage on a copy of `payload` (after cleanup; read, not rewritten), one
    recorded step at a time, then the vectorize stage's body from what it left.
    `params_for(batch, m, n, k)` gives each contraction's MatmulParams. With
    `convolution_params` (schedules.convolution's ConvolutionParams), the convolutions
    beside the contractions (a SwinMLP's token-mixing Conv1d) get the convolution family's
    schedule and @vectorize (whose contractions are f32 kernels: no bf16 pairs), else the
    generic one's."""
    from . import convolution

    transform_ext.load(payload.context)
    rec = StepRecorder(ir.Module.parse(str(payload), payload.context))
    rec.step("normalize", _normalize)
    widened = _short_widened_products(rec.trial, generic)
    if widened:  # read in bf16 by the split below, W in place, widened per vector
        rec.step("fold_short_product_widenings", _fold_widenings(
            [place_of(rec.trial.operation, op) for op in widened]))
    split = _has_short_products(rec.trial, generic)
    if split:
        rec.step("split_short_products", _split_short_products(generic))
    convolutions = convolution_params is not None and bool(convolution.find_convolutions(rec.trial))
    if convolutions:
        params_for = without_bf16_pairs(params_for)
    transposes, poolings = _named_ops_with_unit_dims(rec.trial)
    if transposes or poolings:
        rec.step("fold_unit_dims", _fold_unit_dims_of_named_ops(
            *([place_of(rec.trial.operation, op) for op in ops] for ops in (transposes, poolings))))
    widened = [c.op for c in find_contractions(rec.trial)
               if params_for(*c.shape).bf16_dot and _reads_widened_bf16(c.op)]
    if widened:
        rec.step("fold_bf16_widenings", _fold_widenings(
            [place_of(rec.trial.operation, op) for op in widened]))
    found = find_contractions(rec.trial)
    if not found and not split:
        # Elementwise fusion merged every contraction with other work (e.g. attention's
        # scaling): nothing left for this schedule. (Split short products stay here: the
        # generic script, from the start, would propagate the reshapes before them into
        # their k, which it then does not split: a flatten before a linear layer.)
        return MatmulPlan(None, None)
    # A long payload (a recurrent model unrolled over time) is scheduled in functions of
    # CHUNK_CONTRACTIONS contractions (transform_ext.outline_contraction_chunks: some
    # upstream transforms cost the size of their function per call), inlined back after.
    chunked = len(found) > CHUNK_CONTRACTIONS
    if chunked:
        rec.step("outline_chunks", _outline_chunks)
    schedule_contractions(rec, params_for)
    if convolutions:
        convolutions = convolution.schedule_convolutions(rec, convolution_params)
    _schedule_others(rec, generic, convolution.SCHEDULED if convolutions else ())
    rec.step("canonicalize", lambda root: apply_passes(
        root, *(["inline"] if chunked else []), "canonicalize", "cse"))
    vectorize = convolution.vectorize_body if convolutions else _vectorize_body
    return MatmulPlan(tuple(rec.steps), vectorize(rec.trial, generic))


def matmul_script(plan: MatmulPlan, generic: GenericParams) -> ir.Module:
    """@fuse (the recorded steps in order) and @vectorize; the generic script when the plan
    has no contraction. Needs an active context and location."""
    if plan.fuse is None:
        return generic_script(generic)
    return recorded_script(plan.fuse, plan.vectorize)


# ----------------------------------------------------------------------------- vectorize

def _vector_plan(payload: ir.Module):
    """(role op, vector sizes or None) for every op the fuse stage gave a role, and the
    remaining linalg ops with the generic schedule's vector tiles."""
    plan, others = [], []

    def visit(op):
        if is_linalg_op(op):
            if ROLE in op.attributes:
                sizes = op.attributes[VECTOR_SIZES] if VECTOR_SIZES in op.attributes else None
                plan.append((op, list(sizes) if sizes is not None else None))
            else:
                others.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return plan, others


def role_vector_plan(payload: ir.Module) -> list[tuple[ir.Operation, str, list[int] | None]]:
    """(op, role, vector sizes or None) of every op the fuse stage gave a role."""
    plan, _ = _vector_plan(payload)
    return [(op, ir.StringAttr(op.attributes[ROLE]).value, sizes) for op, sizes in plan]


def vectorize_roles(handles, roles: list[str], sizes: list[list[int] | None]) -> None:
    """Vectorize the ops with a role (`handles`): each at its nominal tile (edge tiles
    masked), the kernel and the fills at their static shapes."""
    for h, role, vector_sizes in zip(handles, roles, sizes):
        if role in ("pooling", "amx_kernel"):
            # a pooling's windowed read has no vector form: loops over a register tile; a
            # kernel on AMX tiles is left for the target
            continue
        if role in ("kernel", "fill") or vector_sizes is None:
            structured.VectorizeOp(h)
        elif role == "register":
            # The register tile's nominal sizes are the tiling sizes; edges are masked.
            structured.VectorizeOp(h, vector_sizes=[s or 1 for s in vector_sizes])
        else:
            structured.VectorizeOp(h, vector_sizes=vector_sizes)


K_STEPS_UNROLL = 4  # steps over k per iteration of a register tile's k loop


def unroll_k_steps(root) -> None:
    """The register tiles' loops over k (marked by the fuse stage, their accumulators
    hoisted into iter_args) unrolled by K_STEPS_UNROLL: a loop's increment, compare and
    branch then come once per four steps of multiply-adds (2-3% on 1024^3 f32 here)."""
    loops = structured.MatchOp(any_op(), root, op_attrs={_K_STEPS: ir.UnitAttr.get()}).result
    tloop.LoopUnrollOp(loops, factor=K_STEPS_UNROLL)


def lower_transposes(func, strategy: str) -> None:
    """The vector transposes of `func` (the packs') lowered with `strategy`
    (a tvec.VectorTransposeLowering name), then canonicalized."""
    apply_patterns(func, lambda: tvec.ApplyLowerTransposePatternsOp(
        lowering_strategy=getattr(tvec.VectorTransposeLowering, strategy)))
    canonicalize(func)


def _vectorize_body(payload: ir.Module, generic: GenericParams):
    """The vectorize stage (see the module docstring) for `payload` as the fuse stage left
    it: each op with a role vectorized at its vector sizes, the others tiled and vectorized
    as the generic schedule does (the generic stage when no op has a role). The f32 packs'
    transposes stay vector.transpose ops: the CPU target lowers every 2-D transpose in
    16 x 16 blocks of register shuffles (lighthouse.targets.transpose_blocks; lowered here,
    B's [NR, pack_k] = [32, 16] one from a k-contiguous B, W^T of x @ W^T, took 32
    registers in and 32 out, spilled, and made its pack a third of the product's time)."""
    plan, others = _vector_plan(payload)
    if not plan:  # no contraction was scheduled here: the payload went the generic way
        return generic_vectorize_stage(generic)
    # the other ops vectorized without bf16 dot products: a k step of 1
    policy = VectorPolicy(generic.vector_tile, generic.register_tile)
    tiles = [(op, vector_tile_sizes(op, policy)) for op in others]
    roles = [ir.StringAttr(op.attributes[ROLE]).value for op, _ in plan]
    pairs = any(role in ("kernel", "amx_kernel") and all(isinstance(v.type.element_type, ir.BF16Type)
                                         for v in op.operands[:2])
                for (op, _), role in zip(plan, roles))
    places = places_of(payload.operation, [op for op, _ in plan + tiles])
    orders = [reductions_innermost(loop_structure(op)) for op, _ in tiles]
    ranges = [loop_structure(op).ranges for op, _ in tiles]

    def body(root):
        handles = at_places(root, places)
        n = len(plan)
        vectorize_roles(handles[:n], roles, [sizes for _, sizes in plan])
        # like the generic schedule: tiled (partial tiles peeled), vectorized below
        for h, (_, sizes), order, extents in zip(handles[n:], tiles, orders, ranges):
            tile_to_vector_tile(h, sizes, order, extents, _OTHER)
        func = match(root, "func.func")

        def to_contractions():
            apply_patterns(func, tvec.ApplyLowerMaskedTransfersPatternsOp)
            apply_patterns(func, tvec.ApplyTransferPermutationPatternsOp)
            if pairs:  # the bf16 extensions before the broadcasts, then into the contraction
                apply_patterns(func, tvec.ApplySinkVectorPatternsOp)
            apply_patterns(func, tvec.ApplyVectorReductionToContractPatternsOp)
            if pairs:
                apply_patterns(func, tvec.ApplyFoldArithExtensionPatternsOp)
            canonicalize(func)

        to_contractions()
        # the other ops once the peeled tiles' sizes are constants (an op the vectorizer
        # cannot take stays a correct loop nest)
        vectorize_marked(func, _OTHER)
        to_contractions()
        # a masked edge tile of C unpacked for a reduction is read back in registers
        forward_masked_writes(func)
        apply_patterns(func, tvec.ApplyCastAwayVectorLeadingOneDimPatternsOp, apply_cse=True)
        canonicalize(func)
        hoist_loop_invariant_subsets(func)
        canonicalize(func)
        lane_contracts_to_fmas(func)
        unroll_k_steps(root)
        if pairs:  # A's [MR, k pairs, 2] -> [k pairs, MR, 2] as a 2-D transpose of words
            transpose_pairs_as_words(func)
            lower_transposes(func, "Shuffle1D")
            contracts_to_bf16_dot_products(func)
            flatten_contiguous_writes(func)
        canonicalize(func)
        for attr in ANNOTATIONS + (_OTHER,):
            remove_annotation(root, attr)

    return body
