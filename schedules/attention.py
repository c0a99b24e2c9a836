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
  stored [..., keys, queries] and K is read in place (schedules/key_major_scores.py): vector
  lanes run along the queries, the max and sum over keys are elementwise, no K^T exists.
vectorize (`vectorize_attention`): every op of the loop body is tiled to register tiles
(contractions as outer products, each starting from its accumulator's producer in registers)
and vectorized; with queries-major scores, K^T tiles are first packed (transform_ext.pack_key_tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

import transform_ext
from transform_ext.analysis.attention import (AttentionOps, NotAttention, attention_in,
                                             is_index_computation, is_neg_inf)
from transform_ext.analysis.structure import dim_positions, is_linalg_op, loop_structure
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
from transform_ext.match_register_tile_loops import match_register_tile_loops
from transform_ext.pack_key_tiles import pack_key_tiles
from transform_ext.rewrite_attention_row_mask import rewrite_attention_row_mask
from transform_ext.sink_normalization_past_contraction import sink_normalization_past_contraction
from transform_ext.store_scores_keys_major import store_scores_keys_major
from transform_ext.widen_softmax import widen_softmax

from .common import any_op, canonicalize, foreach, match, run_passes, run_schedule
from .generic import GenericParams, largest_divisor_at_most, single_func, vectorize_generic
from .prepare import cleanup



@dataclass(frozen=True)
class AttentionParams:
    """query_tile: query rows per scf.forall iteration (None: 64, or 128 when one head's K
    and V hold 1 MiB or more, so they stream from outside L2 half as often); key_tile: keys per step of the fused
    loop (a remainder tile is handled); threads: parallel tiles are balanced for this many
    workers. Tiles larger than the sequence are clamped to it. return_lse: the compiled
    function also returns the per-row log-sum-exp of the scaled, masked scores,
    lse = m + log(l) ([..., L]; -inf on fully masked rows), after the attention output.
    key_major: store the scores [..., keys, queries] (schedules/key_major_scores.py: vector
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


def _func(payload: ir.Module) -> ir.Operation:
    return single_func(payload, NotAttention)


def find_attention(payload: ir.Module) -> AttentionOps:
    """The ops of the attention in a normalized payload (or NotAttention saying why not)."""
    return attention_in(_func(payload))


def recognize(payload: ir.Module) -> bool:
    """Cheap test: a max reduction, an exp and two contractions."""
    text = str(payload)
    return "arith.maximumf" in text and "math.exp" in text and (
        text.count("linalg.batch_matmul") + text.count("linalg.matmul") >= 2
        or text.count("reduction\"]") >= 3)


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


def _is_cast(op: ir.Operation) -> bool:
    """An elementwise generic with identity maps yielding extf or truncf of its one input."""
    ls = loop_structure(op)
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    return ls.is_elementwise and ls.num_inputs == 1 and len(ops) == 2 and \
        ops[0].name in ("arith.extf", "arith.truncf") and ops[0].operands[0] == body.arguments[0] \
        and all(m == ls.maps[0] for m in ls.maps) and ls.maps[0].is_permutation


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


def check(payload: ir.Module) -> str | None:
    """None when this schedule applies to `payload`, else the one-line reason."""
    if _softmax_over_one_key(payload):
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


def _softmax_over_one_key(payload: ir.Module) -> bool:
    """Is there a max reduction over a dim of extent 1 (it folds away with the unit dim)?"""
    found = []

    def visit(op):
        if op.name == "linalg.generic" and any(o.operation.name == "arith.maximumf"
                                               for o in op.regions[0].blocks[0].operations):
            ls = loop_structure(op)
            if ls.reduction_dims and all(ls.ranges[d] == 1 for d in ls.reduction_dims):
                found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return bool(found)


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
    split = delta is not None and _index_masks(ops) == 1
    query_tile, query_iv = _tile_query_blocks(payload, ops, params)
    run_schedule(payload, lambda root: fuse_key_loops(match(root, "func.func"), params.key_tile))
    # s - m and exp become one pass over each tile (single-use producers, no recomputation)
    run_schedule(payload, lambda root: fuse_elementwise_producers(match(root, "func.func")))
    if delta is not None:
        run_schedule(payload, lambda root: bound_causal_key_loops(
            match(root, "scf.forall"), delta=delta, query_tile=query_tile, query_iv=query_iv,
            split=split))
    run_passes(payload, "canonicalize, cse")


def _index_masks(ops: AttentionOps) -> int:
    """The number of ops between the scores and the row max reading a mask computed from
    loop indices (a causal mask, a sliding window, ...)."""
    count, seen, pending = 0, [], [defining_op(ops.row_max.operands[0])]
    while pending:
        op = pending.pop()
        if op is None or op is ops.scores or not is_linalg_op(op) or op in seen:
            continue
        seen.append(op)
        ls = loop_structure(op)
        if ls.reduction_dims:
            continue
        producers = [defining_op(v) for v in list(op.operands)[:ls.num_inputs]]
        if any(p is not None and is_index_computation(p) for p in producers):
            count += 1
        pending.extend(p for p in producers if p is not None and not is_index_computation(p))
    return count


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


def _tile_query_blocks(payload, ops: AttentionOps, params: AttentionParams) -> tuple[int, int | None]:
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
        foreach(producers, lambda producer: structured.FuseIntoContainingOp(producer, tiled.forall_op))

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


def vectorize_attention(payload: ir.Module, params: GenericParams, unroll: int = 4) -> None:
    run_schedule(payload, lambda root: pack_key_tiles(match(root, "func.func")))
    vectorize_generic(payload, params)
    _unroll_register_loops(payload, unroll)


def _unroll_register_loops(payload: ir.Module, factor: int) -> None:
    """Unroll the k loops of register tiles (scf.for carrying only vectors, holding a
    vector.contract) so the outer products of consecutive k overlap."""
    if factor <= 1:
        return
    from torch_mlir.dialects.transform import loop as tloop

    run_schedule(payload, lambda root: tloop.LoopUnrollOp(match_register_tile_loops(root),
                                                          factor=factor))


# --------------------------------------------------------------------------- causal masks


@dataclass(frozen=True)
class _Lin:
    """a linear form sum_d coef[d] * loop_d + const over a generic's loop dims."""

    coef: tuple = ()
    const: int = 0

    def add(self, other: "_Lin", sign: int = 1) -> "_Lin":
        coef = dict(self.coef)
        for d, c in other.coef:
            coef[d] = coef.get(d, 0) + sign * c
        return _Lin(tuple(sorted((d, c) for d, c in coef.items() if c)), self.const + sign * other.const)

    def scale(self, k: int) -> "_Lin":
        return _Lin(tuple((d, c * k) for d, c in self.coef if c * k), self.const * k)


class _NotLinear(Exception):
    pass


_CMP = {"sle": "le", "slt": "lt", "sge": "ge", "sgt": "gt", "ule": "le", "ult": "lt",
        "uge": "ge", "ugt": "gt"}


def _form(value, op: ir.Operation):
    """The symbolic value of a scalar in `op`'s body: _Lin, ("pred", kind, _Lin) meaning
    lin <kind> 0, ("mask", pred) for select(pred, 0, -inf), ("bool", True), or a float."""
    if isinstance(value, ir.BlockArgument) and value.owner.owner == op:
        return _operand_form(op, value.arg_number)
    p = defining_op(value)
    if p is None:
        raise _NotLinear("value from outside the body")
    name = p.name
    if name == "linalg.index":
        return _Lin(((ir.IntegerAttr(p.attributes["dim"]).value, 1),), 0)
    if name == "arith.constant":
        attr = p.attributes["value"]
        if isinstance(attr, ir.IntegerAttr):
            return ("bool", bool(attr.value)) if str(attr.type) == "i1" else _Lin((), attr.value)
        if isinstance(attr, ir.FloatAttr):
            return attr.value
        raise _NotLinear(str(attr))
    args = [_form(v, op) for v in p.operands]
    if name in ("arith.index_cast", "arith.extsi", "arith.extui", "arith.trunci", "arith.index_castui"):
        return args[0]
    if name in ("arith.addi", "arith.subi") and all(isinstance(a, _Lin) for a in args):
        return args[0].add(args[1], 1 if name == "arith.addi" else -1)
    if name == "arith.muli" and all(isinstance(a, _Lin) for a in args):
        a, b = args
        if not a.coef:
            return b.scale(a.const)
        if not b.coef:
            return a.scale(b.const)
    if name == "arith.cmpi" and all(isinstance(a, _Lin) for a in args):
        pred_name = {2: "slt", 3: "sle", 4: "sgt", 5: "sge", 6: "ult", 7: "ule", 8: "ugt", 9: "uge"}.get(
            ir.IntegerAttr(p.attributes["predicate"]).value)
        kind = _CMP.get(pred_name)
        if kind is None:
            raise _NotLinear("cmpi predicate")
        return ("pred", kind, args[0].add(args[1], -1))
    if name == "arith.andi" and len(args) == 2:
        a, b = args
        if a == ("bool", True):
            return b
        if b == ("bool", True):
            return a
    if name == "arith.select":
        c, x, y = args
        if isinstance(c, tuple) and c[0] == "pred" and x == 0.0 and y == float("-inf"):
            return ("mask", c)
    raise _NotLinear(name)


def _operand_form(op: ir.Operation, index: int):
    """The form of `op`'s operand `index`, in `op`'s loop dims."""
    value = op.operands[index]
    producer = defining_op(value)
    amap = loop_structure(op).maps[index]
    if producer is None or not is_linalg_op(producer) or not loop_structure(producer).is_elementwise:
        raise _NotLinear("not computed from indices")
    body = producer.regions[0].blocks[0]
    inner = _form(body.operations[len(body.operations) - 1].operands[0], producer)
    # producer loop dim p is the consumer's loop dim at position p of the operand map
    out_positions = dim_positions(loop_structure(producer).output_map(0))
    outer = dim_positions(amap)
    rename = {pd: outer[pos] for pos, pd in enumerate(out_positions)}

    def relabel(lin: _Lin) -> _Lin:
        if any(rename.get(d) is None for d, _ in lin.coef):
            raise _NotLinear("composite map")
        return _Lin(tuple(sorted((rename[d], c) for d, c in lin.coef)), lin.const)

    if isinstance(inner, _Lin):
        return relabel(inner)
    if isinstance(inner, tuple) and inner[0] == "pred":
        return ("pred", inner[1], relabel(inner[2]))
    if isinstance(inner, tuple) and inner[0] == "mask":
        return ("mask", ("pred", inner[1][1], relabel(inner[1][2])))
    return inner


def causal_offset(payload: ir.Module, ops: AttentionOps) -> int | None:
    """delta such that every masked-in score has key <= query + delta (a causal mask, with
    torch's is_causal delta = 0), read from the index computation that masks the scores
    (added, S + M with M = select(pred, 0, -inf), or selected, select(pred, -inf, S));
    None when the scores carry no such mask."""
    row_max = ops.row_max
    producer = defining_op(row_max.operands[0])
    while producer is not None and producer.name == "linalg.generic" and _is_cast(producer):
        producer = defining_op(producer.operands[0])  # a bf16 softmax reads ext(masked S)
    if producer is None or producer is ops.scores or not is_linalg_op(producer):
        return None
    ls = loop_structure(producer)
    if not ls.is_elementwise:
        return None
    allowed = _allowed_region(producer)
    if allowed is None:
        return None
    # in the scores (either layout) the key is the dim m reduces, the query the one m keeps last
    rls = loop_structure(row_max)
    r_in = dim_positions(rls.maps[0])
    m_dims = dim_positions(rls.output_map(0))
    if not m_dims or m_dims[-1] not in r_in:
        return None
    key_pos, query_pos = r_in.index(rls.reduction_dims[0]), r_in.index(m_dims[-1])
    out = dim_positions(ls.output_map(0))
    if max(key_pos, query_pos) >= len(out):
        return None
    key_loop, query_loop = out[key_pos], out[query_pos]
    _, kind, lin = allowed
    coef = dict(lin.coef)
    if set(coef) - {key_loop, query_loop}:
        return None
    a, b, c = coef.get(query_loop, 0), coef.get(key_loop, 0), lin.const
    # allowed iff a*i + b*j + c <kind> 0; accept the causal family j - i + c <= 0
    if kind in ("ge", "gt"):
        a, b, c = -a, -b, -c
        kind = "le" if kind == "ge" else "lt"
    if (a, b) != (-1, 1):
        return None
    return -c if kind == "le" else -c - 1


_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}


def _allowed_region(op: ir.Operation):
    """("pred", kind, lin) of the scores elementwise `op` keeps, when it masks the others
    to -inf by a predicate computed from loop indices: S + M (M = select(pred, 0, -inf))
    or select(pred, -inf, S) / select(pred, S, -inf). None otherwise."""
    body = op.regions[0].blocks[0]
    last = defining_op(body.operations[len(body.operations) - 1].operands[0])
    if last is None:
        return None
    if last.name == "arith.addf" and all(isinstance(v, ir.BlockArgument) for v in last.operands):
        for i in range(loop_structure(op).num_inputs):
            try:
                form = _operand_form(op, i)
            except _NotLinear:
                continue
            if isinstance(form, tuple) and form[0] == "mask":
                return form[1]
        return None
    if last.name == "arith.select":
        cond, on_true, on_false = last.operands
        try:
            pred = _form(cond, op)
        except _NotLinear:
            return None
        if not (isinstance(pred, tuple) and pred[0] == "pred"):
            return None
        if is_neg_inf(on_true) and isinstance(on_false, ir.BlockArgument):
            return ("pred", _NEGATED[pred[1]], pred[2])
        if is_neg_inf(on_false) and isinstance(on_true, ir.BlockArgument):
            return pred
    return None
