"""The plan of a cross-entropy payload, which the check and the script share.

`plan_cross_entropy` applies the schedule's steps (fuse.py) to a copy of the payload one at
a time, each decision (reshape folding, the gradients to merge, C, the root, the row tiles,
the lanes and class tile of each row block, the vector tiles of the class sums) read from
the copy before the step that needs it. `check` plans on its copy after cleanup, and the
compile's script is built from the same payload text: the last plan made is kept, so the
fusion runs once on a copy per compile.
"""

from __future__ import annotations

from torch_mlir import ir

import transform_ext
from transform_ext.analysis.classify import reduction_combiner
from transform_ext.analysis.dims import DimClasses
from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import Illegal, block_ops, defining_op
from transform_ext.split_reduction_lanes import LANE_DIM
from transform_ext.split_reduction_lanes import check_group as check_lane_split

from ..common import place_of, run_schedule
from ..generic import largest_divisor_at_most
from ..prepare import check_by_planning
from .fuse import (CLASS_SUM, fuse_class_loops, mark_class_sums, merge_gradients,
                   name_target_checks, normalize, restructure, sink_root_readers, tile_rows)
from .params import ClassLoop, CrossEntropyParams, CrossEntropyPlan, RowTiling
from .recognize import (CrossEntropyOps, NotCrossEntropy, cross_entropy_func, find_cross_entropy,
                        find_logits, has_rank0_reshape, refuse_empty)


def check(payload: ir.Module, params: CrossEntropyParams = CrossEntropyParams()) -> str | None:
    """None when this schedule applies to `payload`, else the one-line reason (the plan of
    `params` is made on a copy after cleanup, and kept for the compile's script)."""
    return check_by_planning(payload, lambda trial: plan_cross_entropy(trial, params),
                             NotCrossEntropy)


class _Plans:
    """The last plan made (payload text after cleanup, params -> plan): `check` plans on its
    copy after cleanup and the compile's script is built from the same text, so the fusion
    runs once on a copy per compile."""

    key: tuple | None = None
    plan: CrossEntropyPlan | None = None


def plan_cross_entropy(payload: ir.Module, params: CrossEntropyParams) -> CrossEntropyPlan:
    """The plan of `payload` (after cleanup; read, not rewritten): the schedule's steps
    applied to a copy one at a time, each decision read from the copy before the step that
    needs it (NotCrossEntropy, or the failing transform's error, when the schedule does not
    apply). Needs an active context."""
    key = (str(payload), params)
    if _Plans.key == key:
        return _Plans.plan
    transform_ext.load(payload.context)
    refuse_empty(payload)
    trial = ir.Module.parse(key[0], payload.context)
    fold_reshapes = not has_rank0_reshape(trial)
    _apply(trial, normalize(fold_reshapes))
    find_logits(cross_entropy_func(trial))  # one row max, reading the logits (else: the reason)
    _apply(trial, restructure)
    ops = find_cross_entropy(trial)
    gradients = ()
    if len(ops.gradients) > 1:
        gradients = tuple(place_of(trial.operation, g) for g in ops.gradients)
        _apply(trial, merge_gradients(gradients))
    ops = find_cross_entropy(trial)
    classes = loop_structure(ops.row_max).ranges[ops.class_dim]
    _apply(trial, name_target_checks(classes))
    _apply(trial, mark_class_sums)
    ops = find_cross_entropy(trial)
    root = place_of(trial.operation, ops.root)
    _apply(trial, sink_root_readers(root))
    rows = _row_tiling(trial, ops, params)  # the root as chosen before its readers moved
    if rows is not None:
        _apply(trial, tile_rows(rows))
    blocks = _fused_blocks(trial)
    in_foralls = blocks[0].owner.name == "scf.forall"
    loops = tuple(_class_loop(block, params) for block in blocks)
    _apply(trial, fuse_class_loops(loops, in_foralls))
    plan = CrossEntropyPlan(params, fold_reshapes, gradients, classes, root, rows, loops,
                            in_foralls, _vector_plan(trial, params.vector_tile),
                            _results_in_16_bit(cross_entropy_func(trial)))
    _Plans.key, _Plans.plan = key, plan
    return plan


def _results_in_16_bit(func: ir.Operation) -> bool:
    """Is every result of `func` a tensor of f16 or bf16 (the loss and gradients of 16-bit
    logits)?"""
    results = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value).results
    return bool(results) and all(
        isinstance(t, ir.RankedTensorType)
        and isinstance(ir.RankedTensorType(t).element_type, (ir.BF16Type, ir.F16Type))
        for t in results)


def _apply(payload: ir.Module, step) -> None:
    run_schedule(payload, step)


def _row_tiling(payload: ir.Module, ops: CrossEntropyOps,
                params: CrossEntropyParams) -> RowTiling | None:
    tile, extents = _row_tile(ops, params)
    if not extents:
        return None
    func = cross_entropy_func(payload)
    linalg_ops = [op for op in block_ops(func) if is_linalg_op(op)]
    classes = DimClasses(linalg_ops)
    m = ops.row_max.results[0]
    producers = row_producers(ops.root, linalg_ops, classes, m)
    sizes = [0] * loop_structure(ops.root).num_loops
    for l in ops.row_dims[:-1]:
        sizes[l] = 1
    sizes[ops.row_dims[-1]] = tile
    names = sorted({op.name for op in [ops.root] + producers})
    candidates = [op for op in linalg_ops if op.name in names]  # as structured.match finds them
    places = [candidates.index(op) for op in [ops.root] + producers]
    return RowTiling(tuple(names), len(candidates), tuple(places), tuple(sizes))


def _row_tile(ops: CrossEntropyOps, params: CrossEntropyParams) -> tuple[int, list[int]]:
    ls = loop_structure(ops.root)
    extents = [ls.ranges[l] for l in ops.row_dims]
    if not extents:
        return 0, []
    last = extents[-1]
    if params.row_tile:
        want = params.row_tile
    else:
        # class_dim is a dim of row_max's iteration space: its first operand may have fewer
        # dims (a broadcast row read through its indexing map)
        x = ops.row_max.operands[0]
        classes = loop_structure(ops.row_max).ranges[ops.class_dim]
        row_bytes = classes * max(4, x.type.element_type.width // 8)
        scope = block_ops(ops.row_max.parent)
        swept = ops.gradient is not None or ops.gradients or late_sums(
            scope, _marked(scope), ops.row_max)
        budget = params.sweep_bytes if swept else params.block_bytes
        want = max(1, budget // row_bytes)
        total = 1
        for e in extents:
            total *= e
        want = min(want, max(1, total // (4 * params.threads)))
    return largest_divisor_at_most(last, want), extents


def row_producers(root, linalg_ops, classes, m) -> list[ir.Operation]:
    """The linalg ops `root` reads through chains of ops that run over the rows in parallel
    (they can be computed per row block), consumers first."""

    def over_rows(op):
        ls = loop_structure(op)
        return any(ls.iterators[l] == "parallel" and classes.same((op, l), (m, p))
                   for l in range(ls.num_loops) for p in range(m.type.rank))

    found = set()
    pending = [root]
    while pending:
        op = pending.pop()
        for v in op.operands:
            p = defining_op(v)
            if p is None or p in found or p not in linalg_ops or not over_rows(p):
                continue
            found.add(p)
            pending.append(p)
    return [op for op in reversed(linalg_ops) if op in found]


def _class_loop(block: ir.Block, params: CrossEntropyParams) -> ClassLoop:
    row_max, consumers = _class_group(block)
    scope = block_ops(block)
    group = _marked(scope)
    late = late_sums(scope, group, row_max)
    consumers = [op for op in consumers if op not in late]
    lanes = _lane_count(row_max, consumers, params)
    ls = loop_structure(row_max)
    return ClassLoop(lanes, _class_tile(ls.ranges[ls.reduction_dims[0]] // lanes, params, lanes),
                     tuple(group.index(op) for op in late), len(group))


def late_sums(scope: list[ir.Operation], group: list[ir.Operation],
              row_max: ir.Operation) -> list[ir.Operation]:
    """The late class sums of `group` (the marked class reductions of `scope`, one row
    block's or the function's ops; `row_max` among them): those that read, directly or
    through `scope`'s other ops that are not reductions, a reduction of the group other
    than the row max. They need its final value (sum_c round(x_c - m - log l) of 16-bit
    logits with label smoothing needs the final l), which the fused loop holds only at its
    end."""
    inside = set(scope)

    def reads_group(op, seen) -> bool:
        for value in op.operands:
            producer = defining_op(value)
            if producer is None or producer not in inside or producer in seen:
                continue
            seen.add(producer)
            if producer in group and producer != row_max:
                return True
            if (not is_linalg_op(producer) or loop_structure(producer).is_elementwise) \
                    and reads_group(producer, seen):
                return True
        return False

    return [op for op in group if op != row_max and reads_group(op, set())]


def _fused_blocks(payload: ir.Module) -> list[ir.Block]:
    """The body block of every row forall, or the function's when nothing was tiled."""
    blocks = []

    def visit(op):
        if op.name == "scf.forall":
            blocks.append(op.regions[0].blocks[0])
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return blocks or [cross_entropy_func(payload).regions[0].blocks[0]]


def _marked(scope: list[ir.Operation]) -> list[ir.Operation]:
    """The marked class reductions among `scope`, in its order (as match finds them)."""
    return [op for op in scope if is_linalg_op(op) and CLASS_SUM in op.attributes]


def _class_group(block: ir.Block) -> tuple[ir.Operation, list[ir.Operation]]:
    """The marked row max of a block and the other marked class reductions."""
    ops = _marked(block_ops(block))
    maxes = [op for op in ops if reduction_combiner(op) == "max"]
    if len(maxes) != 1:
        raise NotCrossEntropy("a row block does not hold exactly one row max")
    return maxes[0], [op for op in ops if op is not maxes[0]]


def _lane_count(row_max: ir.Operation, consumers: list, params: CrossEntropyParams) -> int:
    """The lanes to split the group into (transform_ext/split_reduction_lanes.py: one running
    max and sum per SIMD lane) when the classes are the logits' contiguous dim and `lanes`
    divides them; 1: not split."""
    ls = loop_structure(row_max)
    k = ls.reduction_dims[0]
    x = row_max.operands[0]
    results = list(ls.maps[0].results)  # none when the logits are a 0-d value (a broadcast)
    last = results[-1] if results else None
    if params.lanes <= 1 or not isinstance(last, ir.AffineDimExpr) or last.position != k:
        return 1
    extent = x.type.shape[-1]
    lanes = params.lanes
    while lanes > 1 and (extent % lanes or extent < 2 * lanes) and lanes % 2 == 0 and \
            lanes > params.min_lanes:
        lanes //= 2
    if extent % lanes or extent < 2 * lanes:
        return 1
    try:
        check_lane_split(row_max, consumers, lanes)
    except Illegal:
        return 1
    return lanes


def _class_tile(extent: int, params: CrossEntropyParams, lanes: int) -> int:
    """The fused loop's step along its axis (chunks of `lanes` classes when split): the
    classes per step are `class_tile` (default: 8 chunks of lanes when split, else 4096);
    when the classes are fewer, the largest multiple of `vector_tile` in them (the rest runs
    as the remainder tile)."""
    if lanes > 1:
        per_step = params.class_tile or 8 * lanes
        return max(1, min(extent, per_step // lanes))
    per_step = params.class_tile or 4096
    if extent > per_step:
        return per_step
    if extent > params.vector_tile:
        return extent - extent % params.vector_tile
    return extent


def _vector_plan(payload: ir.Module, vector_tile: int):
    """Per marked class reduction (match order): lane-split ones one chunk of lanes at a
    time, the others row by row into `vector_tile` partial results."""
    plan = []
    for op in _tagged(payload, CLASS_SUM):
        ls = loop_structure(op)
        k = ls.reduction_dims[0]
        if LANE_DIM in op.attributes:
            lane = ir.IntegerAttr(op.attributes[LANE_DIM]).value
            plan.append((tuple(0 if l == lane else 1 for l in range(ls.num_loops)), None))
            continue
        rows = tuple(1 if it == "parallel" else 0 for it in ls.iterators)
        partial = [0] * ls.num_loops
        partial[k] = largest_divisor_at_most(ls.ranges[k], vector_tile)
        plan.append((rows, tuple(partial)))
    return tuple(plan)


def _tagged(payload: ir.Module, attr: str) -> list[ir.Operation]:
    found = []

    def visit(op):
        if attr in op.attributes:
            found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return found
