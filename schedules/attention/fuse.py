"""Flash attention: SDPA imported from torch, as one fused loop over key tiles per query block.

Input: the linalg graph torch-mlir makes of `F.scaled_dot_product_attention` (math backend):
    S = (Q c) (K^T c) [+ mask],  m = max_j S,  E = exp(S - m),  l = sum_j E,
    P = select(all_j(S == -inf), 0, E / l),  O = P V
Schedule (the script's @fuse, one named step per item), target independent up to
vectorization:
  1. normalize: drop the unused argmax, fold scalar/splat constants into bodies, fold the
     4-D <-> 3-D reshapes around the batch matmuls, fold unit dims;
  2. sink the 1/l normalization past P V and read the fully-masked-row guard from m
     (rewrite_attention_row_mask): O = select(m == -inf, 0, (E V) / l);
  3. tile the output into an scf.forall over (batch..., heads, query blocks of
     `query_tile` rows); every producer that depends on the query rows is fused into it,
     the K side (transpose, scale) is computed once outside;
  4. inside each query block, fuse_key_loops (fuse_dependent_reduction_ops) turns max, sum
     and P V, with S computed per tile, into one scf.for over key tiles of `key_tile` with
     the online softmax correction (stable exp(m_old - m_new) form): no S_q x S_kv tensor
     exists;
  5. causal masks (and any mask whose -inf region is a half-plane j > i + c) bound that loop:
     key tiles wholly above the diagonal are not computed (bound_causal_key_loops), and the
     tiles wholly below it run in a first loop without the mask.
  6. on the CPU, tile_other_ops: the ops outside the fused loops (the projections around an
     attention written by hand) tiled for threads as the generic schedule tiles its roots.
  On the CPU (`key_major`), before 3: the scores and the values computed from them are
  stored [..., keys, queries] and K is read in place (store_scores_keys_major,
  fold_key_transpose): vector lanes run along the queries, the max and sum over keys are
  elementwise, no K^T exists.
Without a softmax, O = f(S) V with f elementwise (ReLU attention; KeyLoopPlan): steps 1, 3,
then key_tiles instead of 4 (O's contraction tiled over the keys into one loop carrying O,
S, f and the mask fused into it one key tile at a time: match_key_loop_ops, tile_using_for,
fuse_into_containing_op, a partial last tile peeled), 5 when f(-inf) = 0 exactly, and 6.
Every payload rewrite is a transform_ext op; the ops are found by transform_ext matchers
(match_attention, match_kv_chains, match_query_block_ops, match_foldable_collapse). What the
steps cannot decide by matching (the guard, the tile sizes, the causal offset) is read once
from a normalized copy of the payload into a frozen AttentionPlan (`plan_attention`), whose
values appear in the script as attributes. The CPU vectorize stage is cpu.py; script.py
assembles both.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

import transform_ext
from transform_ext.analysis.attention import AttentionOps, NotAttention, elementwise_attention_in
from transform_ext.analysis.attention_backward import NotAttentionBackward, attention_backward_in
from transform_ext.analysis.structure import loop_structure
from transform_ext.append_lse_result import append_lse_result
from transform_ext.bound_causal_key_loops import bound_causal_key_loops
from transform_ext.clone_shared_fills import clone_shared_fills
from transform_ext.collapse_reduction_dims import collapse_reduction_dims
from transform_ext.common import defining_op, walk_ops
from transform_ext.deduplicate_generics import deduplicate_generics
from transform_ext.drop_broadcast_dims import drop_broadcast_dims
from transform_ext.drop_unused_results import drop_unused_results
from transform_ext.filter_keys_major_scores import filter_keys_major_scores
from transform_ext.fold_key_transpose import fold_key_transpose
from transform_ext.fold_reshape_ops_by_expansion import fold_reshape_ops_by_expansion
from transform_ext.fold_scalar_or_splat_constant import fold_scalar_or_splat_constant
from transform_ext.fuse_attention_backward import fuse_attention_backward
from transform_ext.fuse_attention_backward_two_pass import fuse_attention_backward_two_pass
from transform_ext.fuse_elementwise_producers import fuse_elementwise_producers
from transform_ext.fuse_key_loops import fuse_key_loops
from transform_ext.fuse_roots_into_foralls import fuse_roots_into_foralls
from transform_ext.match_attention import match_attention
from transform_ext.match_foldable_collapse import match_foldable_collapse
from transform_ext.match_key_loop_ops import match_key_loop_ops
from transform_ext.match_kv_chains import match_kv_chains
from transform_ext.match_query_block_ops import match_query_block_ops
from transform_ext.rewrite_attention_row_mask import rewrite_attention_row_mask
from transform_ext.sink_normalization_past_contraction import sink_normalization_past_contraction
from transform_ext.store_scores_keys_major import store_scores_keys_major
from transform_ext.widen_softmax import widen_softmax

from ..common import (annotate, any_op, apply_passes, canonicalize, foreach, match, peel_loop,
                      run_schedule)
from ..generic import GenericParams, largest_divisor_at_most
from ..prepare import check_by_planning
from ..script import include_step
from .recognize import (attention_func, causal_offset, elementwise_causal_offset,
                        find_attention, index_masks, softmax_over_one_key)


@dataclass(frozen=True)
class AttentionParams:
    """query_tile: query rows per scf.forall iteration (None: 64, or 128 when one head's K
    and V hold 1 MiB or more, so they stream from outside L2 half as often); key_tile: keys per step of the fused
    loop (a remainder tile is handled); threads: parallel tiles are balanced for this many
    workers. Tiles larger than the sequence are clamped to it. return_lse: the compiled
    function also returns the per-row log-sum-exp of the scaled, masked scores,
    lse = m + log(l) ([..., L]; -inf on fully masked rows), after the attention output.
    key_major: store the scores [..., keys, queries] (store_scores_keys_major: vector
    lanes along the queries; what CPU register tiles want). backward_tiles: the attention
    backward of a joint graph in two passes (transform_ext.fuse_attention_backward_two_pass,
    a GPU's form): (query rows per block, keys per step) of the dQ pass, then (keys per
    block, query rows per step) of the dK, dV pass; None: one pass (the CPU's form)."""

    query_tile: int | None = None
    key_tile: int = 64
    threads: int = 2
    return_lse: bool = False
    key_major: bool = False
    backward_tiles: tuple[int, int, int, int] | None = None

    def __post_init__(self):
        for name in ("query_tile", "key_tile", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"AttentionParams.{name} must be >= 1, got {getattr(self, name)}")
        if self.backward_tiles is not None and (len(self.backward_tiles) != 4
                                                or min(self.backward_tiles) < 1):
            raise ValueError(f"AttentionParams.backward_tiles must be four sizes >= 1, got "
                             f"{self.backward_tiles}")


@dataclass(frozen=True)
class BackwardPlan:
    """The attention backward of a joint forward+backward payload, fused first
    (transform_ext.fuse_attention_backward): its query and key tiles and causal delta."""

    query_tile: int
    key_tile: int
    causal_delta: int | None
    threads: int = 1
    # two passes (AttentionParams.backward_tiles, each clamped to a divisor of its extent):
    # ((query rows, keys per step) of the dQ pass, (keys, query rows per step) of dK, dV)
    two_pass: tuple[tuple[int, int], tuple[int, int]] | None = None


@dataclass(frozen=True)
class KeyLoopPlan:
    """An attention without a softmax, O = f(Q K^T) V: the tile sizes of O's contraction
    that tile its reduction over the keys into a loop of key tiles (tile_using_for) and
    whether the last tile, partial, is peeled off it."""

    sizes: tuple[int, ...]
    peel: bool


@dataclass(frozen=True)
class AttentionPlan:
    """What the script is built from: the parameters and what the normalized payload shows.
    row_guard: a select guards the fully masked rows (SDPA's math backend), read from the
    row max after normalization; tile_sizes: the output's tile_using_forall sizes (1 per
    batch/head dim, `query_tile` rows of the query dim, 0 for the value dim); query_iv: the
    forall induction variable of the query blocks (None: one block); causal_delta: every
    masked-in score has key <= query + delta (None: no such mask); split_unmasked: the tiles
    below the diagonal run without the mask (the index-computed mask is the only one)."""

    params: AttentionParams
    row_guard: bool
    tile_sizes: tuple[int, ...]
    query_tile: int
    query_iv: int | None
    causal_delta: int | None
    split_unmasked: bool
    backward: BackwardPlan | None = None
    forward: bool = True  # False: the payload is an attention backward alone
    key_loop: KeyLoopPlan | None = None  # an attention without a softmax

    @staticmethod
    def backward_only(params: AttentionParams, backward: BackwardPlan) -> "AttentionPlan":
        """The plan of a payload holding an attention backward and no forward (the backward
        graph AOTAutograd splits from a joint one): the backward is fused, nothing else."""
        return AttentionPlan(params, False, (), 0, None, None, False, backward, forward=False)


class _Normalized:
    """The last payload normalized on a copy (payload text after cleanup -> the copy's text
    after steps 1-2 up to the row guard, and whether it has the guard): `check` and the
    script's plan read the same payload, so that prefix runs once on a copy per compile."""

    source: tuple | None = None  # (payload text, threads, backward tiles)
    text: str = ""
    row_guard: bool = False
    backward: BackwardPlan | None = None


def check(payload: ir.Module, params: AttentionParams = AttentionParams(),
          gpu: bool = False) -> str | None:
    """None when this schedule applies to `payload`, else the one-line reason (not an
    attention, or a transform refused it; any other error propagates). `gpu`: for a target
    without a CPU, which has no lowering of an attention without a softmax."""
    if softmax_over_one_key(payload):
        return "the softmax runs over one key (S_kv = 1): there is no key loop to fuse"

    def plan(trial: ir.Module) -> None:
        if plan_attention(trial, params).key_loop is not None and gpu:
            raise NotAttention("an attention without a softmax (f(Q K^T) V) has no GPU "
                               "lowering yet")

    return check_by_planning(payload, plan, NotAttention)


def plan_attention(payload: ir.Module, params: AttentionParams) -> AttentionPlan:
    """The plan of `payload` (after cleanup; read, not rewritten): the schedule's
    normalization applied to a copy, then the attention read from it (NotAttention, or the
    failing transform's error, when the schedule does not apply). Needs an active context."""
    transform_ext.load(payload.context)
    # the backward's kernel is balanced for the threads, in one or two passes
    source = (str(payload), params.threads, params.backward_tiles)
    if _Normalized.source != source:
        trial = ir.Module.parse(source[0], payload.context)
        _apply_steps(trial, [_normalize_layout])
        backward = plan_backward(trial, params.threads, params.backward_tiles)
        if backward is not None:
            _apply_steps(trial, [_fuse_backward(backward)])
            if not _has_forward(trial):
                if params.return_lse:
                    raise NotAttention("return_lse: the payload has an attention backward "
                                       "and no forward")
                return AttentionPlan.backward_only(params, backward)
        try:
            find_attention(trial)  # NotAttention says why not
        except NotAttention as reason:
            if backward is not None:
                raise
            return _plan_key_loop(trial, params, reason)
        _apply_steps(trial, [_share_kv_heads, _sink_normalization])
        _Normalized.source, _Normalized.text = source, str(trial)
        _Normalized.row_guard = _has_guard(find_attention(trial))
        _Normalized.backward = backward
    row_guard, backward = _Normalized.row_guard, _Normalized.backward
    trial = ir.Module.parse(_Normalized.text, payload.context)
    _apply_steps(trial, [_masked_rows(row_guard, params)])
    ops = find_attention(trial)
    delta = causal_offset(trial, ops)
    sizes, query_tile, query_iv = query_block_tiles(ops, params)
    # the mask-free first loop drops the index-computed mask: only when it is the only one
    # (a second one, a sliding window, must stay)
    return AttentionPlan(params, row_guard, tuple(sizes), query_tile, query_iv, delta,
                         delta is not None and index_masks(ops) == 1, backward)


def _plan_key_loop(trial: ir.Module, params: AttentionParams,
                   reason: NotAttention) -> AttentionPlan:
    """The plan of an attention without a softmax in the normalized `trial` (`reason`, why
    it is no softmax attention, when it is none either)."""
    try:
        ops = elementwise_attention_in(attention_func(trial))
    except NotAttention:
        raise reason from None
    if params.return_lse:
        raise NotAttention("return_lse: an attention without a softmax has no log-sum-exp")
    sizes, query_tile, query_iv = query_block_tiles(ops, params)
    values = loop_structure(ops.values)
    key_dim = values.reduction_dims[0]
    tile = min(params.key_tile, values.ranges[key_dim])
    # the key tiles above the diagonal are skipped in a loop of two whole tiles or more (one
    # is no loop: canonicalization folds it)
    delta = elementwise_causal_offset(ops) if values.ranges[key_dim] >= 2 * tile else None
    key_sizes = [0] * values.num_loops
    key_sizes[key_dim] = tile
    return AttentionPlan(params, False, tuple(sizes), query_tile, query_iv, delta,
                         delta is not None and index_masks(ops) == 1,
                         key_loop=KeyLoopPlan(tuple(key_sizes), values.ranges[key_dim] % tile != 0))


def _has_forward(payload: ir.Module) -> bool:
    """Is there a forward attention among the function's top-level ops?"""
    try:
        find_attention(payload)
    except NotAttention:
        return False
    return True


def plan_backward(payload: ir.Module, threads: int = 1,
                  two_pass: tuple[int, int, int, int] | None = None) -> BackwardPlan | None:
    """The plan of the attention backward in a payload after step 1 (None: there is none),
    its kernel balanced for `threads`, in two passes with the tiles `two_pass`
    (AttentionParams.backward_tiles)."""
    func = attention_func(payload)
    try:
        bwd = attention_backward_in(func)
    except NotAttentionBackward:
        return None
    shape = lambda src: list(ir.ShapedType(src.value.type).shape)[-2:]
    rows = lambda src: shape(src)[1 if src.transposed else 0]
    delta = None
    if bwd.masked and bwd.bias is None:
        delta = causal_offset(payload, bwd)
        if delta is None or delta < 0:
            raise NotAttention("the attention backward's mask is not causal (key <= query + "
                               "delta, delta >= 0)")
    L, S = rows(bwd.q), rows(bwd.k)
    passes = None
    if two_pass is not None:   # no padding in the two-pass kernel: tiles that divide
        bq, bk, bk2, bq2 = two_pass
        passes = ((largest_divisor_at_most(L, bq), largest_divisor_at_most(S, bk)),
                  (largest_divisor_at_most(S, bk2), largest_divisor_at_most(L, bq2)))
    return BackwardPlan(backward_tile(L), backward_tile(S), delta, threads, passes)


BACKWARD_TILE = 64


def backward_tile(length: int) -> int:
    """The backward's tile of a length: the largest divisor up to BACKWARD_TILE when it is at
    least half of it, else BACKWARD_TILE itself (the kernel pads the length to whole tiles:
    a prime length would otherwise get 1-row tiles)."""
    if length <= BACKWARD_TILE:
        return length
    tile = largest_divisor_at_most(length, BACKWARD_TILE)
    return tile if 2 * tile >= BACKWARD_TILE else BACKWARD_TILE
QUERY_BLOCKS = "lh.query_blocks"  # the forward's forall (query blocks, key loops inside)


def _fuse_backward(backward: BackwardPlan):
    """Step 1b: the attention backward as one fused kernel (its own loops over query and key
    tiles), inlined; the forward's steps then see the forward alone."""
    def body(root: ir.Value) -> ir.Value:
        if backward.two_pass is not None:
            fuse_attention_backward_two_pass(match(root, "func.func"),
                                             dq_tiles=backward.two_pass[0],
                                             dkv_tiles=backward.two_pass[1],
                                             causal_delta=backward.causal_delta)
        else:
            fuse_attention_backward(match(root, "func.func"), query_tile=backward.query_tile,
                                    key_tile=backward.key_tile,
                                    causal_delta=backward.causal_delta, threads=backward.threads)
        return apply_passes(root, "inline", "symbol-dce", "canonicalize", "cse")

    return body


def _apply_steps(payload: ir.Module, steps) -> None:
    def body(root):
        for step in steps:
            root = step(root)

    run_schedule(payload, body)


def _fold_constants_and_reshapes(root: ir.Value) -> ir.Value:
    """Step 1: the unused argmax dropped, scalar/splat constants folded into bodies, the
    4-D <-> 3-D reshapes around the batch matmuls folded."""
    f = match(root, "func.func")
    f = drop_unused_results(f)
    f = fold_scalar_or_splat_constant(f)
    f = fold_reshape_ops_by_expansion(f)
    canonicalize(f)
    return root


def _fold_shared_collapse(root: ir.Value) -> ir.Value:
    """Step 1: the first collapse read by several linalg ops and foldable into all of them
    (grouped-query attention collapses its [kv heads, group] scores for the softmax), then
    the reshapes that fold exposes, in the function holding it (nothing when none is left)."""
    collapse = match_foldable_collapse(match(root, "func.func"))
    func = transform.GetParentOp(any_op(), collapse, op_name="func.func").result
    fold_reshape_ops_by_expansion(collapse)
    fold_reshape_ops_by_expansion(func)
    return root


_COLLAPSE_ROUNDS = 8


def _fold_unit_dims(root: ir.Value) -> ir.Value:
    """Step 1: unit dims folded, and an f16/bf16 softmax's probabilities kept in f32."""
    root = apply_passes(root, "linalg-fold-unit-extent-dims", "canonicalize", "cse")
    widen_softmax(match(root, "func.func"))
    return apply_passes(root, "canonicalize", "cse")


def _normalize_layout(root: ir.Value) -> ir.Value:
    """Step 1 (for the plan's trial: the same ops as @normalize's first steps)."""
    root = _fold_constants_and_reshapes(root)
    for _ in range(_COLLAPSE_ROUNDS):
        root = _fold_shared_collapse(root)
    return _fold_unit_dims(root)


def _share_kv_heads(root: ir.Value) -> ir.Value:
    """K and V repeated per query head (grouped-query attention) are read once per kv head:
    their elementwise chains (repeat, transpose, scale) merge, then the repeated dims go
    (in the function holding the chains: nothing happens without them)."""
    chains = match_kv_chains(match(root, "func.func"))
    func = transform.GetParentOp(any_op(), chains, op_name="func.func", deduplicate=True).result
    fuse_elementwise_producers(chains)
    apply_passes(drop_broadcast_dims(func), "canonicalize", "cse")
    return root


def _sink_normalization(root: ir.Value) -> ir.Value:
    """Step 2: 1/l sunk past P V: O = (E V) / l."""
    sink_normalization_past_contraction(match_attention(match(root, "func.func"))[2])
    return root


def _guard_from_row_max(root: ir.Value) -> ir.Value:
    """Step 2: the fully-masked-row guard read from the max: O = select(m == -inf, 0, ...)."""
    row_max, _, values = match_attention(match(root, "func.func"))
    rewrite_attention_row_mask(row_max, values)
    return root


def _append_lse(root: ir.Value) -> ir.Value:
    """return_lse: lse = m + log(l) as one more result."""
    append_lse_result(match(root, "func.func"))
    return root


def _store_scores_keys_major(root: ir.Value) -> ir.Value:
    """key_major: the scores stored keys-major and K read in place where the scores allow
    it (the queries-major layout works for every payload, so other scores stay as they
    are, and their function is not canonicalized again)."""
    _, scores, _ = match_attention(match(root, "func.func"))
    relayable = filter_keys_major_scores(scores)
    store_scores_keys_major(relayable)
    fold_key_transpose(relayable)
    func = transform.GetParentOp(any_op(), relayable, op_name="func.func").result
    apply_passes(func, "canonicalize", "cse")
    return root


def _normalize_steps(row_guard: bool, params: AttentionParams) -> list[tuple[str, object]]:
    """The steps @normalize includes after the layout is normalized (see `_masked_rows`)."""
    steps = [("share_kv_heads", _share_kv_heads), ("sink_normalization", _sink_normalization)]
    if row_guard:
        steps.append(("guard_from_row_max", _guard_from_row_max))
    steps.append(("canonicalize", lambda root: apply_passes(root, "canonicalize", "cse")))
    if params.return_lse:
        steps.append(("append_lse", _append_lse))
    if params.key_major:
        steps.append(("store_scores_keys_major", _store_scores_keys_major))
    return steps


def _masked_rows(row_guard: bool, params: AttentionParams):
    """Steps 2 after the 1/l sink, for the plan's trial: as @normalize runs them."""
    steps = _normalize_steps(row_guard, params)[2:]

    def body(root: ir.Value) -> ir.Value:
        for _, step in steps:
            root = step(root)
        return root

    return body


def _has_guard(ops: AttentionOps) -> bool:
    """Does a select feed the P V contraction (SDPA's fully-masked-row guard)?"""
    for v in ops.values.operands:
        p = defining_op(v)
        if p is not None and p.name == "linalg.generic" \
                and walk_ops(p, lambda o: o.name == "arith.select"):
            return True
    return False


def _normalize(plan: AttentionPlan):
    """Steps 1-2 (see the module docstring), one named step each."""
    def body(root: ir.Value) -> ir.Value:
        root = include_step("fold_constants_and_reshapes", root)
        for _ in range(_COLLAPSE_ROUNDS):
            root = include_step("fold_shared_collapse", root)
        root = include_step("fold_unit_dims", root)
        if plan.backward is not None:
            root = include_step("fuse_backward", root)
        if not plan.forward or plan.key_loop is not None:
            return root
        for name, _ in _normalize_steps(plan.row_guard, plan.params):
            root = include_step(name, root)
        return root

    return body


def tile_query_blocks(plan: AttentionPlan):
    """Step 3: the output tiled into an scf.forall over query blocks, the ops computing its
    query rows fused into it one at a time; a producer fused twice (for a reader inside and
    for a result the forall yields) computed once."""
    def body(root: ir.Value) -> ir.Value:
        # a zero init shared by the scores and the output (CSE'd when S = E) would reach
        # one of them only once fused
        clone_shared_fills(match(root, "func.func"))
        output, producers = match_query_block_ops(match(root, "func.func"))
        tiled = structured.TileUsingForallOp(output, tile_sizes=list(plan.tile_sizes))
        # found by name: beside a fused backward's forall, and by the CPU's vectorize stage
        annotate(tiled.forall_op, QUERY_BLOCKS)
        foreach(producers,
                lambda producer: structured.FuseIntoContainingOp(producer, tiled.forall_op))
        root = apply_passes(root, "canonicalize", "cse")
        deduplicate_generics(match(root, "func.func"))
        return apply_passes(root, "canonicalize", "cse")

    return body


def _online_softmax(plan: AttentionPlan):
    """Step 4: per query block, max, sum and P V in one loop over key tiles (the online
    softmax correction), then s - m and exp as one pass over each tile."""
    def body(root: ir.Value) -> ir.Value:
        fuse_key_loops(match(root, "func.func"), plan.params.key_tile)
        fuse_elementwise_producers(match(root, "func.func"))
        return root

    return body


def _key_tiles(plan: AttentionPlan):
    """Step 4 without a softmax: per query block, O = f(S) V tiled over the keys into one
    loop carrying O (tile_using_for on its reduction), S, f and the mask fused into it one
    key tile at a time; a partial last tile peeled off."""
    def body(root: ir.Value) -> ir.Value:
        values, producers = match_key_loop_ops(match(root, "scf.forall"))
        tiled = structured.TileUsingForOp(values, sizes=list(plan.key_loop.sizes))
        foreach(producers,
                lambda producer: structured.FuseIntoContainingOp(producer, tiled.loops[0]))
        if plan.key_loop.peel:
            peel_loop(tiled.loops[0])
        return apply_passes(root, "canonicalize", "cse")

    return body


def _causal_bounds(plan: AttentionPlan):
    """Step 5: key tiles above the diagonal skipped, those below it without the mask."""
    def body(root: ir.Value) -> ir.Value:
        blocks = match(root, "scf.forall") if plan.backward is None else structured.MatchOp(
            any_op(), root, op_attrs={QUERY_BLOCKS: ir.UnitAttr.get()}).result
        bound_causal_key_loops(blocks, delta=plan.causal_delta,
                               query_tile=plan.query_tile, query_iv=plan.query_iv,
                               split=plan.split_unmasked)
        return root

    return body


def _tile_other_ops(params: GenericParams):
    """Step 6 (CPU): the ops outside the fused kernels (the projections around an attention
    written by hand, K's transpose) tiled for threads with their producers fused in, as the
    generic schedule tiles its roots; first, a contraction over several reduction loops
    that its operands read as one contiguous group (an output projection of the heads
    re-assembled, y.transpose(1, 2).view(B, T, C) @ W^T, over (head, head dim)) takes them
    as one loop, as the generic schedule's normalization does (with two, its register
    tile's step had no outer-product form: one scalar FMA per lane)."""
    def body(root: ir.Value) -> ir.Value:
        collapse_reduction_dims(match(root, "func.func"))
        root = apply_passes(root, "canonicalize", "cse")
        fuse_roots_into_foralls(match(root, "func.func"), threads=params.threads,
                                tiles_per_thread=params.tiles_per_thread,
                                tile_bytes=params.tile_bytes, vector_tile=params.vector_tile,
                                min_parallel_work=params.min_parallel_work,
                                pass_bytes=params.pass_bytes, lanes=params.lanes)
        return apply_passes(root, "canonicalize", "cse")

    return body


def fuse_steps(plan: AttentionPlan, others: GenericParams | None = None
               ) -> list[tuple[str, object]]:
    """The named steps of the fuse stage, each before the steps that include it:
    (name, body(root) -> root); with `others`, the ops outside the fused kernels are tiled
    for threads last."""
    steps = [("fold_constants_and_reshapes", _fold_constants_and_reshapes),
             ("fold_shared_collapse", _fold_shared_collapse), ("fold_unit_dims", _fold_unit_dims)]
    if plan.backward is not None:
        steps.append(("fuse_backward", _fuse_backward(plan.backward)))
    if not plan.forward:
        steps.append(("normalize", _normalize(plan)))
        if others is not None:
            steps.append(("tile_other_ops", _tile_other_ops(others)))
        return steps
    if plan.key_loop is None:
        steps += _normalize_steps(plan.row_guard, plan.params)
    steps += [("normalize", _normalize(plan)), ("tile_query_blocks", tile_query_blocks(plan)),
              _key_loop_step(plan)]
    if plan.causal_delta is not None:
        steps.append(("causal_bounds", _causal_bounds(plan)))
    if others is not None:
        steps.append(("tile_other_ops", _tile_other_ops(others)))
    return steps


def _key_loop_step(plan: AttentionPlan) -> tuple[str, object]:
    """Step 4: the online softmax, or without a softmax the key tiles of f(S) V."""
    if plan.key_loop is not None:
        return "key_tiles", _key_tiles(plan)
    return "online_softmax", _online_softmax(plan)


def fuse_stage(plan: AttentionPlan, others: GenericParams | None = None):
    """@fuse: normalize, tile_query_blocks, online_softmax, causal_bounds (with a causal
    mask), with `others` tile_other_ops, then canonicalization and CSE; for a backward
    alone, normalize only (and tile_other_ops)."""
    names = ["normalize"]
    if plan.forward:
        names += ["tile_query_blocks", _key_loop_step(plan)[0]]
    if plan.causal_delta is not None:
        names.append("causal_bounds")
    if others is not None:
        names.append("tile_other_ops")

    def body(root: ir.Value) -> None:
        for name in names:
            root = include_step(name, root)
        apply_passes(root, "canonicalize", "cse")

    return body


def query_block_tiles(ops: AttentionOps, params: AttentionParams
                       ) -> tuple[list[int], int, int | None]:
    """Step 3's tile sizes of the output (see AttentionPlan), its query tile and the forall
    induction variable of the query blocks."""
    out_ls = loop_structure(ops.output)
    extent = out_ls.ranges[ops.query_dim]
    qt = largest_divisor_at_most(extent, params.query_tile or _default_query_tile(ops))
    sizes = [0] * out_ls.num_loops
    heads = [l for l in out_ls.parallel_dims if l not in (ops.query_dim, ops.value_dim)]
    for l in heads:  # batch and head dims: one per query block
        sizes[l] = 1
    blocks = extent // qt
    for l in heads:
        blocks *= out_ls.ranges[l]
    if blocks == 1 and extent > 1:
        # a one-iteration forall would be folded away, and the key loop with it
        qt = largest_divisor_at_most(extent, extent // 2)
    sizes[ops.query_dim] = qt
    # forall IVs exist for the dims split into several tiles (canonicalization drops the rest)
    multi = [l for l, size in enumerate(sizes) if size and out_ls.ranges[l] > size]
    return sizes, qt, (multi.index(ops.query_dim) if ops.query_dim in multi else None)


def _default_query_tile(ops: AttentionOps) -> int:
    s_ls, v_ls = loop_structure(ops.scores), loop_structure(ops.values)
    s_dims, v_dims = s_ls.contraction_dims(), v_ls.contraction_dims()
    keys = s_ls.ranges[s_dims["n"][-1]]
    kv_bytes = 4 * keys * (s_ls.ranges[s_dims["k"][-1]] + v_ls.ranges[v_dims["n"][-1]])
    return 128 if kv_bytes >= 1 << 20 else 64
