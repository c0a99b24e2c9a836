"""XeGPU tail of cross-entropy losses: F.cross_entropy, forward and forward+backward.

Input: the cross_entropy family's target-independent restructuring (fuse.py steps 1-3,
recorded here by `_record_restructure`): the row max m, the exp-sum l and the other class
sums (label smoothing, the backward's sum of d loss / d logp) read the logits x [N, C];
the target gather reads x[i, t_i] (never the [N, C] log-softmax); per-row losses; rank-0 reductions
over the rows (the count or total weight of counted targets, the loss sums) and the mean;
the gradient (backward) is one elementwise [N, C] op reading x and per-row values. The
payload's own ops are kept (their bodies are the math); `lower_loss` decides where each
runs, every kernel an scf.forall whose iterations are workgroups:

  host check     the result-less generic asserting 0 <= y < C for counted targets stays in
                 the host function; after bufferization (`finish_bufferized`) it reads a
                 host copy of y (gpu.memcpy) before the first launch, so a bad target stops
                 the program with a clear message, never a silent clamp;
  rows before    (backward) the rank-0 values the row kernel reads (the count that scales
                 the gradient): one workgroup of one subgroup;
  row kernel     `rows` rows per workgroup, 2 per subgroup: the max and the class sums as
                 ONE online loop over column tiles (fuse_dependent_reduction_ops, as for
                 long softmax rows: stable exp(m_old - m_new) corrections), the gather
                 x[i, t_i] as a scattered load, the per-row losses, and (backward) a second
                 loop over column tiles writing d x: the only N x C tensor besides x;
  rows after     the reductions of the per-row losses and the mean: one workgroup of one
                 subgroup looping over row tiles with [row_tile, 16] partial sums, one
                 cross-lane reduction at the end. No atomics.
No contraction anywhere: the kernels are vectorized without vector.contract (no DPAS).

Per-row data and memory. After a reduction over the classes every lane of a subgroup holds
the row's value (XeGPU's slice layout); XeGPU has no layout for a [rows] vector spread over
the lanes that also fits those values. So per-row data meets memory in "lane form", a
[rows, 16] tile holding the row's value in its 16 lanes:
  - a per-row input (the targets y) is read by a [rows, 16] gather (every lane of row i
    reads y[i]) and reduced by max over the identical lanes (exact);
  - a per-row generic that gathers (x[i, t_i], the weight w[t_i]) runs in lane form the
    same way; a gather at a per-row index inside an [N, C] op (w[y_i] in the gradient) is
    first hoisted into such a per-row generic (`hoist_row_gathers`);
  - a per-row result read by a later kernel is written as an [N, 16] f32 tile (2-D block
    store; 16 f32 = 64 bytes, the 2-D block minimum; f16/bf16 widened exactly); a
    reduction over the rows reads it back in lane form and counts lane 0 only,
    combine(acc, lane == 0 ? t : neutral) (exact);
  - a rank-0 value from an earlier kernel is read once per workgroup as a scalar.
The gather indices are clamped into [0, C) inside the kernels: memory safety only (an
ignored row's index; the host check has refused every out-of-range counted target).

Preconditions (else NotLowerable naming the op or dimension): logits [N, C] (classes last),
N a multiple of 2, C a multiple of a column tile that is a multiple of 16, class-index
targets, no [N, C] op besides the max, the class sums and the gradient.

The rewrites are transform_ext ops in recorded steps of the script (`_step`):
match_loss_kernels (the ops of each kernel, transform_ext/analysis/loss_kernels.py),
inline_argument_producers, split_shared_fills, lane_form_row_reductions,
load_rows_in_lane_form, hoist_row_gathers, lane_form_gathers, outline_into_forall,
fuse_dependent_reduction_ops, match_elementwise_producers, filter_iterators, and after
bufferization read_checks_on_host and scalarize_rank0_writes. Markers a later step matches
(the class reductions, the gradient, the lane-form generics, each kernel's kind) are
`transform.annotate`d and cleared at the end of the stage.

This module holds the recorded lowering (`lower_loss`, then `finish_bufferized` after
bufferization). The analysis of the restructured loss and the tile plans are xegpu_plan.py;
the layout anchors and loop prefetches of the outlined kernels xegpu_layouts.py.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

import transform_ext
from transform_ext.analysis.classify import reduction_combiner
from transform_ext.analysis.loss_kernels import grouped, kernel_groups
from transform_ext.common import (block_ops, failure_reason, is_argument_view, iterator_kinds,
                                   ops_named)
from transform_ext.remove_annotation import remove_annotation

from ..common import annotate, any_op, foreach, match
from ..script import StepRecorder
from ..xegpu.common import passes
from .fuse import match_attr, split_handle, target_check_message
from .xegpu_plan import (LANES, LossGraph, LossKernel, LossRowTiles, NotLowerable, RowSumTiles,
                         analyze, loss_func, plan_row_sums, plan_rows)

CLASS_REDUCTION = "lh.ce_class_reduction"   # the max and the class sums of the online loop
GRADIENT = "lh.ce_gradient"     # the [N, C] op writing d x
LANE_FORM = "lh.ce_lanes"      # generics already in lane form
KERNEL_ATTR = "lh.ce_kernel"    # on each kernel forall: its kind
# the kernels in launch order: (group of transform_ext/analysis/loss_kernels.py, kind)
KERNELS = (("before", "row_sum_before"), ("rows", "cross_entropy"), ("after", "row_sum_after"))


# ------------------------------------------------------------------------------ helpers

def _step(rec: StepRecorder, name: str, body) -> None:
    """Record the step `body(root)`; a transform op's refusal is NotLowerable with its
    reason."""
    transform_ext.load(rec.trial.context)
    try:
        rec.step(name, body)
    except ValueError as exc:  # the interpreter's failure, with the diagnostics
        raise NotLowerable(f"cross-entropy: {failure_reason(str(exc))}") from exc


def _place_in_func(op: ir.Operation) -> tuple[str, int, int]:
    """(name, index, count): `op`'s place among the ops of its name in its function, in the
    walk order structured.match finds them (`_handle_of` takes it back)."""
    same_name = ops_named(op.parent, op.name)
    return op.name, same_name.index(op), len(same_name)


def _handle_of(func: ir.Value, place: tuple[str, int, int]) -> ir.Value:
    """A handle to the op at `place` (see _place_in_func) of the function `func`."""
    name, index, count = place
    return split_handle(match(func, name), count)[index]


# ------------------------------------------------------------------------------ driver

def lower_loss(rec: StepRecorder, *, subgroup_size: int = 16, max_threads: int = 1024,
               min_workgroups: int = 1, rows: int | None = None,
               column_tile: int | None = None, row_tile: int | None = None) -> list[LossKernel]:
    """The workgroups stage of a cross-entropy loss (module docstring): returns the kernels
    in launch order; the host check stays in the function. NotLowerable names what does not
    fit."""
    if subgroup_size != LANES:
        raise NotLowerable(f"cross-entropy: per-row tiles assume subgroups of {LANES} lanes, "
                           f"not {subgroup_size}")
    graph = analyze(rec)
    tiles = plan_rows(graph, subgroup_size=subgroup_size, max_threads=max_threads,
                      min_workgroups=min_workgroups, rows=rows, column_tile=column_tile)
    sums = plan_row_sums(graph, subgroup_size=subgroup_size, row_tile=row_tile)
    _prepare_host_check(rec, graph)
    _prepare_row_sums(rec, graph)
    _prepare_row_kernel(rec, graph)
    kernels = _outline_kernels(rec, graph, tiles, sums)
    rec.step("canonicalize", passes("canonicalize", "cse"))
    _class_loops(rec, tiles.column_tile)
    for kind in ("row_sum_before", "row_sum_after"):
        _row_sum_loops(rec, kind, sums.row_tile)
    rec.step("remove_marks", _remove_marks)
    rec.step("canonicalize", passes("canonicalize", "cse"))
    return kernels


def _describe(kind: str, graph: LossGraph) -> str:
    x = ir.RankedTensorType(graph.logits.type)
    what = f"cross-entropy over [{graph.rows}, {graph.classes}] {x.element_type} logits"
    if kind == "cross_entropy":
        grad = ", d logits" if graph.gradient is not None else ""
        return f"{what}: online max / sum over column tiles, target gather, row losses{grad}"
    if kind == "row_sum_before":
        return f"{what}: reductions over the rows the row kernel reads (the count)"
    return f"{what}: reductions over the rows of the row losses, the mean"


def _kernel_forall(payload: ir.Module, kind: str) -> ir.Operation | None:
    func = loss_func(payload)
    return next((op for op in block_ops(func.regions[0].blocks[0])
                 if op.name == "scf.forall" and KERNEL_ATTR in op.attributes
                 and ir.StringAttr(op.attributes[KERNEL_ATTR]).value == kind), None)


def _remove_marks(root: ir.Value) -> None:
    for attr in (CLASS_REDUCTION, GRADIENT, LANE_FORM, KERNEL_ATTR):
        remove_annotation(root, attr)


def _prepare_host_check(rec: StepRecorder, graph: LossGraph) -> None:
    """Mark the class reductions and the gradient; the target check reads y only (its
    producers inlined) and says what is wrong in the user's terms."""
    from transform_ext.inline_argument_producers import inline_argument_producers
    from transform_ext.match_class_reductions import match_class_reductions
    from transform_ext.match_loss_kernels import match_loss_kernels

    row_max_place = _place_in_func(graph.row_max)
    gradient_place = _place_in_func(graph.gradient) if graph.gradient is not None else None
    message = target_check_message(graph.classes)

    def body(root):
        func = match(root, "func.func")
        row_max = _handle_of(func, row_max_place)
        annotate(row_max, CLASS_REDUCTION)
        annotate(match_class_reductions(row_max), CLASS_REDUCTION)
        if gradient_place is not None:
            annotate(_handle_of(func, gradient_place), GRADIENT)
        checks = inline_argument_producers(match_loss_kernels(func).host)
        foreach(checks, lambda check: annotate(match(check, "cf.assert"), "msg", message))

    _step(rec, "mark_kernel_ops", body)
    block = graph.func.regions[0].blocks[0]
    for op in grouped(block, "host"):
        if not all(is_argument_view(v, block) for v in op.opview.inputs):
            raise NotLowerable(f"cross-entropy: the target check at {op.location} reads values "
                               "computed on the device")


def _prepare_row_sums(rec: StepRecorder, graph: LossGraph) -> None:
    """Each kernel computes its own fills; reductions over the rows read y (and w) itself
    and the row kernel's per-row results in lane form."""
    from transform_ext.inline_argument_producers import inline_argument_producers
    from transform_ext.lane_form_row_reductions import lane_form_row_reductions
    from transform_ext.match_loss_kernels import match_loss_kernels
    from transform_ext.split_shared_fills import split_shared_fills

    rows = graph.rows

    def body(root):
        func = match(root, "func.func")
        split_shared_fills(func)
        inline_argument_producers(match_loss_kernels(func).row_sums, gathers=True)
        lane_form_row_reductions(match_loss_kernels(func).row_sums, rows, LANES)

    _step(rec, "prepare_row_sums", body)


def _prepare_row_kernel(rec: StepRecorder, graph: LossGraph) -> None:
    """Per-row inputs and gathers of the row kernel in lane form."""
    from transform_ext.exclude_ops import exclude_ops
    from transform_ext.hoist_row_gathers import hoist_row_gathers
    from transform_ext.lane_form_gathers import lane_form_gathers
    from transform_ext.load_rows_in_lane_form import load_rows_in_lane_form
    from transform_ext.match_loss_kernels import match_loss_kernels

    def not_in_lane_form(func):
        return exclude_ops(match_loss_kernels(func).rows, match_attr(func, LANE_FORM))

    rows = graph.rows

    def body(root):
        func = match(root, "func.func")
        annotate(load_rows_in_lane_form(match_loss_kernels(func).rows, rows, LANES),
                  LANE_FORM)
        hoist_row_gathers(not_in_lane_form(func))
        annotate(lane_form_gathers(not_in_lane_form(func), LANES), LANE_FORM)

    _step(rec, "prepare_row_kernel", body)


def _outline_kernels(rec: StepRecorder, graph: LossGraph, tiles: LossRowTiles,
                     sums: RowSumTiles) -> list[LossKernel]:
    """Each kernel's ops into a workgroup forall before the return, annotated with its kind;
    a result the function returns reshaped ([B, T, C]) reshaped after the kernels."""
    from transform_ext.match_loss_kernels import match_loss_kernels
    from transform_ext.outline_into_forall import outline_into_forall, outputs_of
    from transform_ext.sink_returned_reshapes import sink_returned_reshapes

    from ..xegpu.contraction import block_mapping

    block = graph.func.regions[0].blocks[0]
    groups = kernel_groups(block)
    kernels, outlined = [], []
    for group, kind in KERNELS:
        ops = grouped(block, group, groups)
        if not ops:
            continue
        if not outputs_of(ops):
            raise NotLowerable(f"cross-entropy: the {kind} kernel computes nothing used")
        outlined.append((group, kind))
        kernels.append(LossKernel(kind if group == "rows" else "row_sum", _describe(kind, graph),
                                  tiles if group == "rows" else sums))

    rows, total_rows = tiles.rows, graph.rows

    def body(root):
        found = match_loss_kernels(match(root, "func.func"))
        for group, kind in outlined:
            forall = outline_into_forall(getattr(found, group),
                                         rows=rows if group == "rows" else 0,
                                         total_rows=total_rows, mapping=block_mapping(1))
            annotate(forall, KERNEL_ATTR, kind)
        sink_returned_reshapes(match(root, "func.func"))

    _step(rec, "outline_kernels", body)
    return kernels


# ------------------------------------------------------------------------- kernel loops

def _class_loops(rec: StepRecorder, column_tile: int) -> None:
    """In the row kernel: the max and the class sums as one online loop over column tiles;
    the gradient (if any) swept in a second loop over column tiles, with the elementwise
    [rows, C] ops it reads computed per tile."""
    from transform_ext.exclude_ops import exclude_ops
    from transform_ext.filter_ops import filter_reductions
    from transform_ext.fuse_dependent_reduction_ops import fuse_dependent_reduction_ops
    from transform_ext.match_elementwise_producers import (elementwise_producers,
                                                           match_elementwise_producers)

    body = _kernel_forall(rec.trial, "cross_entropy").regions[0].blocks[0]
    group = [op for op in block_ops(body) if CLASS_REDUCTION in op.attributes]
    if len([op for op in group if reduction_combiner(op) == "max"]) != 1:
        raise NotLowerable("cross-entropy: the row kernel does not hold exactly one row max")

    def fuse(root):
        reductions = match_attr(match_attr(root, KERNEL_ATTR, "cross_entropy"), CLASS_REDUCTION)
        row_max = filter_reductions(reductions, combiner="max")
        fuse_dependent_reduction_ops(row_max, exclude_ops(reductions, row_max), column_tile,
                                     allow_remainder=False)

    _step(rec, "online_class_loop", fuse)
    rec.step("canonicalize", passes("canonicalize", "cse"))
    body = _kernel_forall(rec.trial, "cross_entropy").regions[0].blocks[0]
    gradients = [op for op in block_ops(body) if GRADIENT in op.attributes]
    if not gradients:
        return
    chain = len(elementwise_producers(gradients[0]))

    def sweep(root):
        gradient = match_attr(match_attr(root, KERNEL_ATTR, "cross_entropy"), GRADIENT)
        producers = split_handle(match_elementwise_producers(gradient), chain)
        loop = structured.TileUsingForOp(gradient, sizes=[0, column_tile]).results[1]
        for producer in producers:
            loop = structured.FuseIntoContainingOp(producer, loop).new_containing_op

    _step(rec, "gradient_sweep", sweep)


def _row_sum_loops(rec: StepRecorder, kind: str, row_tile: int) -> None:
    """In a reduction kernel: each lane-form reduction over [N, LANES] as a loop over row
    tiles accumulating [row_tile, LANES] partial results, combined once at the end."""
    from transform_ext.filter_iterators import filter_iterators

    forall = _kernel_forall(rec.trial, kind)
    if forall is None:
        return
    count = len([op for op in block_ops(forall.regions[0].blocks[0])
                 if op.name == "linalg.generic" and iterator_kinds(op) == ["reduction", "reduction"]])
    if not count:
        return

    def tile(root):
        generics = match(match_attr(root, KERNEL_ATTR, kind), "linalg.generic")
        reductions = filter_iterators(generics, ["reduction", "reduction"])
        for reduction in split_handle(reductions, count):
            structured.TileReductionUsingForOp([any_op()], any_op(), any_op(), any_op(), reduction,
                                               tile_sizes=[row_tile, LANES])

    _step(rec, "row_sum_loop", tile)


# ------------------------------------------------------------------ later stage hooks

def finish_bufferized(rec: StepRecorder) -> None:
    """After bufferization: the target check reads a host copy of y (module docstring), a
    rank-0 result is written by a scalar store (all lanes store the same value)."""
    from transform_ext.read_checks_on_host import host_checks, read_checks_on_host
    from transform_ext.scalarize_rank0_writes import scalarize_rank0_writes

    count = len(host_checks(loss_func(rec.trial)))

    def body(root):
        func = match(root, "func.func")
        checks = read_checks_on_host(func)
        scalarize_rank0_writes(func)
        for check in split_handle(checks, count):
            structured.ConvertToLoopsOp(any_op(), check)

    _step(rec, "finish_bufferized_loss", body)
