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

This module holds the steps and @fuse. Recognizing the payload and finding its ops is
recognize.py; the parameters and the plan's dataclasses params.py; the plan (the steps
applied to a copy, each decision read before the step that needs it) plan.py; the CPU
vectorize stage cpu.py; script.py assembles the script; the XeGPU lowering is xegpu.py.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

from transform_ext.add_unread_input import add_unread_input
from transform_ext.drop_unused_results import drop_unused_results
from transform_ext.exclude_ops import exclude_ops
from transform_ext.filter_ops import filter_reductions
from transform_ext.fold_gathers_through_elementwise import fold_gathers_through_elementwise
from transform_ext.fold_reshape_ops_by_expansion import fold_reshape_ops_by_expansion
from transform_ext.fold_scalar_or_splat_constant import fold_scalar_or_splat_constant
from transform_ext.fuse_dependent_reduction_ops import fuse_dependent_reduction_ops
from transform_ext.inline_elementwise_producers import inline_elementwise_producers
from transform_ext.match_class_reductions import match_class_reductions
from transform_ext.match_assertion_checks import match_assertion_checks
from transform_ext.merge_elementwise import merge_elementwise
from transform_ext.promote_indexed_extracts import promote_indexed_extracts
from transform_ext.sink_sibling_readers import sink_sibling_readers
from transform_ext.split_affine_reductions import split_affine_reductions
from transform_ext.split_class_reductions import split_class_reductions
from transform_ext.split_assertions import split_assertions
from transform_ext.split_reduction_lanes import split_reduction_lanes
from transform_ext.trace_to_argument import trace_to_argument

from ..common import Place, annotate, apply_passes, at_place, canonicalize, foreach, match
from ..script import include_step
from .params import ClassLoop, CrossEntropyPlan, RowTiling


CLASS_SUM = "lh.class_sum"  # marks the reductions of the fused class loops for vectorization


def normalize(fold_reshapes: bool):
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


def logits_argument(func: ir.Value, row_max: ir.Value) -> ir.Value:
    """The logits a cross-entropy reads: the function argument its row max is computed from
    (a value handle)."""
    return trace_to_argument(row_max, 0)


def restructure_reading(logits_of):
    """Step 2 of the module docstring, the logits (the [N, C] tensor the rewrites keep:
    `logits_of(func, row_max)`, a value handle) found by `logits_of` (canonicalize and cse
    as passes between the rewrites)."""
    def body(root: ir.Value) -> ir.Value:
        func = match(root, "func.func")
        fold_gathers_through_elementwise(func)
        promote_indexed_extracts(func)
        root = apply_passes(root, "canonicalize", "cse")
        func = match(root, "func.func")
        generics = match(func, "linalg.generic")
        logits = logits_of(func, filter_reductions(generics, combiner="max"))
        inline_elementwise_producers(generics, witness=logits)
        root = apply_passes(root, "canonicalize", "cse")
        row_max = filter_reductions(match(match(root, "func.func"), "linalg.generic"), combiner="max")
        split_class_reductions(row_max)
        split_affine_reductions(row_max)
        return apply_passes(root, "canonicalize", "cse")

    return body


restructure = restructure_reading(logits_argument)


def merge_gradients(places: tuple[Place, ...]):
    """Step 3: the gradients (several results computed elementwise) merged into one op."""
    def body(root: ir.Value) -> ir.Value:
        handles = [at_place(root, place) for place in places]
        merge_elementwise(transform.MergeHandlesOp(handles).result)
        return root

    return body


def target_check_message(classes: int) -> str:
    """What the target checks say when a target is out of range (on every target)."""
    return (f"cross_entropy: a target is out of range: class indices must be in [0, {classes}) "
            f"or equal ignore_index")


def name_target_checks(classes: int):
    """The imported bounds checks of the gathers at the targets (x[i, y_i], w[y_i]; split
    into result-less generics by step 1) say what is wrong in the user's terms: a step
    (body(root) -> root) annotating the message on their cf.assert ops."""
    def body(root: ir.Value) -> ir.Value:
        message = ir.StringAttr.get(target_check_message(classes))
        text = transform.ParamConstantOp(transform.AnyParamType.get(), message).param
        foreach(match_assertion_checks(match(root, "func.func")),
                lambda check: transform.AnnotateOp(match(check, "cf.assert"), "msg", param=text))
        return root

    return body


def mark_class_sums(root: ir.Value) -> ir.Value:
    """Mark the row max and the class reductions `CLASS_SUM` (the fused loop's group, tiled
    for vectors later). A class reduction whose class loop no operand shares with the logits
    (the row sum of the one-hot gradient reads only targets and loop indices) gets the logits
    as an unread input, mapped by the dims they share in the whole graph: the fusion then
    sees it runs over the logits' classes."""
    func = match(root, "func.func")
    row_max = filter_reductions(match(func, "linalg.generic"), combiner="max")
    transform.AnnotateOp(row_max, CLASS_SUM)
    transform.AnnotateOp(match_class_reductions(row_max), CLASS_SUM)
    add_unread_input(match_attr(func, CLASS_SUM), trace_to_argument(row_max, 0))
    return root


def sink_root_readers(root_place: Place):
    """Step 4's preparation: the root's sibling readers after it (sink_sibling_readers)."""
    def body(root: ir.Value) -> ir.Value:
        sink_sibling_readers(at_place(root, root_place))
        return root

    return body


def tile_rows(rows: RowTiling, mark: str | None = None):
    """Step 4: the root tiled into an scf.forall over row blocks, its producers over the
    rows fused in one at a time (CSE first: equal slices of one producer become one use);
    the forall annotated `mark` when given."""
    def body(root: ir.Value) -> ir.Value:
        func = match(root, "func.func")
        handles = split_handle(match(func, list(rows.names)), rows.count)
        tiled = structured.TileUsingForallOp(handles[rows.places[0]], tile_sizes=list(rows.sizes))
        for producer in [handles[i] for i in rows.places[1:]]:
            canonicalize(func)
            structured.FuseIntoContainingOp(producer, tiled.forall_op)
        if mark is not None:  # (the fusions replace the forall: mark the last one)
            annotate(tiled.forall_op, mark)
        return apply_passes(root, "canonicalize", "cse")

    return body


def fuse_class_loops(loops: tuple[ClassLoop, ...], in_foralls: bool):
    """Step 5 of the module docstring, in every row block (or the function when unbatched):
    the lane split (when the lanes divide the classes) then the fusion over class tiles. A
    late class sum (one reading the final exp-sum l: sum_c round(x_c - m - log l), the
    label smoothing of 16-bit logits, as torch rounds the log-probabilities) stays out of
    both: a sweep of its own over the block's logits after the loop (the block sized for
    it, `CrossEntropyParams.sweep_bytes`)."""
    def body(root: ir.Value) -> ir.Value:
        if in_foralls:
            foralls = match(root, "scf.forall")
            scopes = [foralls] if len(loops) == 1 else list(transform.SplitHandleOp(
                [transform.AnyOpType.get()] * len(loops), foralls).results)
        else:
            scopes = [match(root, "func.func")]
        for scope, loop in zip(scopes, loops):
            late = None
            if loop.late:
                parts = split_handle(match_attr(scope, CLASS_SUM), loop.group_size)
                late = transform.MergeHandlesOp([parts[i] for i in loop.late]).result
            if loop.lanes > 1:
                group = match_attr(scope, CLASS_SUM)
                split_reduction_lanes(group if late is None else exclude_ops(group, late),
                                      loop.lanes)
            group = match_attr(scope, CLASS_SUM)
            if late is not None:
                group = exclude_ops(group, late)
            row_max = filter_reductions(group, combiner="max")
            fuse_dependent_reduction_ops(row_max, exclude_ops(group, row_max), loop.class_tile)
        return apply_passes(root, "canonicalize", "cse")

    return body


def fuse_steps(plan: CrossEntropyPlan) -> list[tuple[str, object]]:
    """The named steps of the fuse stage, in order: (name, body(root) -> root)."""
    steps = [("normalize", normalize(plan.fold_reshapes)), ("restructure", restructure)]
    if plan.gradients:
        steps.append(("merge_gradients", merge_gradients(plan.gradients)))
    steps += [("name_target_checks", name_target_checks(plan.classes)),
              ("mark_class_sums", mark_class_sums),
              ("sink_root_readers", sink_root_readers(plan.root))]
    if plan.rows is not None:
        steps.append(("tile_rows", tile_rows(plan.rows)))
    steps.append(("fuse_class_loops", fuse_class_loops(plan.blocks, plan.blocks_in_foralls)))
    return steps


def fuse_stage(plan: CrossEntropyPlan):
    """@fuse: its steps in order."""
    names = [name for name, _ in fuse_steps(plan)]

    def body(root: ir.Value) -> None:
        for name in names:
            root = include_step(name, root)

    return body


def split_handle(handle: ir.Value, count: int) -> list[ir.Value]:
    """One handle per payload op of `handle` (which must hold `count`), in order."""
    if not count:
        return []
    return list(transform.SplitHandleOp([transform.AnyOpType.get()] * count, handle).results)


def match_attr(target: ir.Value, attr: str, value: str | None = None) -> ir.Value:
    """The ops nested in `target` carrying `attr` (unit, or the string `value`)."""
    a = ir.UnitAttr.get() if value is None else ir.StringAttr.get(value)
    return structured.MatchOp(transform.AnyOpType.get(), target, op_attrs={attr: a}).result
