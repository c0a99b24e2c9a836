"""XeGPU tail of the fused linear cross-entropy backward: the two passes of
transform_ext.fuse_linear_cross_entropy_backward_two_pass as two GPU kernels.

Input: the family's `fuse` result in its GPU form with a backward (fuse.py), after the
forward's kernel (xegpu.py): two scf.forall carrying BACKWARD_PASS,
  pass 1 (dh) over blocks of `rows` rows, a loop over class tiles of `step` classes:
    S = h_blk W_c^T [rows, step], G = E(S, ...), dh_blk += G W_c; dh written in h's type;
  pass 2 (dW, db) over blocks of `rows` classes, a loop over row tiles of `step` rows:
    S^T = W_blk h_s^T [rows, step], G^T, dW_blk += G^T h_s, db_blk += sum over the tile's
    rows of G^T; dW and db written in W's (b's) type.
E reads per-row values: the forward kernel's row max m and exp-sum l (in lane form [N, 16],
read back by a max over the lanes: fuse.py, transform_ext.forall_results_in_lane_form), the
count or total weight (a rank-0 result of the reduction kernel, read as a scalar) and the
per-row ops computed from them (log l, the folded one-hot sum,
transform_ext.fold_one_hot_class_sums), which are fused into pass 1 (computed for the
block's rows).
Workgroups (`tile_backward_pass`): one forall iteration = one workgroup; the per-row
producers read through slices fused into the pass and into its loop; unit dims folded.
Pass 1 reads y by a lane-form gather reduced over the lanes and hands the per-row values it
computes (m, log l, the one-hot sums) to pass 2 as [N, 16] lane tiles, which pass 2 reads
at lane 0, a value per column of its tile (`_hand_over_in_lanes`): XeGPU lays a row's
value out in every lane of its row after a reduction, a column's along the lanes, and has
no layout that writes or reads a [rows] vector across kernels.
Depth (`slice_depth`): a subgroup holds its rows' f32 accumulator (dh_s or dW_c, [rows, D])
in registers over the whole depth while its tiles fit the register file (D <= 64 with
steps of 32). A deeper head takes D in slices of `depth_tile` (64 for bf16/f16 on bmg and
pvc) inside each loop step:
    for each D slice d:  S += A[:, d] B[:, d]^T       (S [rows, step] in registers)
    G = E(S, ...)
    for each D slice d:  acc[:, d] += G B[:, d]       (acc's slice loaded, added, stored)
with acc zeroed before the loop and written through its cast after it, slice by slice.
acc lives in memory: each workgroup owns its rows of one f32 [N, D] (pass 1) / [V, D]
(pass 2) device buffer (transform_ext.forall_allocs_to_function), so no atomics and no
synchronisation; its slices are re-read within a step and stay cache-resident. S is
computed once per step (not once per slice: splitting D over separate workgroups would
recompute S D / depth_tile times), and no shared memory holds S or G (splitting D over
the workgroup's subgroups would reduce S across them through SLM, which the XeGPU
distribution does not express). The price is the accumulator's traffic: per step
2 * rows * D * 4 bytes of loads and stores against 4 * rows * step * D DPAS FLOPs.
The loops over D slices carry `llvm.loop_annotation` unroll-disable (DontUnroll in SPIR-V):
IGC unrolls short constant loops whole, which spills once D reaches ~1024.
The per-class vectors: the bias tile b_c is a vector over pass 1's tile columns (a
scattered load along the lanes); pass 2 has the classes as rows and reads b per row of its
tiles once per block by a lane-form gather reduced over the lanes (`_class_vectors_in_lanes`,
as pass 1 reads y) and writes db, a value per row, in lane form, lane 0 of each row storing
(`stores_in_lanes`: transform_ext.scattered_stores_in_lane_form). The class weight w[y_n]
is a per-row gather hoisted out of G and the column sums by the two-pass fusion: pass 1
runs it in lane form (transform_ext.lane_form_gathers, beside the one-hot sums' w[y_n]),
pass 2 reads it per column of its tile, a scattered load at y along the lanes.
Subgroups: the block's `rows` split over `rows / sg_rows` subgroups (sg_layout [n, 1]):
h (pass 1) or W (pass 2) rows, S, G and the accumulator; the loop's operand tile (W_c in
pass 1, h_s in pass 2) is read whole by every subgroup, transposed for S and as stored for
the accumulator's product (two loads: split_transposed_loads), so no value crosses
subgroups.
Layouts (`pass_anchors`, annotated as the forward's kernel): anchors on the 2-D block loads
and stores, the DPAS operands, the lane-form gathers and db's lane-form store (one row per
instruction) and the vectors over a tile's columns (sliced from the logits tile's layout);
the transposed broadcasts and row reductions converted to the tile's row layout
(row_conversions).

Refused by name: f32 h and W (DPAS multiplies f16/bf16), N or V not multiples of the tiles,
D not a multiple of the DPAS depth (16).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured, tensor as ttensor

from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import block_ops, ops_named
from transform_ext.fuse_linear_cross_entropy_backward_two_pass import BACKWARD_PASS

from ..attention.xegpu import (DPAS_TYPES, REGISTER_SHARE, _constant_index,
                               _fuse_sliced_producers, check_tiles, static_bounds)
from ..common import annotate, any_op, apply_patterns, match
from ..script import StepRecorder
from ..xegpu.common import RowSubgroups, passes
from ..xegpu.contraction import block_mapping

# What each pass's workgroup computes, by its BACKWARD_PASS number.
PASS_KINDS = {1: "linear_cross_entropy_dh", 2: "linear_cross_entropy_dw"}
# Rows of the block per subgroup: the DPAS rows.
SG_ROWS = 8


@dataclass(frozen=True)
class BackwardPassTiles(RowSubgroups):
    """One workgroup of a backward pass: `rows` rows of the block (h's rows in pass 1, W's
    classes in pass 2) against `step` columns per loop iteration (classes, rows), depth
    `depth` (D); `sg_rows` rows per subgroup; the DPAS shape; `grid`: workgroups."""

    backward_pass: int
    rows: int
    step: int
    depth: int
    depth_tile: int
    sg_rows: int
    grid: tuple[int, ...]
    dtype: str
    dpas: tuple[int, int, int] = (8, 16, 16)
    subgroup_size: int = 16
    nb_prefetch: int = 1

    @property
    def kind(self) -> str:
        return PASS_KINDS[self.backward_pass]

    @property
    def sg_data(self) -> tuple[int, int]:
        return (self.sg_rows, self.depth_tile)

    @property
    def depth_sliced(self) -> bool:
        """The accumulator in memory, S and the accumulation in loops over D slices."""
        return self.depth_tile < self.depth

    def register_bytes(self) -> int:
        """Live registers of a subgroup in a loop step, `depth_tile` deep: its rows of the
        block's operand (16-bit) and of the f32 accumulator, the step's operand tile
        (16-bit, whole), S and G (f32) of its rows."""
        narrow, r, c, d = 2, self.sg_rows, self.step, self.depth_tile
        return r * d * narrow + r * d * 4 + c * d * narrow + 2 * r * c * 4


def backward_pass_foralls(func: ir.Operation) -> list[ir.Operation]:
    """The top-level foralls of `func` that are passes of the fused backward, in order."""
    return [op for op in block_ops(func) if op.name == "scf.forall"
            and BACKWARD_PASS in op.attributes]


def backward_pass_of(forall: ir.Operation) -> int:
    return ir.IntegerAttr(forall.attributes[BACKWARD_PASS]).value


def _contractions(loop: ir.Operation) -> list[ir.Operation]:
    return [op for op in block_ops(loop) if is_linalg_op(op) and op.name != "linalg.fill"
            and loop_structure(op).is_contraction]


# Depth slices to try, most first (the whole depth when it fits: no loops over D).
DEPTH_TILES = (256, 128, 64, 32, 16)


def check_accumulators(forall: ir.Operation, where: str) -> None:
    """ValueError unless each accumulator of the pass's loop (dh, dW) starts from a fill and
    is written through an epilogue of its own (the cast to the inputs' type), the form
    whose loops over D slices keep the f32 accumulator in memory
    (transform_ext.match_loop_accumulators)."""
    from transform_ext.common import Illegal
    from transform_ext.match_loop_accumulators import loop_accumulators

    try:
        products, _, _, epilogues = loop_accumulators(forall)
    except Illegal as exc:
        raise ValueError(f"{where}: {exc.reason}") from exc
    if not products or len(epilogues) != len(products):
        raise ValueError(f"{where}: {len(products)} accumulators in its loop, "
                         f"{len(epilogues)} written through a cast of their own: a depth "
                         "beyond the registers needs each accumulator cast to the inputs' type")


def plan_backward_pass(forall: ir.Operation, *, subgroup_size: int, dpas: tuple[int, int, int],
                       max_threads: int, grf_bytes: int, nb_prefetch: int = 1,
                       depth_tile: int | None = None) -> BackwardPassTiles:
    """Tiles of one pass read from its IR, validated against the DPAS shape and the chip
    (ValueError naming the dimension otherwise). depth_tile None: the whole depth D when a
    subgroup's tiles fit REGISTER_SHARE of the register file `grf_bytes`, else the largest
    of DEPTH_TILES dividing D that fits (the loops over D slices are kept rolled, so their
    trip count does not matter: slice_depth)."""
    number = backward_pass_of(forall)
    where = f"linear cross-entropy backward pass {number} at {forall.location}"
    loops = ops_named(forall, "scf.for")
    if len(loops) != 1:
        raise ValueError(f"{where}: {len(loops)} loops, not one over the tiles")
    (loop,) = loops
    contractions = _contractions(loop)
    if not contractions:
        raise ValueError(f"{where}: no contraction in its loop")
    logits = loop_structure(contractions[0])
    dims = logits.contraction_dims()
    if any(len(dims[d]) != 1 for d in "mnk") or dims["batch"]:
        raise ValueError(f"{where}: the logits tile is not a plain [rows, columns] contraction")
    rows, step, depth = (logits.ranges[dims[d][0]] for d in "mnk")
    dtypes = sorted({str(ir.RankedTensorType(v.type).element_type)
                     for v in list(contractions[0].operands)[:2]})
    if len(dtypes) != 1 or dtypes[0] not in DPAS_TYPES:
        raise ValueError(f"{where}: h and W of type {' and '.join(dtypes)}: DPAS multiplies f16 "
                         "or bf16 (with f32 accumulation); give h and W in float16 or bfloat16")
    loop_step = _constant_index(loop.operands[2])
    if loop_step != step:
        raise ValueError(f"{where}: loop step {loop_step} differs from the tile's {step}")
    dm, dn, dk = dpas
    budget = int(grf_bytes * REGISTER_SHARE)

    def tiles(depth_tile):
        return BackwardPassTiles(number, rows, step, depth, depth_tile, SG_ROWS,
                                 tuple(static_bounds(forall, where)), dtypes[0], dpas,
                                 subgroup_size, nb_prefetch)

    if depth_tile is None:
        candidates = [depth] + [d for d in DEPTH_TILES if d < depth and depth % d == 0]
        depth_tile = next((d for d in candidates if tiles(d).register_bytes() <= budget),
                          candidates[-1])
    if depth_tile < depth:
        check_accumulators(forall, where)
    planned = tiles(depth_tile)
    checks = [("rows per workgroup", rows, SG_ROWS, "rows per subgroup"),
              ("rows per subgroup", SG_ROWS, dm, "DPAS rows"),
              ("loop step", step, dk, "DPAS depth"),
              ("loop step", step, dn, "DPAS columns"),
              ("depth D", depth, dk, "DPAS depth"),
              ("depth D", depth, dn, "DPAS columns"),
              ("depth D", depth, depth_tile, "depth tile"),
              ("depth tile", depth_tile, dk, "DPAS depth"),
              ("depth tile", depth_tile, dn, "DPAS columns")]
    check_tiles(where, planned, checks, max_threads, grf_bytes,
                "the LIGHTHOUSE row_tile and class_tile")
    return planned


# -------------------------------------------------------------------------------- tiling

def _hand_over_in_lanes(rec: StepRecorder, tiles: BackwardPassTiles, forall_now, mark) -> None:
    """Pass 1's per-row data in lane form: it reads the targets through a lane-form gather
    reduced over the lanes (transform_ext.load_rows_in_lane_form, the chain fused in), and
    the per-row values it computes for pass 2 (the row max, log l, the one-hot sums) leave
    it as [N, 16] lane tiles that pass 2 reads at lane 0, a value per column of its tile
    (transform_ext.forall_results_in_lane_form)."""
    from transform_ext.filter_iterators import filter_iterators
    from transform_ext.forall_results_in_lane_form import forall_results_in_lane_form
    from transform_ext.lane_form_gathers import lane_form_gathers
    from transform_ext.load_rows_in_lane_form import load_rows_in_lane_form

    rows = tiles.rows * tiles.grid[0]

    def targets(root):
        load_rows_in_lane_form(match(_pass_handle(match(root, "func.func"), 1),
                                     "tensor.extract_slice"), rows, tiles.subgroup_size)

    rec.step("targets_in_lanes", targets)
    _fuse_sliced_producers(rec, forall_now, lambda func: _pass_handle(func, 1), mark)

    def gathers(root):
        pass_ops = match(_pass_handle(match(root, "func.func"), 1), "linalg.generic")
        lane_form_gathers(filter_iterators(pass_ops, ["parallel"]), tiles.subgroup_size)

    rec.step("gathers_in_lanes", gathers)
    rec.step("canonicalize", passes("canonicalize", "cse"))

    def results(root):
        forall_results_in_lane_form(_pass_handle(match(root, "func.func"), 1),
                                    tiles.subgroup_size, read="first")

    rec.step("results_in_lanes", results)
    rec.step("canonicalize", passes("canonicalize", "cse"))


def _class_vectors_in_lanes(rec: StepRecorder, tiles: BackwardPassTiles, forall_now,
                            mark) -> None:
    """Pass 2's per-class vectors (the bias b_c: a value per row of its [classes, rows]
    tiles) read through a lane-form gather reduced over the lanes
    (transform_ext.load_rows_in_lane_form over the [V] float arguments it slices), the
    layout of a reduction over a tile's columns, as pass 1 reads y."""
    from transform_ext.filter_by_element_type import filter_by_element_type
    from transform_ext.load_rows_in_lane_form import load_rows_in_lane_form

    classes = tiles.rows * tiles.grid[0]
    element = {"bf16": ir.BF16Type, "f16": ir.F16Type}[tiles.dtype].get()

    def vectors(root):
        slices = match(_pass_handle(match(root, "func.func"), 2), "tensor.extract_slice")
        load_rows_in_lane_form(filter_by_element_type(slices, element), classes,
                               tiles.subgroup_size)

    rec.step("class_vectors_in_lanes", vectors)
    _fuse_sliced_producers(rec, forall_now, lambda func: _pass_handle(func, 2), mark)


def _pass_handle(func: ir.Value, number: int) -> ir.Value:
    return structured.MatchOp(any_op(), func, ops=["scf.forall"], op_attrs={
        BACKWARD_PASS: ir.IntegerAttr.get(ir.IntegerType.get_signless(64), number)}).result


def tile_backward_pass(rec: StepRecorder, tiles: BackwardPassTiles) -> None:
    """Workgroup form of one pass (module docstring): the per-row producers it reads
    through slices fused into it and into its loop; transposes and copies generalized,
    unit dims folded, block mapping attached; steps of `rec`."""
    from ..generic import func_ops

    number = tiles.backward_pass

    def forall_now():
        (func,) = func_ops(rec.trial)
        (forall,) = [f for f in backward_pass_foralls(func) if backward_pass_of(f) == number]
        return forall

    i64 = ir.IntegerType.get_signless(64)
    mark = lambda handle: annotate(handle, BACKWARD_PASS, ir.IntegerAttr.get(i64, number))
    _fuse_sliced_producers(rec, forall_now, lambda func: _pass_handle(func, number), mark)
    _fuse_sliced_producers(rec, lambda: ops_named(forall_now(), "scf.for")[0],
                           lambda func: match(_pass_handle(func, number), "scf.for"))
    if number == 1:
        _hand_over_in_lanes(rec, tiles, forall_now, mark)
    else:
        _class_vectors_in_lanes(rec, tiles, forall_now, mark)

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
    if tiles.depth_sliced:
        slice_depth(rec, tiles, lambda root: _pass_handle(match(root, "func.func"), number))
    dims = len(tiles.grid)

    def map_to_blocks(root):
        annotate(_pass_handle(match(root, "func.func"), number), "mapping", block_mapping(dims))

    rec.step("map_to_workgroups", map_to_blocks)


def slice_depth(rec: StepRecorder, tiles: BackwardPassTiles, pass_of) -> None:
    """The pass over D in slices of `depth_tile` (`pass_of(root)`: a handle to the pass's
    forall): in its loop, S = A B^T accumulated over D slices (a loop over D inside the
    step, S its accumulator), then acc[:, d] += G B[:, d] per D slice (a second loop over
    D: the accumulator's slice read, added to, written back); before the loop the
    accumulator zeroed and after it written through its cast, slice by slice. The
    accumulator [rows, D] f32 is then loop state in memory, not in registers (no vector
    of the whole depth), one buffer per workgroup after bufferization
    (transform_ext.forall_allocs_to_function); S is computed once per step, not once per
    slice. The four loops over D are annotated unroll-disable (module docstring)."""
    from transform_ext.match_loop_accumulators import match_loop_accumulators

    dt = tiles.depth_tile

    def body(root):
        products, logits, fills, epilogues = match_loop_accumulators(pass_of(root))
        no_unroll = ir.Attribute.parse("#llvm.loop_annotation<unroll = <disable = true>>")
        for handle, sizes in ((logits, [0, 0, dt]), (products, [0, dt, 0]),
                              (fills, [0, dt]), (epilogues, [0, dt])):
            loops = structured.TileUsingForOp(handle, sizes=sizes).loops
            annotate(loops[0], "llvm.loop_annotation", no_unroll)

    rec.step("depth_slices", body)
    rec.step("canonicalize", passes("canonicalize", "cse"))


# ------------------------------------------------------------------------------- layouts

def stores_in_lanes(rec: StepRecorder, gpu_func: ir.Operation, lanes: int) -> None:
    """Step of `rec`: pass 2's column sums of its classes (db, a value per row of its tiles)
    written in lane form, lane 0 of each row (transform_ext.scattered_stores_in_lane_form)."""
    from transform_ext.scattered_stores_in_lane_form import scattered_stores_in_lane_form

    from ..common import at_place, place_of

    place = place_of(rec.trial.operation, gpu_func)

    def body(root):
        scattered_stores_in_lane_form(at_place(root, place), lanes)

    rec.step("stores_in_lanes", body)


def pass_anchors(gpu_func: ir.Operation, tiles: BackwardPassTiles) -> dict[str, list]:
    """The anchor layouts of one outlined pass after convert-vector-to-xegpu and
    split_transposed_loads, per ANCHOR_OPS name in structured.match order (a layout per
    operand for xegpu.dpas): the block's rows split over the subgroups (the block's tile,
    every DPAS A operand and result, the stores); DPAS B operands whole in every subgroup
    (read transposed with order [0, 1]); the per-row vectors sliced from the [rows, step]
    logits tile's layout: a row's value (pass 1: dims [1]) or a step column's (pass 2:
    dims [0])."""
    from ..attention.xegpu_backward import _dpas_reader, _layout
    from .xegpu import ANCHOR_OPS, row_conversions

    dm, dn, dk = tiles.dpas
    n, r = tiles.subgroups, tiles.sg_rows
    where = f"{tiles.kind} kernel {gpu_func.attributes['sym_name']}"
    rows = lambda cols, inst: _layout([n, 1], [r, cols], inst)
    whole = lambda shape, inst, **extra: _layout([1, 1], shape, inst, **extra)
    anchors = {name: [] for name in ANCHOR_OPS}
    for load in ops_named(gpu_func, "xegpu.load_nd"):
        shape = list(ir.VectorType(load.results[0].type).shape)
        users = [getattr(u.owner, "operation", u.owner) for u in load.results[0].uses]
        reader = _dpas_reader(load.results[0])
        if users and all(u.name == "vector.transpose" for u in users):
            anchors["xegpu.load_nd"].append(whole(shape, [dn, dk], order=[0, 1]))
        elif reader is not None and reader[1] == 1:
            anchors["xegpu.load_nd"].append(whole(shape, [dk, dn]))
        elif shape[0] == tiles.rows:
            anchors["xegpu.load_nd"].append(rows(shape[1], [dm, dk]))
        else:
            raise ValueError(f"{where}: a [{shape[0]}, {shape[1]}] tile that is neither the "
                             f"block's rows ({tiles.rows}) nor a DPAS B operand")
    for dpas in ops_named(gpu_func, "xegpu.dpas"):
        (m, k), (_, cols) = (ir.VectorType(v.type).shape for v in list(dpas.operands)[:2])
        if m != tiles.rows:
            raise ValueError(f"{where}: a DPAS of {m} rows, not the block's {tiles.rows}")
        b = dpas.operands[1].owner
        transposed = getattr(b, "operation", b).name == "vector.transpose"
        anchors["xegpu.dpas"].append((rows(k, [dm, dk]),
                                      whole([k, cols], [dk, dn], **({"order": [1, 0]}
                                                                      if transposed else {})),
                                      rows(cols, [dm, dn])))
    for store in ops_named(gpu_func, "xegpu.store_nd"):
        anchors["xegpu.store_nd"].append(rows(ir.VectorType(store.operands[0].type).shape[1],
                                              [dm, dn]))
    logits = rows(tiles.step, [dm, dn])
    for op in ops_named(gpu_func, "xegpu.load"):
        shape = list(ir.VectorType(op.results[0].type).shape)
        if shape == [tiles.rows, tiles.subgroup_size]:
            # the block's per-row data in lane form (pass 1: the targets, pass 2: the bias
            # of its classes): one row per instruction
            anchors["xegpu.load"].append(rows(shape[1], [1, tiles.subgroup_size]))
        elif shape == [tiles.step]:
            # a value per column of the step's tile: pass 1's bias tile, pass 2's per-row
            # values (read at lane 0)
            anchors["xegpu.load"].append(dict(logits, slice_dims=[0]))
        else:
            raise ValueError(f"{where}: a {shape} scattered load that is neither the block's "
                             "targets in lane form (pass 1) nor a vector over the step's "
                             "columns")
    for op in ops_named(gpu_func, "xegpu.store"):
        shape = list(ir.VectorType(op.operands[0].type).shape)
        if tiles.backward_pass != 2 or shape != [tiles.rows, tiles.subgroup_size]:
            raise ValueError(f"{where}: a {shape} scattered store that is not pass 2's column "
                             "sums of its classes (db) in lane form")
        # db in lane form, lane 0 of each row writing: one row per instruction
        anchors["xegpu.store"].append(rows(shape[1], [1, tiles.subgroup_size]))
    anchors["conversions"] = row_conversions(gpu_func, tiles.rows, n, r, (dm, dn))
    return anchors
