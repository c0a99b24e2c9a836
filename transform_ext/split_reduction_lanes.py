"""split_reduction_lanes: the class axis of an online-softmax group split into (chunks,
lanes): one running max and sum per SIMD lane, combined once at the end.

A group is R1, a max over axis k of x, and reductions over k: dependent ones whose terms are
A(x) exp(beta m) (beta < 0, m = R1's result broadcast along k; beta as
fuse_dependent_reduction_ops reads it), and siblings that do not read m. With x viewed as
x3[.., k / L, L, ..] (k = L k' + l), every group op is rebuilt over (.., k', l, ..) with k'
a reduction and l a parallel loop, and reads m_l (the lane's own max) where it read m.
After the group:
    m     = max_l m_l
    S_dep = init + sum_l S_l * exp(beta (m - m_l))      (0 for a lane with m_l = -inf)
    S_sib = init + sum_l S_l                             (max_l for a max sibling)
Exact in real arithmetic (the online fusion's own identity, applied once across lanes);
floating point sums are reassociated. Fused over k' afterwards, the loop keeps L running
maxima and sums, so a tile of x is read once and each element costs one max and one exp,
with no reduction across lanes inside the loop. Each lane op carries `lh.lane_dim` (its
lane loop) and the discardable attributes of the op it replaces.

Target: the group's ops, R1 (the one max reduction among them) and its consumers. Legality
first (`check_group`): exactly one max reduction; every op a linalg.generic with one result,
one reduction dim and an add or max combiner, maps of plain dims and constants; every
operand indexed by the reduction dim indexed by it alone at one position, L dividing its
extent (and L <= the extent); the group fusible as fuse_dependent_reduction_ops needs it.
Else a silenceable failure naming the op (nothing rewritten). The handle is consumed.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform
from torch_mlir.dialects import math as mmath

from .analysis.classify import reduction_combiner
from .analysis.maps import Const, make_map, terms
from .common import (Illegal, Success, body_of, build_generic, clone_op, fail, iterator_kinds,
                     payload_ops, terminator)
from .dialect import TransformExt
from .fuse_dependent_reduction_ops import analyze as fusion_plan

NAME = "transform_ext.split_reduction_lanes"
_IDENTITY = {"add": 0.0, "max": float("-inf")}
LANE_DIM = "lh.lane_dim"  # on the split ops: the loop running over the lanes
STRUCTURAL_ATTRS = ("indexing_maps", "iterator_types", "operandSegmentSizes")


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


def split_group(ops: list) -> tuple:
    """(R1, its consumers) of a group: R1 is its one max reduction."""
    maxes = [op for op in ops if reduction_combiner(op) == "max"]
    if len(maxes) != 1:
        raise Illegal(ops[0] if ops else None,
                      f"the group must hold one max reduction, it holds {len(maxes)}")
    return maxes[0], [op for op in ops if op != maxes[0]]


def check_group(r1, consumers, lanes: int) -> dict:
    """Raise Illegal unless the group can be split into `lanes` lanes; returns beta per
    consumer (None for a sibling)."""
    ops = [r1] + list(consumers)
    for op in ops:
        if op.name != "linalg.generic" or len(op.results) != 1:
            raise Illegal(op, "not a linalg.generic with one result")
        if iterator_kinds(op).count("reduction") != 1:
            raise Illegal(op, "it does not have exactly one reduction dim")
        if any(t is None for t in (terms(a) for a in linalg.get_indexing_maps(op))):
            raise Illegal(op, "an indexing map is not made of dims and constants")
        if reduction_combiner(op) not in _IDENTITY:
            raise Illegal(op, f"its combiner is {reduction_combiner(op)}, not add or max")
    k = iterator_kinds(r1).index("reduction")
    for op in ops:
        kk = iterator_kinds(op).index("reduction")
        for v, ts in zip(op.operands, (terms(a) for a in linalg.get_indexing_maps(op))):
            if kk in ts and (ts.count(kk) != 1 or v.type.shape[ts.index(kk)] % lanes):
                raise Illegal(op, f"an operand is indexed by the reduction dim more than once "
                                  f"or not in multiples of {lanes}")
    extent = [v.type.shape[t.index(k)] for v, t in
              zip(r1.operands, (terms(a) for a in linalg.get_indexing_maps(r1))) if k in t][0]
    if extent % lanes or extent < lanes:
        raise Illegal(r1, f"{lanes} lanes do not divide the {extent} classes")
    plan = fusion_plan(r1, list(consumers), [], extent, True)
    return {c.op: (c.beta if c.dependent else None) for c in plan.consumers}


def _carry_attributes(old, new) -> None:
    attrs = old.attributes
    for i in range(len(attrs)):
        if attrs[i].name not in STRUCTURAL_ATTRS and attrs[i].name not in new.attributes:
            new.attributes[attrs[i].name] = attrs[i].attr


def split_lanes(r1, consumers, lanes: int, betas: dict, rewriter) -> None:
    """Rewrite the checked group (see the module docstring)."""
    ks = {op: iterator_kinds(op).index("reduction") for op in [r1] + list(consumers)}
    k = ks[r1]
    m = r1.results[0]
    f32 = ir.F32Type.get()
    with ir.InsertionPoint(r1), r1.location:
        cache: dict = {}
        r1_lanes = _lane_op(r1, k, lanes, None, None, float("-inf"), cache)
        _carry_attributes(r1, r1_lanes)
        m_lanes = r1_lanes.results[0]
        m_final = _lane_reduce(m_lanes, r1.operands[len(r1.operands) - 1],
                               lambda a, acc: arith.maximumf(a, acc))
    replacements = {}
    for op in consumers:
        with ir.InsertionPoint(op), op.location:
            beta = betas.get(op)
            identity = _IDENTITY[reduction_combiner(op)]
            new = _lane_op(op, ks[op], lanes, m, m_lanes, identity if beta is None else 0.0, cache)
            _carry_attributes(op, new)
            s_lanes = new.results[0]
            init = op.operands[len(op.operands) - 1]
            etype = s_lanes.type.element_type
            if beta is None:
                if reduction_combiner(op) == "add":
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
        rewriter.replace_op(op, [value])
    rewriter.replace_op(r1, [m_final])


class SplitReductionLanesOp(TransformExt.Operation, name="split_reduction_lanes"):
    target: ext.Operand[transform.AnyOpType]
    lanes: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                lanes = ir.IntegerAttr(op.lanes).value
                ops = payload_ops(state, op.target)
                try:
                    if not ops:
                        raise Illegal(op.operation, "the group is empty")
                    r1, consumers = split_group(ops)
                    betas = check_group(r1, consumers, lanes)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                split_lanes(r1, consumers, lanes, betas, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    class Effects(ir.MemoryEffectsOpInterface):
        @staticmethod
        def get_effects(op, effects):
            transform.consumes_handle(op.op_operands, effects)
            transform.modifies_payload(effects)


def split_reduction_lanes(target: ir.Value, lanes: int) -> SplitReductionLanesOp:
    """Split the group in `target` into `lanes` lanes (see the module docstring)."""
    if lanes < 2:
        raise ValueError(f"lanes must be >= 2, got {lanes}")
    i64 = ir.IntegerType.get_signless(64)
    return SplitReductionLanesOp(target, ir.IntegerAttr.get(i64, lanes))


__all__ = ["SplitReductionLanesOp", "split_reduction_lanes", "check_group", "split_group",
           "LANE_DIM"]
