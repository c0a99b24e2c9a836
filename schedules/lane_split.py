"""Split the class axis of an online-softmax group into (chunks, lanes): one running max and
sum per SIMD lane, combined once at the end.

A group is R1, a max over axis k of x, and reductions over k: dependent ones whose terms are
A(x) exp(beta m) (beta < 0, m = R1's result broadcast along k), and siblings that do not
read m. With x viewed as x3[.., k / L, L, ..] (k = L k' + l), every group op is rebuilt over
(.., k', l, ..) with k' a reduction and l a parallel loop, and reads m_l (the lane's own max)
where it read m. After the group:
    m     = max_l m_l
    S_dep = init + sum_l S_l * exp(beta (m - m_l))      (0 for a lane with m_l = -inf)
    S_sib = init + sum_l S_l
Exact in real arithmetic (the online fusion's own identity, applied once across lanes);
floating point sums are reassociated. Fused over k' afterwards, the loop keeps L running
maxima and sums, so a tile of x is read once and each element costs one max and one exp,
with no reduction across lanes inside the loop.

Preconditions (checked by `lane_split_group`, which returns False and changes nothing
otherwise): L divides the extent of k; every group op is a linalg.generic with one result and
k as its only reduction dim; every operand indexed by k is indexed by k alone at one
position (it is reshaped); m reaches the consumers only as an input.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, linalg, tensor
from torch_mlir.dialects import math as mmath

from transform_ext.analysis.maps import Const, make_map, terms
from transform_ext.common import body_of, build_generic, clone_op, iterator_kinds, terminator

_IDENTITY = {"add": 0.0, "max": float("-inf")}
LANE_DIM = "lh.lane_dim"  # on the split ops: the loop running over the lanes


def _shift(t, k):
    """A term of the old loops as a term of the new loops (k' keeps k's number)."""
    if isinstance(t, Const) or t <= k:
        return t
    return t + 1


def _clone_body(block, mapping, k, lanes):
    """Clone `block`'s ops at the insertion point; linalg.index k -> k' * L + l, later loops
    shift by one."""
    index = ir.IndexType.get()
    for inner in list(block.operations)[:-1]:
        inner = inner.operation
        if inner.name == "linalg.index":
            d = ir.IntegerAttr(inner.attributes["dim"]).value
            if d == k:
                chunk = linalg.IndexOp(k).result
                lane = linalg.IndexOp(k + 1).result
                value = arith.addi(arith.muli(chunk, arith.ConstantOp(
                    index, ir.IntegerAttr.get(index, lanes)).result), lane)
            else:
                value = linalg.IndexOp(_shift(d, k)).result
            mapping[inner.results[0]] = value
            continue
        clone_op(inner, mapping)
    return [mapping.get(v, v) for v in terminator(block).operands]


def _expanded(value: ir.Value, pos: int, lanes: int, cache: dict) -> ir.Value:
    key = (value, pos)
    if key in cache:
        return cache[key]
    t = value.type
    shape = list(t.shape)
    new_shape = shape[:pos] + [shape[pos] // lanes, lanes] + shape[pos + 1:]
    groups, j = [], 0
    for d in range(len(shape)):
        if d == pos:
            groups.append([j, j + 1])
            j += 2
        else:
            groups.append([j])
            j += 1
    i64 = ir.IntegerType.get_signless(64)
    attr = ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(i64, i) for i in g]) for g in groups])
    result = tensor.ExpandShapeOp(ir.RankedTensorType.get(new_shape, t.element_type, t.encoding),
                                  value, attr, [], new_shape).result
    cache[key] = result
    return result


def _lane_op(op, k, lanes, m, m_lanes, identity, cache):
    """op rebuilt over (.., k', l, ..) with a lane dim appended to its result."""
    view = op.opview
    maps = [terms(a.value) for a in view.indexing_maps]
    n_in = len(view.inputs)
    n_loops = len(iterator_kinds(op)) + 1
    kinds = list(iterator_kinds(op))
    kinds = kinds[:k] + ["reduction", "parallel"] + kinds[k + 1:]
    inputs, in_maps = [], []
    for v, ts in zip(view.inputs, maps[:n_in]):
        if m is not None and v == m:
            inputs.append(m_lanes)
            in_maps.append(make_map(n_loops, [_shift(t, k) for t in ts] + [k + 1]))
            continue
        if k in ts:
            pos = ts.index(k)
            inputs.append(_expanded(v, pos, lanes, cache))
            new_ts = []
            for t in ts:
                new_ts += [k, k + 1] if t == k else [_shift(t, k)]
            in_maps.append(make_map(n_loops, new_ts))
        else:
            inputs.append(v)
            in_maps.append(make_map(n_loops, [_shift(t, k) for t in ts]))
    out = op.results[0].type
    out_shape = list(out.shape) + [lanes]
    etype = out.element_type
    empty = tensor.EmptyOp(out_shape, etype).result
    init = linalg.fill(arith.ConstantOp(etype, ir.FloatAttr.get(etype, identity)).result,
                       outs=[empty])
    out_map = make_map(n_loops, [_shift(t, k) for t in maps[-1]] + [k + 1])
    block = body_of(op)

    def body(args):
        mapping = {block.arguments[i]: args[i] for i in range(n_in)}
        mapping[block.arguments[n_in]] = args[n_in]
        return _clone_body(block, mapping, k, lanes)

    new = build_generic(inputs, [init], in_maps + [out_map], kinds, body, name_from=op)
    new.attributes[LANE_DIM] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), k + 1)
    return new


def _lane_reduce(value, init, body_fn, extra=()):
    """Reduce the last dim of `value` (and of the tensors in `extra`, read the same way)
    into `init` (value's shape without it): body_fn(lane args..., acc) -> new acc."""
    rank = value.type.rank
    lane_map = ir.AffineMap.get_identity(rank)
    row_map = ir.AffineMap.get(rank, 0, [ir.AffineDimExpr.get(d) for d in range(rank - 1)])
    inputs = [value] + [v for v, _ in extra]
    maps = [lane_map] + [lane_map if lanewise else row_map for _, lanewise in extra] + [row_map]
    return build_generic(inputs, [init], maps, ["parallel"] * (rank - 1) + ["reduction"],
                         lambda args: [body_fn(*args)]).results[0]


def lane_split_group(r1, consumers, lanes: int, combiner_of, beta_of) -> bool:
    """Split the group (see the module docstring); combiner_of(op) -> 'add' | 'max',
    beta_of(op) -> beta for dependent consumers, None for siblings."""
    ops = [r1] + list(consumers)
    for op in ops:
        if op.name != "linalg.generic" or len(op.results) != 1:
            return False
        if [kd for kd in iterator_kinds(op)].count("reduction") != 1:
            return False
        if any(t is None for t in (terms(a) for a in linalg.get_indexing_maps(op))):
            return False
        if combiner_of(op) not in _IDENTITY:
            return False
    k = iterator_kinds(r1).index("reduction")
    ks = {op: iterator_kinds(op).index("reduction") for op in ops}
    m = r1.results[0]
    for op in ops:
        maps = [terms(a) for a in linalg.get_indexing_maps(op)]
        kk = ks[op]
        for v, ts in zip(op.operands, maps):
            if kk in ts:
                if ts.count(kk) != 1 or v.type.shape[ts.index(kk)] % lanes:
                    return False
    extent = [v.type.shape[t.index(k)] for v, t in zip(r1.operands, (terms(a) for a in linalg.get_indexing_maps(r1)))
              if k in t][0]
    if extent % lanes or extent < lanes:
        return False
    f32 = ir.F32Type.get()
    with r1.context, r1.location, ir.InsertionPoint(r1):
        cache: dict = {}
        r1_lanes = _lane_op(r1, k, lanes, None, None, float("-inf"), cache)
        m_lanes = r1_lanes.results[0]
        m_final = _lane_reduce(m_lanes, r1.operands[len(r1.operands) - 1],
                               lambda a, acc: arith.maximumf(a, acc))
    replacements = {r1: m_final}
    for op in consumers:
        with op.context, op.location, ir.InsertionPoint(op):
            beta = beta_of(op)
            identity = _IDENTITY[combiner_of(op)]
            new = _lane_op(op, ks[op], lanes, m, m_lanes, identity if beta is None else 0.0, cache)
            s_lanes = new.results[0]
            init = op.operands[len(op.operands) - 1]
            etype = s_lanes.type.element_type
            if beta is None:
                if combiner_of(op) == "add":
                    combined = _lane_reduce(s_lanes, init, lambda a, acc: arith.addf(a, acc))
                else:
                    combined = _lane_reduce(s_lanes, init, lambda a, acc: arith.maximumf(a, acc))
            else:
                def rescale(s, ml, mrow, acc, beta=beta, etype=etype):
                    ninf = arith.ConstantOp(ml.type, ir.FloatAttr.get(ml.type, float("-inf"))).result
                    empty_lane = arith.cmpf(arith.CmpFPredicate.OEQ, ml, ninf)
                    delta = arith.subf(mrow, ml)
                    if beta != -1.0:
                        delta = arith.mulf(delta, arith.ConstantOp(ml.type, ir.FloatAttr.get(ml.type, -beta)).result)
                    factor = mmath.exp(arith.negf(delta))
                    scaled = arith.mulf(s if s.type == f32 else arith.extf(f32, s),
                                        factor if factor.type == f32 else arith.extf(f32, factor))
                    if etype != f32:
                        scaled = arith.truncf(etype, scaled)
                    zero = arith.ConstantOp(etype, ir.FloatAttr.get(etype, 0.0)).result
                    return arith.addf(arith.select(empty_lane, zero, scaled), acc)

                combined = _lane_reduce(s_lanes, init, rescale,
                                        extra=[(m_lanes, True), (m_final, False)])
        replacements[op] = combined
    for op, value in replacements.items():
        if op is r1:
            continue
        op.results[0].replace_all_uses_with(value)
        op.erase()
    r1.results[0].replace_all_uses_with(m_final)
    r1.erase()
    return True
