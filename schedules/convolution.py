"""The convolution family: payloads dominated by convolutions (1-D, 2-D, 3-D; strided,
padded, dilated, grouped, depthwise, pointwise, transposed) on the CPU.

Math, per convolution (transform_ext.analysis.convolution names the dims):
    Y[b, g, f, o] = I[b, g, f, o] + sum_{c, k} X[b, g, c, o s + k t] W[g, f, c, k]
with I the accumulator's producer (zeros, or the bias broadcast), optionally followed by an
elementwise epilogue E (ReLU, a residual add, ...). A direct convolution on the matmul
family's register tile: the output's rows (output channels f, or the groups g of a
depthwise convolution) times its lanes (the innermost image dim o_w, contiguous in X and
Y), each step of the reduction an outer product of MR filter values (broadcast) and NR
image values (a vector load of X at o_w s + k t):
    acc[f0 : f0 + MR, o_w0 : o_w0 + NR] += W[f, c, k] (x) X[c, o_w0 s + k t : + NR s : s]
No im2col buffer: the register tile reads X where it is. When the innermost image dim is
narrow (its last vector mostly masked: `wants_channel_lanes`) and the output channels fill
whole vectors, the lanes run along the output channels instead, the rows along o_w:
    acc[o_w0 : o_w0 + MR, f0 : f0 + NR] += X[c, o_w0 + k t : + MR] (x) W_t[c, k, f0 : f0 + NR]
with the filter and the result in channels-last form (transform_ext.
move_output_channels_innermost; each register tile of the result transposed back in the
convolution's output tiles, as an epilogue).

Preconditions: static shapes; f32, f16 or bf16 (16-bit operands extended in the body, f32
accumulation as torch-mlir imports them); the lanes dim is the innermost dim of X and Y
(or, channels innermost, an output channel dim innermost in W and Y).
A transposed convolution (torch-mlir imports it as a convolution over the input stuffed
with zeros, s - 1 between neighbours) is first split into s^d convolutions over the input
itself, one per phase of the output (transform_ext.split_transposed_convolution), so no
multiply reads a stuffed zero.

fuse (the script's @fuse: steps recorded on a trial copy by `plan_convolution`):
  1. normalize: assertions split out, elementwise ops fused (the epilogue becomes one
     generic), stuffed convolutions split into phases, convolutions and the bias
     broadcast generalized to linalg.generic; the convolutions that take the output
     channels as lanes rewritten with them innermost;
  2. per convolution, last first: the epilogue (or the convolution) is tiled into an
     `scf.forall` over (batch, group, a block of tile_rows output channels, blocks of the
     outer image dims) with the convolution and its accumulator producer fused in (with
     the output channels as lanes, blocks of NR channels over the whole batch where they
     are enough tiles and their output fits tile_bytes, `_batch_in_lane_tiles`: the
     filter read once for all images; the image then padded once, before); inside,
     register tiles (outer image dims by 1, the lanes by NR, the rows by MR or by a
     divisor of their extent from MR / 2 up (`register_rows`), rows innermost so that the
     image rows a tile reads stay in L1 across the row tiles; a partial last tile of the
     rows, then of the lanes, peeled into a static tile of its own); the
     accumulator producer computed per register tile
     (transform_ext.fuse_init_into_register_tile); the input channels and the window by
     1 (loops c, k_1 .. k_d innermost; the taps of an outer image dim clamped to those
     reading the unpadded image, transform_ext.clamp_window_loops); the tile, now of a
     window of one element, rebuilt as a contraction
     (transform_ext.convolution_to_contraction); the epilogue tiled to register tiles
     after the convolution's. A pooling over image dims after it (`find_pooling`) is the
     root instead: its forall splits the kept dims, a loop inside walks the reduced outer
     image dims, the convolution fused into that loop, the pooling reduced register tile
     by register tile;
  3. the contractions beside the convolutions (a CNN's linear layers) get the matmul
     family's schedule (schedules.matmul.schedule_contractions; a flatten folded into one
     by the elementwise fusion collapsed back, transform_ext.collapse_reduction_dims);
  4. any other linalg op is tiled for threads as the generic schedule does, the reductions
     among them first prepared as its @fuse prepares them (`_prepare_reductions`: the
     reshapes they read folded into them, the elementwise producers only they read
     computed in their bodies, sums over one tensor merged).
vectorize (@vectorize): every op of step 2 vectorized at its register tile (edge tiles
masked), the contraction lowered by the target to MR x NR/lanes FMAs per step, the
accumulator hoisted into registers across the reduction loops (a masked tile's start read
back in registers, transform_ext.forward_masked_writes, not through a buffer per tile); with
the image lanes, a register tile's innermost tap loop of at most TAPS_UNROLL_MAX taps
unrolled whole (`tap_unroll`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import linalg, transform
from torch_mlir.dialects.transform import loop, structured
from torch_mlir.dialects.transform import tensor as ttensor
from torch_mlir.dialects.transform import vector as tvec

import transform_ext
from transform_ext.analysis.maps import Const, terms
from transform_ext.analysis.convolution import ConvolutionDims, NotConvolution, convolution_dims
from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.analysis.tiles import VectorPolicy
from transform_ext.clamp_window_loops import clamp_window_loops
from transform_ext.clone_shared_fills import clone_shared_fills
from transform_ext.collapse_reduction_dims import collapse_reduction_dims
from transform_ext.convolution_to_contraction import convolution_to_contraction
from transform_ext.drop_contraction_masks import drop_contraction_masks
from transform_ext.common import Illegal, defining_op, walk_ops
from transform_ext.drop_overwritten_fills import drop_overwritten_fills
from transform_ext.fill_slices_of_fills import fill_slices_of_fills
from transform_ext.forward_masked_writes import forward_masked_writes
from transform_ext.move_output_channels_innermost import move_output_channels_innermost
from transform_ext.pad_image_rows import filled_insert, pad_image_rows
from transform_ext.drop_unit_result_dims import drop_unit_result_dims
from transform_ext.filter_ops import matches as filter_matches
from transform_ext.fold_reshape_ops_by_expansion import (CannotFold, fold_reshape_ops_by_expansion,
                                                         plan_fold)
from transform_ext.fuse_init_into_register_tile import fuse_init_into_register_tile
from transform_ext.inline_elementwise_producers import inline_elementwise_producers
from transform_ext.merge_sibling_reductions import merge_sibling_reductions, sibling_groups
from transform_ext.lane_contracts_to_fmas import lane_contracts_to_fmas
from transform_ext.split_transposed_convolution import analyze as analyze_stuffed
from transform_ext.split_strided_convolution import analyze as analyze_strided
from transform_ext.split_strided_convolution import split_strided_convolution
from transform_ext.split_transposed_convolution import split_transposed_convolution
from transform_ext.remove_annotation import remove_annotation
from transform_ext.split_assertions import split_assertions
from transform_ext.tile_to_vector_tiles import reductions_innermost

from .common import (annotate, any_op, apply_passes, apply_patterns, at_place, at_places,
                     canonicalize, foreach, hoist_loop_invariant_subsets, match, peel_loop,
                     place_of, places_of, suppressed, tile_to_vector_tile, vectorize_marked,
                     vectorize_or_leave)
from .generic import (GenericParams, func_ops, generic_script, parallel_tile_sizes,
                      register_tile_for, top_level_linalg_ops, vector_tile_sizes)
from .generic import vectorize_stage as generic_vectorize_stage
from . import matmul
from .matmul import find_epilogue, reducing_reader
from .script import StepRecorder, recorded_script

ROLE = "lh.cv_role"            # string attribute: the part of the schedule an op plays
VECTOR_SIZES = "lh.cv_vector"  # i64 array: vector sizes of the op's nominal tile
LANES = "lh.cv_lanes"          # i64: the loop dim of the register tile's lanes
_DONE = "lh.cv_done"           # a convolution already scheduled
_TILE = "lh.cv_tile"           # the register tiles of the convolution being scheduled
_TAPS = "lh.cv_taps"           # i64: a register tile's innermost tap loop, unrolled by this
_OTHER = "lh.cv_other"         # an op outside the convolutions' tiles, vectorized with gathers

FLOAT_TYPES = ("f32", "f16", "bf16")


class NotApplicable(Exception):
    """The payload is not one this schedule takes; the message is the one-line reason."""


L1_WAY_BYTES = 4096
LINE_BYTES = 64


@dataclass(frozen=True)
class ConvolutionParams:
    """register: (MR, NR) accumulator tile, MR rows (output channels) x NR lanes (the
    innermost image dim), NR a multiple of the f32 vector width. tile_rows: output channels
    of one forall tile at most (a multiple of MR). threads: the forall tiles are sized so
    that every thread gets work (at least tiles_per_thread tiles each, when the shape
    allows). block_bytes: when the image rows and filter values one register tile reads
    over all input channels exceed it, the channels are split into blocks that fit (a loop
    over the blocks around the register tiles, the accumulators reloaded per block);
    tile_bytes: the output of a forall tile of such a convolution, which stays in cache
    across the blocks, is at most this. l1_bytes: the L1 data cache, whose ways span 4 KiB
    each (x86: the page size bounds a way), for `image_row_padding`."""

    register: tuple[int, int] = (8, 32)
    tile_rows: int = 128
    threads: int = 2
    tiles_per_thread: int = 4
    block_bytes: int = 24 << 10
    tile_bytes: int = 256 << 10
    l1_bytes: int = 48 << 10

    def __post_init__(self):
        mr, nr = self.register
        if mr < 1 or nr < 1:
            raise ValueError(f"register tile must be positive, got {self.register}")
        if self.tile_rows < mr or self.tile_rows % mr:
            raise ValueError(f"tile_rows={self.tile_rows} must be a positive multiple of {mr}")
        if self.threads < 1 or self.tiles_per_thread < 1:
            raise ValueError("threads and tiles_per_thread must be >= 1")
        if self.block_bytes < 1 or self.tile_bytes < 1:
            raise ValueError("block_bytes and tile_bytes must be >= 1")
        if self.l1_bytes < L1_WAY_BYTES or self.l1_bytes % L1_WAY_BYTES:
            raise ValueError(f"l1_bytes={self.l1_bytes} must be a positive multiple of {L1_WAY_BYTES}")

    @staticmethod
    def for_cpu(cpu, threads: int) -> "ConvolutionParams":
        """The parameters on a CPU described by `cpu` (lighthouse.targets.description
        CpuDescription): the register tile of its vector registers (register_tile_for);
        channel blocks whose image rows and filter values fill at most half of L1 (all of
        it with the output channels as lanes, `_channel_block`); forall
        tiles of a blocked convolution whose output fills at most a quarter of L2."""
        mr, nr = register_tile_for(cpu.f32_lanes, cpu.vector_registers)
        return ConvolutionParams(register=(mr, nr), tile_rows=16 * mr, threads=threads,
                                 block_bytes=cpu.l1d_bytes // 2, tile_bytes=cpu.l2_bytes // 4,
                                 l1_bytes=cpu.l1d_bytes)


# ----------------------------------------------------------------------------- analysis

def lanes_per_vector(params: ConvolutionParams) -> int:
    """f32 lanes of one vector register: params.register's NR is two vectors."""
    return params.register[1] // 2


@dataclass
class Convolution:
    """A convolution of the payload and how its register tile covers it: `rows`, the loop
    dim along the tile's MR rows (None: one row), `lanes`, the dim along its NR lanes."""

    dims: ConvolutionDims
    rows: int | None
    lanes: int

    @property
    def op(self) -> ir.Operation:
        return self.dims.op

    @property
    def work(self) -> int:
        w = 1
        for r in self.dims.ranges:
            w *= r
        return w


def _element_type_name(value) -> str:
    return str(value.type.element_type)


def analyze_convolution(op: ir.Operation) -> Convolution:
    """The convolution's register tile roles, or NotApplicable with the reason."""
    name = f"{op.name} at {op.location}"
    try:
        dims = convolution_dims(op)
    except NotConvolution as exc:
        raise NotApplicable(f"{name} is not a convolution ({exc})") from None
    for v in list(op.operands) + list(op.results):
        if not isinstance(v.type, ir.RankedTensorType):
            raise NotApplicable(f"{name} has an operand of type {v.type} (wants ranked tensors)")
        if _element_type_name(v) not in FLOAT_TYPES:
            raise NotApplicable(f"{name} has element type {_element_type_name(v)} "
                                f"(wants f32, f16 or bf16)")
    if _element_type_name(op.results[0]) != "f32":
        raise NotApplicable(f"{name} accumulates in {_element_type_name(op.results[0])} "
                            f"(wants f32)")
    ls = loop_structure(op)
    x_map, w_map, y_map = ls.maps[dims.input_index], ls.maps[dims.filter_index], ls.output_map(0)
    last = len(x_map.results) - 1
    if last not in dims.exprs:
        raise NotApplicable(f"{name}: the innermost dim of its image is not an image dim "
                            f"(wants channels-first layouts)")
    inner = dims.exprs[last].image
    y_inner = y_map.results[-1]
    if not isinstance(y_inner, ir.AffineDimExpr):
        raise NotApplicable(f"{name}: its output's innermost dim is not a loop dim")
    lanes = y_inner.position
    if lanes in dims.out_channel and w_map.results[-1] == y_inner:
        # channels innermost (transform_ext.move_output_channels_innermost): the lanes run
        # along the output channels, the rows along the image's innermost dim
        # (the next image dim out when that one is narrow and the other wider: a tail split
        # off by `lane_tail_start`)
        outer = [e.image for i, e in sorted(dims.exprs.items()) if i < last]
        if dims.ranges[inner] < MIN_CHANNEL_ROWS and outer and \
                dims.ranges[outer[-1]] > dims.ranges[inner]:
            return Convolution(dims, outer[-1], lanes)
        return Convolution(dims, inner if dims.ranges[inner] > 1 else None, lanes)
    if lanes != inner:
        raise NotApplicable(f"{name}: its output's innermost dim is not the image's")
    return Convolution(dims, _rows_dim(dims, lanes), lanes)


# Output channels of fewer than this many rows: the register tile's rows run along another
# dim (a depthwise convolution's image rows) so that it holds enough accumulators.
MIN_CHANNEL_ROWS = 4


def _rows_dim(dims: ConvolutionDims, lanes: int) -> int | None:
    """The dim along the register tile's rows: the widest output channel dim (its filter
    values broadcast, the image vector shared by the rows) when it has MIN_CHANNEL_ROWS or
    more; else the image dim outside the lanes, else a batch dim (the filter value shared,
    each row its own image vector); None (one row) when all have extent 1. Never a group
    dim: rows along a dim of both operands would broadcast the filter across the lanes of
    another dim than its own (a transposing broadcast)."""
    wide = [d for d in dims.out_channel if dims.ranges[d] >= MIN_CHANNEL_ROWS]
    if wide:
        return max(wide, key=lambda d: dims.ranges[d])
    outer = [o for o in dims.image if o != lanes and dims.ranges[o] > 1]
    if outer:
        return outer[-1]
    batch = [b for b in dims.batch if dims.ranges[b] > 1]
    return batch[-1] if batch else None


def _convolution_ops(payload: ir.Module) -> list[ir.Operation]:
    """Top-level convolutions not scheduled yet."""
    found = []
    for func in func_ops(payload):
        for op in top_level_linalg_ops(func):
            if _DONE in op.attributes or ROLE in op.attributes:
                continue
            try:
                convolution_dims(op, static=False)
            except NotConvolution:
                continue
            found.append(op)
    return found


def find_convolutions(payload: ir.Module) -> list[Convolution]:
    """The convolutions this schedule takes (others are tiled like the generic schedule)."""
    found = []
    for op in _convolution_ops(payload):
        try:
            found.append(analyze_convolution(op))
        except NotApplicable:
            pass
    return found


def _work(op: ir.Operation) -> int:
    w = 1
    for r in loop_structure(op).ranges:
        w *= r or 1
    return w


def recognize(payload: ir.Module) -> bool:
    """The payload's heavy ops are convolutions: their multiply-adds outnumber the loop
    iterations of all other linalg ops together."""
    convolutions = set(_convolution_ops(payload))
    conv, other = 0, 0
    for func in func_ops(payload):
        for op in top_level_linalg_ops(func):
            if op in convolutions:
                conv += _work(op)
            else:
                other += _work(op)
    return conv > 0 and conv >= other


def check(payload: ir.Module) -> str | None:
    """None when the schedule applies (some convolution fits it), else the reason."""
    reasons = []
    for op in _convolution_ops(payload):
        try:
            analyze_convolution(op)
            return None
        except NotApplicable as exc:
            reasons.append(str(exc))
    return reasons[0] if reasons else "the payload has no convolution"


# ----------------------------------------------------------------------------- tiles

@dataclass(frozen=True)
class ConvolutionTiles:
    """Tile sizes over the convolution's loop dims (0: not tiled). forall: one thread's
    tile; register: MR x NR (1 on the outer image dims) with `interchange` putting the
    rows innermost; reduction: 1 on the input channels and window dims."""

    forall: list[int]
    register: list[int]
    interchange: list[int]
    reduction: list[int]
    vector: list[int]          # the register tile's sizes over the contraction's dims
    output: list[int]          # the register tile over the output's dims
    vector_lanes: int          # the lanes dim among the contraction's dims
    output_lanes: int          # the lanes dim among the output's dims
    peel: int | None           # the lanes loop among the register loops, when its last
                               # tile is partial (peeled: vectorized at fewer lanes)
    peel_rows: int | None      # the rows loop among them, when its last tile is partial
                               # (peeled: vectorized at its rows, no mask per row)
    channel_block: list[int] | None  # the input channel block (None: all channels at once)
    tail: "TailTiles | None" = None  # the lanes past the last whole NR, when split off


# multiply-adds per output element from which an unblocked convolution's last lanes are split
# off into taller tiles (`TailTiles`): its start is then written by a pass of its own (a
# store and a load per element), instead of starting each register tile in registers
TAIL_MIN_TERMS = 64


@dataclass(frozen=True)
class TailTiles:
    """The register tiles of a convolution's last lanes, split off at `start` (the lanes
    past the last whole NR, one vector or less): MR x NR / lanes accumulators of one vector
    each, rows taller than MR (a tile of MR one-vector accumulators waits on the FMA latency);
    sizes as in ConvolutionTiles."""

    lanes_dim: int
    start: int
    register: list[int]
    vector: list[int]
    peel_rows: int | None



def register_rows(extent: int, mr: int) -> int:
    """Rows of the register tile along a dim of `extent`: the largest divisor of the extent
    from MR / 2 up to MR (every tile full: 42 channels take 7 rows, not 8 and a tile of 2),
    else MR (the last tile partial, peeled); the extent when it is under MR."""
    if extent <= mr:
        return extent
    return next((t for t in range(mr, -(-mr // 2) - 1, -1) if extent % t == 0), mr)


def _tile_of(extent: int, unit: int, largest: int) -> int:
    """The largest multiple of `unit` dividing `extent` up to `largest`, else `largest`
    rounded down to `unit` (a partial last tile); the whole extent when it fits."""
    if extent <= largest:
        return extent
    top = max(unit, largest // unit * unit)
    return next((t for t in range(top, 0, -unit) if extent % t == 0), top)


def convolution_tiles(c: Convolution, params: ConvolutionParams) -> ConvolutionTiles:
    """The tiles of convolution `c` (see ConvolutionTiles). forall: 1 on every batch, group
    and output channel dim, except the rows: tile_rows of them (`_tile_of`); the outer image
    dims whole, then split (by divisors, outermost first; the rows dim in multiples of MR)
    until the threads have tiles_per_thread tiles each. register: MR x NR (NR rounded down
    to whole vectors covering the lanes dim when it is narrower), 1 elsewhere. With the
    lanes along the output channels: MR x NR of `channel_lane_tile`."""
    d, ranges = c.dims, c.dims.ranges
    rank = len(ranges)
    rows_extent = ranges[c.rows] if c.rows is not None else 1
    vector_lanes = lanes_per_vector(params)
    nr = min(params.register[1], -(-ranges[c.lanes] // vector_lanes) * vector_lanes)
    channel_lanes = c.lanes in d.out_channel
    if channel_lanes:
        mr, nr, _ = channel_lane_tile(ranges[c.lanes], rows_extent, params)
    else:
        mr = register_rows(rows_extent, params.register[0])
    outer = [o for o in d.image if o != c.lanes]
    forall = [0] * rank
    for dim in d.batch + d.group + d.out_channel:
        forall[dim] = 1
    if channel_lanes:
        forall[c.lanes] = _tile_of(ranges[c.lanes], nr, params.tile_rows)
        if _batch_in_lane_tiles(c, params, nr):
            forall[c.lanes] = nr
            for dim in d.batch:
                forall[dim] = ranges[dim]
    for o in outer:
        forall[o] = ranges[o]
    if c.rows is not None:
        forall[c.rows] = _tile_of(rows_extent, mr, params.tile_rows if c.rows in d.out_channel
                                  else rows_extent)
    count = 1
    for dim in range(rank):
        if forall[dim]:
            count *= -(-ranges[dim] // forall[dim])
    wanted = params.threads * params.tiles_per_thread
    for o in outer:
        if count >= wanted:
            break
        unit = mr if o == c.rows else 1
        need = -(-wanted // count)
        sizes = [t for t in range(unit, ranges[o] + 1, unit) if ranges[o] % t == 0] or [forall[o]]
        size = max([t for t in sizes if ranges[o] // t >= need] or [min(sizes)])
        count = count // -(-ranges[o] // forall[o]) * (ranges[o] // size)
        forall[o] = size
    forall = [0 if s == ranges[i] and i not in d.batch + d.group + d.out_channel else s
              for i, s in enumerate(forall)]
    if c.rows is not None and forall[c.rows] == ranges[c.rows]:
        forall[c.rows] = 0
    register = [0] * rank
    for dim in d.batch + d.group + d.out_channel + outer:
        register[dim] = 1
    if c.rows is not None:
        register[c.rows] = mr
    register[c.lanes] = nr
    order = [x for x in d.batch + d.group + d.out_channel + outer
             if x not in (c.rows, c.lanes)] + [c.lanes]
    order += [c.rows] if c.rows is not None else []
    reduction = [0] * rank
    for dim in d.in_channel + [k for k in d.window if k is not None]:
        reduction[dim] = 1
    window = {k for k in d.window if k is not None}
    vector = [1 if i in d.in_channel else register[i] or 1 for i in range(rank) if i not in window]
    block = _channel_block(c, params, mr, nr)
    lanes_left = ranges[c.lanes] % nr
    # the last lanes split off (`TailTiles`) when they are one vector or less
    terms = math.prod(ranges[x] for x in d.in_channel + [k for k in d.window if k is not None])
    splits_tail = ranges[c.lanes] > nr and 0 < lanes_left <= vector_lanes and c.rows is not None \
        and not channel_lanes and not writes_strided_lanes(c) \
        and (block is not None or terms >= TAIL_MIN_TERMS)
    if block is not None or splits_tail:  # the tile's start is then written before it
        _fit_output_tile(c, params, forall, outer, mr)
    y_map = loop_structure(c.op).output_map(0)
    output = [register[e.position] or 1 for e in y_map.results]
    kept = [i for i in range(rank) if i not in window]
    output_lanes = [e.position for e in y_map.results].index(c.lanes)
    tiled = [x for x in order if register[x]]
    peel = tiled.index(c.lanes) if ranges[c.lanes] > nr and ranges[c.lanes] % nr else None
    peel_rows = None
    if c.rows is not None and mr > 1:
        tile = forall[c.rows] or rows_extent
        if tile % mr or rows_extent % tile:
            peel_rows = tiled.index(c.rows)
    tail = None
    if splits_tail:
        tail = _tail_tiles(c, ranges[c.lanes] - lanes_left, forall[c.rows] or rows_extent,
                           mr * nr // vector_lanes, register, vector, kept, tiled)
    return ConvolutionTiles(forall, register, order, reduction, vector, output,
                            kept.index(c.lanes), output_lanes, peel, peel_rows, block, tail)


def _tail_tiles(c: Convolution, start: int, rows_tile: int, accumulators: int,
                register: list[int], vector: list[int], kept: list[int],
                tiled: list[int]) -> TailTiles | None:
    """TailTiles of the lanes from `start` on: rows a divisor of the rows tile up to
    `accumulators` (else that many, the last tile peeled); None when that is no taller
    than the main tiles' rows."""
    rows = register_rows(rows_tile, accumulators)
    if rows <= register[c.rows]:
        return None
    tail_register = list(register)
    tail_register[c.rows] = rows
    tail_register[c.lanes] = c.dims.ranges[c.lanes] - start
    tail_vector = list(vector)
    tail_vector[kept.index(c.rows)] = rows
    return TailTiles(c.lanes, start, tail_register, tail_vector,
                     tiled.index(c.rows) if rows_tile % rows else None)


def _batch_in_lane_tiles(c: Convolution, params: ConvolutionParams, nr: int) -> bool:
    """With the output channels as lanes: do the forall tiles take NR channels of the whole
    batch? When NR-channel tiles alone give every thread its tiles_per_thread and such a
    tile's output (the batch's images by NR channels) fits params.tile_bytes: a tile then
    reads its columns of the filter (C K NR values) from memory once and from L2 for every
    image, where a tile per image read the whole filter again per image (ResNet's 3 x 3
    convolution of 512 channels at 7 x 7, batch 10: a 9.4 MB filter read 10 times, 22.3 ->
    19.6 ms on one thread)."""
    d, ranges = c.dims, c.dims.ranges
    channels = ranges[c.lanes]
    if channels % nr or channels // nr < params.threads * params.tiles_per_thread:
        return False
    output = 4 * nr * math.prod(ranges[x] for x in d.batch + d.group + d.image)
    return output <= params.tile_bytes


def channel_lane_tile(channels: int, rows: int, params: ConvolutionParams) -> tuple[int, int, float]:
    """(MR, NR, useful share) of the register tile whose lanes run along `channels` output
    channels and its rows along an image dim of `rows`: NR a power-of-two count of vectors
    dividing the channels (LLVM widens a vector of 3 to 4 and rebuilt the 7 x 48
    accumulators of a 1 x 1 convolution at 7 x 7 lane by lane per step: 25x slower), MR x
    NR / lanes accumulators up to 1.5 times those of params.register, and no more than the
    vector registers hold beside the step's NR / lanes filter vectors and a broadcast (LLVM
    spilled 3 x 8 accumulators with 8 filter vectors to the stack every step). The useful
    share: the rows computed that are not past the edge (a partial last row tile computes
    masked rows) times the accumulators' share of params.register's (fewer cannot hide the
    FMA latency). The tile of the best `_step_rate` wins, then the most accumulators.
    (1, lanes, 0) when the channels are not whole vectors."""
    lanes = lanes_per_vector(params)
    vectors = params.register[0] * params.register[1] // lanes
    registers = 2 * vectors  # params.register: half the registers hold accumulators
    best = (1, lanes, 0.0)
    best_key = (0.0, 0)
    for v in range(1, vectors + 1):
        if channels % (v * lanes) or v & (v - 1):
            continue
        for mr in range(1, min(rows, vectors * 3 // 2 // v) + 1):
            if mr * v + v + 1 > registers:
                break
            row_share = rows / (-(-rows // mr) * mr)
            share = row_share * min(mr * v, vectors) / vectors
            key = (round(row_share * _step_rate(mr, v, vectors), 3), mr * v)
            if key > best_key:
                best, best_key = (mr, v * lanes, share), key
    return best


def _step_rate(mr: int, v: int, vectors: int) -> float:
    """The share of the FMA peak one reduction step of an MR x v-vector register tile
    reaches: its MR v FMAs against the longest of them, the FMA latency (`vectors`
    independent accumulators hide it) and its loads, a filter vector counting as two FMAs
    and a broadcast as one. Measured with AVX-512 on one thread (128 output channels as
    lanes; ms for 2 x 8 vectors, 5 x 4, 12 x 2 or 11 x 2): a dilated stride-3 Conv1d over
    339 rows (KernelBench 76) 8.5, 7.1, 7.8; a 3 x 3 convolution over 14 x 14 2.8, 2.3,
    2.6 (7 x 2). Where two tiles tie, the one of fewer filter vectors wins: a stride-2 3 x 3
    convolution to 64 channels ran 5-10% faster in 8 x 2 than in 4 x 4."""
    return mr * v / max(mr * v, vectors, 2 * v + mr)


def image_lane_share(c: Convolution, params: ConvolutionParams) -> float:
    """The useful share (as in `channel_lane_tile`) of the register tile whose lanes run
    along the innermost image dim: the lanes not past its edge (the last tile takes whole
    vectors covering it) times the rows not past theirs times the accumulators' share."""
    lanes = lanes_per_vector(params)
    width = c.dims.ranges[c.lanes]
    nr = min(params.register[1], -(-width // lanes) * lanes)
    lane_share = width / (-(-width // lanes) * lanes)
    return lane_share * _image_rows_share(c, params, nr)


def _image_rows_share(c: Convolution, params: ConvolutionParams, nr: int) -> float:
    """With the lanes along the innermost image dim in register tiles of `nr` lanes: the
    rows not past their edge times the accumulators' share of params.register's."""
    lanes = lanes_per_vector(params)
    vectors = params.register[0] * params.register[1] // lanes
    rows = c.dims.ranges[c.rows] if c.rows is not None else 1
    mr = register_rows(rows, params.register[0])
    return rows / (-(-rows // mr) * mr) * min(mr * nr // lanes, vectors) / vectors


def writes_strided_lanes(c: Convolution) -> bool:
    """Is the convolution's result inserted into a tensor strided along its lanes (a phase of
    a transposed convolution, transform_ext.split_transposed_convolution)? Its tiles are
    then read and written element by element where masked."""
    y_map = loop_structure(c.op).output_map(0)
    axis = [e.position for e in y_map.results].index(c.lanes)
    for use in c.op.results[0].uses:
        owner = getattr(use.owner, "operation", use.owner)
        if owner.name == "tensor.insert_slice" and use.operand_number == 0:
            strides = list(owner.opview.static_strides)
            if axis < len(strides) and strides[axis] != 1:
                return True
    return False


def _channel_block(c: Convolution, params: ConvolutionParams, mr: int, nr: int) -> list[int] | None:
    """Tile sizes splitting the widest input channel dim into blocks whose image rows and
    filter values (per register tile) fit params.block_bytes (with the output channels as
    lanes, params.l1_bytes: the filter values, most of it, are read by each row tile in
    turn and stay in L1; a stride-2 3 x 3 convolution to 64 channels ran 8% faster in
    blocks of 32 channels than of 16), None when all fit or when the
    output is strided along the lanes (`writes_strided_lanes`: one block keeps the tile's
    start in registers and writes it once, where each block would read and write it)."""
    if writes_strided_lanes(c):
        return None
    d, ranges = c.dims, c.dims.ranges
    wide = [x for x in d.in_channel if ranges[x] > 1]
    if not wide:
        return None
    channel = max(wide, key=lambda x: ranges[x])
    rows = mr if c.rows is not None and c.rows in d.image else 1
    x_elements, w_elements = 1, mr if c.rows in d.out_channel else 1
    if c.lanes in d.out_channel:
        w_elements = nr
    for w in d.exprs.values():
        k = ranges[w.window] if w.window is not None else 1
        w_elements *= k
        if w.image == c.lanes:
            x_elements *= nr * w.stride + (k - 1) * w.dilation
        elif w.image == c.rows:
            x_elements *= (rows - 1) * w.stride + (k - 1) * w.dilation + 1
        else:
            x_elements *= k
    others = 1
    for x in d.in_channel:
        if x != channel:
            others *= ranges[x]
    per_channel = 4 * others * (x_elements + w_elements)
    fit = (params.l1_bytes if c.lanes in d.out_channel else params.block_bytes) // per_channel
    if fit >= ranges[channel]:
        return None
    size = max([t for t in range(1, max(1, fit) + 1) if ranges[channel] % t == 0])
    sizes = [0] * len(ranges)
    sizes[channel] = size
    return sizes


def _fit_output_tile(c: Convolution, params: ConvolutionParams, forall: list[int],
                     outer: list[int], mr: int) -> None:
    """Split the outer image dims of `forall` (in place, by divisors, outermost first)
    until a tile's output holds at most params.tile_bytes."""
    ranges = c.dims.ranges
    output_dims = [e.position for e in loop_structure(c.op).output_map(0).results]

    def tile_bytes():
        size = 4
        for dim in output_dims:
            size *= forall[dim] or ranges[dim]
        return size

    for o in outer:
        unit = mr if o == c.rows else 1
        while tile_bytes() > params.tile_bytes:
            current = forall[o] or ranges[o]
            smaller = [t for t in range(unit, current, unit) if ranges[o] % t == 0]
            if not smaller:
                break
            forall[o] = smaller[-1]


# ----------------------------------------------------------------------------- fuse

def _tile(handle, sizes, interchange=None):
    t = structured.TileUsingForOp(handle, sizes=sizes, interchange=interchange)
    return t.tiled_linalg_op, list(t.loops)


def _fuse_into(producer, containing):
    f = structured.FuseIntoContainingOp(producer, containing)
    return f.fused_op, f.new_containing_op


def _set_role(handle, role: str, vector_sizes: list[int], lanes: int) -> None:
    """Annotate the ops of `handle` with their ROLE, nominal VECTOR_SIZES and LANES dim."""
    annotate(handle, ROLE, ir.StringAttr.get(role))
    annotate(handle, VECTOR_SIZES, ir.DenseI64ArrayAttr.get(vector_sizes))
    annotate(handle, LANES, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), lanes))


def _single_use(value) -> ir.Operation | None:
    uses = list(value.uses)
    if len(uses) != 1:
        return None
    owner = uses[0].owner
    return getattr(owner, "operation", owner)


def _accumulator_producer(c: Convolution) -> ir.Operation | None:
    """The fill or elementwise generic computing the accumulator's start, used by the
    convolution alone (computed per register tile), else None."""
    from transform_ext.analysis.tiles import per_tile_producer

    value = c.op.operands[2]
    owner = value.owner
    producer = getattr(owner, "operation", owner)
    if not isinstance(producer, ir.Operation) or not is_linalg_op(producer):
        return None
    if len(list(value.uses)) != 1 or not per_tile_producer(producer):
        return None
    return producer


def accumulation_chain(c: Convolution, candidates: list[Convolution]) -> list[Convolution]:
    """The convolutions whose results `c` accumulates onto, first first, then `c`: while
    the accumulator of the first is the result of another of `candidates` used by nothing
    else (the phases of a strided convolution, transform_ext.split_strided_convolution)."""
    by_op = {x.op: x for x in candidates}
    chain = [c]
    while True:
        value = chain[0].op.operands[2]
        owner = value.owner
        owner = getattr(owner, "operation", owner)
        if owner not in by_op or len(list(value.uses)) != 1 or by_op[owner] in chain:
            return chain
        chain.insert(0, by_op[owner])


def find_copy_back(value: ir.Value) -> ir.Operation | None:
    """The generic consuming `value` (the convolution's result, its only use) that copies
    it to a tensor of its dims permuted: all loops parallel over `value`'s dims, read with
    the identity map, written through a permutation, its body yielding the element read
    (the transpose back of transform_ext.move_output_channels_innermost). Its loops are the
    convolution's output dims: it is tiled with the output tiles, as an epilogue."""
    user = _single_use(value)
    if user is None or user.name != "linalg.generic" or len(user.operands) != 2:
        return None
    ls = loop_structure(user)
    rank = len(value.type.shape)
    if ls.reduction_dims or not ls.is_static or ls.num_loops != rank or \
            ls.maps[0] != ir.AffineMap.get_identity(rank) or not ls.output_map(0).is_permutation:
        return None
    block = user.regions[0].blocks[0]
    body = [op.operation for op in block.operations]
    if len(body) != 1 or body[0].operands[0] != block.arguments[0]:
        return None
    return user


def find_pooling(c: Convolution, value: ir.Value) -> ir.Operation | None:
    """The generic consuming `value` (the convolution's result, or its epilogue's; its only
    use) that reduces it over image dims (a global average pool: a sum over H x W, GELU or
    an epilogue folded into its body): one result, static, `value` read with the identity
    map, every reduced loop an image dim of the output, the kept loops written in order (or
    a unit dim by a constant index, transform_ext.drop_unit_result_dims); else None."""
    user = reducing_reader(value)
    if user is None:
        return None
    ls = loop_structure(user)
    y_dims = [e.position for e in loop_structure(c.op).output_map(0).results]
    if any(y_dims[d] not in c.dims.image for d in ls.reduction_dims):
        return None
    written = [e.position for e in ls.output_map(0).results if isinstance(e, ir.AffineDimExpr)]
    return user if written == ls.parallel_dims else None


def _pooling_tiles(c: Convolution, tiles: ConvolutionTiles, params: ConvolutionParams,
                   reduced: set[int]) -> tuple[list[int], list[int]] | None:
    """(forall, loop) tile sizes over a pooling's loops (the output's dims): the forall
    splits the kept dims (batch and groups by 1, the rows by the convolution's forall tile,
    in multiples of MR until every thread gets a tile, a kept image dim by 1, the lanes
    whole); inside, a loop walks the reduced outer image dims one by one (along the rows
    of a depthwise convolution's register tile, by the largest divisor of their extent up
    to MR; None when that is under MR / 2, the register tiles mostly masked), so the
    convolution's output lives one row of tiles at a time, in cache."""
    y_dims = [e.position for e in loop_structure(c.op).output_map(0).results]
    ranges = c.dims.ranges
    mr = register_rows(ranges[c.rows], params.register[0]) if c.rows is not None else 1
    forall, loop = [], []
    for d, l in enumerate(y_dims):
        if d in reduced and l == c.rows:
            rows = max(t for t in range(1, mr + 1) if ranges[l] % t == 0)
            if 2 * rows < mr:
                return None
            forall.append(0)
            loop.append(rows)
        elif d in reduced:
            forall.append(0)
            loop.append(0 if l == c.lanes else 1)
        elif l == c.rows:
            forall.append(tiles.forall[l] or ranges[l])
            loop.append(0)
        else:
            forall.append(0 if l == c.lanes else 1)
            loop.append(0)
    if c.rows is not None and c.rows in y_dims and y_dims.index(c.rows) not in reduced:
        d = y_dims.index(c.rows)
        count = 1
        for e, l in enumerate(y_dims):
            if forall[e]:
                count *= -(-ranges[l] // forall[e])
        while count < params.threads and forall[d] > mr:
            smaller = max(mr, (forall[d] // 2) // mr * mr)
            count = count // -(-ranges[c.rows] // forall[d]) * -(-ranges[c.rows] // smaller)
            forall[d] = smaller
    return forall, loop


def _schedule(rec: StepRecorder, chain: list[Convolution], params: ConvolutionParams) -> None:
    """Step 2 of the module docstring for an accumulation chain (one convolution, or the
    phases of a strided one: one forall tile computes them all in turn, each its own
    register tiles over the same output tile). A pooling after it (`find_pooling`) is the
    root instead: its forall splits the kept dims, a loop inside walks the reduced ones, the
    convolution (and its epilogue) computed in that loop's tiles and reduced there, no
    [N, C, H, W] result stored."""
    last = chain[-1]
    tiles = [convolution_tiles(c, params) for c in chain]
    forall_tiles = tiles[-1]
    epilogue = find_epilogue(last.op.results[0]) or find_copy_back(last.op.results[0])
    pooling = find_pooling(last, (epilogue or last.op).results[0])
    if pooling is not None and any(not isinstance(e, ir.AffineDimExpr)
                                   for e in loop_structure(pooling).output_map(0).results):
        place = place_of(rec.trial.operation, pooling)

        def unit_dims(root):
            drop_unit_result_dims(at_place(root, place))

        rec.step("pooling_result", unit_dims)
        pooling = find_pooling(last, (epilogue or last.op).results[0])
    pooling_tiles = None if pooling is None else _pooling_tiles(
        last, forall_tiles, params, set(loop_structure(pooling).reduction_dims))
    if pooling_tiles is None:
        pooling = None
    else:
        pooling_forall, pooling_loop = pooling_tiles
    init = _accumulator_producer(chain[0])
    pad = _padded_image(chain, forall_tiles)
    ops = [epilogue, init, pooling, pad] + [c.op for c in chain]
    places = {i: place_of(rec.trial.operation, op) for i, op in enumerate(ops) if op is not None}
    epilogue_forall = _output_sizes(last, forall_tiles.forall)
    init_peel = _init_peel(chain[0], tiles[0])
    epilogue_register = _output_sizes(last, forall_tiles.register)
    taps = [tap_unroll(c) for c in chain]

    def body(root):
        h = {i: at_place(root, place) for i, place in places.items()}
        convs = [h[4 + i] for i in range(len(chain))]
        for conv in convs:
            annotate(conv, _DONE)
        if pooling is not None:
            t = structured.TileUsingForallOp(h[2], tile_sizes=pooling_forall)
            forall = t.forall_op
            tiled_pooling, loops = _tile(t.tiled_op, pooling_loop)
            # the loops then slice the result directly, not the forall's slice of it
            apply_patterns(forall, ttensor.ApplyMergeConsecutiveInsertExtractSlicePatternsOp)
            forall = loops[-1] if loops else forall
            if epilogue is not None:
                tiled_epilogue, forall = _fuse_into(h[0], forall)
            convs[-1], forall = _fuse_into(convs[-1], forall)
        elif epilogue is not None:
            t = structured.TileUsingForallOp(h[0], tile_sizes=epilogue_forall)
            forall, tiled_epilogue = t.forall_op, t.tiled_op
            convs[-1], forall = _fuse_into(convs[-1], forall)
        else:
            t = structured.TileUsingForallOp(convs[-1], tile_sizes=forall_tiles.forall)
            forall, convs[-1] = t.forall_op, t.tiled_op
        for i in range(len(convs) - 2, -1, -1):
            convs[i], forall = _fuse_into(convs[i], forall)
        if pad is not None:
            _, forall = _fuse_into(h[3], forall)
        first = tiles[0]
        # the start is computed per register tile, unless the channels come in blocks or the
        # last lanes are split off (`TailTiles`): then once per forall tile, before them
        fused_init = init is not None and first.channel_block is None and first.tail is None
        if init is not None:
            init_h, forall = _fuse_into(h[1], forall)
            if not fused_init:  # the tile starts from I, then the channel blocks add
                _init_tiles(init_h, first, init_peel, forall)
        for i, (conv, tile) in enumerate(zip(convs, tiles)):
            _register_tiles(conv, tile, forall, fused_init and i == 0, taps[i])
        if epilogue is not None:
            tiled_epilogue, _ = _tile(tiled_epilogue, epilogue_register)
            _set_role(tiled_epilogue, "epilogue", forall_tiles.output, forall_tiles.output_lanes)
        if pooling is not None:  # reduced register tile by register tile
            tiled_pooling, _ = _tile(tiled_pooling, epilogue_register)
            _set_role(tiled_pooling, "pooling", forall_tiles.output, forall_tiles.output_lanes)
        canonicalize(match(root, "func.func"))

    rec.step("tile", body)


def _padded_image(chain: list[Convolution], tiles: ConvolutionTiles) -> ir.Operation | None:
    """The tensor.pad computing the image of a lone convolution that alone reads it, when
    its forall tiles take whole images (they split batch, groups or channels only): each
    tile's images are padded in a small buffer, in cache, not the whole image copied into a
    filled one before the convolution. (A tile of image rows would copy its halo again; a
    tile of some output channels of every image, `_batch_in_lane_tiles`, would pad them all
    again: there the image is padded once.)"""
    c = chain[0]
    d, ranges = c.dims, c.dims.ranges
    pad = defining_op(c.op.operands[d.input_index])
    if len(chain) > 1 or pad is None or pad.name != "tensor.pad" or \
            len(list(pad.results[0].uses)) != 1:
        return None
    whole = all(tiles.forall[x] in (0, ranges[x]) for x in d.image)
    every_image = all(tiles.forall[x] in (0, ranges[x]) for x in d.batch + d.group)
    return pad if whole and not every_image else None


def _init_peel(c: Convolution, tiles: ConvolutionTiles) -> list[int]:
    """The loops of `_init_tiles` to peel, inner first: those over the output's lanes and
    rows dims where the convolution's register tiles peel theirs."""
    positions = [e.position for e in loop_structure(c.op).output_map(0).results]
    partial = ([tiles.output_lanes] if tiles.peel is not None else []) + \
        ([positions.index(c.rows)] if tiles.peel_rows is not None else [])
    return sorted(partial, reverse=True)


def _init_tiles(init, tiles: ConvolutionTiles, peel: list[int], forall) -> None:
    """The accumulator start of a channel-blocked convolution's forall tile in register
    tiles, the loops `peel` (`_init_peel`) peeled as the convolution's are (each tile then
    static: a dynamic edge masks every tile's stores, which AMD's vmaskmovps makes slow)."""
    init, loops = _tile(init, tiles.output)
    if peel:
        annotate(init, _TILE)
        for index in peel:
            peel_loop(loops[index])
        init = structured.MatchOp(any_op(), forall, op_attrs={_TILE: ir.UnitAttr.get()}).result
        remove_annotation(init, _TILE)
    _set_role(init, "init", tiles.output, tiles.output_lanes)


def _register_tiles(conv, tiles: ConvolutionTiles, forall, fuse_init: bool, taps: int) -> None:
    """A convolution's tile in the forall: channel blocks, register tiles (the last partial
    tile of the rows, then of the lanes, peeled; or the last lanes split off with their own
    taller tiles, `TailTiles`, when the accumulator start is not fused), the accumulator
    start per register tile when `fuse_init`, the reductions by 1 (the window loops clamped
    to the taps that read the unpadded image, transform_ext.clamp_window_loops), then each
    register tile rebuilt as a contraction; its innermost tap loop marked to be unrolled by
    `taps` (`tap_unroll`) when that is above 1."""
    if tiles.channel_block is not None:
        conv, _ = _tile(conv, tiles.channel_block)
    tail = tiles.tail
    if tail is None or fuse_init:
        _register_loops(conv, tiles, tiles.register, tiles.peel, tiles.peel_rows, tiles.vector,
                        forall, fuse_init, taps)
        return
    parts = structured.SplitOp(conv, dimension=tail.lanes_dim, chunk_sizes=tail.start)
    main, rest = transform.SplitHandleOp([any_op(), any_op()], parts.results[0]).results
    _register_loops(main, tiles, tiles.register, None, tiles.peel_rows, tiles.vector, forall, False,
                    taps)
    _register_loops(rest, tiles, tail.register, None, tail.peel_rows, tail.vector, forall, False,
                    taps)


def _register_loops(conv, tiles: ConvolutionTiles, register: list[int], peel: int | None,
                    peel_rows: int | None, vector: list[int], forall, fuse_init: bool,
                    taps: int) -> None:
    """`_register_tiles` from the register tiles on, for `register` tiles whose lanes and
    rows loops `peel` and `peel_rows` (indices among the tile loops) are peeled."""
    conv, loops = _tile(conv, register, interchange=tiles.interchange)
    if fuse_init:
        fuse_init_into_register_tile(conv)
    if peel is not None or peel_rows is not None:
        annotate(conv, _TILE)
        # the rows loop is inside the lanes loop: peeling the lanes copies both row loops
        for index in (peel_rows, peel):
            if index is not None:
                peel_loop(loops[index])
        conv = structured.MatchOp(any_op(), forall, op_attrs={_TILE: ir.UnitAttr.get()}).result
        remove_annotation(conv, _TILE)
    if fuse_init:
        producer = transform.GetProducerOfOperand(any_op(), conv, 2).producer
        _set_role(producer, "init", tiles.output, tiles.output_lanes)
    conv, loops = _tile(conv, tiles.reduction)
    if taps > 1:
        annotate(loops[-1], _TAPS, _taps_attr(taps))
    clamp_window_loops(conv)
    kernel = convolution_to_contraction(conv)
    _set_role(kernel, "register", vector, tiles.vector_lanes)


# A register tile's innermost tap loop with at most this many taps is unrolled whole (with
# the image lanes): its increment, compare and branch then come once per row of taps.
# KernelBench 68 (3 x 5 x 5 taps over 16 channels, its tail split off, one thread, AMD Zen
# 5): 28.6 -> 25.6 ms; 58 (3 x 5 x 7): 37.7 -> 35.8 ms. With the output channels as lanes the image values are the broadcast operand:
# unrolled, LLVM loads each once for all the taps that read it and keeps them live beside
# the accumulators, spilling them (58: 47.7 -> 58.5 ms), so such loops stay rolled; so do
# those of rows along an image dim (a depthwise convolution: the suite's, one thread,
# 0.43 -> 0.58 ms unrolled).
TAPS_UNROLL_MAX = 8


def _taps_attr(taps: int) -> ir.IntegerAttr:
    """The _TAPS annotation of a tap loop unrolled by `taps`."""
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), taps)


def tap_unroll(c: Convolution) -> int:
    """The factor `c`'s innermost tap loop is unrolled by: its taps when the lanes run along
    an image dim, the rows along the output channels and the innermost window dim has 2 to
    TAPS_UNROLL_MAX taps, else 1."""
    d = c.dims
    windows = [k for k in d.window if k is not None]
    if c.lanes in d.out_channel or c.rows not in d.out_channel or not windows:
        return 1
    taps = d.ranges[windows[-1]]
    return taps if 1 < taps <= TAPS_UNROLL_MAX else 1


def _output_sizes(c: Convolution, sizes: list[int]) -> list[int]:
    """Tile sizes over the convolution's loops as sizes over its output's dims (the loops
    of an epilogue with an identity map)."""
    y_map = loop_structure(c.op).output_map(0)
    return [sizes[e.position] for e in y_map.results]


def _untiled(op: ir.Operation) -> bool:
    return ROLE not in op.attributes and _DONE not in op.attributes \
        and matmul.ROLE not in op.attributes


def _outside_reduction(op) -> bool:
    """Is `op` a reduction linalg.generic outside the convolutions' tiles?"""
    op = getattr(op, "operation", op)
    return op.name == "linalg.generic" and _untiled(op) and filter_matches(op, [], "reduction", "") \
        and op.parent.name == "func.func"


def _prepare_reductions(rec: StepRecorder) -> None:
    """The reductions outside the convolutions' tiles prepared as the generic schedule's
    @fuse prepares them: the collapse_shapes they read folded into them (a group norm's
    [images, groups, channels x pixels] view of the convolution's output), then the
    elementwise producers only they read computed inside them (its x widened to f64 for
    the sums of x and x^2 read as f32 by the sums, not stored per tile as [images,
    groups, channels, pixels] f64; KernelBench level 2's 85: 295 -> 48 ms, one thread), then
    those of the same loops over the same tensor merged into one pass when none is inside
    the tiles (the sums of x and x^2). Their keepdim unit dims stay: a consumer's tiles
    cannot slice them, so `_schedule_others` tiles each as a root of its own, not once
    per tile of the elementwise op that reads it (with the dims dropped, a group norm's
    sums were fused into its normalization's tiles of two image rows: KernelBench level
    2's 21 12.8 -> 982 ms)."""

    def fold(root, places):
        for handle in at_places(root, places):
            # (checked by `_folds` on the trial; should an earlier fold change that, the
            # reshape stays and its reduction reads it as before)
            suppressed(handle, fold_reshape_ops_by_expansion)
        canonicalize(root)

    def inline(root, places):
        handles = at_places(root, places)
        consumers = handles[0] if len(handles) == 1 else transform.MergeHandlesOp(handles).result
        inline_elementwise_producers(consumers, whole=True)
        canonicalize(root)

    def merge(root, _):
        merge_sibling_reductions(match(root, "func.func"))

    for name, where, body in (("fold_reshapes_into_reductions", _reshapes_read_by_reductions, fold),
                              ("inline_into_reductions", _outside_reductions, inline),
                              ("merge_sibling_reductions", _siblings_outside_only, merge)):
        places = where(rec.trial)
        if places:
            rec.step(name, lambda root, places=places, body=body: body(root, places))


def _siblings_outside_only(trial: ir.Module) -> bool:
    """Are there sibling reductions to merge (the sums of x and x^2 of a variance), all of
    them outside the convolutions' tiles? (merge_sibling_reductions takes a whole function.)"""
    groups = [g for func in func_ops(trial) for g in sibling_groups(func)]
    return bool(groups) and all(_outside_reduction(op) for g in groups for op in g)


def _reshapes_read_by_reductions(trial: ir.Module) -> list:
    """The top-level collapse_shapes read only by reductions outside the tiles, that fold
    into them (transform_ext.fold_reshape_ops_by_expansion.plan_fold)."""
    return places_of(trial.operation, [
        op.operation for func in func_ops(trial) for op in func.regions[0].blocks[0].operations
        if op.operation.name == "tensor.collapse_shape" and list(op.results[0].uses)
        and all(_outside_reduction(u.owner) for u in op.results[0].uses)
        and _folds(op.operation)])


def _folds(reshape: ir.Operation) -> bool:
    try:
        plan_fold(reshape, multi_use=True)
    except CannotFold:
        return False
    return True


def _outside_reductions(trial: ir.Module) -> list:
    return places_of(trial.operation, [op for func in func_ops(trial)
                                       for op in top_level_linalg_ops(func) if _outside_reduction(op)])


def _writes_constant_dims(op: ir.Operation) -> bool:
    """Does `op` write a result through a constant index (a keepdim reduction)?"""
    maps = list(linalg.get_indexing_maps(op))  # (an ArrayAttr takes no index -1)
    outs = [terms(m) for m in maps[len(maps) - len(op.results):]]
    return any(out is not None and any(isinstance(t, Const) for t in out) for out in outs)


def _schedule_others(rec: StepRecorder, params: GenericParams) -> None:
    """Linalg ops outside the convolutions' tiles: tiled for threads like the generic
    schedule. The keepdim reductions first, in order, each the root of its own tiles: a
    consumer's tiles cannot slice them (fusing one into them fails, loudly), and would
    compute one once per tile if they could."""
    for func in list(func_ops(rec.trial)):
        while True:
            ops = [op for op in top_level_linalg_ops(func) if _untiled(op)]
            keepdims = [op for op in ops if op.name == "linalg.generic"
                        and filter_matches(op, [], "reductions", "") and _writes_constant_dims(op)]
            # else the last op with parallel tiles, scanned from the end (as schedules.matmul)
            found = next(((op, sizes) for op in keepdims + list(reversed(ops))
                          if (sizes := parallel_tile_sizes(op, params)) is not None), None)
            if found is None:
                break
            root, sizes = found
            place = place_of(rec.trial.operation, root)

            def body(r, place=place, sizes=sizes):
                structured.FuseOp(at_place(r, place), tile_sizes=sizes, use_forall=True,
                                  apply_cleanup=True)

            rec.step("tile_other", body)


def _normalize(root: ir.Value) -> ir.Value:
    """Assertions split out, elementwise ops fused (a contraction's reduction loops that
    this expanded, a flatten before a linear layer, collapsed back)."""
    split_assertions(root)
    root = apply_passes(root, "canonicalize", "cse")
    apply_passes(match(root, "func.func"), "linalg-fuse-elementwise-ops")
    collapse_reduction_dims(match(root, "func.func"))
    root = apply_passes(root, "canonicalize", "cse")
    return root


@dataclass(frozen=True)
class ConvolutionPlan:
    """The script's steps as recorded on a trial of the payload; None when no convolution
    is left for the schedule (the generic script)."""

    fuse: tuple | None
    vectorize: object | None


def _split_phases(rec: StepRecorder, name: str, legal, split) -> None:
    """The convolutions `legal` accepts (it raises Illegal otherwise) split by `split`, in
    one recorded step."""
    found = []
    for op in _convolution_ops(rec.trial):
        try:
            legal(op)
        except Illegal:
            continue
        found.append(place_of(rec.trial.operation, op))
    if not found:
        return

    def body(root):
        handles = [at_place(root, place) for place in found]
        for h in handles:
            split(h)
        canonicalize(match(root, "func.func"))

    rec.step(name, body)


# A register tile takes the output channels as its lanes instead of the innermost image dim
# when that raises its useful share (`channel_lane_tile`, `image_lane_share`: a narrow
# image dim leaves its last vector mostly masked) by CHANNEL_LANES_SMALL_GAIN or more and
# each output sums at least CHANNEL_LANES_TERMS products (the transposes around it, of its
# filter and of its output tiles, are then a small part of its work); when its last lanes
# can be split off after whole register tiles instead (`lane_tail_start`), by
# CHANNEL_LANES_GAIN over the share of that split (`split_lane_share`). An image row of 56
# or 28 (7 of 8 lanes used) gains 0.125: with AVX-512 on one thread, 3 x 3 convolutions
# over 56 x 56 (64 channels) ran 12.0 -> 10.5 ms and over 28 x 28 (128 channels)
# 11.0 -> 9.1 ms with the channels as lanes; one over 72 x 72 (64 + a tail of 8) ran 9.5 ms
# with its tail split off, 11.9 ms with the channels as lanes. Rows of 36 and 38 (two
# vectors and a tail of 4 or 6: KernelBench 68 and 58, 3-D transposed convolutions of 16
# channels, one thread on AMD Zen 5) gain 0.25 over their unsplit image lanes but none
# over the split: 40.7 -> 26.1 ms and 49.1 -> 35.3 ms split (its taps unrolled,
# `tap_unroll`), against torch's 24 and 31 ms; the channel lanes' 18 x 1-vector tile kept one
# address register per row, spilling them.
CHANNEL_LANES_GAIN = 0.2
CHANNEL_LANES_SMALL_GAIN = 0.1
CHANNEL_LANES_TERMS = 128


def wants_channel_lanes(c: Convolution, found: list[Convolution], params: ConvolutionParams) -> bool:
    """Should convolution `c` (one of `found`) compute with its output channels innermost
    (transform_ext.move_output_channels_innermost), the lanes along them and the rows along
    the image's innermost dim? When that raises the register tile's useful share by
    CHANNEL_LANES_SMALL_GAIN, or by CHANNEL_LANES_GAIN over the share with its last lanes
    split off after whole register tiles when they can be (`lane_tail_start`,
    `split_lane_share`; when its lanes are strided: on any gain over the image lanes, and
    only with STRIDED_CHANNEL_LANES_ACCUMULATORS in the register tile), its one
    output channel dim fills whole vectors, each output sums
    CHANNEL_LANES_TERMS products or more (input channels times window), and nothing is fused
    onto its result (an epilogue, a pooling, a strided phase's insert, another convolution
    accumulating onto it): the transpose back stands between them."""
    d, ranges = c.dims, c.dims.ranges
    if c.lanes in d.out_channel or len(d.out_channel) != 1 or any(ranges[g] > 1 for g in d.group):
        return False
    *_, share = channel_lane_tile(ranges[d.out_channel[0]], ranges[c.lanes], params)
    image_share = image_lane_share(c, params)
    if strided_lanes(c):
        accumulators = params.register[0] * params.register[1] // lanes_per_vector(params)
        if accumulators < STRIDED_CHANNEL_LANES_ACCUMULATORS or share <= image_share:
            return False
        return _channel_lanes_pay(c, found)
    start = lane_tail_start(c, found, params)
    if start is not None and start % params.register[1] == 0:
        # the image lanes with the last lanes split off: whole register tiles up to start
        if share < split_lane_share(c, params, start) + CHANNEL_LANES_GAIN:
            return False
    elif share < image_share + CHANNEL_LANES_SMALL_GAIN:
        return False
    return _channel_lanes_pay(c, found)


def split_lane_share(c: Convolution, params: ConvolutionParams, start: int) -> float:
    """The useful share (as in `channel_lane_tile`) of convolution `c` computed with its
    lanes along the innermost image dim up to `start` (a multiple of the register tile's
    lanes: every lane useful) and its last lanes apart (`lane_tail_start`: the output
    channels as lanes, the rows along those last lanes), each part's share weighted by its
    lanes."""
    d, ranges = c.dims, c.dims.ranges
    width = ranges[c.lanes]
    main = _image_rows_share(c, params, params.register[1])
    *_, tail = channel_lane_tile(ranges[d.out_channel[0]], width - start, params)
    return (start * main + (width - start) * tail) / width


# A convolution whose lanes are strided (`strided_lanes`) takes the channel lanes on any gain
# in the tile's useful share when the register tile holds this many accumulators (32 vector
# registers): its image lanes would read every s-th element, so
# transform_ext.split_strided_convolution splits it into s phases of unit stride, each adding
# onto the output in turn, while channel lanes (rows along that dim) broadcast single
# elements at any stride and need no phases. With AVX-512, one thread: KernelBench 50
# (AlexNet's 11 x 11 stride-4 conv1) 0.76x -> 0.83x eager, 76 (a stride-3 dilated 1-D conv)
# 0.85x -> 1.27x; with 16 registers (8 accumulators, AVX2) both ran 12-14% slower than
# their phases.
STRIDED_CHANNEL_LANES_ACCUMULATORS = 16


def strided_lanes(c: Convolution) -> bool:
    """Does the image dim of the convolution's lanes have a stride > 1?"""
    return any(e.stride != 1 for e in c.dims.exprs.values() if e.image == c.lanes)


def _channel_lanes_pay(c: Convolution, found: list[Convolution]) -> bool:
    """The conditions of `wants_channel_lanes` and `lane_tail_start` past the tile's share:
    CHANNEL_LANES_TERMS products per output or more, nothing fused onto the result."""
    d, ranges = c.dims, c.dims.ranges
    terms = 1
    for dim in d.in_channel + [k for k in d.window if k is not None]:
        terms *= ranges[dim]
    if terms < CHANNEL_LANES_TERMS:
        return False
    result = c.op.results[0]
    if writes_strided_lanes(c) or find_epilogue(result) is not None or \
            find_pooling(c, result) is not None or len(accumulation_chain(c, found)) > 1:
        return False
    return not any(x.op.operands[2] == result for x in found)


# A convolution whose innermost image dim ends in at most a half vector past its last whole
# vector computes those last lanes apart, with the output channels as their lanes and its
# rows along the next image dim out (`lane_tail_start`); each part starts from a fill of its
# own (transform_ext.fill_slices_of_fills) and no pass fills the whole result
# (transform_ext.drop_overwritten_fills). On 8 lanes the 2-lane tail of a 66-wide row (a
# stride-1 transposed convolution's output) ran 2 of 8 lanes and took 13-25% of the time for
# 3-6% of the work; split off, KernelBench 57, 61, 68 and 71 ran 14-25% faster.


def lane_tail_start(c: Convolution, found: list[Convolution], params: ConvolutionParams) -> int | None:
    """Where convolution `c` (one of `found`) splits off its last lanes to compute them with
    its output channels as lanes (transform_ext.move_output_channels_innermost on the part
    past the split), None when it does not: the lanes run along the image's innermost dim
    with stride 1, past one vector and ending in at most half a vector past the last whole
    one; another image dim is wider than 1 (the tail's rows run along it); its one output
    channel dim fills whole vectors; each output sums CHANNEL_LANES_TERMS products or more;
    its accumulator starts from a fill (each part then fills its own; a bias broadcast would
    be computed whole, in a pass of its own); and nothing is fused onto its result (as in
    `wants_channel_lanes`)."""
    d, ranges = c.dims, c.dims.ranges
    lanes = lanes_per_vector(params)
    if c.lanes in d.out_channel or len(d.out_channel) != 1 or any(ranges[g] > 1 for g in d.group):
        return None
    width = ranges[c.lanes]
    tail = width % lanes
    if width <= lanes or tail == 0 or tail > lanes // 2 or ranges[d.out_channel[0]] % lanes:
        return None
    if not any(ranges[o] > 1 for o in d.image if o != c.lanes) or strided_lanes(c):
        return None
    start = _accumulator_producer(c)
    if start is None or start.name != "linalg.fill" or not _channel_lanes_pay(c, found):
        return None
    return width - tail


def _split_lane_tails(rec: StepRecorder, params: ConvolutionParams) -> None:
    """The convolutions that `lane_tail_start` splits, their last lanes rewritten with the
    output channels innermost, in one recorded step."""
    found = find_convolutions(rec.trial)
    splits = [(place_of(rec.trial.operation, c.op), c.lanes, start) for c in found
              if (start := lane_tail_start(c, found, params)) is not None]
    if not splits:
        return

    def body(root):
        handles = [(at_place(root, place), lanes, start) for place, lanes, start in splits]
        for h, lanes, start in handles:
            parts = structured.SplitOp(h, dimension=lanes, chunk_sizes=start)
            _, tail = transform.SplitHandleOp([any_op(), any_op()], parts.results[0]).results
            move_output_channels_innermost(tail)
        fill_slices_of_fills(match(root, "func.func"))
        drop_overwritten_fills(match(root, "func.func"))
        canonicalize(match(root, "func.func"))

    rec.step("split_lane_tails", body)


def _move_channels_innermost(rec: StepRecorder, params: ConvolutionParams) -> None:
    """The convolutions that `wants_channel_lanes` rewritten with their output channels
    innermost, in one recorded step."""
    found = find_convolutions(rec.trial)
    places = [place_of(rec.trial.operation, c.op) for c in found
              if wants_channel_lanes(c, found, params)]
    if not places:
        return

    def body(root):
        handles = [at_place(root, place) for place in places]  # before any rewrite
        for h in handles:
            move_output_channels_innermost(h)
        canonicalize(match(root, "func.func"))

    rec.step("channels_innermost", body)


# A copy of the image into longer rows (pad_image_rows, when no zero padding is built
# anyway) pays when each image element takes part in this many multiply-adds or more.
COPY_MIN_TERMS = 64


def _row_major(shape: list[int]) -> list[int]:
    strides, stride = [], 1
    for extent in reversed(shape):
        strides.insert(0, stride)
        stride *= extent
    return strides


def _element_strides(value: ir.Value) -> list[int]:
    """The strides, in elements, of `value`'s dims in the tensor it is sliced from
    (through tensor.extract_slice; rank-reducing slices drop unit dims)."""
    op = value.owner
    op = getattr(op, "operation", op)
    shape = value.type.shape
    if not isinstance(op, ir.Operation) or op.name != "tensor.extract_slice":
        return _row_major(shape)
    view = op.opview
    parent = _element_strides(op.operands[0])
    strides = [p * s for p, s in zip(parent, view.static_strides)]
    kept = []   # a rank-reducing slice drops unit dims: match the others in order
    for size, stride in zip(view.static_sizes, strides):
        if len(kept) < len(shape) and size == shape[len(kept)]:
            kept.append(stride)
    return kept


def _rows_read(c: Convolution, tiles: ConvolutionTiles) -> list[list[int]] | None:
    """Per non-innermost dim of `c`'s image, the index offsets of the rows one register tile
    reads over its reductions: its input channels (of one channel block), its window rows
    and its rows along an image dim; None past 1 << 16 rows."""
    d = c.dims
    x_map = loop_structure(c.op).maps[d.input_index]
    rank = len(x_map.results)
    mr = tiles.register[c.rows] if c.rows is not None else 1
    per_dim, count = [], 1
    for i in range(rank - 1):
        values = [0]
        if i in d.exprs:
            we = d.exprs[i]
            taps = range(d.ranges[we.window]) if we.window is not None else [0]
            rows = range(mr) if we.image == c.rows else [0]
            values = sorted({r * we.stride + t * we.dilation for r in rows for t in taps})
        else:
            dim = x_map.results[i].position
            if dim in d.in_channel:
                block = tiles.channel_block[dim] if tiles.channel_block else 0
                values = list(range(block or d.ranges[dim]))
            elif dim == c.rows:
                values = list(range(mr))
        per_dim.append(values)
        count *= len(values)
    return per_dim if count <= 1 << 16 else None


def _lanes_window(c: Convolution) -> int:
    """Taps of the window along the image's innermost dim (1 without a window)."""
    we = c.dims.exprs[len(loop_structure(c.op).maps[c.dims.input_index].results) - 1]
    return c.dims.ranges[we.window] if we.window is not None else 1


def _set_load(c: Convolution, tiles: ConvolutionTiles, rows: list[list[int]],
              strides: list[int]) -> tuple[int, int]:
    """(most lines in one L1 set, lines in all) of the rows `rows` (`_rows_read`) with the
    image's dims `strides` elements apart."""
    sets = L1_WAY_BYTES // LINE_BYTES
    size = ir.RankedTensorType(c.op.operands[c.dims.input_index].type).element_type.width // 8
    we = c.dims.exprs[len(strides) - 1]
    span = size * ((tiles.register[c.lanes] - 1) * we.stride + (_lanes_window(c) - 1) * we.dilation + 1)
    offsets = [0]
    for values, stride in zip(rows, strides):
        offsets = [o + v * stride for v in values for o in offsets]
    load = [0] * sets
    for offset in offsets:
        start = size * offset
        for line in range(start // LINE_BYTES, (start + span - 1) // LINE_BYTES + 1):
            load[line % sets] += 1
    return max(load), sum(load)


# Set conflicts send a register tile's image lines to L2; they cost time only where the
# tile does few vector multiply-adds per line (L2 feeds L1 about half a line per cycle,
# two FMAs issue per cycle): below this many.
MAX_FMAS_PER_L2_LINE = 8


def image_row_padding(c: Convolution, tiles: ConvolutionTiles, params: ConvolutionParams) -> int:
    """Elements to add to each row of `c`'s image (transform_ext.pad_image_rows: rows of a
    new tensor) so that the lines one register tile reads over its reductions spread over
    L1's sets (each holds a line per way: l1_bytes / 4 KiB of them); 0 when they already
    do, would not fit L1 anyway, the tile does MAX_FMAS_PER_L2_LINE or more vector
    multiply-adds per line (L2 keeps up with the re-reads), or no padding up to 16 lines
    spreads them. Padding in whole lines (16 f32, 32 bf16)."""
    rows = _rows_read(c, tiles) if c.lanes not in c.dims.out_channel else None
    if rows is None:
        return 0
    ways = params.l1_bytes // L1_WAY_BYTES
    image = c.op.operands[c.dims.input_index]
    most, total = _set_load(c, tiles, rows, _element_strides(image))
    if most <= ways or total > ways * (L1_WAY_BYTES // LINE_BYTES):
        return 0
    vectors = -(-tiles.register[c.lanes] // lanes_per_vector(params))
    mr = tiles.register[c.rows] if c.rows is not None else 1
    fmas = math.prod(len(v) for v in rows) * _lanes_window(c) * mr * vectors
    if fmas >= MAX_FMAS_PER_L2_LINE * total:
        return 0
    shape = list(image.type.shape)
    step = LINE_BYTES // (ir.RankedTensorType(image.type).element_type.width // 8)
    return next((p for p in range(step, 16 * step + 1, step)
                 if _set_load(c, tiles, rows, _row_major(shape[:-1] + [shape[-1] + p]))[0] <= ways), 0)


def _pad_image_rows(rec: StepRecorder, params: ConvolutionParams) -> None:
    """The convolutions whose register tiles' image rows crowd into a few L1 sets
    (`image_row_padding`) read them from longer rows, in one recorded step; a copy only where
    it costs a small part of the convolution (COPY_MIN_TERMS)."""
    found = []
    for c in find_convolutions(rec.trial):
        padding = image_row_padding(c, convolution_tiles(c, params), params)
        image = c.op.operands[c.dims.input_index]
        elements = math.prod(image.type.shape)
        if padding and (filled_insert(image) or c.work >= COPY_MIN_TERMS * elements):
            found.append((place_of(rec.trial.operation, c.op), padding))
    if not found:
        return

    def body(root):
        handles = [(at_place(root, place), padding) for place, padding in found]
        for h, padding in handles:
            pad_image_rows(h, padding)
        canonicalize(match(root, "func.func"))

    rec.step("pad_image_rows", body)


def _generalize_convolutions(rec: StepRecorder) -> None:
    """Named convolutions and the broadcasts feeding them as linalg.generic (the tiles and
    the per-register-tile accumulator work on generics)."""
    names = set()
    for c in find_convolutions(rec.trial):
        names.add(c.op.name)
        init = c.op.operands[2].owner
        init = getattr(init, "operation", init)
        if isinstance(init, ir.Operation) and init.name == "linalg.broadcast":
            names.add(init.name)
    names.discard("linalg.generic")
    if not names:
        return

    def body(root):
        structured.GeneralizeOp(match(root, sorted(names)))

    rec.step("generalize", body)


def plan_convolution(payload: ir.Module, params: ConvolutionParams, generic: GenericParams,
                     matmul_params=None) -> ConvolutionPlan:
    """The fuse stage on a copy of `payload` (after cleanup; read, not rewritten), one
    recorded step at a time, then the vectorize stage's body from what it left. With
    `matmul_params` (the matmul family's MatmulParams of a contraction's (batch, m, n, k)),
    the contractions beside the convolutions (a CNN's linear layers) get the matmul
    family's schedule (schedules.matmul.schedule_contractions), else the generic one's."""
    transform_ext.load(payload.context)
    rec = StepRecorder(ir.Module.parse(str(payload), payload.context))
    rec.step("normalize", _normalize)
    if not schedule_convolutions(rec, params):
        return ConvolutionPlan(None, None)
    if matmul_params is not None:
        matmul.schedule_contractions(rec, matmul_params)
    _prepare_reductions(rec)
    _schedule_others(rec, generic)
    rec.step("canonicalize", lambda root: apply_passes(root, "canonicalize", "cse"))
    return ConvolutionPlan(tuple(rec.steps), vectorize_body(rec.trial, generic))


# The attributes of the ops this schedule took (another family's schedule of the same
# payload leaves them to it: schedules.matmul.plan_matmul).
SCHEDULED = (ROLE, _DONE)


def schedule_convolutions(rec: StepRecorder, params: ConvolutionParams) -> bool:
    """Steps 1-2 of the module docstring for every convolution of `rec.trial` (normalized)
    this schedule takes, last first; False (and nothing scheduled) when none is left."""
    # transposed convolutions: no products of stuffed zeros; strided ones: unit-stride lanes,
    # but for those that take their output channels as lanes (`strided_lanes`)
    _split_phases(rec, "split_transposed", analyze_stuffed, split_transposed_convolution)
    found = find_convolutions(rec.trial)
    unsplit = [c.op for c in found if strided_lanes(c) and wants_channel_lanes(c, found, params)]

    def phases(op):
        if any(op == u for u in unsplit):
            raise Illegal(op, "takes its output channels as lanes, unsplit")
        return analyze_strided(op)

    _split_phases(rec, "split_strided", phases, split_strided_convolution)
    _generalize_convolutions(rec)
    _move_channels_innermost(rec, params)
    _split_lane_tails(rec, params)
    _pad_image_rows(rec, params)
    if not find_convolutions(rec.trial):
        return False
    while True:
        found = find_convolutions(rec.trial)
        if not found:
            return True
        if _shares_its_fill(accumulation_chain(found[-1], found)[0]):
            # CSE merged the zero inits of convolutions of one output shape (a depthwise
            # separable pair): each gets its own, computed per register tile
            rec.step("clone_shared_fills", _clone_shared_fills)
            found = find_convolutions(rec.trial)
        _schedule(rec, accumulation_chain(found[-1], found), params)


def _clone_shared_fills(root: ir.Value) -> None:
    clone_shared_fills(match(root, "func.func"))


def _shares_its_fill(c: Convolution) -> bool:
    """Is the accumulator's start of `c` a linalg.fill that something else reads too?"""
    init = defining_op(c.op.operands[2])
    return init is not None and init.name == "linalg.fill" and len(list(init.results[0].uses)) > 1


def convolution_script(plan: ConvolutionPlan, generic: GenericParams) -> ir.Module:
    """@fuse (the recorded steps in order) and @vectorize; the generic script when the plan
    has no convolution. Needs an active context and location."""
    if plan.fuse is None:
        return generic_script(generic)
    return recorded_script(plan.fuse, plan.vectorize)


# ----------------------------------------------------------------------------- vectorize

def _role_vector_sizes(op: ir.Operation, lanes: int) -> list[int]:
    """The vector sizes of an op with a role: its nominal sizes, but along the lanes a
    static tile narrower than them (a peeled last tile, a narrow image) takes whole vectors
    of `lanes` covering it; its lanes past the edge are masked in reads and writes (a vector
    of 30 lanes would be legalized lane by lane); along any other dim such a tile (a peeled
    last tile of rows) takes its own extent, unmasked."""
    sizes = list(op.attributes[VECTOR_SIZES])
    dim = ir.IntegerAttr(op.attributes[LANES]).value
    for d, extent in enumerate(loop_structure(op).ranges):
        if extent is not None and extent < sizes[d]:
            sizes[d] = -(-extent // lanes) * lanes if d == dim else extent
    return sizes


def _extracts_16_bit(op: ir.Operation) -> bool:
    """Does `op` read a 16-bit tensor element by element (tensor.extract: a gather once
    vectorized, which LLVM's x86 backend cannot select for bf16; such ops, a filter flipped
    for a transposed convolution, stay scalar loops)?"""
    def extracts(inner):
        return inner.name == "tensor.extract" and \
            ir.RankedTensorType(inner.operands[0].type).element_type.width == 16
    return bool(walk_ops(op, extracts))


def _vector_plan(payload: ir.Module, lanes: int):
    """(op with a role, its vector sizes) and the other linalg ops (the matmul family's
    role ops, schedules.matmul.role_vector_plan, left out)."""
    plan, others = [], []

    def visit(op):
        if is_linalg_op(op):
            if ROLE in op.attributes:
                plan.append((op, _role_vector_sizes(op, lanes)))
            elif matmul.ROLE not in op.attributes:
                others.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return plan, others


def vectorize_body(payload: ir.Module, generic: GenericParams):
    """The vectorize stage: each op with a role at its vector sizes (edge tiles masked), the
    matmul family's role ops as it vectorizes them (schedules.matmul.vectorize_roles; the
    packs' transposes left to the target's 16 x 16 blocks), the others tiled and
    vectorized as the generic schedule does; loop invariants hoisted so that the
    accumulator stays in registers across the reduction loops; the tap loops the fuse stage
    marked (`tap_unroll`) unrolled."""
    plan, others = _vector_plan(payload, generic.register_tile[1] // 2)
    tap_factors = sorted({ir.IntegerAttr(op.attributes[_TAPS]).value
                          for op in walk_ops(payload.operation, lambda op: _TAPS in op.attributes)})
    if not plan:
        return generic_vectorize_stage(generic)
    contractions = matmul.role_vector_plan(payload)
    # the other ops vectorized without bf16 dot products: a k step of 1
    policy = VectorPolicy(generic.vector_tile, generic.register_tile)
    tiles = [(op, vector_tile_sizes(op, policy)) for op in others]
    places = places_of(payload.operation, [op for op, _ in plan + tiles])
    contraction_places = places_of(payload.operation, [op for op, _, _ in contractions])
    sizes = [s for _, s in plan]
    gathers = [not _extracts_16_bit(op) for op, _ in tiles]
    orders = [reductions_innermost(loop_structure(op)) for op, _ in tiles]
    ranges = [loop_structure(op).ranges for op, _ in tiles]
    tiles = [s for _, s in tiles]

    def body(root):
        handles = at_places(root, places)
        n = len(plan)
        contraction_handles = at_places(root, contraction_places)
        for h, vector_sizes in zip(handles, sizes):
            structured.VectorizeOp(h, vector_sizes=vector_sizes)
        matmul.vectorize_roles(contraction_handles, [role for _, role, _ in contractions],
                               [sizes for _, _, sizes in contractions])
        for h, sizes_of_tile, gather, order, extents in zip(handles[n:], tiles, gathers, orders,
                                                            ranges):
            if gather:
                tile_to_vector_tile(h, sizes_of_tile, order, extents, _OTHER)
            else:  # no bf16 gathers: stays a (correct) loop nest where it must
                if sizes_of_tile is not None:
                    h, _ = _tile(h, sizes_of_tile)
                vectorize_or_leave(h, gather=False)
        func = match(root, "func.func")

        def to_contractions():
            apply_patterns(func, tvec.ApplyLowerMaskedTransfersPatternsOp)
            apply_patterns(func, tvec.ApplyTransferPermutationPatternsOp)
            # f16/bf16 operands extended inside the contraction (the lowering extends each
            # vector it multiplies, never a 1-lane vector of a unit dim)
            apply_patterns(func, tvec.ApplyVectorReductionToContractPatternsOp,
                           tvec.ApplyFoldArithExtensionPatternsOp)
            canonicalize(func)

        to_contractions()
        # the other ops vectorized once the canonicalization has folded their peeled tiles'
        # sizes to constants (not before: it would fold the register tiles' reductions over
        # a unit dim to adds, which then never become contractions)
        vectorize_marked(func, _OTHER)
        to_contractions()
        drop_contraction_masks(func)
        if contractions:  # a masked edge tile of C unpacked for a reduction, in registers
            forward_masked_writes(func)
        apply_patterns(func, tvec.ApplyCastAwayVectorLeadingOneDimPatternsOp, apply_cse=True)
        canonicalize(func)
        foreach(match(func, "scf.for"), lambda loop: transform.ApplyLoopInvariantCodeMotionOp(loop))
        hoist_loop_invariant_subsets(func)
        canonicalize(func)
        # a masked register tile's accumulator start read back in registers, not through
        # a buffer per tile (its write and read share one mask once hoisted and CSE'd)
        forward_masked_writes(func)
        # a short product's or mat-vec's split k step (elementwise along its lanes) as
        # FMAs of whole vectors, as the generic and matmul schedules do
        lane_contracts_to_fmas(func)
        canonicalize(func)
        for taps in tap_factors:
            marked = structured.MatchOp(any_op(), func, op_attrs={_TAPS: _taps_attr(taps)}).result
            loop.LoopUnrollOp(marked, factor=taps)
        if tap_factors:
            canonicalize(func)
        for attr in (ROLE, VECTOR_SIZES, LANES, _DONE, _TAPS, _OTHER) + matmul.ANNOTATIONS:
            remove_annotation(root, attr)

    return body
