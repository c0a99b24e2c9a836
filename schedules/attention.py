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
  4. inside each query block, fuse_dependent_reduction_ops turns max, sum and P V, with S
     computed per tile, into one scf.for over key tiles of `key_tile` with the online
     softmax correction (stable exp(m_old - m_new) form): no S_q x S_kv tensor exists;
  5. causal masks (and any mask whose -inf region is a half-plane j > i + c) bound that loop:
     key tiles wholly above the diagonal are not computed (bound_key_loops), and the tiles
     wholly below it run in a first loop without the mask.
  On the CPU (`key_major`), before 3: the scores and the values computed from them are
  stored [..., keys, queries] and K is read in place (schedules/key_major_scores.py): vector
  lanes run along the queries, the max and sum over keys are elementwise, no K^T exists.
vectorize (`vectorize_attention`): every op of the loop body is tiled to register tiles
(contractions as outer products, each starting from its accumulator's producer in registers)
and vectorized; with queries-major scores, K^T tiles are first packed (pack_key_tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

import transform_ext
from transform_ext.analysis.classify import reduction_combiner
from transform_ext.analysis.structure import dim_positions, is_linalg_op, loop_structure
from transform_ext.common import (block_ops, build_generic, clone_body, defining_op,
                                  erase_dead_body_ops, iterator_kinds, reassociation_attr,
                                  walk_ops)
from transform_ext.drop_broadcast_dims import drop_broadcast_dims
from transform_ext.drop_unused_results import drop_unused_results
from transform_ext.fold_reshape_ops_by_expansion import fold_reshape_ops_by_expansion, reassociation
from transform_ext.fold_scalar_or_splat_constant import fold_scalar_or_splat_constant
from transform_ext.fuse_dependent_reduction_ops import fuse_dependent_reduction_ops
from transform_ext.fuse_elementwise_producers import fuse_elementwise_producers
from transform_ext.rewrite_attention_row_mask import rewrite_attention_row_mask
from transform_ext.sink_normalization_past_contraction import sink_normalization_past_contraction

from .common import canonicalize, clear_tags, match, match_id, run_passes, run_schedule, tag_ops
from .generic import GenericParams, largest_divisor_at_most, single_func, vectorize_generic
from .prepare import cleanup


DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


class NotAttention(Exception):
    """The payload is not attention this schedule takes; the message is the reason."""


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


@dataclass
class AttentionOps:
    """The ops of one attention after normalization (payload ops)."""

    scores: ir.Operation       # S = Q K^T
    row_max: ir.Operation      # m
    row_sum: ir.Operation      # l
    values: ir.Operation       # E V
    output: ir.Operation       # the op whose result is the attention output
    query_dim: int             # loop dim of `output` running over query rows
    value_dim: int             # loop dim of `output` running over the value columns


def _func(payload: ir.Module) -> ir.Operation:
    return single_func(payload, NotAttention)


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
    if _widen_softmax(payload):
        run_passes(payload, "canonicalize, cse")


_NARROW = ("f16", "bf16")


def _widen_softmax(payload: ir.Module) -> bool:
    """The probabilities of a softmax written by hand in f16/bf16 kept in f32, as SDPA's:
    torch rounds P = E / l to f16/bf16 before P V (which reads it back through extf), a
    rounding the online softmax cannot reproduce (P is never formed). The scores keep
    torch's roundings (S = trunc(Q K^T), the scale and mask in bf16: elementwise ops the
    key loop computes per tile), so the result differs from torch's by P's rounding only.
    Forward from the row max, in block order:
      - a truncf-only generic of an f32 value has that value as its f32 shadow;
      - an op reading shadowed values only through extf reads the shadow (the extf goes);
      - an elementwise op computing in f16/bf16 from shadowed values is recomputed in f32
        (constants keep their rounded value; unshadowed narrow inputs, a bf16 mask, are
        extended), and its result gets that f32 shadow.
    Narrow values still read elsewhere keep their ops. Returns whether anything changed."""
    func = _func(payload)
    maxes = [op for op in block_ops(func) if is_linalg_op(op) and reduction_combiner(op) == "max"]
    if len(maxes) != 1:
        return False
    row_max = maxes[0]
    f32 = ir.F32Type.get(payload.context)
    shadow: dict = {}
    changed = False
    for op in block_ops(func):
        if op.name != "linalg.generic" or len(op.results) != 1 or op is row_max or \
                not _depends_into(op, row_max):
            continue
        ls = loop_structure(op)
        inputs = list(op.operands)[:ls.num_inputs]
        if _is_truncation(op) and str(inputs[0].type.element_type) == "f32":
            shadow[op.results[0]] = inputs[0]
            continue
        read = [i for i, v in enumerate(inputs) if v in shadow]
        if not read:
            continue
        with payload.context, op.location:
            if all(_read_through_extf(op, i) for i in read):
                new = _read_shadows(op, read, shadow)
                op.results[0].replace_all_uses_with(new.results[0])
                op.erase()
                changed = True
            elif ls.is_elementwise and str(op.results[0].type.element_type) in _NARROW:
                wide = _recompute_in_f32(op, read, shadow, f32)
                if wide is not None:
                    shadow[op.results[0]] = wide.results[0]
                    changed = True
    return changed


def _is_truncation(op: ir.Operation) -> bool:
    """An elementwise generic yielding truncf of its one input (a rounding to f16/bf16)."""
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    return loop_structure(op).is_elementwise and loop_structure(op).num_inputs == 1 and \
        len(ops) == 2 and ops[0].name == "arith.truncf" and ops[0].operands[0] == body.arguments[0] \
        and ops[1].operands[0] == ops[0].results[0]


def _is_cast(op: ir.Operation) -> bool:
    """An elementwise generic with identity maps yielding extf or truncf of its one input."""
    ls = loop_structure(op)
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    return ls.is_elementwise and ls.num_inputs == 1 and len(ops) == 2 and \
        ops[0].name in ("arith.extf", "arith.truncf") and ops[0].operands[0] == body.arguments[0] \
        and all(m == ls.maps[0] for m in ls.maps) and ls.maps[0].is_permutation


def _read_through_extf(op: ir.Operation, index: int) -> bool:
    """Does `op`'s body read input `index` only as arith.extf to f32?"""
    arg = op.regions[0].blocks[0].arguments[index]
    uses = [u.owner for u in arg.uses]
    return bool(uses) and all(getattr(u, "name", None) == "arith.extf" and
                              str(u.results[0].type) == "f32" for u in uses)


def _read_shadows(op: ir.Operation, read: list[int], shadow: dict) -> ir.Operation:
    """`op` rebuilt with inputs `read` replaced by their f32 shadows, their extf dropped."""
    ls = loop_structure(op)
    operands = list(op.operands)
    new_inputs = [shadow[v] if i in read else v for i, v in enumerate(operands[:ls.num_inputs])]
    body = op.regions[0].blocks[0]

    def build(args):
        mapping = dict(zip(body.arguments, args))
        for i in read:
            for use in list(body.arguments[i].uses):
                mapping[use.owner.results[0]] = args[i]
        for inner in list(body.operations)[:-1]:
            inner = inner.operation
            if inner.name == "arith.extf" and inner.results[0] in mapping:
                continue
            clone = inner.clone()
            for j, v in enumerate(clone.operands):
                if v in mapping:
                    clone.operands[j] = mapping[v]
            for old, res in zip(inner.results, clone.results):
                mapping[old] = res
        yielded = body.operations[len(body.operations) - 1].operands
        return [mapping.get(v, v) for v in yielded]

    with ir.InsertionPoint(op):
        return build_generic(new_inputs, operands[ls.num_inputs:], ls.maps,
                             iterator_kinds(op), build, name_from=op)


def _recompute_in_f32(op, read: list[int], shadow: dict, f32) -> ir.Operation | None:
    """Elementwise `op` recomputed in f32 from the shadows of inputs `read` (None when its
    body holds anything but arith/math ops, or reads its init)."""
    from torch_mlir.dialects import arith, tensor

    ls = loop_structure(op)
    body = op.regions[0].blocks[0]
    if list(body.arguments[ls.num_inputs].uses) or any(
            not o.operation.name.startswith(("arith.", "math.", "linalg.yield"))
            for o in body.operations):
        return None
    operands = list(op.operands)
    new_inputs = [shadow[v] if i in read else v for i, v in enumerate(operands[:ls.num_inputs])]

    def is_narrow(v):
        return str(v.type) in _NARROW

    def build(args):
        mapping = dict(zip(list(body.arguments)[:ls.num_inputs], args[:ls.num_inputs]))
        for inner in list(body.operations)[:-1]:
            inner = inner.operation
            ins = [mapping.get(v, v) for v in inner.operands]
            if inner.name == "arith.truncf" and str(ins[0].type) == "f32":
                mapping[inner.results[0]] = ins[0]
                continue
            if inner.name == "arith.extf" and str(ins[0].type) == "f32":
                mapping[inner.results[0]] = ins[0]
                continue
            if inner.name == "arith.constant" and is_narrow(inner.results[0]):
                value = ir.FloatAttr(inner.attributes["value"]).value
                mapping[inner.results[0]] = arith.ConstantOp(f32, ir.FloatAttr.get(f32, value)).result
                continue
            if any(str(v.type) == "f32" for v in ins):
                ins = [arith.extf(f32, v) if is_narrow(v) else v for v in ins]
            clone = inner.clone()
            for j, v in enumerate(ins):
                clone.operands[j] = v
            for old, res in zip(inner.results, clone.results):
                if is_narrow(res) and any(str(v.type) == "f32" for v in ins):
                    res.set_type(f32)
                mapping[old] = res
        out = mapping.get(body.operations[len(body.operations) - 1].operands[0])
        return [out if str(out.type) == "f32" else arith.extf(f32, out)]

    t = op.results[0].type
    with ir.InsertionPoint(op):
        init = tensor.EmptyOp(list(t.shape), f32).result
        return build_generic(new_inputs, [init], ls.maps, iterator_kinds(op), build, name_from=op)


def _fold_shared_collapses(payload: ir.Module, rounds: int = 8) -> None:
    """Collapses read by several linalg ops (grouped-query attention collapses its
    [kv heads, group] scores for the softmax) are folded into every reader, so the whole
    graph runs in the scores' iteration space."""
    from transform_ext.fold_reshape_ops_by_expansion import CannotFold, plan_fold

    for _ in range(rounds):
        foldable = []

        def visit(op):
            if op.name == "tensor.collapse_shape":
                try:
                    plan_fold(op, multi_use=True)
                    foldable.append(op)
                except CannotFold:
                    pass
            return ir.WalkResult.ADVANCE

        payload.operation.walk(visit)
        if not foldable:
            return
        tag_ops(foldable[:1])

        def body(root):
            fold_reshape_ops_by_expansion(match_id(root, 0))
            fold_reshape_ops_by_expansion(match(root, "func.func"))

        run_schedule(payload, body)
        clear_tags(payload)


def find_attention(payload: ir.Module) -> AttentionOps:
    """Locate S, m, l, P V and the output in a normalized payload (or say why not)."""
    func = _func(payload)
    ops = [op for op in block_ops(func) if is_linalg_op(op)]
    maxes = [op for op in ops if reduction_combiner(op) == "max"]
    if len(maxes) != 1:
        raise NotAttention(f"expected one row max (softmax), found {len(maxes)}")
    row_max = maxes[0]
    ls = loop_structure(row_max)
    if len(ls.reduction_dims) != 1:
        raise NotAttention("the row max must reduce one dim (the keys)")
    scores = _producing_contraction(row_max.operands[0])
    if scores is None:
        raise NotAttention("the row max does not read a contraction (S = Q K^T)")
    m = row_max.results[0]
    dependent = [op for op in ops if op is not row_max and _reads(op, m)]
    contractions = [op for op in ops if op is not scores and loop_structure(op).is_contraction]
    values = [op for op in contractions if _depends_on(op, m)]
    sums = [op for op in ops if reduction_combiner(op) == "add" and not
            loop_structure(op).is_contraction and _depends_on(op, m)]
    if len(values) != 1:
        raise NotAttention(f"expected one P V contraction after the softmax, found {len(values)}")
    if len(sums) != 1:
        raise NotAttention(f"expected one row sum of the softmax, found {len(sums)}")
    del dependent
    rounded = _narrowed_softmax_value(ops, row_max, values[0])
    if rounded is not None:
        raise NotAttention(f"torch rounds this softmax's probabilities to {rounded} (written "
                           f"by hand in {rounded}), which the fused loop never forms")
    # P V is [..., L, Ev]: the output's query and value dims are the loop dims that run
    # with P V's rows and columns (the output may permute them: the head merge
    # o.transpose(1, 2) gives [B, L, H, Ev]). The output is the function's result op, or,
    # when its dims do not follow P V's through linalg ops (a reshape between), the last
    # op before it on the way back to P V whose dims do; the ops after it run after the
    # fused loops.
    pv_dims = dim_positions(loop_structure(values[0]).output_map(0))
    if len(pv_dims) < 2 or None in pv_dims[-2:]:
        raise NotAttention("the P V contraction is not [..., queries, values]")
    output = _final_op(func)
    while True:
        found = _query_and_value_dims(output, values[0], pv_dims[-2], pv_dims[-1])
        if found is not None or output is values[0]:
            break
        output = _reshaped_source(output)
        if output is None:
            break
    if found is None:
        raise NotAttention("the output's query rows or value columns are not one loop dim each")
    return AttentionOps(scores, row_max, sums[0], values[0], output, *found)


def _query_and_value_dims(output: ir.Operation, values: ir.Operation, row: int, col: int):
    """`output`'s loop dims running with P V's loop dims `row` and `col`, or None."""
    ls = loop_structure(output)
    rows = [d for d in ls.parallel_dims if row in propagate_loop_dim(output, d).get(values, ())]
    cols = [d for d in ls.parallel_dims if col in propagate_loop_dim(output, d).get(values, ())]
    return (rows[0], cols[0]) if len(rows) == 1 and len(cols) == 1 else None


def _reshaped_source(op: ir.Operation):
    """The linalg op producing `op`'s only tensor input, through reshapes, or None."""
    n_in = loop_structure(op).num_inputs
    inputs = [v for v in list(op.operands)[:n_in] if isinstance(v.type, ir.ShapedType)
              and ir.ShapedType(v.type).rank > 0]
    if len(inputs) != 1:
        return None
    source = defining_op(inputs[0])
    while source is not None and source.name in ("tensor.expand_shape", "tensor.collapse_shape"):
        source = defining_op(source.operands[0])
    return source if source is not None and is_linalg_op(source) else None


def _narrowed_softmax_value(ops, row_max: ir.Operation, values: ir.Operation) -> str | None:
    """The element type (f16, bf16) of a value computed from the row max and read by the
    P V contraction when it is narrower than f32 (torch rounds the probabilities of a
    hand-written f16/bf16 softmax; _widen_softmax keeps them in f32 where it can); None when
    there is none."""
    for op in ops:
        if op is row_max or op is values or not op.results or not _depends_into(op, row_max) \
                or not _depends_into(values, op):
            continue
        etype = op.results[0].type.element_type
        if isinstance(etype, ir.FloatType) and etype.width < 32:
            return str(etype)
    return None


def _producing_contraction(value: ir.Value):
    """The one contraction `value` is computed from through elementwise linalg ops (a scale,
    an added or selected mask: S * c, S + M, select(M, -inf, S)); None when there is none
    or more than one."""
    found, seen, pending = [], [], [defining_op(value)]
    while pending:
        op = pending.pop()
        if op is None or not is_linalg_op(op) or op in seen:
            continue
        seen.append(op)
        ls = loop_structure(op)
        if ls.is_contraction:
            found.append(op)
        elif not ls.reduction_dims:
            pending.extend(defining_op(v) for v in list(op.operands)[:ls.num_inputs])
    return found[0] if len(found) == 1 else None


def _reads(op: ir.Operation, value: ir.Value) -> bool:
    return any(v == value for v in op.operands)


def _depends_on(op: ir.Operation, value: ir.Value, limit: int = 64) -> bool:
    seen, pending = [], [op]
    while pending and len(seen) < limit:
        cur = pending.pop()
        if cur in seen:
            continue
        seen.append(cur)
        for v in cur.operands:
            if v == value:
                return True
            p = defining_op(v)
            if p is not None and p.block == op.block:
                pending.append(p)
    return False


def _final_op(func: ir.Operation) -> ir.Operation:
    """The linalg op whose result the function returns (through reshapes)."""
    ret = block_ops(func)[-1]
    if len(ret.operands) < 1:
        raise NotAttention("the function returns nothing")
    op = defining_op(ret.operands[0])
    while op is not None and op.name in ("tensor.expand_shape", "tensor.collapse_shape"):
        op = defining_op(op.operands[0])
    if op is None or not is_linalg_op(op):
        raise NotAttention("the result is not computed by a linalg op")
    return op


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
    their elementwise chains (repeat, transpose, scale) merge, then the repeated dims go."""
    ops = find_attention(payload)
    chain = []
    for contraction in (ops.scores, ops.values):
        pending = [defining_op(v) for v in contraction.operands[:2]]
        while pending:
            op = pending.pop()
            if op is None or op in chain or not is_linalg_op(op) or op is ops.row_max:
                continue
            if op.name != "linalg.generic" or not loop_structure(op).is_elementwise:
                continue
            if _depends_on(op, ops.row_max.results[0]):
                continue
            chain.append(op)
            pending.extend(defining_op(v) for v in op.operands)
    if not chain:
        return
    tag_ops(chain)

    def body(root):
        handles = [match_id(root, i) for i in range(len(chain))]
        merged = handles[0] if len(handles) == 1 else transform.merge_handles(handles)
        fuse_elementwise_producers(merged)
        drop_broadcast_dims(match(root, "func.func"))

    run_schedule(payload, body)
    clear_tags(payload)
    run_passes(payload, "canonicalize, cse")


def _prepare_guard(payload: ir.Module) -> None:
    """Steps 2 of the module docstring: sink 1/l past P V, guard read from the max."""
    _share_kv_heads(payload)
    ops = find_attention(payload)
    tag_ops([ops.values])
    run_schedule(payload, lambda root: sink_normalization_past_contraction(match_id(root, 0)))
    clear_tags(payload)
    ops = find_attention(payload)
    if _has_guard(ops):
        tag_ops([ops.row_max, ops.values])
        run_schedule(payload, lambda root: rewrite_attention_row_mask(match_id(root, 0),
                                                                      match_id(root, 1)))
        clear_tags(payload)
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
        append_lse_result(payload)
    if params.key_major:
        _store_keys_major(payload)
    ops = find_attention(payload)
    delta = causal_offset(payload, ops)
    # the mask-free first loop drops the index-computed mask: only when it is the only one
    # (a second one, a sliding window, must stay)
    split = delta is not None and _index_masks(ops) == 1
    query_tile, query_iv = _tile_query_blocks(payload, ops, params)
    _fuse_key_loop(payload, params)
    # s - m and exp become one pass over each tile (single-use producers, no recomputation)
    run_schedule(payload, lambda root: fuse_elementwise_producers(match(root, "func.func")))
    if delta is not None:
        bound_key_loops(payload, delta, query_tile, query_iv, split)
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
        if any(p is not None and _is_index_computation(p) for p in producers):
            count += 1
        pending.extend(p for p in producers if p is not None and not _is_index_computation(p))
    return count


def _store_keys_major(payload: ir.Module) -> None:
    from .key_major_scores import CannotRelayout, fold_key_transpose, store_scores_keys_major

    ops = find_attention(payload)
    try:
        store_scores_keys_major(ops.scores)
    except CannotRelayout:
        return  # the queries-major layout works for every payload this schedule takes
    fold_key_transpose(ops.scores)
    run_passes(payload, "canonicalize, cse")


def append_lse_result(payload: ir.Module) -> None:
    """A second function result: lse = m + log(l) per query row. It is computed by the op
    that also passes the attention output through (broadcast along the value dim, one
    row read back), so the query-block forall computes it from each block's final m and l."""
    import math as pymath

    from torch_mlir.dialects import arith, tensor
    from torch_mlir.dialects import math as mmath

    from transform_ext.common import build_generic

    ops = find_attention(payload)
    func = _func(payload)
    ret = block_ops(func)[-1]
    out = ops.output.results[0]
    m, l = ops.row_max.results[0], ops.row_sum.results[0]
    shape = list(out.type.shape)
    if list(m.type.shape) != shape[:-1] or list(l.type.shape) != shape[:-1]:
        raise NotAttention("the row max and sum are not [..., queries] of the output")
    rank = len(shape)
    ident = ir.AffineMap.get_identity(rank)
    rows = ir.AffineMap.get(rank, 0, [ir.AffineDimExpr.get(d) for d in range(rank - 1)])
    etype = out.type.element_type
    with ir.InsertionPoint(ret), ret.location:
        outs = [tensor.EmptyOp(shape, etype).result, tensor.EmptyOp(shape, etype).result]

        def body(args):
            o, mv, lv = args[:3]
            lse = arith.addf(mv, mmath.log(lv))
            if lse.type != etype:
                lse = arith.truncf(etype, lse)
            return [o, lse]

        both = build_generic([out, m, l], outs, [ident, rows, rows, ident, ident],
                             ["parallel"] * rank, body)
        sizes = shape[:-1] + [1]
        lse_type = ir.RankedTensorType.get(shape[:-1], etype)
        lse = tensor.ExtractSliceOp(lse_type, both.results[1], [], [], [], [0] * rank, sizes,
                                    [1] * rank).result
    for i, v in enumerate(ret.operands):
        if v == out:
            ret.operands[i] = both.results[0]
    expand = None
    # the output may reach the return through reshapes: pass it through them
    first = defining_op(ret.operands[0])
    if first is not None and first.name in ("tensor.expand_shape", "tensor.collapse_shape"):
        expand = first
    if expand is not None and expand.operands[0] == out:
        expand.operands[0] = both.results[0]
        expand.move_after(getattr(both, "operation", both))
        lse = _reshape_rows_like(expand, lse, ret)
    new_ret_operands = list(ret.operands) + [lse]
    with ir.InsertionPoint(ret), ret.location:
        from torch_mlir.dialects import func as funcd
        funcd.ReturnOp(new_ret_operands)
    ret.erase()
    block = func.regions[0].blocks[0]
    fn_type = ir.FunctionType.get([a.type for a in block.arguments], [v.type for v in new_ret_operands])
    func.attributes["function_type"] = ir.TypeAttr.get(fn_type)
    del pymath


def _reshape_rows_like(reshape: ir.Operation, rows: ir.Value, before: ir.Operation) -> ir.Value:
    """`rows` ([..., L], the output without its value dim) reshaped the way `reshape`
    reshapes the output, so it has the model's leading dims (built before `before`)."""
    from torch_mlir.dialects import tensor

    groups = reassociation(reshape)
    result = reshape.results[0].type
    if groups[-1] != [result.rank - 1 if reshape.name == "tensor.expand_shape"
                      else reshape.operands[0].type.rank - 1]:
        raise NotAttention("the output's value dim is reshaped on its way to the result")
    groups = groups[:-1]
    with ir.InsertionPoint(before), reshape.location:
        rtype = ir.RankedTensorType.get(list(result.shape)[:-1], rows.type.element_type)
        if reshape.name == "tensor.expand_shape":
            return tensor.ExpandShapeOp(rtype, rows, reassociation_attr(groups), [],
                                        list(result.shape)[:-1]).result
        return tensor.CollapseShapeOp(rtype, rows, reassociation_attr(groups)).result


def propagate_loop_dim(output: ir.Operation, query_dim: int) -> dict:
    """Loop dims running with `output`'s loop dim `query_dim`, per op, propagated to its
    producers through operand maps (top-down, so a shared input such as one iota read as
    both the query and the key index cannot tie unrelated dims together)."""
    found = {output: {query_dim}}
    pending = [output]
    while pending:
        op = pending.pop()
        ls = loop_structure(op)
        for value, amap in zip(op.operands, ls.maps):
            producer = defining_op(value)
            if producer is None or not is_linalg_op(producer) or producer.block != op.block:
                continue
            positions = [p for p, d in enumerate(dim_positions(amap)) if d in found[op]]
            if not positions:
                continue
            pls = loop_structure(producer)
            index = list(producer.results).index(value) if value in list(producer.results) else 0
            out_map = pls.output_map(index)
            dims = {d for p, d in enumerate(dim_positions(out_map)) if p in positions and d is not None}
            if dims - found.get(producer, set()):
                found.setdefault(producer, set()).update(dims)
                pending.append(producer)
    return found


def _tile_query_blocks(payload, ops: AttentionOps, params: AttentionParams) -> None:
    func = _func(payload)
    linalg_ops = [op for op in block_ops(func) if is_linalg_op(op)]
    query = propagate_loop_dim(ops.output, ops.query_dim)
    out_ls = loop_structure(ops.output)
    producers = [op for op in reversed(linalg_ops)
                 if op is not ops.output and op in query and _depends_into(ops.output, op)]
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
    tag_ops([ops.output] + producers)

    def body(root):
        tiled = structured.TileUsingForallOp(match_id(root, 0), tile_sizes=sizes)
        for i in range(len(producers)):
            structured.FuseIntoContainingOp(match_id(root, i + 1), tiled.forall_op)

    run_schedule(payload, body)
    clear_tags(payload)
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


def bound_key_loops(payload: ir.Module, delta: int, query_tile: int, query_iv: int | None,
                    split: bool = True) -> None:
    """Causal tile skipping: in the query block of rows [i0, i0 + query_tile), every score
    with key j > i0 + query_tile - 1 + delta is masked, so the key loop (tiles [j0, j0 + T))
    stops at j0 < i0 + query_tile + delta: those tiles are not computed at all. The bound is
    min(full tiles, max(0, i0 + query_tile + delta)); a remainder tile after the loop still
    runs (its masked keys contribute exactly 0). With `split`, the tiles wholly below the
    diagonal run first without the mask (_split_unmasked_tiles)."""
    from torch_mlir.dialects import arith

    idx = ir.IndexType.get()

    def const(v):
        return arith.ConstantOp(idx, ir.IntegerAttr.get(idx, v)).result

    for forall in _foralls(payload):
        body = forall.regions[0].blocks[0]
        loops = [o.operation for o in body.operations if o.operation.name == "scf.for"]
        if len(loops) != 1:
            raise NotAttention("a query block does not hold exactly one key loop")
        loop = loops[0]
        with ir.InsertionPoint(loop), loop.location:
            if query_iv is None:  # a single query block: rows start at 0
                i0 = const(0)
            else:
                i0 = arith.muli(body.arguments[query_iv], const(query_tile))
            bound = arith.maxsi(arith.addi(i0, const(query_tile + delta)), const(0))
            full = loop.operands[1]
            loop.operands[1] = arith.minsi(bound, full)
            if split:
                _split_unmasked_tiles(loop, i0, delta)


def _split_unmasked_tiles(loop: ir.Operation, i0: ir.Value, delta: int) -> None:
    """Below the diagonal band every key of a tile is allowed for every row of the block
    (j0 + T - 1 <= i0 + delta): a first copy of the key loop runs those tiles without
    computing the mask; the original loop continues from where it stopped."""
    from torch_mlir.dialects import arith

    idx = ir.IndexType.get()
    lb, ub, step = loop.operands[0], loop.operands[1], loop.operands[2]
    tile = ir.IntegerAttr(defining_op(step).attributes["value"]).value

    def const(v):
        return arith.ConstantOp(idx, ir.IntegerAttr.get(idx, v)).result

    # tiles j0 < i0 + delta - T + 2 are unmasked; the masked loop starts at the next multiple
    split = arith.maxsi(arith.addi(i0, const(delta - tile + 2)), const(0))
    split = arith.muli(arith.ceildivsi(split, step), step)
    split = arith.minsi(split, ub)
    unmasked = loop.clone()
    unmasked.operands[1] = split
    n_iter = len(loop.results)
    for k in range(n_iter):
        loop.operands[3 + k] = unmasked.results[k]
    loop.operands[0] = split
    del lb
    _drop_mask(unmasked)


def _drop_mask(loop: ir.Operation) -> None:
    """In `loop`'s body, the scores masked by a mask computed from indices (S + M, or
    select(pred, -inf, S) / select(pred, S, -inf)) become the scores: in the body of the op
    reading that one mask, the add or select is replaced by its unmasked operand."""
    body = loop.regions[0].blocks[0]
    for op in list(body.operations):
        op = op.operation
        if op.name != "linalg.generic" or len(op.results) != 1:
            continue
        n_in = loop_structure(op).num_inputs
        masks = [i for i in range(n_in) if defining_op(op.operands[i]) is not None
                 and _is_index_computation(defining_op(op.operands[i]))]
        if len(masks) != 1:
            continue
        inner = op.regions[0].blocks[0]
        mask = inner.arguments[masks[0]]
        for inner_op in list(inner.operations):
            inner_op = inner_op.operation
            unmasked = _unmasked_operand(inner_op, mask)
            if unmasked is not None:
                inner_op.results[0].replace_all_uses_with(unmasked)
                inner_op.erase()
        erase_dead_body_ops(inner)
        if not list(mask.uses):
            _drop_input(op, masks[0])


def _drop_input(op: ir.Operation, index: int) -> None:
    """Rebuild linalg.generic `op` without input `index`, which its body does not read."""
    ls = loop_structure(op)
    operands = list(op.operands)
    keep = [i for i in range(len(operands)) if i != index]
    old_args = list(op.regions[0].blocks[0].arguments)
    with ir.InsertionPoint(op), op.location:
        new = build_generic(operands[:index] + operands[index + 1:ls.num_inputs],
                            operands[ls.num_inputs:], [ls.maps[i] for i in keep],
                            iterator_kinds(op), lambda args: clone_body(
                                op, {old_args[i]: a for i, a in zip(keep, args)}), name_from=op)
    for old, res in zip(op.results, new.results):
        old.replace_all_uses_with(res)
    op.erase()


def _unmasked_operand(op: ir.Operation, mask: ir.Value):
    """x for op = x + mask or op = select(c(mask), -inf, x) / select(c(mask), x, -inf) with
    c(mask) the mask itself or a cast of it; None otherwise."""
    if op.name == "arith.addf" and mask in list(op.operands):
        others = [v for v in op.operands if v != mask]
        return others[0] if len(others) == 1 else None
    if op.name != "arith.select":
        return None
    cond, on_true, on_false = op.operands
    while cond != mask:
        p = defining_op(cond)
        if p is None or p.name not in ("arith.trunci", "arith.extui") or p.block != op.block:
            return None
        cond = p.operands[0]
    if _is_neg_inf(on_true):
        return on_false
    if _is_neg_inf(on_false):
        return on_true
    return None


def _foralls(payload: ir.Module) -> list[ir.Operation]:
    found = []

    def visit(op):
        if op.name == "scf.forall":
            found.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _depends_into(consumer: ir.Operation, producer: ir.Operation) -> bool:
    """Does `consumer` (transitively, within the block) read `producer`'s results?"""
    return any(_depends_on(consumer, r) for r in producer.results)


def _forall_bodies(payload: ir.Module) -> list[list[ir.Operation]]:
    bodies = []

    def visit(op):
        if op.name == "scf.forall":
            bodies.append([o.operation for o in op.regions[0].blocks[0].operations])
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return bodies


def _fuse_key_loop(payload, params: AttentionParams) -> None:
    for body_ops in _forall_bodies(payload):
        ops = [op for op in body_ops if is_linalg_op(op)]
        maxes = [op for op in ops if reduction_combiner(op) == "max"]
        if len(maxes) != 1:
            raise NotAttention("the query block does not hold exactly one row max")
        row_max = maxes[0]
        m = row_max.results[0]
        scores = _producing_contraction(row_max.operands[0])
        consumers = [op for op in ops if op is not row_max and _depends_on(op, m) and (
            reduction_combiner(op) == "add" or loop_structure(op).is_contraction)]
        key_dim = loop_structure(row_max).reduction_dims[0]
        along_keys = propagate_loop_dim(row_max, key_dim)
        # S, and the ops computing a mask from indices (the causal mask): per key tile
        producers = [scores] + [op for op in ops if op in along_keys and op is not scores
                                and op is not row_max and _is_index_computation(op)]
        tag_ops([row_max] + producers + consumers)
        key_extent = loop_structure(row_max).ranges[key_dim]
        kt = min(params.key_tile, key_extent)
        n_prod = len(producers)

        def body(root):
            handles = [match_id(root, 1 + n_prod + i) for i in range(len(consumers))]
            cons = handles[0] if len(handles) == 1 else transform.merge_handles(handles)
            fuse_dependent_reduction_ops(match_id(root, 0), cons, kt,
                                         producers=[match_id(root, 1 + i) for i in range(n_prod)])

        run_schedule(payload, body)
        clear_tags(payload)


def pack_key_tiles(payload: ir.Module) -> int:
    """Key tiles of the scores contraction read from a tile-packed copy of their operand.

    X [..., A, S] with the keys last (K^T) becomes P [..., S/T, A, T],
    P[..., t, a, j] = X[..., a, t T + j], made once next to X; the slice X[..., a0:a0+n,
    k:k+T] of key tile k is then the contiguous block P[..., k/T, a0:a0+n, :] instead of
    n rows S elements apart (rows 4 KiB apart share cache sets). Preconditions, checked: the
    key loop has constant step T and starts on a tile (`_starts_on_tile`), and the
    slice's last dim is (iv, T) over an X
    of static shape defined outside the query blocks (a remainder S mod T is left to the
    peeled last tile, which still reads X). Returns the number of slices rewritten."""
    from torch_mlir.dialects import arith, tensor

    packed: dict = {}
    rewritten = 0
    for forall in _foralls(payload):
        for loop in walk_ops(forall, lambda op: op.name == "scf.for"):
            step = _int_const(loop.operands[2])
            if step is None or loop.parent.operation != forall or \
                    not _starts_on_tile(loop.operands[0], loop.operands[1], step):
                continue
            iv = loop.regions[0].blocks[0].arguments[0]
            for op in list(loop.regions[0].blocks[0].operations):
                op = op.operation
                plan = _key_tile_slice(op, iv, step, forall) if op.name == "tensor.extract_slice" \
                    else None
                if plan is None:
                    continue
                x, offsets, sizes = plan
                key = (x, step)
                if key not in packed:
                    packed[key] = _packed_copy(x, step)
                with ir.InsertionPoint(op), op.location:
                    idx = ir.IndexType.get()
                    tile = arith.divui(iv, arith.ConstantOp(idx, ir.IntegerAttr.get(idx, step)))
                    rank = len(sizes)
                    offs = offsets[:rank - 2] + [tile] + [offsets[rank - 2], 0]
                    szs = sizes[:rank - 2] + [1] + [sizes[rank - 2], step]
                    static, dynamic = [], []
                    for o in offs:
                        if isinstance(o, int):
                            static.append(o)
                        else:
                            static.append(DYNAMIC)
                            dynamic.append(o)
                    new = tensor.ExtractSliceOp(op.results[0].type, packed[key], dynamic, [], [],
                                                static, szs, [1] * (rank + 1))
                op.results[0].replace_all_uses_with(new.result)
                op.erase()
                rewritten += 1
    return rewritten


def _starts_on_tile(lb: ir.Value, ub: ir.Value, step: int) -> bool:
    """Is every iteration of a loop from lb to ub a multiple of `step`? lb is a constant
    multiple, c * step, or min(such, ub) (when ub wins the loop is empty): the starts
    bound_key_loops gives the key loops."""
    c = _int_const(lb)
    if c is not None:
        return c % step == 0
    op = defining_op(lb)
    if op is None:
        return False
    if op.name == "arith.muli":
        return any(_int_const(v) is not None and _int_const(v) % step == 0 for v in op.operands)
    if op.name == "arith.minsi":
        return all(v == ub or _starts_on_tile(v, ub, step) for v in op.operands)
    return False


def _slice_parts(op: ir.Operation):
    """(source, offsets, sizes) of a unit-stride extract_slice with static sizes; offsets are
    ints or index values. None otherwise."""
    view = op.opview
    if any(s != 1 for s in view.static_strides) or any(s == DYNAMIC for s in view.static_sizes):
        return None
    dynamic = iter(view.offsets)
    offsets = [next(dynamic) if o == DYNAMIC else o for o in view.static_offsets]
    return view.source, offsets, list(view.static_sizes)


def _key_tile_slice(op: ir.Operation, iv: ir.Value, step: int, forall: ir.Operation):
    """For a slice, read by a contraction, of X[..., a0:a0+n, iv:iv+step] (possibly through
    one slice in the query block): (X, offsets, sizes) in X's coordinates, else None."""
    from torch_mlir.dialects import arith

    if not any(is_linalg_op(u.owner) and loop_structure(u.owner).is_contraction
               for u in op.results[0].uses):
        return None
    parts = _slice_parts(op)
    if parts is None or parts[1][-1] != iv or parts[2][-1] != step:
        return None
    source, offsets, sizes = parts
    if len(sizes) != source.type.rank or len(sizes) < 2:
        return None  # rank-reducing slices are not rewritten
    outer = defining_op(source)
    if outer is not None and outer.name == "tensor.extract_slice" and \
            outer.parent.operation == forall:
        outer_parts = _slice_parts(outer)
        if outer_parts is None or outer_parts[1][-1] != 0 or \
                len(outer_parts[2]) != outer_parts[0].type.rank:
            return None
        source = outer_parts[0]
        combined = []
        with ir.InsertionPoint(op), op.location:
            for a, b in zip(outer_parts[1][:-1], offsets[:-1]):
                if isinstance(a, int) and isinstance(b, int):
                    combined.append(a + b)
                elif a == 0 or b == 0:
                    combined.append(b if a == 0 else a)
                else:
                    a = a if not isinstance(a, int) else arith.ConstantOp(
                        ir.IndexType.get(), ir.IntegerAttr.get(ir.IndexType.get(), a)).result
                    b = b if not isinstance(b, int) else arith.ConstantOp(
                        ir.IndexType.get(), ir.IntegerAttr.get(ir.IndexType.get(), b)).result
                    combined.append(arith.addi(a, b))
        offsets = combined + [iv]
    t = source.type
    if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape or t.shape[-1] < step:
        return None
    owner = source.owner
    if not isinstance(owner, ir.Block):
        owner = owner.operation
        if forall.parent is None or _is_ancestor(forall, owner):
            return None
    return source, offsets, sizes


def _is_ancestor(ancestor: ir.Operation, op: ir.Operation) -> bool:
    while op is not None:
        if op == ancestor:
            return True
        parent = op.parent
        op = parent.operation if parent is not None else None
    return False


def _packed_copy(x: ir.Value, tile: int) -> ir.Value:
    """P [..., S/T, A, T] = X[..., A, :S - S mod T] with its key dim split into tiles, the
    tile index moved before A (see `pack_key_tiles`)."""
    from torch_mlir.dialects import linalg, tensor

    t = x.type
    *lead, a, s = t.shape
    n = s // tile
    rank = t.rank
    owner = x.owner
    ip = ir.InsertionPoint.at_block_begin(owner) if isinstance(owner, ir.Block) \
        else ir.InsertionPoint.after(owner.operation)
    with ip, x.location:
        if s % tile:
            x = tensor.ExtractSliceOp(ir.RankedTensorType.get(lead + [a, n * tile], t.element_type),
                                      x, [], [], [], [0] * rank, lead + [a, n * tile],
                                      [1] * rank).result
        groups = [[i] for i in range(rank - 1)] + [[rank - 1, rank]]
        expanded = tensor.ExpandShapeOp(
            ir.RankedTensorType.get(lead + [a, n, tile], t.element_type), x, reassociation_attr(groups),
            [], lead + [a, n, tile]).result
        init = tensor.EmptyOp(lead + [n, a, tile], t.element_type).result
        perm = list(range(rank - 2)) + [rank - 1, rank - 2, rank]
        return linalg.transpose(expanded, outs=[init], permutation=perm).results[0]


def _is_index_computation(op: ir.Operation) -> bool:
    """An elementwise op whose value derives from loop indices and constants only (iotas and
    the comparisons, selects and casts of a mask computed from them)."""
    if not (is_linalg_op(op) and len(op.results) == 1 and loop_structure(op).is_elementwise):
        return False
    for v in list(op.operands)[: loop_structure(op).num_inputs]:
        p = defining_op(v)
        if p is None or not _is_index_computation(p):
            return False
    return True


def vectorize_attention(payload: ir.Module, params: GenericParams, unroll: int = 4) -> None:
    pack_key_tiles(payload)
    vectorize_generic(payload, params)
    _unroll_register_loops(payload, unroll)


def _unroll_register_loops(payload: ir.Module, factor: int) -> None:
    """Unroll the k loops of register tiles (scf.for carrying only vectors, holding a
    vector.contract) so the outer products of consecutive k overlap."""
    if factor <= 1:
        return
    from torch_mlir.dialects.transform import loop as tloop

    loops = []

    def visit(op):
        if op.name == "scf.for" and len(op.results) and all(
                isinstance(r.type, ir.VectorType) for r in op.results):
            body = op.regions[0].blocks[0]
            if any(o.operation.name == "vector.contract" for o in body.operations):
                loops.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    if not loops:
        return
    tag_ops(loops)
    run_schedule(payload, lambda root: [tloop.LoopUnrollOp(match_id(root, i), factor=factor)
                                        for i in range(len(loops))])
    clear_tags(payload)


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


def _int_const(value) -> int | None:
    op = defining_op(value)
    if op is not None and op.name == "arith.constant" and isinstance(op.attributes["value"], ir.IntegerAttr):
        return ir.IntegerAttr(op.attributes["value"]).value
    return None


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
        if _is_neg_inf(on_true) and isinstance(on_false, ir.BlockArgument):
            return ("pred", _NEGATED[pred[1]], pred[2])
        if _is_neg_inf(on_false) and isinstance(on_true, ir.BlockArgument):
            return pred
    return None


def _is_neg_inf(value: ir.Value) -> bool:
    p = defining_op(value)
    return p is not None and p.name == "arith.constant" and \
        isinstance(p.attributes["value"], ir.FloatAttr) and \
        ir.FloatAttr(p.attributes["value"]).value == float("-inf")
