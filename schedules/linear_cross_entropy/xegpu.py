"""XeGPU tail of the fused linear cross-entropy forward: its row-block forall as one GPU
kernel, then the cross-entropy family's reduction kernel.

Input: the family's `fuse` result in its GPU form (params classes_major=False,
masked_target=True, lanes=16; fuse.py): one `scf.forall` over blocks of `rows` rows
(ROW_BLOCKS) whose body reads y in lane form ([rows, 16] gathers reduced over the lanes)
and holds one loop over class tiles of `class_tile` classes: the logits tile
S = h_blk W_tile^T (+ b_tile) [rows, class_tile], the running max m, the rescaled exp-sum
l and the target logit sum_c (c == y_n ? S[n, c] : 0); then the rows' losses (b_{y_n} and
the class weight w_{y_n} gathered in lane form), written as a lane-form [rows, 16] f32
tile. Outside it: the reductions over the rows of those tiles (the mean or sum, the count
or total weight reading y and w themselves) and the host's bounds check of the targets.

Workgroups (`tile_linear_cross_entropy`): one forall iteration = one workgroup; the
producers it and its class loop read through slices (h, W and b tiles) fused in, unit dims
folded; the logits contraction tiled over D in steps of `depth_tile` when the h and W tiles
of the whole depth would not fit the registers (a loop over D inside the class loop, the
logits tile its accumulator). The reductions over the rows become the cross_entropy
family's reduction kernel (`lower_row_sums`: one workgroup of one subgroup).
Subgroups: `rows / sg_rows` subgroups, each owning `sg_rows` rows of h, S and the per-row
vectors (sg_layout [n, 1]); the W tile is read whole by every subgroup (a transposed 2-D
block read), so the class reductions stay inside a subgroup.
Vectorization (schedules/xegpu/common.py): S = h W^T is a DPAS on f16/bf16 h and W with f32
accumulation; the lane-form gathers are scattered loads.
Layouts (`kernel_anchors`, `annotate_linear_cross_entropy`): anchors on every 2-D block
load and store (rows split, or W whole and transposed), on the DPAS and on the scattered
loads; the results of the per-row vectors' transposed broadcasts and of the reductions
over a tile's columns converted to (slices of) the tile's row layout
(transform_ext.convert_result_layouts), where XeGPU's propagation would otherwise re-lay
S out after the per-row layouts.
After bufferization the target check reads a host copy of y before the first launch (the
cross_entropy family's finish_bufferized).

Not lowered (the reason in a one-line error): f32 h and W (DPAS multiplies f16/bf16), N or
V not multiples of the tiles, a second sweep over the classes (label smoothing of f16/bf16
logits; refused by the plan), per-row losses as the result (reduction='none').
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured, tensor as ttensor, xegpu

from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import block_ops, ops_named
from transform_ext.match_logits_contraction import match_logits_contraction

from ..attention.xegpu import (DPAS_TYPES, REGISTER_SHARE, _constant_index,
                               _fuse_sliced_producers, check_tiles, static_bounds)
from ..common import annotate, any_op, apply_patterns, canonicalize, match
from ..script import StepRecorder
from ..xegpu.common import RowSubgroups, passes
from ..xegpu.contraction import block_mapping, split
from .fuse import ROW_BLOCKS

KIND = "linear_cross_entropy"
# Rows per subgroup to try, most first: the DPAS rows (16 rows against 16-class tiles gave
# layout conversions XeGPU's blocking cannot distribute).
SG_ROWS = (8,)


@dataclass(frozen=True)
class LinearCrossEntropyTiles(RowSubgroups):
    """One workgroup: `rows` rows of h against all classes, `class_tile` classes per step,
    depth `depth` in steps of `depth_tile` (a loop over D inside the class loop when it is
    less); `sg_rows` rows per subgroup; the DPAS shape; `grid`: workgroups."""

    rows: int
    class_tile: int
    depth: int
    depth_tile: int
    sg_rows: int
    grid: tuple[int, ...]
    dtype: str
    dpas: tuple[int, int, int] = (8, 16, 16)
    subgroup_size: int = 16
    nb_prefetch: int = 1

    @property
    def sg_data(self) -> tuple[int, int]:
        return (self.sg_rows, self.class_tile)

    def register_bytes(self) -> int:
        """Live registers of a subgroup in a class step: its rows of an h tile and the W
        tile (16-bit, `depth_tile` deep: the step of the loop over D), S and exp(S - m)
        (f32) and the target comparison (i64 class indices of the tile), plus the rows'
        m, l, target logit and target."""
        narrow, r, c, d = 2, self.sg_rows, self.class_tile, self.depth_tile
        return r * d * narrow + c * d * narrow + 2 * r * c * 4 + r * c * 8 + 4 * r * 8


def row_block_forall(func: ir.Operation) -> ir.Operation | None:
    """The family's row-block forall in `func`'s block, if any."""
    return next((op for op in block_ops(func) if op.name == "scf.forall"
                 and ROW_BLOCKS in op.attributes), None)


def _match_forall(func: ir.Value) -> ir.Value:
    return structured.MatchOp(any_op(), func, ops=["scf.forall"],
                              op_attrs={ROW_BLOCKS: ir.UnitAttr.get()}).result


# Depth steps to try, most first (the whole depth when it fits: no loop over D).
DEPTH_TILES = (256, 128, 64, 32, 16)
# IGC 2.40 unrolls a depth loop of up to UNROLL_TRIPS steps whole; unrolled, it builds
# without spills while D x depth_tile <= UNROLLED_ELEMENTS. Calibrated on bf16 builds for bmg
# (8 rows per subgroup, 32 classes per step; D / depth tile: spill bytes): 256/64, 512/64,
# 512/32, 768/64, 768/32, 1024/32, 1024/16: 0 (unrolled); 1024/64: 832; 2048/32: 6,400
# (unrolled); 2048/16, 4096/32: 0 (not unrolled, 128 steps).
UNROLL_TRIPS = 64
UNROLLED_ELEMENTS = 32 * 1024


def _unrolls_without_spills(depth: int, depth_tile: int) -> bool:
    return depth // depth_tile > UNROLL_TRIPS or depth * depth_tile <= UNROLLED_ELEMENTS


def plan_linear_cross_entropy(forall: ir.Operation, *, sg_rows: int | None,
                              subgroup_size: int, dpas: tuple[int, int, int], max_threads: int,
                              grf_bytes: int, nb_prefetch: int = 1,
                              depth_tile: int | None = None) -> LinearCrossEntropyTiles:
    """Tiles of the fused kernel read from its IR, validated against the DPAS shape and the
    chip (ValueError naming the dimension otherwise). sg_rows None: SG_ROWS' first that
    divides the rows; depth_tile None: the whole depth D when the tiles fit REGISTER_SHARE
    of the register file `grf_bytes`, else the largest of DEPTH_TILES dividing D that
    does and whose loop over D builds without spills (_unrolls_without_spills)."""
    where = f"linear cross-entropy at {forall.location}"
    loops = ops_named(forall, "scf.for")
    if len(loops) != 1:
        raise ValueError(f"{where}: {len(loops)} class loops (a second sweep over the classes, "
                         "label smoothing of f16/bf16 logits, has no GPU mapping yet)")
    (loop,) = loops
    contractions = [op for op in block_ops(loop) if is_linalg_op(op)
                    and op.name != "linalg.fill" and loop_structure(op).is_contraction]
    if len(contractions) != 1:
        raise ValueError(f"{where}: the class loop holds {len(contractions)} contractions, "
                         "not the one logits tile")
    ls = loop_structure(contractions[0])
    dtypes = sorted({str(ir.RankedTensorType(v.type).element_type)
                     for v in list(contractions[0].operands)[:2]})
    if len(dtypes) != 1 or dtypes[0] not in DPAS_TYPES:
        raise ValueError(f"{where}: h and W of type {' and '.join(dtypes)}: DPAS multiplies f16 "
                         "or bf16 (with f32 accumulation); give h and W in float16 or bfloat16 "
                         "(the CPU target takes f32)")
    dtype = dtypes[0]
    dims = ls.contraction_dims()
    if any(len(dims[d]) != 1 for d in "mnk") or dims["batch"]:
        raise ValueError(f"{where}: the logits tile is not a plain [rows, classes] contraction")
    rows, class_tile, depth = (ls.ranges[dims[d][0]] for d in "mnk")
    step = _constant_index(loop.operands[2])
    if step != class_tile:
        raise ValueError(f"{where}: class loop step {step} differs from the class tile "
                         f"{class_tile} (the classes are not a multiple of the class tile)")
    extra = [op for op in block_ops(forall.regions[0].blocks[0]) if is_linalg_op(op)
             and loop_structure(op).is_contraction and op.name != "linalg.fill"]
    if extra:
        raise ValueError(f"{where}: a contraction outside the class loop (a remainder tile of "
                         "the classes) has no GPU form yet; choose class_tile dividing V")
    bounds = static_bounds(forall, where)
    dm, dn, dk = dpas
    budget = int(grf_bytes * REGISTER_SHARE)

    def tiles(r, d):
        return LinearCrossEntropyTiles(rows, class_tile, depth, d, r, tuple(bounds), dtype,
                                       dpas, subgroup_size, nb_prefetch)

    if sg_rows is None:
        sg_rows = next((r for r in SG_ROWS if rows % r == 0 and r % dm == 0), SG_ROWS[-1])
    if depth_tile is None:
        candidates = [depth] + [d for d in DEPTH_TILES if d < depth and depth % d == 0]
        fitting = [d for d in candidates if tiles(sg_rows, d).register_bytes() <= budget
                   and (d == depth or _unrolls_without_spills(depth, d))]
        depth_tile = fitting[0] if fitting else candidates[-1]
    checks = [("rows per workgroup", rows, sg_rows, "rows per subgroup"),
              ("rows per subgroup", sg_rows, dm, "DPAS rows"),
              ("class tile", class_tile, dn, "DPAS columns"),
              ("depth D", depth, depth_tile, "depth tile"),
              ("depth tile", depth_tile, dk, "DPAS depth")]
    planned = tiles(sg_rows, depth_tile)
    check_tiles(where, planned, checks, max_threads, grf_bytes,
                "the LIGHTHOUSE class_tile or the depth tile (XeGpuParams.k_tile)")
    return planned


def tile_linear_cross_entropy(rec: StepRecorder, tiles: LinearCrossEntropyTiles) -> None:
    """Workgroup form of the row-block forall (module docstring); steps of `rec`."""
    from ..generic import func_ops

    def forall_now():
        (func,) = func_ops(rec.trial)
        return row_block_forall(func)

    _fuse_sliced_producers(rec, forall_now, lambda func: _match_forall(func))
    _fuse_sliced_producers(rec, lambda: ops_named(forall_now(), "scf.for")[0],
                           lambda func: match(_match_forall(func), "scf.for"))

    def fold(root):
        func = match(root, "func.func")
        structured.GeneralizeOp(match(func, ["linalg.transpose", "linalg.copy"]))
        apply_patterns(func, structured.ApplyFoldUnitExtentDimsViaReshapesPatternsOp,
                       transform.ApplyCanonicalizationPatternsOp)
        apply_patterns(func, ttensor.ApplyReassociativeReshapeFoldingPatternsOp,
                       ttensor.ApplyBubbleUpExtractSlicePatternsOp,
                       transform.ApplyCanonicalizationPatternsOp)

    rec.step("fold_unit_dims", fold)
    rec.step("canonicalize", passes("canonicalize", "cse"))
    if tiles.depth_tile < tiles.depth:
        def depth_loop(root):
            class_loop = match(_match_forall(match(root, "func.func")), "scf.for")
            structured.TileUsingForOp(match_logits_contraction(class_loop),
                                      sizes=[0, 0, tiles.depth_tile])

        rec.step("depth_loop", depth_loop)
        rec.step("canonicalize", passes("canonicalize", "cse"))
    dims = len(tiles.grid)

    def map_to_blocks(root):
        annotate(_match_forall(match(root, "func.func")), "mapping", block_mapping(dims))

    rec.step("map_to_workgroups", map_to_blocks)


# ------------------------------------------------------------------------------- layouts

ANCHOR_OPS = ("xegpu.load_nd", "xegpu.dpas", "xegpu.store_nd", "xegpu.load", "xegpu.store")


def _layout(sg_layout, sg_data, inst_data, **extra) -> dict:
    return {"sg_layout": list(sg_layout), "sg_data": list(sg_data), "inst_data": list(inst_data),
            **extra}


def kernel_anchors(gpu_func: ir.Operation, tiles: LinearCrossEntropyTiles) -> dict[str, list]:
    """The anchor layouts of the outlined kernel after convert-vector-to-xegpu, per
    ANCHOR_OPS name in structured.match order (for xegpu.dpas one per operand): h tiles,
    the lane-form gather of y ([rows, 16], one row per instruction) and the lane-form
    store of the losses split by rows over the subgroups, the W tile whole and read
    transposed (DPAS B); the results of the transposed broadcasts of per-row vectors and
    of the class reductions laid out as S (or sliced from it)."""
    dm, dn, dk = tiles.dpas
    n, r = tiles.subgroups, tiles.sg_rows
    where = f"{KIND} kernel {gpu_func.attributes['sym_name']}"
    rows = lambda cols, inst: _layout([n, 1], [r, cols], inst)
    anchors = {name: [] for name in ANCHOR_OPS}
    dpas_ops = ops_named(gpu_func, "xegpu.dpas")
    b_loads = set()
    for dpas in dpas_ops:
        b = dpas.operands[1].owner
        b = getattr(b, "operation", b)
        while b.name in ("vector.transpose", "arith.extf", "arith.truncf"):
            b = getattr(b.operands[0].owner, "operation", b.operands[0].owner)
        b_loads.add(b)
    for load in ops_named(gpu_func, "xegpu.load_nd"):
        shape = list(ir.VectorType(load.results[0].type).shape)
        if load in b_loads:
            anchors["xegpu.load_nd"].append(_layout([1, 1], shape, [dn, dk], order=[0, 1]))
        elif shape[0] == tiles.rows:
            anchors["xegpu.load_nd"].append(rows(shape[1], [dm, dk]))
        else:
            raise ValueError(f"{where}: a [{shape[0]}, {shape[1]}] tile that is neither the "
                             f"block's rows ({tiles.rows}) nor the W tile")
    for dpas in dpas_ops:
        (m, k), (_, cols) = (ir.VectorType(v.type).shape for v in list(dpas.operands)[:2])
        if m != tiles.rows:
            raise ValueError(f"{where}: a DPAS of {m} rows, not the block's {tiles.rows}")
        anchors["xegpu.dpas"].append((rows(k, [dm, dk]),
                                      _layout([1, 1], [k, cols], [dk, dn], order=[1, 0]),
                                      rows(cols, [dm, dn])))
    for store in ops_named(gpu_func, "xegpu.store_nd"):
        anchors["xegpu.store_nd"].append(rows(ir.VectorType(store.operands[0].type).shape[1],
                                              [dm, dn]))
    anchors["conversions"] = row_conversions(gpu_func, tiles.rows, n, r, (dm, dn))
    for op in ops_named(gpu_func, "xegpu.load"):
        shape = list(ir.VectorType(op.results[0].type).shape)
        if shape == [tiles.class_tile]:
            # a class vector (the bias tile) broadcast over the rows: S's layout, sliced
            anchors["xegpu.load"].append(dict(rows(tiles.class_tile, [dm, dn]), slice_dims=[0]))
            continue
        if len(shape) != 2 or shape[0] != tiles.rows:
            raise ValueError(f"{where}: a {shape} scattered load that is not the block's "
                             "targets in lane form")
        anchors["xegpu.load"].append(rows(shape[1], [1, tiles.subgroup_size]))
    if ops_named(gpu_func, "xegpu.store"):
        raise ValueError(f"{where}: a scattered store (per-row results leave in lane form)")
    return anchors


def row_conversions(gpu_func: ir.Operation, rows: int, subgroups: int, sg_rows: int,
                    inst: tuple[int, int]) -> list:
    """Per-row vectors broadcast over a tile (m and y over the class tile, the losses over
    the lanes) are transposed broadcasts: their results take the tile's row layout (the
    block's `rows` split over the subgroups), which no anchor reaches through the class
    reductions; the reductions over a tile's columns (the class sums, y's max over the
    lanes) give results sliced from it (else the per-row layouts that meet in the rows' ops
    reach back and re-lay the tiles out). (op name, count, [(place, layout)]) per op name."""
    def layout(cols):
        return (f"#xegpu.layout<sg_layout = {[subgroups, 1]}, sg_data = {[sg_rows, cols]}, "
                f"inst_data = {list(inst)}>")

    transposes = ops_named(gpu_func, "vector.transpose")
    broadcasts = [(i, layout(ir.VectorType(op.results[0].type).shape[1]))
                  for i, op in enumerate(transposes)
                  if getattr(op.operands[0].owner, "name", "") == "vector.broadcast"]
    reductions = ops_named(gpu_func, "vector.multi_reduction")
    row_sums = [(i, f"#xegpu.slice<{layout(ir.VectorType(op.operands[0].type).shape[1])}, "
                    "dims = [1]>")
                for i, op in enumerate(reductions)
                if ir.VectorType(op.operands[0].type).shape[0] == rows]
    return [("vector.transpose", len(transposes), broadcasts),
            ("vector.multi_reduction", len(reductions), row_sums)]


def annotate_linear_cross_entropy(gpu_func: ir.Value, anchors: dict[str, list]) -> None:
    """Transform IR: the anchor layouts of `kernel_anchors` (gpu_func a handle), each op
    taken by its place among the ops of its name that structured.match finds, after the
    result conversions (convert_result_layouts)."""
    from transform_ext.convert_result_layouts import convert_result_layouts

    for name, count, conversions in anchors["conversions"]:
        handles = split(match(gpu_func, name), count)
        for i, layout in conversions:
            convert_result_layouts(handles[i], layout, layout)
    for name in ANCHOR_OPS:
        layouts = anchors[name]
        for handle, layout in zip(split(match(gpu_func, name), len(layouts)), layouts):
            if name == "xegpu.dpas":
                for index, operand in enumerate(layout):
                    xegpu.set_anchor_layout(handle, index=index, **operand)
            else:
                xegpu.set_anchor_layout(handle, **layout)
    canonicalize(gpu_func)


# ------------------------------------------------------------------ reductions over rows

def row_sum_ops(func: ir.Operation) -> tuple[list[ir.Operation], list[ir.Operation]]:
    """(the rank-0 ops after the forall: the reductions over the rows of the lane-form
    losses and the mean; the other linalg ops outside the forall and the host's target
    checks, which have no kernel)."""
    from transform_ext.analysis.loss_kernels import kernel_groups

    groups = kernel_groups(func.regions[0].blocks[0])
    after = [op for op, g in groups.items() if g == "after"]
    other = [op for op, g in groups.items() if g not in ("after", "host")
             and op.name != "linalg.fill"]
    return after, other


def lower_row_sums(rec: StepRecorder, rows: int, subgroup_size: int):
    """The reductions over the rows as the cross_entropy family's reduction kernel (one
    workgroup of one subgroup looping over [row_tile, 16] lane-form tiles,
    schedules/cross_entropy/xegpu.py), outlined after the row-block forall; returns its
    LossKernel."""
    from transform_ext.match_loss_kernels import match_loss_kernels
    from transform_ext.outline_into_forall import outline_into_forall

    from ..cross_entropy.xegpu import KERNEL_ATTR, _remove_marks, _row_sum_loops, _step
    from ..cross_entropy.xegpu_plan import LossKernel, RowSumTiles

    row_tile = next(t for t in (16, 8, 4, 2, 1) if rows % t == 0)
    tiles = RowSumTiles(rows, row_tile, subgroup_size)

    def body(root):
        forall = outline_into_forall(match_loss_kernels(match(root, "func.func")).after,
                                     rows=0, total_rows=rows, mapping=block_mapping(1))
        annotate(forall, KERNEL_ATTR, "row_sum_after")

    _step(rec, "outline_row_sums", body)
    rec.step("canonicalize", passes("canonicalize", "cse"))
    _row_sum_loops(rec, "row_sum_after", row_tile)
    rec.step("remove_marks", _remove_marks)
    rec.step("canonicalize", passes("canonicalize", "cse"))
    return LossKernel("row_sum", f"linear cross-entropy over {rows} rows: reductions over "
                      "the rows of the row losses (the mean or sum)", tiles)
