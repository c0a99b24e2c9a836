"""Flash attention: SDPA imported from torch, as one fused loop over key tiles per query block.

Input: the linalg graph torch-mlir makes of `F.scaled_dot_product_attention` (math backend):
    S = (Q c) (K^T c) [+ mask],  m = max_j S,  E = exp(S - m),  l = sum_j E,
    P = select(all_j(S == -inf), 0, E / l),  O = P V
Schedule (`fuse_attention`), target independent up to vectorization:
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
  On the CPU (`key_major`), before 3: the scores and the values computed from them are
  stored [..., keys, queries] and K is read in place (store_scores_keys_major,
  fold_key_transpose): vector lanes run along the queries, the max and sum over keys are
  elementwise, no K^T exists.
Every payload rewrite is a transform_ext op; the ops are found by transform_ext matchers
(match_attention, match_kv_chains, match_query_block_ops, match_foldable_collapse). The CPU
vectorize stage is cpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

import transform_ext
from transform_ext.analysis.attention import AttentionOps, NotAttention
from transform_ext.analysis.structure import loop_structure
from transform_ext.append_lse_result import append_lse_result
from transform_ext.bound_causal_key_loops import bound_causal_key_loops
from transform_ext.common import defining_op
from transform_ext.drop_broadcast_dims import drop_broadcast_dims
from transform_ext.drop_unused_results import drop_unused_results
from transform_ext.filter_keys_major_scores import filter_keys_major_scores
from transform_ext.fold_key_transpose import fold_key_transpose
from transform_ext.fold_reshape_ops_by_expansion import fold_reshape_ops_by_expansion
from transform_ext.fold_scalar_or_splat_constant import fold_scalar_or_splat_constant
from transform_ext.fuse_elementwise_producers import fuse_elementwise_producers
from transform_ext.fuse_key_loops import fuse_key_loops
from transform_ext.match_attention import match_attention
from transform_ext.match_foldable_collapse import match_foldable_collapse
from transform_ext.match_kv_chains import match_kv_chains
from transform_ext.match_query_block_ops import match_query_block_ops
from transform_ext.rewrite_attention_row_mask import rewrite_attention_row_mask
from transform_ext.sink_normalization_past_contraction import sink_normalization_past_contraction
from transform_ext.store_scores_keys_major import store_scores_keys_major
from transform_ext.widen_softmax import widen_softmax

from ..common import any_op, canonicalize, foreach, match, run_passes, run_schedule
from ..generic import largest_divisor_at_most
from ..prepare import cleanup
from .recognize import causal_offset, find_attention, index_masks, softmax_over_one_key


@dataclass(frozen=True)
class AttentionParams:
    """query_tile: query rows per scf.forall iteration (None: 64, or 128 when one head's K
    and V hold 1 MiB or more, so they stream from outside L2 half as often); key_tile: keys per step of the fused
    loop (a remainder tile is handled); threads: parallel tiles are balanced for this many
    workers. Tiles larger than the sequence are clamped to it. return_lse: the compiled
    function also returns the per-row log-sum-exp of the scaled, masked scores,
    lse = m + log(l) ([..., L]; -inf on fully masked rows), after the attention output.
    key_major: store the scores [..., keys, queries] (store_scores_keys_major: vector
    lanes along the queries; what CPU register tiles want)."""

    query_tile: int | None = None
    key_tile: int = 64
    threads: int = 2
    return_lse: bool = False
    key_major: bool = False

    def __post_init__(self):
        for name in ("query_tile", "key_tile", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"AttentionParams.{name} must be >= 1, got {getattr(self, name)}")


def check(payload: ir.Module) -> str | None:
    """None when this schedule applies to `payload`, else the one-line reason."""
    if softmax_over_one_key(payload):
        return "the softmax runs over one key (S_kv = 1): there is no key loop to fuse"
    trial = ir.Module.parse(str(payload), payload.context)
    try:
        with payload.context, ir.Location.unknown():
            cleanup(trial)  # the family is chosen on the import: judge what fuse will see
            _normalize(trial)
            _prepare_guard(trial)
            find_attention(trial)
    except NotAttention as exc:
        return str(exc)
    except Exception as exc:  # a transform refused the payload: its first line says why
        return _first_line(exc)
    return None


def _first_line(exc: Exception) -> str:
    import re

    text = str(exc)
    for line in text.splitlines():
        if "Diagnostic message" in line:
            text = line.split("): ", 1)[-1]
            break
    else:
        text = (text.splitlines() or [type(exc).__name__])[0]
    text = re.sub(r" at loc\([^)]*\)", "", text)
    return text.split("at loc(unknown)")[0].strip()[:240]


def _normalize(payload: ir.Module) -> None:
    transform_ext.load(payload.context)

    def body(root):
        f = match(root, "func.func")
        f = drop_unused_results(f)
        f = fold_scalar_or_splat_constant(f)
        f = fold_reshape_ops_by_expansion(f)
        canonicalize(f)

    run_schedule(payload, body)
    _fold_shared_collapses(payload)
    run_passes(payload, "linalg-fold-unit-extent-dims, canonicalize, cse")
    run_schedule(payload, lambda root: widen_softmax(match(root, "func.func")))
    run_passes(payload, "canonicalize, cse")


def _fold_shared_collapses(payload: ir.Module, rounds: int = 8) -> None:
    """Collapses read by several linalg ops (grouped-query attention collapses its
    [kv heads, group] scores for the softmax) are folded into every reader, so the whole
    graph runs in the scores' iteration space: per round, the first foldable collapse, then
    the reshapes that fold exposes (in the function holding the collapse: a round without
    one changes nothing)."""
    def body(root):
        for _ in range(rounds):
            collapse = match_foldable_collapse(match(root, "func.func"))
            func = transform.GetParentOp(any_op(), collapse, op_name="func.func").result
            fold_reshape_ops_by_expansion(collapse)
            fold_reshape_ops_by_expansion(func)

    run_schedule(payload, body)


def _share_kv_heads(payload: ir.Module) -> None:
    """K and V repeated per query head (grouped-query attention) are read once per kv head:
    their elementwise chains (repeat, transpose, scale) merge, then the repeated dims go
    (in the function holding the chains: nothing happens without them)."""
    find_attention(payload)  # NotAttention says why not

    def body(root):
        chains = match_kv_chains(match(root, "func.func"))
        func = transform.GetParentOp(any_op(), chains, op_name="func.func", deduplicate=True).result
        fuse_elementwise_producers(chains)
        apply_passes(drop_broadcast_dims(func), "canonicalize", "cse")

    run_schedule(payload, body)


def _prepare_guard(payload: ir.Module) -> None:
    """Steps 2 of the module docstring: sink 1/l past P V, guard read from the max."""
    _share_kv_heads(payload)
    run_schedule(payload, lambda root: sink_normalization_past_contraction(
        match_attention(match(root, "func.func"))[2]))
    if _has_guard(find_attention(payload)):
        def guard_from_max(root):
            row_max, _, values = match_attention(match(root, "func.func"))
            rewrite_attention_row_mask(row_max, values)

        run_schedule(payload, guard_from_max)
    run_passes(payload, "canonicalize, cse")


def _has_guard(ops: AttentionOps) -> bool:
    """Does a select feed the P V contraction (SDPA's fully-masked-row guard)?"""
    for v in ops.values.operands:
        p = defining_op(v)
        if p is not None and p.name == "linalg.generic" and "arith.select" in str(p):
            return True
    return False


def fuse_attention(payload: ir.Module, params: AttentionParams = AttentionParams()) -> None:
    _normalize(payload)
    _prepare_guard(payload)
    if params.return_lse:
        run_schedule(payload, lambda root: append_lse_result(match(root, "func.func")))
    if params.key_major:
        _store_keys_major(payload)
    ops = find_attention(payload)
    delta = causal_offset(payload, ops)
    # the mask-free first loop drops the index-computed mask: only when it is the only one
    # (a second one, a sliding window, must stay)
    split = delta is not None and index_masks(ops) == 1
    query_tile, query_iv = tile_query_blocks(payload, ops, params)
    run_schedule(payload, lambda root: fuse_key_loops(match(root, "func.func"), params.key_tile))
    # s - m and exp become one pass over each tile (single-use producers, no recomputation)
    run_schedule(payload, lambda root: fuse_elementwise_producers(match(root, "func.func")))
    if delta is not None:
        run_schedule(payload, lambda root: bound_causal_key_loops(
            match(root, "scf.forall"), delta=delta, query_tile=query_tile, query_iv=query_iv,
            split=split))
    run_passes(payload, "canonicalize, cse")


def apply_passes(target: ir.Value, *names: str) -> ir.Value:
    """transform.apply_registered_pass of each pass in turn (it consumes its target);
    returns the handle to the target after the last."""
    for name in names:
        target = transform.ApplyRegisteredPassOp(any_op(), target, name).result
    return target


def _store_keys_major(payload: ir.Module) -> None:
    """Scores stored keys-major and K read in place (transform_ext/store_scores_keys_major.py,
    fold_key_transpose.py) where the scores allow it: the queries-major layout works for
    every payload this schedule takes, so other scores are left as they are (and their
    function is not canonicalized again)."""
    def body(root):
        _, scores, _ = match_attention(match(root, "func.func"))
        relayable = filter_keys_major_scores(scores)
        store_scores_keys_major(relayable)
        fold_key_transpose(relayable)
        func = transform.GetParentOp(any_op(), relayable, op_name="func.func").result
        apply_passes(func, "canonicalize", "cse")

    run_schedule(payload, body)


def tile_query_blocks(payload: ir.Module, ops: AttentionOps,
                      params: AttentionParams) -> tuple[int, int | None]:
    """Step 3 of the module docstring: the output tiled into an scf.forall over query
    blocks, the ops computing its query rows fused into it one at a time. Returns the query
    tile and the forall induction variable of the query blocks (None for one block)."""
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

    def body(root):
        output, producers = match_query_block_ops(match(root, "func.func"))
        tiled = structured.TileUsingForallOp(output, tile_sizes=sizes)
        foreach(producers,
                lambda producer: structured.FuseIntoContainingOp(producer, tiled.forall_op))

    run_schedule(payload, body)
    run_passes(payload, "canonicalize, cse")
    # forall IVs exist for the dims split into several tiles (canonicalization drops the rest)
    multi = [l for l, size in enumerate(sizes) if size and out_ls.ranges[l] > size]
    return qt, (multi.index(ops.query_dim) if ops.query_dim in multi else None)


def _default_query_tile(ops: AttentionOps) -> int:
    s_ls, v_ls = loop_structure(ops.scores), loop_structure(ops.values)
    s_dims, v_dims = s_ls.contraction_dims(), v_ls.contraction_dims()
    keys = s_ls.ranges[s_dims["n"][-1]]
    kv_bytes = 4 * keys * (s_ls.ranges[s_dims["k"][-1]] + v_ls.ranges[v_dims["n"][-1]])
    return 128 if kv_bytes >= 1 << 20 else 64
