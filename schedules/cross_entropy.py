"""Fused cross-entropy (and log-softmax): F.cross_entropy imported from torch, one pass over
the logits.

Input: the linalg graph torch-mlir makes of `F.cross_entropy` (forward, or the joint
forward+backward graph): log_softmax over the class dim,
    m = max_c x,  l = sum_c exp(x - m),  logp = (x - m) - log(l),
then the loss reads logp (a gather logp[i, y_i], class sums for label smoothing and
probability targets) and the backward computes
    d x = G - exp(logp) * sum_c G,   G = d loss / d logp (the one-hot of nll_loss_backward).
Any payload of that shape qualifies (a bare log_softmax too: its result is the "gradient").
Schedule (the script's @fuse, one named step per item, decisions read by `plan_cross_entropy`
from a copy of the payload), target independent up to vectorization:
  1. normalize: drop the unused argmax, fold scalar constants into bodies, fold reshapes and
     unit dims, split the target-bounds assertions out of the gathers;
  2. restructure so nothing reads an [N, C] intermediate (transform_ext ops
     fold_gathers_through_elementwise, promote_indexed_extracts, inline_elementwise_producers,
     split_class_reductions, split_affine_reductions): gathers from elementwise results read
     what they are made of (logp[i, y] = x[i, y] - m[i] - log l[i]); [N, C] elementwise ops
     are inlined into every reader; a sum over rows and classes becomes a per-row class sum;
     class sums affine in per-row values are split
     (sum_c a_c logp_c = sum_c a_c x_c - (m + log l) sum_c a_c);
  3. check: every op iterating over all the logits must be the row max, a class reduction
     or a result computed elementwise (the gradients, merged into one op); anything else
     (e.g. d weight, a sum over the rows) and the schedule does not apply, with the reason;
  4. tile the rows into an scf.forall (the gradient, or the per-row loss, is the root; every
     producer over the rows is fused into it; readers of the row statistics outside the root
     read them from the forall's results); blocks of rows whose logits fit `block_bytes`;
  5. inside each row block: with the classes contiguous, the group is split into lanes
     (transform_ext.split_reduction_lanes: `lanes` running maxima and sums, combined once
     per row), then
     fuse_dependent_reduction_ops makes the max, the exp-sum (online, stable exp(m_old -
     m_new) correction) and every sibling class sum ONE loop over class tiles; the gradient,
     if any, is a second sweep over the block's logits (still in cache) writing d x once.
Vectorization (@vectorize, CPU: the step tile_class_sums, then the generic stage): each class
reduction runs one chunk of lanes at a time with vector accumulators; exp is expanded by
transform_ext.expand_fast_exp.
Forward: the logits are read once, no [N, C] tensor exists. Forward+backward: the logits are
read once from memory (the second sweep hits the cache), the gradient written once.

Behaviour at the edges, all as torch: all rows ignored -> mean NaN, sum 0, none zeros,
gradients 0; non-finite logits in ignored rows -> finite loss, and the row's gradient
softmax * 0 (NaN where the row holds NaN or +inf, as torch computes it); one row (N = 1,
its unit dim folded away) as an unbatched loss. A target outside [0, C) that is not
ignore_index -> a clear error when the kernel file's inputs hold it (the import runs
torch), else the imported bounds check, named "cross_entropy: a target is out of range:
class indices must be in [0, C) or equal ignore_index" (`name_target_checks`), becomes the
kernel-reported error on the CPU (schedules/prepare.py: checks_to_error_code; the call
raises lighthouse.errors.KernelError); every gather at a target reads a clamped index
(clamp_gather_indices, at cleanup), so no access leaves the logits or the weights. The
schedule refuses an empty input (N = 0) and C = 1 (no class max is left) with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

import transform_ext
from transform_ext.add_unread_input import add_unread_input
from transform_ext.analysis.classify import reduction_combiner
from transform_ext.analysis.dims import DimClasses
from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import (Illegal, block_ops, defining_op, depends_on,
                                  failure_reason, walk_ops)
from transform_ext.drop_unused_results import drop_unused_results
from transform_ext.exclude_ops import exclude_ops
from transform_ext.expand_fast_exp import expand_fast_exp
from transform_ext.filter_ops import filter_reductions
from transform_ext.fold_gathers_through_elementwise import fold_gathers_through_elementwise
from transform_ext.fold_reshape_ops_by_expansion import fold_reshape_ops_by_expansion
from transform_ext.fold_scalar_or_splat_constant import fold_scalar_or_splat_constant
from transform_ext.fuse_dependent_reduction_ops import fuse_dependent_reduction_ops
from transform_ext.inline_elementwise_producers import inline_elementwise_producers
from transform_ext.match_class_reductions import match_class_reductions
from transform_ext.match_assertion_checks import match_assertion_checks
from transform_ext.merge_elementwise import check_mergeable, merge_elementwise
from transform_ext.promote_indexed_extracts import promote_indexed_extracts
from transform_ext.remove_annotation import remove_annotation
from transform_ext.sink_sibling_readers import sink_sibling_readers
from transform_ext.split_affine_reductions import split_affine_reductions
from transform_ext.split_class_reductions import split_class_reductions
from transform_ext.split_assertions import split_assertions
from transform_ext.split_reduction_lanes import LANE_DIM, split_reduction_lanes
from transform_ext.split_reduction_lanes import check_group as check_lane_split
from transform_ext.trace_to_argument import trace_to_argument

from .common import (Place, apply_passes, at_place, canonicalize, foreach, match, place_of,
                     run_schedule)
from .generic import GenericParams, largest_divisor_at_most, single_func
from .generic import vectorize_stage as generic_vectorize_stage
from .prepare import cleanup
from .script import build_script, include_step


CLASS_SUM = "lh.class_sum"  # marks the reductions of the fused class loops for vectorization


class NotCrossEntropy(Exception):
    """The payload is not a cross-entropy this schedule takes; the message is the reason."""


@dataclass(frozen=True)
class CrossEntropyParams:
    """row_tile: rows per scf.forall iteration (0: chosen so a block's logits stay in L2,
    `block_bytes`, with enough blocks for `threads` workers); class_tile: classes per step of
    the fused loop (0: 8 chunks of `lanes` when the lanes are split, else 4096; a remainder
    tile is handled); lanes: running maxima and sums per row when the classes are the
    contiguous dim (halved down to `min_lanes` until it divides them; 1: one per row, as
    when none does): several vector registers of lanes keep the max chains independent;
    vector_tile: elements per vector op elsewhere."""

    row_tile: int = 0
    class_tile: int = 0
    threads: int = 2
    lanes: int = 64
    min_lanes: int = 16
    block_bytes: int = 1 << 20
    vector_tile: int = 64

    def __post_init__(self):
        for name in ("threads", "lanes", "min_lanes", "block_bytes", "vector_tile"):
            if getattr(self, name) < 1:
                raise ValueError(f"CrossEntropyParams.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("row_tile", "class_tile"):
            if getattr(self, name) < 0:
                raise ValueError(f"CrossEntropyParams.{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class CrossEntropyOps:
    """The ops of one restructured cross-entropy (payload ops)."""

    row_max: ir.Operation          # m = max_c x
    class_sums: list               # reductions over the classes (exp-sum and siblings)
    gradient: ir.Operation | None  # the [.., C, ..] elementwise op writing d x, if any
    root: ir.Operation             # the op tiled into the row forall
    class_dim: int                 # of row_max's iteration space
    row_dims: list                 # loop dims of `root` running over the rows
    gradients: list                # every gradient op (several: to merge first; root and
                                   # gradient are None until then)


def _func(payload: ir.Module) -> ir.Operation:
    return single_func(payload, NotCrossEntropy)


def recognize(payload: ir.Module) -> bool:
    """Cheap test: a log_softmax (max, exp, log) and no matmul."""
    names = {op.name for op in walk_ops(payload.operation, lambda op: True)}
    return {"arith.maximumf", "math.exp", "math.log"} <= names and \
        not any(n.startswith(("linalg.batch_matmul", "linalg.matmul")) for n in names)


def _normalize(fold_reshapes: bool):
    """Step 1 of the module docstring (fold_reshapes False: fold_reshape_ops_by_expansion
    mistypes reshapes between rank 0 and rank 1, the unbatched loss; unit-dim folding
    removes those on its own)."""
    def body(root: ir.Value) -> ir.Value:
        f = match(root, "func.func")
        f = drop_unused_results(f)
        f = fold_scalar_or_splat_constant(f)
        if fold_reshapes:
            f = fold_reshape_ops_by_expansion(f)
        canonicalize(f)
        root = apply_passes(root, "linalg-fold-unit-extent-dims", "canonicalize", "cse")
        split_assertions(root)
        return root

    return body


def _refuse_empty(payload: ir.Module) -> None:
    """A function argument with a zero-size dim (no rows: N = 0) has nothing to fuse."""
    for arg in _func(payload).regions[0].blocks[0].arguments:
        if isinstance(arg.type, ir.RankedTensorType) and 0 in list(arg.type.shape):
            raise NotCrossEntropy(f"an input is empty ({arg.type})")


def _has_rank0_reshape(payload: ir.Module) -> bool:
    found = []

    def visit(op):
        if op.name in ("tensor.expand_shape", "tensor.collapse_shape") and any(
                v.type.rank == 0 for v in list(op.operands)[:1] + list(op.results)):
            found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return bool(found)


def _restructure(root: ir.Value) -> ir.Value:
    """Step 2 of the module docstring (canonicalize and cse as passes between the rewrites)."""
    func = match(root, "func.func")
    fold_gathers_through_elementwise(func)
    promote_indexed_extracts(func)
    root = apply_passes(root, "canonicalize", "cse")
    generics = match(match(root, "func.func"), "linalg.generic")
    logits = trace_to_argument(filter_reductions(generics, combiner="max"), 0)
    inline_elementwise_producers(generics, witness=logits)
    root = apply_passes(root, "canonicalize", "cse")
    row_max = filter_reductions(match(match(root, "func.func"), "linalg.generic"), combiner="max")
    split_class_reductions(row_max)
    split_affine_reductions(row_max)
    return apply_passes(root, "canonicalize", "cse")


def _row_max(func: ir.Operation) -> ir.Operation:
    maxes = [op for op in block_ops(func) if is_linalg_op(op) and reduction_combiner(op) == "max"
             and len(loop_structure(op).reduction_dims) == 1]
    if len(maxes) != 1:
        raise NotCrossEntropy(f"expected one row max over the classes (log_softmax), found {len(maxes)}")
    return maxes[0]


def _logits(func: ir.Operation) -> ir.Value:
    """The function argument the row max reduces (directly or through elementwise ops), or
    its reshape when that is what the ops read (one row: [1, C] folded to [C])."""
    value = _row_max(func).operands[0]
    while not isinstance(value, ir.BlockArgument):
        op = defining_op(value)
        if op is not None and op.name in ("tensor.collapse_shape", "tensor.expand_shape") and \
                isinstance(op.operands[0], ir.BlockArgument):
            return value
        if op is None or not is_linalg_op(op) or not loop_structure(op).is_elementwise:
            raise NotCrossEntropy("the row max does not read a function argument (the logits)")
        value = op.operands[0]
    return value


def find_cross_entropy(payload: ir.Module) -> CrossEntropyOps:
    """Locate the row max, the class sums, the gradient and the root (or say why not; with
    several gradients only them: they are merged into one op first)."""
    func = _func(payload)
    ops = [op for op in block_ops(func) if is_linalg_op(op)]
    maxes = [op for op in ops if reduction_combiner(op) == "max"
             and len(loop_structure(op).reduction_dims) == 1]
    if len(maxes) != 1:
        raise NotCrossEntropy(f"expected one row max over the classes (log_softmax), found {len(maxes)}")
    row_max = maxes[0]
    class_dim = loop_structure(row_max).reduction_dims[0]
    classes = DimClasses(ops)
    axis = (row_max, class_dim)
    m = row_max.results[0]

    def iterates_classes(op):
        return any(classes.same((op, l), axis) for l in range(loop_structure(op).num_loops))

    def reduces_classes(op):
        ls = loop_structure(op)
        return len(ls.reduction_dims) == 1 and classes.same((op, ls.reduction_dims[0]), axis)

    class_sums = [op for op in ops if op is not row_max and reduces_classes(op)]
    if not class_sums:
        raise NotCrossEntropy("no reduction over the classes besides the max")
    results = _returned_ops(func)
    x_elements = _numel(row_max.operands[0].type.shape)
    gradients = []
    for op in ops:
        if op is row_max or op in class_sums or not iterates_classes(op):
            continue
        ls = loop_structure(op)
        if _numel(ls.ranges) < x_elements:
            continue  # a loop over the classes only (weights, indices): no logits pass
        if op in results and not ls.reduction_dims and all(
                m.is_permutation for m in ls.maps[ls.num_inputs:]):
            gradients.append(op)
            continue
        raise NotCrossEntropy(f"{op.name} iterates over all the logits outside the fused "
                              f"pass ({'a reduction over the rows' if ls.reduction_dims else 'not a result'})")
    if len(gradients) > 1:
        if len({tuple(loop_structure(g).ranges) for g in gradients}) != 1:
            raise NotCrossEntropy("the gradients iterate over different spaces")
        try:
            check_mergeable(gradients)
        except Illegal as exc:
            raise NotCrossEntropy(f"the gradients cannot be merged into one op ({exc.reason})")
        return CrossEntropyOps(row_max, class_sums, None, None, class_dim, [], gradients)
    gradient = gradients[0] if gradients else None
    row_dims = [p for p in range(m.type.rank)]
    root = gradient if gradient is not None else _last_row_op(ops, row_max, classes)
    root_rows = []
    for p in row_dims:
        for l in range(loop_structure(root).num_loops):
            if classes.same((root, l), (m, p)):
                root_rows.append(l)
    return CrossEntropyOps(row_max, class_sums, gradient, root, class_dim, root_rows, gradients)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _returned_ops(func: ir.Operation) -> list[ir.Operation]:
    """The ops computing the function's results (through reshapes: one row's gradient
    [C] is returned as [1, C])."""
    found = []
    for v in block_ops(func)[-1].operands:
        op = defining_op(v)
        while op is not None and op.name in ("tensor.expand_shape", "tensor.collapse_shape"):
            op = defining_op(op.operands[0])
        if op is not None:
            found.append(op)
    return found


def _last_row_op(ops, row_max, classes) -> ir.Operation:
    """The last op over the rows (m's dims, all parallel) that depends on m."""
    m = row_max.results[0]
    last = None
    for op in ops:
        ls = loop_structure(op)
        if op is row_max or ls.reduction_dims or ls.num_loops != m.type.rank:
            continue
        if all(any(classes.same((op, l), (m, p)) for l in range(ls.num_loops))
               for p in range(m.type.rank)) and depends_on(op, m):
            last = op
    if last is None:
        raise NotCrossEntropy("no per-row op reads the log-softmax")
    return last



def check(payload: ir.Module, params: CrossEntropyParams = CrossEntropyParams()) -> str | None:
    """None when this schedule applies to `payload`, else the one-line reason (the plan of
    `params` is made on a copy after cleanup, and kept for the compile's script)."""
    trial = ir.Module.parse(str(payload), payload.context)
    try:
        with payload.context, ir.Location.unknown():
            cleanup(trial)  # the family is chosen on the import: judge what fuse will see
            plan_cross_entropy(trial, params)
    except NotCrossEntropy as exc:
        return str(exc)
    except Exception as exc:  # a transform refused the payload: its first line says why
        return _first_line(exc)
    return None


def _first_line(exc: Exception) -> str:
    """The diagnostic's message on one line, without its locations (no use to a user)."""
    return (failure_reason(str(exc)) or type(exc).__name__)[:200]


def _target_check_message(classes: int) -> str:
    return (f"cross_entropy: a target is out of range: class indices must be in [0, {classes}) "
            f"or equal ignore_index")


def name_target_checks(classes: int):
    """The imported bounds checks of the gathers at the targets (x[i, y_i], w[y_i]; split
    into result-less generics by step 1) say what is wrong in the user's terms: a step
    (body(root) -> root) annotating the message on their cf.assert ops."""
    def body(root: ir.Value) -> ir.Value:
        message = ir.StringAttr.get(_target_check_message(classes))
        text = transform.ParamConstantOp(transform.AnyParamType.get(), message).param
        foreach(match_assertion_checks(match(root, "func.func")),
                lambda check: transform.AnnotateOp(match(check, "cf.assert"), "msg", param=text))
        return root

    return body


@dataclass(frozen=True)
class RowTiling:
    """Step 4: the root and its producers over the rows, by their places (root first) among
    the `count` ops of `names` that structured.match finds in the function; the root's
    tile_using_forall sizes."""

    names: tuple[str, ...]
    count: int
    places: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class ClassLoop:
    """Step 5 in one row block: lanes to split the group into (1: none), class tile."""

    lanes: int
    class_tile: int


@dataclass(frozen=True)
class CrossEntropyPlan:
    """What the script is built from: the parameters and what the payload showed at each
    step of a trial on a copy. gradients: places of the gradients to merge into one (empty
    with at most one); classes: C; root: place of the root (as RowTiling.ops); rows: None
    when nothing is tiled (the unbatched loss); blocks: one ClassLoop per row block (the
    function when untiled); vector: per class reduction in match order, the tile sizes of
    the row loops and of the partial vector results (None: a lane-split one)."""

    params: CrossEntropyParams
    fold_reshapes: bool
    gradients: tuple[Place, ...]
    classes: int
    root: Place
    rows: RowTiling | None
    blocks: tuple[ClassLoop, ...]
    blocks_in_foralls: bool
    vector: tuple[tuple[tuple[int, ...], tuple[int, ...] | None], ...]


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
    _refuse_empty(payload)
    trial = ir.Module.parse(key[0], payload.context)
    fold_reshapes = not _has_rank0_reshape(trial)
    _apply(trial, _normalize(fold_reshapes))
    _logits(_func(trial))  # one row max, reading the logits (else: the reason)
    _apply(trial, _restructure)
    ops = find_cross_entropy(trial)
    gradients = ()
    if len(ops.gradients) > 1:
        gradients = tuple(place_of(trial.operation, g) for g in ops.gradients)
        _apply(trial, _merge_gradients(gradients))
    ops = find_cross_entropy(trial)
    classes = loop_structure(ops.row_max).ranges[ops.class_dim]
    _apply(trial, name_target_checks(classes))
    _apply(trial, _mark_class_sums)
    ops = find_cross_entropy(trial)
    root = place_of(trial.operation, ops.root)
    _apply(trial, _sink_root_readers(root))
    rows = _row_tiling(trial, ops, params)  # the root as chosen before its readers moved
    if rows is not None:
        _apply(trial, _tile_rows(rows))
    blocks = _fused_blocks(trial)
    in_foralls = blocks[0].owner.name == "scf.forall"
    loops = tuple(_class_loop(block, params) for block in blocks)
    _apply(trial, _fuse_class_loops(loops, in_foralls))
    plan = CrossEntropyPlan(params, fold_reshapes, gradients, classes, root, rows, loops,
                            in_foralls, _vector_plan(trial, params.vector_tile))
    _Plans.key, _Plans.plan = key, plan
    return plan


def restructure(payload: ir.Module) -> CrossEntropyOps:
    """Steps 1-3 applied to `payload` itself (where the XeGPU lowering starts): the ops found
    after them, or NotCrossEntropy with the reason."""
    transform_ext.load(payload.context)
    _apply(payload, _normalize(not _has_rank0_reshape(payload)))
    _logits(_func(payload))
    _apply(payload, _restructure)
    ops = find_cross_entropy(payload)
    if len(ops.gradients) > 1:
        _apply(payload, _merge_gradients(tuple(place_of(payload.operation, g) for g in ops.gradients)))
        ops = find_cross_entropy(payload)
    return ops


def _apply(payload: ir.Module, step) -> None:
    run_schedule(payload, step)


def _merge_gradients(places: tuple[Place, ...]):
    """Step 3: the gradients (several results computed elementwise) merged into one op."""
    def body(root: ir.Value) -> ir.Value:
        handles = [at_place(root, place) for place in places]
        merge_elementwise(transform.MergeHandlesOp(handles).result)
        return root

    return body


def _mark_class_sums(root: ir.Value) -> ir.Value:
    """Mark the row max and the class reductions `CLASS_SUM` (the fused loop's group, tiled
    for vectors later). A class reduction whose class loop no operand shares with the logits
    (the row sum of the one-hot gradient reads only targets and loop indices) gets the logits
    as an unread input, mapped by the dims they share in the whole graph: the fusion then
    sees it runs over the logits' classes."""
    func = match(root, "func.func")
    row_max = filter_reductions(match(func, "linalg.generic"), combiner="max")
    transform.AnnotateOp(row_max, CLASS_SUM)
    transform.AnnotateOp(match_class_reductions(row_max), CLASS_SUM)
    add_unread_input(_match_attr(func, CLASS_SUM), trace_to_argument(row_max, 0))
    return root


def _sink_root_readers(root_place: Place):
    """Step 4's preparation: the root's sibling readers after it (sink_sibling_readers)."""
    def body(root: ir.Value) -> ir.Value:
        sink_sibling_readers(at_place(root, root_place))
        return root

    return body


def _row_tiling(payload: ir.Module, ops: CrossEntropyOps,
                params: CrossEntropyParams) -> RowTiling | None:
    tile, extents = _row_tile(ops, params)
    if not extents:
        return None
    func = _func(payload)
    linalg_ops = [op for op in block_ops(func) if is_linalg_op(op)]
    classes = DimClasses(linalg_ops)
    m = ops.row_max.results[0]
    producers = _row_producers(ops.root, linalg_ops, classes, m)
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
        x = ops.row_max.operands[0]
        row_bytes = x.type.shape[ops.class_dim] * max(4, x.type.element_type.width // 8)
        want = max(1, params.block_bytes // row_bytes)
        total = 1
        for e in extents:
            total *= e
        want = min(want, max(1, total // (4 * params.threads)))
    return largest_divisor_at_most(last, want), extents


def _tile_rows(rows: RowTiling):
    """Step 4: the root tiled into an scf.forall over row blocks, its producers over the
    rows fused in one at a time (CSE first: equal slices of one producer become one use)."""
    def body(root: ir.Value) -> ir.Value:
        func = match(root, "func.func")
        handles = _split(match(func, list(rows.names)), rows.count)
        tiled = structured.TileUsingForallOp(handles[rows.places[0]], tile_sizes=list(rows.sizes))
        for producer in [handles[i] for i in rows.places[1:]]:
            canonicalize(func)
            structured.FuseIntoContainingOp(producer, tiled.forall_op)
        return apply_passes(root, "canonicalize", "cse")

    return body


def _row_producers(root, linalg_ops, classes, m) -> list[ir.Operation]:
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
    lanes = _lane_count(row_max, consumers, params)
    ls = loop_structure(row_max)
    return ClassLoop(lanes, _class_tile(ls.ranges[ls.reduction_dims[0]] // lanes, params, lanes))


def _fuse_class_loops(loops: tuple[ClassLoop, ...], in_foralls: bool):
    """Step 5 of the module docstring, in every row block (or the function when unbatched):
    the lane split (when the lanes divide the classes) then the fusion over class tiles."""
    def body(root: ir.Value) -> ir.Value:
        if in_foralls:
            foralls = match(root, "scf.forall")
            scopes = [foralls] if len(loops) == 1 else list(transform.SplitHandleOp(
                [transform.AnyOpType.get()] * len(loops), foralls).results)
        else:
            scopes = [match(root, "func.func")]
        for scope, loop in zip(scopes, loops):
            if loop.lanes > 1:
                split_reduction_lanes(_match_attr(scope, CLASS_SUM), loop.lanes)
            group = _match_attr(scope, CLASS_SUM)
            row_max = filter_reductions(group, combiner="max")
            fuse_dependent_reduction_ops(row_max, exclude_ops(group, row_max), loop.class_tile)
        return apply_passes(root, "canonicalize", "cse")

    return body


def _fused_blocks(payload: ir.Module) -> list[ir.Block]:
    """The body block of every row forall, or the function's when nothing was tiled."""
    blocks = []

    def visit(op):
        if op.name == "scf.forall":
            blocks.append(op.regions[0].blocks[0])
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return blocks or [_func(payload).regions[0].blocks[0]]


def _class_group(block: ir.Block) -> tuple[ir.Operation, list[ir.Operation]]:
    """The marked row max of a block and the other marked class reductions."""
    ops = [o.operation for o in block.operations
           if is_linalg_op(o.operation) and CLASS_SUM in o.operation.attributes]
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
    last = ls.maps[0].results[len(ls.maps[0].results) - 1]
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


def fuse_steps(plan: CrossEntropyPlan) -> list[tuple[str, object]]:
    """The named steps of the fuse stage, in order: (name, body(root) -> root)."""
    steps = [("normalize", _normalize(plan.fold_reshapes)), ("restructure", _restructure)]
    if plan.gradients:
        steps.append(("merge_gradients", _merge_gradients(plan.gradients)))
    steps += [("name_target_checks", name_target_checks(plan.classes)),
              ("mark_class_sums", _mark_class_sums),
              ("sink_root_readers", _sink_root_readers(plan.root))]
    if plan.rows is not None:
        steps.append(("tile_rows", _tile_rows(plan.rows)))
    steps.append(("fuse_class_loops", _fuse_class_loops(plan.blocks, plan.blocks_in_foralls)))
    return steps


def fuse_stage(plan: CrossEntropyPlan):
    """@fuse: its steps in order."""
    names = [name for name, _ in fuse_steps(plan)]

    def body(root: ir.Value) -> None:
        for name in names:
            root = include_step(name, root)

    return body


def _tile_class_sums(plan: CrossEntropyPlan):
    """Each class reduction of the fused loops reads its elementwise producers in its own
    body (nothing per tile is materialized) and runs as the plan's `vector` says; exp
    becomes transform_ext.expand_fast_exp's expansion; the marks go. A step of its own: the
    handles it leaves end with it (the generic stage's ops rewrite their ops through nested
    sequences, which the handles of this one would not see)."""
    def body(root: ir.Value) -> ir.Value:
        inline_elementwise_producers(_match_attr(root, CLASS_SUM))
        if plan.vector:  # (the inlining keeps the sums' loops: the plan holds for the rebuilt ops)
            matched = _match_attr(root, CLASS_SUM)
            for target, (outer, partial) in zip(_split(matched, len(plan.vector)), plan.vector):
                if any(outer):
                    target = structured.TileUsingForOp(target, sizes=list(outer)).tiled_linalg_op
                if partial is not None:
                    any_op = transform.AnyOpType.get()
                    structured.TileReductionUsingForOp([any_op], any_op, any_op, any_op, target,
                                                       tile_sizes=list(partial))
        expand_fast_exp(root)
        remove_annotation(root, CLASS_SUM)
        remove_annotation(root, LANE_DIM)
        return root

    return body


def vectorize_stage(params: GenericParams):
    """@vectorize: the class sums tiled for vectors (`tile_class_sums`), then the generic
    vectorize stage."""
    generic = generic_vectorize_stage(params)

    def body(root: ir.Value) -> None:
        generic(include_step("tile_class_sums", root))

    return body


def cross_entropy_script(plan: CrossEntropyPlan, vector: GenericParams | None) -> ir.Module:
    """@fuse of `plan` and, with `vector` (the CPU's vector tiles), @vectorize. Needs an
    active context and location."""
    steps = fuse_steps(plan)
    stages = [("fuse", fuse_stage(plan))]
    if vector is not None:
        steps.append(("tile_class_sums", _tile_class_sums(plan)))
        stages.append(("vectorize", vectorize_stage(vector)))
    return build_script(stages, steps)


def _split(handle: ir.Value, count: int) -> list[ir.Value]:
    """One handle per payload op of `handle` (which must hold `count`), in order."""
    return list(transform.SplitHandleOp([transform.AnyOpType.get()] * count, handle).results)


def _match_attr(target: ir.Value, attr: str) -> ir.Value:
    """The ops nested in `target` carrying the unit attribute `attr`."""
    return structured.MatchOp(transform.AnyOpType.get(), target,
                              op_attrs={attr: ir.UnitAttr.get()}).result


def _tagged(payload: ir.Module, attr: str) -> list[ir.Operation]:
    found = []

    def visit(op):
        if attr in op.attributes:
            found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return found
