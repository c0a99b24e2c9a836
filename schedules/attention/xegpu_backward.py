"""XeGPU tail of the attention backward: the two passes of
transform_ext.fuse_attention_backward_two_pass as two GPU kernels.

Input: the attention family's `fuse` result with a backward in two passes, each an
scf.forall carrying BACKWARD_PASS:
  pass 1 (dQ) over (groups, query blocks of `rows` queries), a first key loop computing the
    rows' lse (unless the forward's is given) and a key loop of `step` keys per iteration:
    S = c Q K^T, P, dP = dO V^T, dS, dQ += dS K; it writes dQ and the rows' lse and D;
  pass 2 (dK, dV) over (K/V groups, key blocks of `rows` keys), a loop over the group's
    query heads and one over query tiles of `step` rows: S^T = c K Q^T, P^T, dV += P^T dO,
    dP^T = V dO^T, dS^T, dK += dS^T Q.
Workgroups (`tile_backward`): one forall iteration = one workgroup; the transposes of Q, K,
V and dO that the template computes outside are fused into the loops that read them, so
every tile is read from the inputs (a transposed tile by a transposed 2-D block read).
Subgroups: the block's rows split over `rows / sg_rows` subgroups (sg_layout [n, 1]):
Q, dO, O, S, P, dP, dS and dQ of pass 1, K, V, S^T, P^T, dP^T, dS^T, dK, dV of pass 2;
the tiles of the loop's other operand (K, K^T, V^T in pass 1; Q, Q^T, dO, dO^T in pass
2) and the per-query vectors lse and D of pass 2 are read whole by every subgroup. Every
contraction reduces over what a subgroup holds whole (the head dim, or the loop step's
columns), so no value crosses subgroups.
Vectorization (schedules/xegpu/common.py): every contraction is a DPAS on f16/bf16 operands
(the computed P and dS rounded to the input type, the scale applied to the f32 product),
f32 accumulation.
Layouts (`annotate_backward`): anchors on every 2-D block load (rows split or whole, a
transposed read with order [0, 1]), on every DPAS and on the stores.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured, tensor as ttensor, xegpu

from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import block_ops, ops_named
from transform_ext.fuse_attention_backward_two_pass import BACKWARD_PASS

from ..common import annotate, any_op, apply_patterns, canonicalize, match
from ..script import StepRecorder
from ..xegpu.common import RowSubgroups, passes
from ..xegpu.contraction import block_mapping, split
from .xegpu import (REGISTER_SHARE, _constant_index, _fuse_sliced_producers, check_tiles,
                    input_dtype, static_bounds)

# What each pass's workgroup computes, by its BACKWARD_PASS number.
PASS_KINDS = {1: "attention_dq", 2: "attention_dkv"}


@dataclass(frozen=True)
class BackwardTiles(RowSubgroups):
    """One workgroup of a backward pass: `rows` rows of the block (queries in pass 1, keys
    in pass 2) against `step` columns (keys, queries) per loop iteration, head dim `dim`;
    `sg_rows` rows per subgroup; the DPAS shape; `grid`: workgroups per forall dim."""

    backward_pass: int
    rows: int
    step: int
    dim: int
    sg_rows: int
    grid: tuple[int, ...]
    dtype: str
    dpas: tuple[int, int, int] = (8, 16, 16)
    subgroup_size: int = 16
    nb_prefetch: int = 1
    position_mask: bool = False    # the loops mask by query and key positions (causal)

    @property
    def kind(self) -> str:
        return PASS_KINDS[self.backward_pass]

    @property
    def sg_data(self) -> tuple[int, int]:
        return (self.sg_rows, self.dim)

    def register_bytes(self) -> int:
        """Live registers of a subgroup at the peak of a loop step, by a model calibrated on
        IGC 2.40's builds (below). Pass 1: Q, dO (16-bit) and the f32 dQ accumulator, the
        rows' lse, D and running max/sum throughout; per step one operand tile (K^T, V^T or
        K: they serve DPAS phases one after the other) and two f32 [rows, step] tiles (P
        with dP, or dS). Pass 2: K, V (16-bit) and the f32 dK and dV accumulators, the
        step's lse and D throughout; per step two operand tiles (of Q^T, dO, dO^T, Q) and
        two f32 tiles. A position mask (causal) adds one i64 [rows, step] tile."""
        narrow, r, e, c = 2, self.sg_rows, self.dim, self.step
        tile, score = c * e * narrow, r * c * 4
        mask = r * c * 8 if self.position_mask else 0
        if self.backward_pass == 1:
            return r * e * (2 * narrow + 4) + 3 * r * 4 + tile + 2 * score + mask
        return r * e * (2 * narrow + 2 * 4) + 2 * c * 4 + 2 * tile + 2 * score + mask


def backward_foralls(func: ir.Operation) -> list[ir.Operation]:
    """The top-level foralls of `func` that are passes of a fused attention backward."""
    return [op for op in block_ops(func) if op.name == "scf.forall"
            and BACKWARD_PASS in op.attributes]


def backward_pass_of(forall: ir.Operation) -> int:
    return ir.IntegerAttr(forall.attributes[BACKWARD_PASS]).value


def _loops(forall: ir.Operation) -> list[ir.Operation]:
    """The scf.for loops nested in `forall`, in post-order (inner loops first)."""
    return ops_named(forall, "scf.for")


def _contractions(loop: ir.Operation) -> list[ir.Operation]:
    return [op for op in block_ops(loop) if is_linalg_op(op) and op.name != "linalg.fill"
            and loop_structure(op).is_contraction]


# Rows per subgroup to try, most first. REGISTER_SHARE (schedules/attention/xegpu.py) of the
# register file bounds register_bytes; its calibration, f16 D = 64 [1, 2, 512, 64] on bmg
# with 256 registers, (rows per subgroup, step): pass 1 builds without spills at (8, 16),
# (8, 32), (8, 64), (16, 16) and spills at (16, 32) causal (320 B) and (16, 64) (3,904 B);
# pass 2 builds at (8, 16) and spills at (8, 32) (640 B), (16, 16) (1,024 B), (16, 32)
# (9,088 B). The model takes (8, 16), (8, 32), (16, 16) of pass 1 (causal: not (16, 16))
# and (8, 16) of pass 2.
SG_ROWS = (16, 8)


def plan_backward_pass(forall: ir.Operation, *, sg_rows: int | None, subgroup_size: int,
                       dpas: tuple[int, int, int], max_threads: int, grf_bytes: int,
                       nb_prefetch: int = 1) -> BackwardTiles:
    """Tiles of one backward pass read from its IR, validated against the DPAS shape and
    the chip (ValueError naming the dimension otherwise); sg_rows None: the most rows per
    subgroup (SG_ROWS) whose tiles fit REGISTER_SHARE of the register file `grf_bytes`."""
    number = backward_pass_of(forall)
    where = f"attention backward pass {number} at {forall.location}"
    loops = [loop for loop in _loops(forall) if _contractions(loop)]
    if not loops:
        raise ValueError(f"{where}: no loop holds its contractions")
    main = loops[-1]
    first = loop_structure(_contractions(main)[0])
    dims = first.contraction_dims()
    if any(len(dims[d]) != 1 for d in "mnk"):
        raise ValueError(f"{where}: the scores are not a plain [rows, columns] contraction")
    rows, step, dim = (first.ranges[dims[d][0]] for d in "mnk")
    for loop in loops:
        loop_step = _constant_index(loop.operands[2])
        if loop_step != step:
            raise ValueError(f"{where}: loop step {loop_step} differs from the tile's {step}")
    dtype = input_dtype(forall, where)
    bounds = static_bounds(forall, where)
    if number == 2:
        for read in (op for loop in loops for op in ops_named(loop, "tensor.extract_slice")):
            element = ir.RankedTensorType(read.results[0].type).element_type
            if isinstance(element, ir.IntegerType):
                raise ValueError(
                    f"{where}: a mask of {element} is read in [keys, queries] tiles, transposed, "
                    "and 2-D block reads transpose 32- and 64-bit data only: no XeGPU "
                    "backward for a boolean attention mask yet")
    masked = any(ops_named(loop, "linalg.index") for loop in loops)
    dm, dn, dk = dpas
    budget = int(grf_bytes * REGISTER_SHARE)

    def tiles(r):
        return BackwardTiles(number, rows, step, dim, r, tuple(bounds), dtype, dpas,
                             subgroup_size, nb_prefetch, masked)

    if sg_rows is None:
        fitting = [r for r in SG_ROWS if rows % r == 0 and r % dm == 0
                   and tiles(r).register_bytes() <= budget]
        sg_rows = fitting[0] if fitting else SG_ROWS[-1]
    checks = [("rows per workgroup", rows, sg_rows, "rows per subgroup"),
              ("rows per subgroup", sg_rows, dm, "DPAS rows"),
              ("loop step", step, dk, "DPAS depth"),
              ("loop step", step, dn, "DPAS columns"),
              ("head dim", dim, dk, "DPAS depth"),
              ("head dim", dim, dn, "DPAS columns")]
    planned = tiles(sg_rows)
    check_tiles(where, planned, checks, max_threads, grf_bytes,
                "the backward_tiles or attention_sg_rows")
    return planned


# -------------------------------------------------------------------------------- tiling

def _pass_handle(func: ir.Value, number: int) -> ir.Value:
    return structured.MatchOp(any_op(), func, ops=["scf.forall"], op_attrs={
        BACKWARD_PASS: ir.IntegerAttr.get(ir.IntegerType.get_signless(64), number)}).result


def tile_backward(rec: StepRecorder, tiles: BackwardTiles) -> None:
    """Workgroup form of one backward pass (module docstring): the producers it reads
    through slices (the inputs' transposes) fused into it and into its loops, outermost
    first; transposes and copies generalized, unit dims folded, block mapping attached;
    steps of `rec`."""
    from ..generic import func_ops

    number = tiles.backward_pass

    def forall_now():
        (func,) = func_ops(rec.trial)
        (forall,) = [f for f in backward_foralls(func) if backward_pass_of(f) == number]
        return forall

    def loop_handle(func, index):
        # structured.match lists the loops as _loops does (post-order)
        return split(match(_pass_handle(func, number), "scf.for"),
                     len(_loops(forall_now())))[index]

    _fuse_sliced_producers(rec, forall_now, lambda func: _pass_handle(func, number))
    # outer loops first (a producer reaches an inner loop through its outer one); last loop
    # first among siblings (see tile_attention)
    for index in _fusion_order(forall_now()):
        _fuse_sliced_producers(rec, lambda i=index: _loops(forall_now())[i],
                               lambda func, i=index: loop_handle(func, i))

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
    dims = len(tiles.grid)

    def map_to_blocks(root):
        annotate(_pass_handle(match(root, "func.func"), number), "mapping", block_mapping(dims))

    rec.step("map_to_workgroups", map_to_blocks)


def _fusion_order(forall: ir.Operation) -> list[int]:
    """Indices (into `_loops`) of the loops in the order producers are
    fused into them: a loop before the loops nested in it, later siblings first."""
    loops = _loops(forall)
    depth = {}
    for i, loop in enumerate(loops):
        parent, d = loop.parent, 0
        while parent is not None and parent != forall:
            d += parent.name == "scf.for"
            parent = parent.parent
        depth[i] = d
    return sorted(range(len(loops)), key=lambda i: (depth[i], -i))


# ------------------------------------------------------------------------------- layouts

# the ops given anchor layouts, each in the order structured.match lists them
ANCHOR_OPS = ("xegpu.load_nd", "xegpu.dpas", "xegpu.store_nd", "xegpu.load", "xegpu.store")


def _layout(sg_layout, sg_data, inst_data, **extra) -> dict:
    return {"sg_layout": list(sg_layout), "sg_data": list(sg_data), "inst_data": list(inst_data),
            **extra}


def _load_of(value: ir.Value) -> ir.Operation | None:
    owner = value.owner
    owner = getattr(owner, "operation", owner)
    return owner if isinstance(owner, ir.Operation) and owner.name == "xegpu.load_nd" else None


def _dpas_reader(value: ir.Value) -> tuple[ir.Operation, int] | None:
    """(the xegpu.dpas, operand index) reading `value` (through type conversions), or None
    when no DPAS reads it."""
    for use in value.uses:
        user = getattr(use.owner, "operation", use.owner)
        if user.name == "xegpu.dpas":
            return user, use.operand_number
        if user.name in ("arith.extf", "arith.truncf"):
            found = _dpas_reader(user.results[0])
            if found is not None:
                return found
    return None


def backward_anchors(gpu_func: ir.Operation, tiles: BackwardTiles) -> dict[str, list]:
    """The anchor layouts of one outlined backward pass after convert-vector-to-xegpu and
    split_transposed_loads, per ANCHOR_OPS name in structured.match order (for xegpu.dpas
    a layout per operand: A, B, C/D). The block's rows split over the subgroups: every DPAS
    A operand and result, the stores, and the loads of tiles that are no DPAS B operand;
    B operands whole in every subgroup (a load read transposed in order [0, 1]); the
    per-query vectors (1-D scattered loads and stores) sliced from the score tile's
    layout: pass 1 stores its rows' lse and D (their rows), pass 2 reads a step's whole."""
    dm, dn, dk = tiles.dpas
    n, r = tiles.subgroups, tiles.sg_rows
    where = f"{tiles.kind} kernel {gpu_func.attributes['sym_name']}"
    rows = lambda cols, inst: _layout([n, 1], [r, cols], inst)
    whole = lambda shape, inst, **extra: _layout([1, 1], shape, inst, **extra)
    anchors = {name: [] for name in ANCHOR_OPS}
    for load in ops_named(gpu_func, "xegpu.load_nd"):
        shape = list(ir.VectorType(load.results[0].type).shape)
        users = [getattr(u.owner, "operation", u.owner) for u in load.results[0].uses]
        if users and all(u.name == "vector.transpose" for u in users):
            # a per-row vector in lane form is read [rows, 8] (a transposed 32-bit 2-D
            # block read is at most 8 wide)
            anchors["xegpu.load_nd"].append(whole(shape, [dn, min(dk, shape[1])], order=[0, 1]))
            continue
        reader = _dpas_reader(load.results[0])
        if reader is not None and reader[1] == 1:
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
    # per-query vectors read in lane form (pass 2): reduced from a tile every subgroup reads
    # whole, broadcast over the rows split among them (convert_result_layouts)
    reductions = ops_named(gpu_func, "vector.multi_reduction")
    conversions = []
    for i, reduction in enumerate(reductions):
        source = reduction.operands[0].owner
        source = getattr(source, "operation", source)
        if source.name != "vector.transpose" or _load_of(source.operands[0]) is None:
            continue
        copies, count = ir.VectorType(reduction.operands[0].type).shape
        layout = lambda sg_layout, sg_rows: (
            f"#xegpu.slice<#xegpu.layout<sg_layout = {list(sg_layout)}, sg_data = "
            f"{[sg_rows, count]}, inst_data = {[dm, dn]}>, dims = [0]>")
        conversions.append((i, layout([1, 1], copies), layout([n, 1], r)))
    anchors["vector.multi_reduction"] = [(len(reductions), conversions)]
    # per-query vectors: sliced from the [rows, step] score tile's layout
    score = rows(tiles.step, [dm, dn])
    for name, dims in (("xegpu.load", [0]), ("xegpu.store", [1])):
        for op in ops_named(gpu_func, name):
            value = op.results[0] if name == "xegpu.load" else op.operands[0]
            if ir.VectorType(value.type).rank != 1:
                raise ValueError(f"{where}: a {ir.VectorType(value.type).rank}-D {name}")
            anchors[name].append(dict(score, slice_dims=dims))
    return anchors


def annotate_backward(gpu_func: ir.Value, anchors: dict[str, list]) -> None:
    """Transform IR: the anchor layouts and conversions of `backward_anchors` (gpu_func a
    handle), each op taken by its place among the ops of its name that structured.match
    finds."""
    from transform_ext.convert_result_layouts import convert_result_layouts

    ((count, conversions),) = anchors["vector.multi_reduction"]
    if conversions:
        reductions = split(match(gpu_func, "vector.multi_reduction"), count)
        for i, input_layout, target_layout in conversions:
            convert_result_layouts(reductions[i], input_layout, target_layout)
    for name in ANCHOR_OPS:
        layouts = anchors[name]
        for handle, layout in zip(split(match(gpu_func, name), len(layouts)), layouts):
            if name == "xegpu.dpas":
                for index, operand in enumerate(layout):
                    xegpu.set_anchor_layout(handle, index=index, **operand)
            else:
                xegpu.set_anchor_layout(handle, **layout)
    canonicalize(gpu_func)


def split_loads(rec: StepRecorder, gpu_func: ir.Operation) -> None:
    """Step of `rec`: the tiles a backward pass reads both transposed and as stored get a
    load each (transform_ext.split_transposed_loads), so each carries its own layout."""
    from transform_ext.split_transposed_loads import split_transposed_loads

    from ..common import at_place, place_of

    place = place_of(rec.trial.operation, gpu_func)

    def body(root):
        split_transposed_loads(at_place(root, place))

    rec.step("split_transposed_loads", body)
