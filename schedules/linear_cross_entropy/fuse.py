"""Fused linear cross-entropy: F.cross_entropy(F.linear(h, W[, b]), y) (nn.Linear with
nn.CrossEntropyLoss, the usual view(-1, V)) without ever holding the [N, V] logits.

Input: the linalg graph torch-mlir makes of the loss over S = h W^T [+ b] (forward, or the
joint forward+backward graph): the cross-entropy family's log-softmax over S, the target
logit gathered from it, class sums for label smoothing and weights, and in the joint graph
the d logits G = E(S, ...) read by dh = G W, dW = G^T h and db = sum_n G.
Schedule (the script's @fuse, one named step per item; decisions read by
`plan_linear_cross_entropy` from a copy of the payload):
  1. normalize (the cross_entropy family's, reshapes not folded by expansion); fold_casts:
     S's contraction reads h and W in place (bf16/f16 widenings and W's transpose folded
     into it, transform_ext.fold_casts_into_contractions); restructure as the
     cross_entropy family does (its step 2, the [N, V] values kept being S's,
     transform_ext.match_logits_contraction); shrink_bounds: S kept as an unread bound of a
     class loop becomes an empty [V] (transform_ext.shrink_unread_inputs); the target
     bounds checks named;
  2. fold_gathers: the target logit S[n, y_n] becomes the dot product h_n . W_{y_n}
     (transform_ext.fold_gathers_through_contraction), so nothing reads S at an index;
  3. fuse_backward (joint graph): transform_ext.fuse_linear_cross_entropy_backward replaces
     G and its readers (and the reductions over the rows of S, db) by a loop over blocks of
     `backward_rows` rows, each a forall over the threads' shares of the class tiles: S's
     tile read from S^T as the forward stored it (stores_logits) or recomputed from h and
     W, G's tile from it and the forward's row statistics (m, log l: the saved lse), dW
     and db accumulated per class tile, dh per thread and summed;
  4. logits_classes_major: S stored [V, N] (store_scores_keys_major) with W read in place
     (fold_key_transpose) and h^T made by a transpose: a CPU register tile of S's
     contraction then has its lanes along the rows (h^T) and broadcasts W, and the max and
     sums over the classes are elementwise;
  5. mark_class_sums (the row max and the class reductions reading S), the cross_entropy
     family's sink_root_readers, then tile_rows: the last per-row op of the loss tiled into
     an scf.forall over blocks of `row_tile` rows (marked ROW_BLOCKS), its producers over
     the rows fused in (S^T's contraction, h^T, the row max and sums, the dot products);
  6. fuse_class_loops: in each row block, fuse_dependent_reduction_ops makes the row max,
     the exp-sum (online, exp(m_old - m_new)) and every class sum ONE loop over tiles of
     `class_tile` classes, with S^T's contraction computed per tile (its producer; with
     stored logits each tile is also written into the block's columns of S^T, which the
     row-block forall yields: yield_producers); a class
     sum that needs the final exp-sum (label smoothing of bf16/f16 logits: torch rounds each
     log-probability before summing) gets a second loop over the class tiles after it, the
     logits tile recomputed in it (read from S^T when stored).
  7. logits_in_pairs (plan.amx: bf16 h and W on a CPU with AMX, D, the row block and the
     class tile multiples of 32; not a remainder tile of V mod class_tile classes): S^T's
     tile contraction in the class loops reads
     W's class tile in pairs of the depth in place, [C, D/2, 2], and the row block's h^T as
     pairs [D/2, rows, 2] packed once per block (transform_ext.contraction_in_vnni_pairs),
     marked AMX_PRODUCT; the CPU's vectorize stage cuts it into 32 x 32 steps of 16 pairs
     that the target runs on AMX tiles. The fused backward (step 3, params.amx) builds its
     products of such extents in pairs itself: S^T likewise, dW from G^T's rows in place
     and h_s's pairs of rows, dh from G's rows in place and W's pairs of classes packed
     once before the row blocks.
The GPU form (params classes_major=False, masked_target=True, lanes=16; the XeGPU target's
linear_cross_entropy_tiles): step 2 is masked_gathers (the target logit as a masked sum
over S's classes, transform_ext.gathers_to_masked_class_sums, a class sum of the fused
loop) and lane_form (the reductions over the rows read the losses in lane form), step 3 is
fold_one_hot_sums then the backward in two passes (transform_ext.
fuse_linear_cross_entropy_backward_two_pass: dh per block of rows, dW and db per block of
classes, no reduction across blocks), step 4 is
skipped (S stays [N, V]: DPAS tiles), targets_in_lanes follows step 5 (y and the gathers
per row in lane form), and the row blocks tile the losses' lane copy; xegpu.py maps the
row-block forall to workgroups.
No [N, V] tensor is left in a forward: it holds a [class_tile, row_tile] tile of S per
thread. The joint graph's backward holds a [class_tile, backward_rows] tile of G per thread
plus the threads' dh partials [threads, backward_rows, D], and S^T [V, N] in f32 when it
fits `stored_logits_bytes` (stores_logits; step 3 makes the backward read S^T's tiles, step
6 makes the forward's class loops yield the tiles they compute into it, and the second
sweep of a late class sum reads them too), else a tile of S per thread, recomputed. The
CPU @vectorize (cpu.py) is the generic one, the k loops of the register tiles unrolled.
Not taken (the reason in the fallback's note): the logits read otherwise (returned, a
reduction over rows and classes), a weight read [D, V] without a transpose (W passed as a
transposed view), hidden states that torch.export turns into a batch matmul with a
broadcast weight (a non-contiguous 3-D h).
"""

from __future__ import annotations

import math

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

from transform_ext.common import AMX_PRODUCT
from transform_ext.contraction_in_vnni_pairs import contraction_in_vnni_pairs
from transform_ext.filter_iterators import filter_iterators
from transform_ext.filter_ops import filter_reductions
from transform_ext.fold_casts_into_contractions import fold_casts_into_contractions
from transform_ext.fold_gathers_through_contraction import fold_gathers_through_contraction
from transform_ext.fold_key_transpose import fold_key_transpose
from transform_ext.fold_one_hot_class_sums import fold_one_hot_class_sums
from transform_ext.fuse_dependent_reduction_ops import fuse_dependent_reduction_ops
from transform_ext.fuse_linear_cross_entropy_backward import fuse_linear_cross_entropy_backward
from transform_ext.fuse_linear_cross_entropy_backward_two_pass import (
    fuse_linear_cross_entropy_backward_two_pass)
from transform_ext.gathers_to_masked_class_sums import gathers_to_masked_class_sums
from transform_ext.inline_argument_producers import inline_argument_producers
from transform_ext.forall_results_in_lane_form import forall_results_in_lane_form
from transform_ext.lane_form_gathers import lane_form_gathers
from transform_ext.lane_form_row_reductions import lane_form_row_reductions
from transform_ext.load_rows_in_lane_form import load_rows_in_lane_form
from transform_ext.match_assertion_checks import match_assertion_checks
from transform_ext.match_loss_kernels import match_loss_kernels
from transform_ext.split_shared_fills import split_shared_fills
from transform_ext.exclude_ops import exclude_ops
from transform_ext.match_logits_contraction import match_logits_contraction
from transform_ext.match_class_reductions import match_class_reductions
from transform_ext.promote_indexed_extracts import promote_indexed_extracts
from transform_ext.shrink_unread_inputs import shrink_unread_inputs
from transform_ext.store_scores_keys_major import store_scores_keys_major

from ..common import apply_passes, match, peel_loop
from ..generic import largest_divisor_at_most
from ..cross_entropy.fuse import (CLASS_SUM, match_attr, name_target_checks, normalize,
                                  restructure_reading, sink_root_readers, split_handle, tile_rows)
from ..script import include_step
from .params import LateSum, LinearCrossEntropyParams, LinearCrossEntropyPlan

ROW_BLOCKS = "lh.row_blocks"  # the forward's forall (the backward's is a fused kernel's)
LOGITS = "lh.logits"  # S^T's contraction and its tiles, while the class loops are made (amx)
AMX_LOGITS = "lh.amx_logits"  # S^T's tile contractions in the class loops, to be paired
ONE_HOT_SUM = "lh.one_hot_sum"  # the backward's one-hot row sums, folded to per-row ops

# the cross_entropy family's normalization without folding reshapes by expansion: the
# logits' contraction of [B, T, D] hidden states keeps its 2-D form on the collapsed rows
normalize_loss = normalize(False)


def logits_shape(func: ir.Value, row_max: ir.Value) -> ir.Value:
    """An [N, V] value standing for the logits in the restructure (which reads only its
    shape, and keeps it as an unread loop bound where one is needed: shrink_bounds shrinks
    those): the logits contraction's init (a value handle; not the contraction's result,
    whose op the restructure consumes with the other generics)."""
    return transform.GetOperandOp(transform.AnyValueType.get(), match_logits_contraction(func),
                                  [2]).result


def fold_casts(root: ir.Value) -> ir.Value:
    """Step 1: the logits contraction generalized, reading h and W in place: the widening
    of bf16/f16 operands and the transpose of W folded into it
    (transform_ext.fold_casts_into_contractions)."""
    logits = structured.GeneralizeOp(match_logits_contraction(match(root, "func.func"))).transformed
    fold_casts_into_contractions(logits)
    return apply_passes(root, "canonicalize", "cse")


restructure = restructure_reading(logits_shape)


def shrink_bounds(root: ir.Value) -> ir.Value:
    """Step 1: the logits kept by the restructure as an unread bound of a loop over the
    classes (the one-hot row sum of the gradient reads only the targets) become an empty
    [V] bound (transform_ext.shrink_unread_inputs): only the ops reading S stay its
    readers."""
    shrink_unread_inputs(match(root, "func.func"))
    return apply_passes(root, "canonicalize", "cse")


def mark_class_sums(root: ir.Value) -> ir.Value:
    """Step 5: the row max and the class reductions over S's classes marked `CLASS_SUM`
    (the fused loop's group). Class reductions that do not read S (the one-hot row sum)
    share no dim with it: they stay outside the row blocks, as loops over [N, V] indices
    that read no [N, V] tensor."""
    func = match(root, "func.func")
    row_max = filter_reductions(match(func, "linalg.generic"), combiner="max")
    transform.AnnotateOp(row_max, CLASS_SUM)
    transform.AnnotateOp(match_class_reductions(row_max), CLASS_SUM)
    return root


def fold_gathers(root: ir.Value) -> ir.Value:
    """Step 2: the gathers from S read dot products, their row operand promoted to an input
    (which then bounds the depth loop: the empty [D] bound goes, before CSE could merge it
    with a [V] bound of a class loop when D = V and tie the depth to the classes)."""
    func = match(root, "func.func")
    fold_gathers_through_contraction(func)
    promote_indexed_extracts(func)
    shrink_unread_inputs(func)
    return apply_passes(root, "canonicalize", "cse")


def masked_gathers(root: ir.Value) -> ir.Value:
    """Step 2 (masked_target): the gathers from S read masked sums over S's classes
    (transform_ext.gathers_to_masked_class_sums), class sums like the exp-sum's, so the
    class loop computes the target logit from its logits tile."""
    gathers_to_masked_class_sums(match(root, "func.func"))
    return apply_passes(root, "canonicalize", "cse")


def lane_form(rows: int, lanes: int):
    """Step 2 (lanes > 0): the reductions over the rows read the targets themselves and the
    rows' losses in lane form [N, lanes] (transform_ext.lane_form_row_reductions, after
    split_shared_fills and inline_argument_producers): the cross_entropy family's XeGPU
    form of per-row data crossing kernels."""
    def body(root: ir.Value) -> ir.Value:
        func = match(root, "func.func")
        split_shared_fills(func)
        inline_argument_producers(match_loss_kernels(func).row_sums, gathers=True)
        lane_form_row_reductions(match_loss_kernels(func).row_sums, rows, lanes)
        return apply_passes(root, "canonicalize", "cse")

    return body


def targets_in_lanes(rows: int, lanes: int):
    """Step 5 (lanes > 0, after the class sums are marked): the per-row ops read y through
    a lane-form gather reduced over the lanes (transform_ext.load_rows_in_lane_form) and
    the per-row gathers (the bias b_{y_n} of the target logit) run in lane form
    (transform_ext.lane_form_gathers), so on the GPU y_n and b_{y_n} have the layout of a
    reduction over the classes; the targets' bounds
    checks read y itself first (their producers inlined: they stay on the host)."""
    def body(root: ir.Value) -> ir.Value:
        func = match(root, "func.func")
        inline_argument_producers(match_assertion_checks(func))
        forward_rows = lambda: exclude_ops(match_loss_kernels(func).rows,
                                           match_attr(func, ONE_HOT_SUM))
        loads = load_rows_in_lane_form(forward_rows(), rows, lanes)
        lane_form_gathers(filter_iterators(exclude_ops(forward_rows(), loads), ["parallel"]),
                          lanes)
        return apply_passes(root, "canonicalize", "cse")

    return body


def fold_one_hot_sums(root: ir.Value) -> ir.Value:
    """Step 3 (lanes > 0, the joint graph): the backward's one-hot row sums (a sum over the
    classes of a term that only the target class leaves nonzero) become per-row ops
    (transform_ext.fold_one_hot_class_sums): the passes read them per row, no [N, V]
    iteration space is left outside the kernels; they compute what they read from the
    arguments (the targets with ignored rows selected away) themselves
    (transform_ext.inline_argument_producers), so they read no value of the forward's
    kernel. Marked ONE_HOT_SUM: they are not run in lane form (targets_in_lanes), each pass
    reads them per row."""
    folded = inline_argument_producers(fold_one_hot_class_sums(match(root, "func.func")))
    transform.AnnotateOp(folded, ONE_HOT_SUM)
    return apply_passes(root, "canonicalize", "cse")


def fuse_backward(params: LinearCrossEntropyParams, rows: int = 0, classes: int = 0):
    """Step 3 of the module docstring; in the [N, V]-major form (the GPU's) the backward in
    two passes (transform_ext.fuse_linear_cross_entropy_backward_two_pass: dh per block of
    rows over class tiles, dW and db per block of classes over row tiles; the block the
    largest divisor of N and V (`rows`, `classes`) at most `row_tile` and, when N allows,
    at most N / 2: a grid of one block would fold into its body and leave the per-row
    producers unsliced, with no kernel to take them; the step the largest at most
    `class_tile` and, for the same reason (pass 2 loops over the rows), at most N / 2)."""
    common = math.gcd(rows, classes)
    block_cap = min(params.row_tile, max(rows // 2, 1))

    def body(root: ir.Value) -> ir.Value:
        func = match(root, "func.func")
        if params.classes_major:
            fuse_linear_cross_entropy_backward(func, row_tile=params.backward_rows,
                                               class_tile=params.class_tile,
                                               threads=params.threads, panel=params.panel,
                                               bf16_pairs=params.bf16_dot, amx=params.amx,
                                               stored_logits=stores_logits(params, rows, classes))
        else:
            fuse_linear_cross_entropy_backward_two_pass(
                func, block=largest_divisor_at_most(common, block_cap),
                step=largest_divisor_at_most(common, min(params.class_tile, block_cap)))
        return apply_passes(root, "canonicalize", "cse")

    return body


def stores_logits(params: LinearCrossEntropyParams, rows: int, classes: int) -> bool:
    """Does the backward read S^T [V, N] as the forward's class loops computed it (f32, at
    most `stored_logits_bytes`), instead of recomputing its tiles from h and W?"""
    return params.classes_major and 4 * rows * classes <= params.stored_logits_bytes


def logits_classes_major(root: ir.Value) -> ir.Value:
    """Step 4 of the module docstring."""
    logits = match_logits_contraction(match(root, "func.func"))
    store_scores_keys_major(logits)
    fold_key_transpose(logits)
    return apply_passes(root, "canonicalize", "cse")


def fuse_class_loops(params: LinearCrossEntropyParams, late: tuple[LateSum, ...] = (),
                     group_size: int = 0, amx: bool = False, stored: bool = False):
    """Step 6 of the module docstring, in every row block; then each late class sum (one
    that reads a reduction of the group other than the row max: sum_c round(x_c - m -
    log l), label smoothing of bf16 logits, needs the final l) gets a loop of its own over
    the class tiles with S^T's tile computed in it (a second sweep: the logits recomputed).
    With `amx`, S^T's tile contractions inside these loops are marked AMX_LOGITS (a
    remainder tile of V mod class_tile classes, after a loop, is not: S^T's contraction is
    marked LOGITS first, its tiles keep the mark)."""
    def body(root: ir.Value) -> ir.Value:
        blocks = structured.MatchOp(transform.AnyOpType.get(), root,
                                    op_attrs={ROW_BLOCKS: ir.UnitAttr.get()}).result
        group = match_attr(blocks, CLASS_SUM)
        lates = []
        if late:
            parts = split_handle(group, group_size)
            lates = [parts[s.place] for s in late]
            group = exclude_ops(group, transform.MergeHandlesOp(lates).result)
        row_max = filter_reductions(group, combiner="max")
        logits = match_logits_contraction(blocks)
        if amx:
            transform.AnnotateOp(logits, LOGITS)
        class_loops = [fuse_dependent_reduction_ops(row_max, exclude_ops(group, row_max),
                                                    params.class_tile, producers=[logits],
                                                    yield_producers=stored)]
        for target, s in zip(lates, late):
            any_op = transform.AnyOpType.get()
            if not stored:
                producer = transform.GetProducerOfOperand(any_op, target,
                                                          s.logits_operand).producer
                init = transform.GetProducerOfOperand(any_op, producer, 2).producer  # its fill
            tiled = structured.TileUsingForOp(target, sizes=list(s.tile_sizes))
            if not stored:
                structured.FuseIntoContainingOp(producer, tiled.loops[0])
                structured.FuseIntoContainingOp(init, tiled.loops[0])
            main = tiled.loops[0]
            if s.peel:  # the last, partial class tile as a static tile of its own
                main = peel_loop(tiled.loops[0]).peeled_loop
            class_loops.append(main)
        if amx:
            for class_loop in class_loops:
                marked = structured.MatchOp(transform.AnyOpType.get(), class_loop,
                                            op_attrs={LOGITS: ir.UnitAttr.get()}).result
                transform.AnnotateOp(marked, AMX_LOGITS)
        return apply_passes(root, "canonicalize", "cse")

    return body


def logits_in_pairs(root: ir.Value) -> ir.Value:
    """Step 7 (plan.amx): each S^T tile's contraction (marked AMX_LOGITS) reads W's rows in
    pairs of the depth in place and h^T as pairs [D/2, rows, 2] made once per row block
    (transform_ext.contraction_in_vnni_pairs), marked AMX_PRODUCT: the layout of AMX's
    tdpbf16ps, whose 32 x 32 tiles the CPU's vectorize stage cuts (cpu.py)."""
    marked = structured.MatchOp(transform.AnyOpType.get(), root,
                                op_attrs={AMX_LOGITS: ir.UnitAttr.get()}).result
    transform.AnnotateOp(contraction_in_vnni_pairs(marked), AMX_PRODUCT)
    return apply_passes(root, "canonicalize", "cse")


def row_results_in_lanes(lanes: int):
    """Step 7 (lanes > 0, the joint graph): the row max m and exp-sum l that the backward's
    passes read leave the row blocks in lane form [N, lanes] and are read back reduced over
    the lanes (transform_ext.forall_results_in_lane_form): on the GPU they cross kernels as
    2-D block stores and loads, as the losses do."""
    def body(root: ir.Value) -> ir.Value:
        blocks = structured.MatchOp(transform.AnyOpType.get(), root,
                                    op_attrs={ROW_BLOCKS: ir.UnitAttr.get()}).result
        forall_results_in_lane_form(blocks, lanes)
        return apply_passes(root, "canonicalize", "cse")

    return body


def gather_step(params: LinearCrossEntropyParams) -> tuple[str, object]:
    """Step 2 as the params choose: masked class sums, or dot products."""
    return ("masked_gathers", masked_gathers) if params.masked_target else \
        ("fold_gathers", fold_gathers)


def fuse_steps(plan: LinearCrossEntropyPlan) -> list[tuple[str, object]]:
    """The named steps of the fuse stage, in order: (name, body(root) -> root)."""
    steps = [("normalize", normalize_loss), ("fold_casts", fold_casts),
             ("restructure", restructure), ("shrink_bounds", shrink_bounds),
             ("name_target_checks", name_target_checks(plan.classes)),
             gather_step(plan.params)]
    if plan.params.lanes:
        steps.append(("lane_form", lane_form(plan.rows_total, plan.params.lanes)))
    if plan.params.lanes and plan.backward:
        steps.append(("fold_one_hot_sums", fold_one_hot_sums))
    if plan.backward:
        steps.append(("fuse_backward", fuse_backward(plan.params, plan.rows_total,
                                                     plan.classes)))
    if plan.params.classes_major:
        steps.append(("logits_classes_major", logits_classes_major))
    steps.append(("mark_class_sums", mark_class_sums))
    if plan.params.lanes:
        steps.append(("targets_in_lanes", targets_in_lanes(plan.rows_total, plan.params.lanes)))
    steps += [
              ("sink_root_readers", sink_root_readers(plan.root)),
              ("tile_rows", tile_rows(plan.rows, mark=ROW_BLOCKS)),
              ("fuse_class_loops", fuse_class_loops(plan.params, plan.late, plan.group_size,
                                                    plan.amx, plan.stored_logits))]
    if plan.amx:
        steps.append(("logits_in_pairs", logits_in_pairs))
    if plan.params.lanes and plan.backward:
        steps.append(("row_results_in_lanes", row_results_in_lanes(plan.params.lanes)))
    return steps


def fuse_stage(plan: LinearCrossEntropyPlan):
    """@fuse: its steps in order."""
    names = [name for name, _ in fuse_steps(plan)]

    def body(root: ir.Value) -> None:
        for name in names:
            root = include_step(name, root)

    return body
