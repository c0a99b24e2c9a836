"""The plan of a linear cross-entropy payload, which the check and the script share.

`plan_linear_cross_entropy` applies the schedule's steps (fuse.py) to a copy of the payload
one at a time, each decision read from the copy before the step that needs it: V, whether
the joint graph's backward is fused, the root of the forward and its row tiling, the late
class sums. `check` plans on its copy after cleanup; the compile's script is built from
the same payload text, so the last plan made is kept.
"""

from __future__ import annotations

import dataclasses

from torch_mlir import ir

import transform_ext
from transform_ext.analysis.dims import DimClasses
from transform_ext.analysis.linear_cross_entropy_backward import (
    NotLinearCrossEntropyBackward, linear_cross_entropy_backward_in)
from transform_ext.analysis.logits import NotLogits, row_max, row_max_contraction, row_max_logits
from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.analysis.classify import reduction_combiner
from transform_ext.common import AMX_PRODUCT, AMX_SIDE, block_ops, defining_op, user_op

from ..common import place_of, run_schedule
from ..cross_entropy.params import RowTiling
from ..cross_entropy.plan import late_sums, row_producers
from ..cross_entropy.recognize import last_row_op
from ..generic import largest_divisor_at_most
from ..prepare import check_by_planning
from .fuse import (ROW_BLOCKS, fold_casts, fold_one_hot_sums, fuse_backward, fuse_class_loops,
                   gather_step, logits_classes_major, mark_class_sums, name_target_checks,
                   normalize_loss, restructure, shrink_bounds, sink_root_readers, tile_rows)
from .fuse import CLASS_SUM, lane_form, logits_in_pairs, stores_logits, targets_in_lanes
from .params import LateSum, LinearCrossEntropyParams, LinearCrossEntropyPlan
from .recognize import NotLinearCrossEntropy, linear_cross_entropy_func


def check(payload: ir.Module,
          params: LinearCrossEntropyParams = LinearCrossEntropyParams()) -> str | None:
    """None when this schedule applies to `payload`, else the one-line reason (the plan of
    `params` is made on a copy after cleanup, and kept for the compile's script)."""
    def plan(trial: ir.Module) -> None:
        plan_linear_cross_entropy(trial, params)

    return check_by_planning(payload, plan, NotLinearCrossEntropy)


class _Plans:
    """The last plan made (payload text after cleanup, params -> plan)."""

    key: tuple | None = None
    plan: LinearCrossEntropyPlan | None = None


def plan_linear_cross_entropy(payload: ir.Module,
                              params: LinearCrossEntropyParams) -> LinearCrossEntropyPlan:
    """The plan of `payload` (after cleanup; read, not rewritten): the schedule's steps
    applied to a copy one at a time (NotLinearCrossEntropy, or the failing transform's
    error, when the schedule does not apply). Needs an active context."""
    key = (str(payload), params)
    if _Plans.key == key:
        return _Plans.plan
    transform_ext.load(payload.context)
    for arg in linear_cross_entropy_func(payload).regions[0].blocks[0].arguments:
        if isinstance(arg.type, ir.RankedTensorType) and 0 in list(arg.type.shape):
            raise NotLinearCrossEntropy(f"an input is empty ({arg.type})")
    trial = ir.Module.parse(key[0], payload.context)
    for step in (normalize_loss, fold_casts):
        _apply(trial, step)
    _logits(trial)  # the row max reads the logits of a linear layer (else: the reason)
    for step in (restructure, shrink_bounds):
        _apply(trial, step)
    n, classes, depth = _logits(trial).shape
    if n < 2 or classes < 2:
        raise NotLinearCrossEntropy(f"the logits are [{n}, {classes}]: one row or one class "
                                    f"leaves no loop to fuse")
    if depth == classes:
        # h^T [D, N] and S^T [V, N] would share one empty init (CSE), which ties the depth
        # to the classes in the loop-dim analysis the fusion reads
        raise NotLinearCrossEntropy(f"the depth equals the classes ({depth}): the fusion "
                                    f"cannot tell them apart")
    candidate = _amx_candidate(trial, params, depth)
    if candidate:
        params = _amx_params(params, classes)
    if not params.classes_major and classes % params.class_tile:
        raise NotLinearCrossEntropy(
            f"the classes ({classes}) are not a multiple of the class tile "
            f"({params.class_tile}): the [N, V]-major form (the GPU's) has no remainder tile "
            "yet; choose the LIGHTHOUSE class_tile dividing V")
    for step in (name_target_checks(classes), gather_step(params)[1]):
        _apply(trial, step)
    if params.lanes:
        _apply(trial, lane_form(n, params.lanes))
    backward = _has_backward(trial)
    if backward and n == classes:
        # the backward's column sums (db [V]) and the per-row values [N] then share a shape,
        # and the choice of the forward's last per-row op can take a column sum
        raise NotLinearCrossEntropy(f"the rows equal the classes ({n}) in the joint graph: "
                                    f"the plan cannot tell the per-row values from the "
                                    f"column sums")
    if params.lanes and backward:
        _apply(trial, fold_one_hot_sums)
    if backward:
        _apply(trial, fuse_backward(params, n, classes))
    if params.classes_major:
        _apply(trial, logits_classes_major)
    _apply(trial, mark_class_sums)
    if params.lanes:
        _apply(trial, targets_in_lanes(n, params.lanes))
    block = linear_cross_entropy_func(trial).regions[0].blocks[0]
    ops = [op for op in block_ops(block.owner) if is_linalg_op(op)]
    root = last_row_op(ops, row_max(block), DimClasses(ops))
    if params.lanes:
        root = _lane_copy(ops, root)
    root_place = place_of(trial.operation, root)
    _apply(trial, sink_root_readers(root_place))
    # the forward's logits tiles on AMX (plan.amx): static 32 x 32 tiles of the class tile
    # and of the row block (chosen so when N allows)
    amx = candidate and params.class_tile % AMX_SIDE == 0
    # the root as chosen before its readers moved
    rows = _row_tiling(trial, root, params, AMX_SIDE if amx else 1)
    amx = amx and all(s % AMX_SIDE == 0 for s in rows.sizes if s)
    _apply(trial, tile_rows(rows, mark=ROW_BLOCKS))
    late, group_size = _late_sums(trial, params)
    if late and not params.classes_major:
        raise NotLinearCrossEntropy(
            "label smoothing of f16/bf16 logits (torch rounds each log-probability, so a "
            "second sweep over the classes recomputes the logits) has no [N, V]-major form "
            "(the GPU's) yet; give f32 logits or no label smoothing")
    stored = backward and stores_logits(params, n, classes)
    _apply(trial, fuse_class_loops(params, late, group_size, amx, stored))
    if amx:
        try:
            _apply(trial, logits_in_pairs)
        except ValueError:  # the interpreter's failure: a tile the pairs do not take
            amx = False
    products = any(AMX_PRODUCT in op.attributes for op in _walk(trial))
    plan = LinearCrossEntropyPlan(params, classes, backward, root_place, rows, late, group_size,
                                  n, amx, products, stored)
    _Plans.key, _Plans.plan = key, plan
    return plan


def _lane_copy(ops: list[ir.Operation], root: ir.Operation) -> ir.Operation:
    """The lane-form copy of the rows' losses `root` computes (lane_form), the op the row
    blocks then tile; NotLinearCrossEntropy when there is none (reduction='none': the
    losses are the function's result, which has no lane form)."""
    copies = [op for op in ops if op.name == "linalg.generic" and root.results[0] in
              list(op.operands) and len(op.results) == 1
              and ir.RankedTensorType(op.results[0].type).rank == 2
              and not loop_structure(op).reduction_dims]
    if len(copies) != 1:
        raise NotLinearCrossEntropy("the rows' losses are not reduced over the rows "
                                    "(reduction='none'): per-row losses have no store form in "
                                    "the GPU kernels (XeGPU has no lane layout for a [rows] "
                                    "vector); use reduction='mean' or 'sum'")
    return copies[0]


def _apply(payload: ir.Module, step) -> None:
    run_schedule(payload, step)


def _logits(payload: ir.Module):
    try:
        return row_max_logits(linear_cross_entropy_func(payload).regions[0].blocks[0])
    except NotLogits as exc:
        raise NotLinearCrossEntropy(str(exc)) from None


def _has_backward(payload: ir.Module) -> bool:
    """Does the joint graph hold the loss's backward (an elementwise reader of the logits
    with their shape: their gradient)? Then it must be one the backward fusion takes."""
    block = linear_cross_entropy_func(payload).regions[0].blocks[0]
    logits = _logits(payload)
    shape = list(ir.RankedTensorType(logits.result.type).shape)
    gradients = [op for op in {user_op(u) for u in logits.result.uses}
                 if is_linalg_op(op) and not loop_structure(op).reduction_dims
                 and len(op.results) == 1
                 and list(ir.RankedTensorType(op.results[0].type).shape) == shape]
    if not gradients:
        return False
    try:
        linear_cross_entropy_backward_in(block)
    except NotLinearCrossEntropyBackward as exc:
        raise NotLinearCrossEntropy(str(exc)) from None
    return True


def _amx_candidate(payload: ir.Module, params: LinearCrossEntropyParams, depth: int) -> bool:
    """May the logits' products run on AMX tiles? The params ask for it (classes-major),
    S's contraction reads bf16 h and W, and D is a multiple of AMX_SIDE (every product has
    D as an extent)."""
    if not (params.amx and params.classes_major) or depth % AMX_SIDE:
        return False
    contraction = row_max_contraction(linear_cross_entropy_func(payload).regions[0].blocks[0])
    return all(isinstance(v.type.element_type, ir.BF16Type)
               for v in list(contraction.opview.inputs))


def _amx_params(params: LinearCrossEntropyParams, classes: int) -> LinearCrossEntropyParams:
    """`params` (of an `_amx_candidate`) with the class tile of amx_class_tile
    (LinearCrossEntropyParams): the largest multiple of AMX_SIDE up to it (and up to V)
    that divides V when one of at least half of that exists, else that multiple itself (a
    remainder tile of V mod it classes then keeps the AVX512-BF16 products); and no stored
    logits: on AMX tiles the backward's recompute of S^T costs less than writing and reading
    back f32 S^T (N = 4096, D = 1024, V = 32000 on two threads: 709 ms recomputed, 765 ms
    stored, with 279 against 778 MB of memory)."""
    high = min(params.amx_class_tile, classes)
    high -= high % AMX_SIDE
    if high < AMX_SIDE:
        return params
    tile = next((t for t in range(high, high // 2 - 1, -AMX_SIDE) if classes % t == 0), high)
    return dataclasses.replace(params, class_tile=tile, stored_logits_bytes=0)


def _row_tiling(payload: ir.Module, root: ir.Operation,
                params: LinearCrossEntropyParams, unit: int = 1) -> RowTiling:
    """The root over blocks of rows and its producers over the rows, by their places among
    the ops `structured.match` finds (nested ones, the fused backward's, included). Blocks
    of `row_tile` rows, else as many as keep h^T of a block [D, rows] f32 within
    `block_bytes` with four blocks per thread at least; a divisor of N (and a multiple of
    `unit` when N has one such divisor: AMX tiles take 32 rows). In the [N, V]-major
    form (the GPU's) at most N / 2 rows: a forall of one block would fold away."""
    block = linear_cross_entropy_func(payload).regions[0].blocks[0]
    linalg_ops = [op for op in block_ops(block.owner) if is_linalg_op(op)]
    classes = DimClasses(linalg_ops)
    m = row_max(block).results[0]
    producers = row_producers(root, linalg_ops, classes, m)
    ls = loop_structure(root)
    row_dims = [l for l in range(ls.num_loops)
                if any(classes.same((root, l), (m, p)) for p in range(m.type.rank))]
    if len(row_dims) != 1 or m.type.rank != 1:
        raise NotLinearCrossEntropy("the loss's per-row op does not run over one row dim")
    extent = ls.ranges[row_dims[0]]
    contraction = loop_structure(row_max_contraction(block))
    depth = contraction.ranges[contraction.contraction_dims()["k"][0]]
    want = params.row_tile or max(1, min(params.block_bytes // (4 * depth),
                                         extent // (4 * params.threads)))
    if not params.classes_major:   # the GPU's workgroups: two blocks at least (one is folded)
        want = min(want, max(1, extent // 2))
    sizes = [0] * ls.num_loops
    sizes[row_dims[0]] = _block_rows(extent, want, unit)
    names = tuple(sorted({op.name for op in [root] + producers}))
    candidates = [op for op in _walk(payload) if op.name in names]
    places = tuple(candidates.index(op) for op in [root] + producers)
    return RowTiling(names, len(candidates), places, tuple(sizes))


def _block_rows(extent: int, want: int, unit: int) -> int:
    """The largest divisor of `extent` at most `want` that is a multiple of `unit`, else
    (`unit` > want, or none divides) the largest divisor at most `want`."""
    for rows in range(want - want % unit, 0, -unit):
        if extent % rows == 0:
            return rows
    return largest_divisor_at_most(extent, want)


def _late_sums(payload: ir.Module, params: LinearCrossEntropyParams) -> tuple[tuple, int]:
    """The late class sums of the (first) row block and the number of its marked class
    reductions: those reading, through the block's ops, a marked reduction other than the
    row max (fuse.py: fuse_class_loops)."""
    blocks = [op for op in _walk(payload) if ROW_BLOCKS in op.attributes]
    if not blocks:
        raise NotLinearCrossEntropy("the loss's rows were not tiled into blocks")
    body = blocks[0].regions[0].blocks[0]
    group = [op for op in _walk_in(blocks[0]) if CLASS_SUM in op.attributes]
    row_max_op = next((op for op in group if reduction_combiner(op) == "max"), None)
    if row_max_op is None:
        raise NotLinearCrossEntropy("the row max over the classes was not fused into the "
                                    "row blocks (the per-row loss reaches them through "
                                    "another op)")
    logits = row_max_contraction(body).results[0]
    found = late_sums(block_ops(body), group, row_max_op)
    late = []
    for place, op in enumerate(group):
        if op not in found:
            continue
        if logits not in list(op.operands):
            raise NotLinearCrossEntropy("a class sum reads the final sum of the exponentials "
                                        "but not the logits")
        ls = loop_structure(op)
        sizes = [0] * ls.num_loops
        k = ls.reduction_dims[0]
        sizes[k] = min(params.class_tile, ls.ranges[k])
        late.append(LateSum(place, list(op.operands).index(logits), tuple(sizes),
                            ls.ranges[k] % sizes[k] != 0))
    return tuple(late), len(group)


def _walk_in(op: ir.Operation) -> list[ir.Operation]:
    found = []

    def visit(o):
        found.append(o)
        return ir.WalkResult.ADVANCE

    op.walk(visit, ir.WalkOrder.POST_ORDER)
    return found


def _walk(payload: ir.Module) -> list[ir.Operation]:
    """Every op of the payload in the order structured.match lists them (post-order)."""
    found = []

    def visit(op):
        found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit, ir.WalkOrder.POST_ORDER)
    return found
