"""fold_one_hot_class_sums: a sum over the classes whose terms vanish at every class but a
per-row one becomes that term, an op over the rows only.

    transform_ext.fold_one_hot_class_sums %func

A target function's linalg.generic z[n] = init[n] + sum_c x(n, c) (two loops, the class
loop c a reduction that only linalg.index reads and unread inputs bound, an add combiner)
whose term x vanishes wherever c != a(n) for one class-independent index a(n) of the body
(the cross-entropy backward's one-hot row sum: x = select(c != y_n or y_n == ignore, 0,
-w_{y_n} / count), rounded) becomes

    z[n] = init[n] + (0 <= a(n) < V ? x(n, a(n)) : 0)

(a linalg.generic over the rows reading init as an input, its output empty: the body
cloned with c = a(n); a rank-0 input, the count, read by `tensor.extract` in the body, so
a kernel reads it as a scalar: a GPU has no layout for a 0-d vector). Exact: the sum had one
nonzero term at most, and adding zeros in floating point changes nothing. The term is shown
to vanish by evaluating the body under c != a(n): `cmpi ne`/`eq` of c and a(n) are true /
false, `ori`/`andi`/`xori` of known booleans and `select` on a known condition propagate,
and the term must come out as a zero constant through value-preserving casts of zero
(truncf, extf). Its users read the new op; no [N, V] iteration is left to compute it (on a
GPU, a per-row op fuses into the kernels that read it).

Targets: functions; a target without a region is a silenceable failure. Ops that do not
have this form are left alone (matching never fails). The target handle stays valid; the
result holds the per-row ops made.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.classify import reduction_combiner
from .analysis.structure import dim_positions, loop_structure
from .common import (Illegal, RewritesTargets, Success, block_ops, body_of, build_generic,
                     clone_op, fail, is_zero, payload_ops, terminator)
from .dialect import TransformExt

NAME = "transform_ext.fold_one_hot_class_sums"
ZERO = "zero"     # a value known to be 0.0 (or an integer 0)
_CASTS = ("arith.truncf", "arith.extf", "arith.sitofp", "arith.uitofp")


def _owner(value: ir.Value):
    owner = value.owner
    owner = getattr(owner, "operation", owner)
    return owner if isinstance(owner, ir.Operation) else None


def _class_index(op: ir.Operation, class_loop: int) -> ir.Value | None:
    """The result of the body's linalg.index of the class loop (one at most), else None."""
    found = [o.operation for o in body_of(op).operations if o.operation.name == "linalg.index"
             and ir.IntegerAttr(o.operation.attributes["dim"]).value == class_loop]
    return found[0].results[0] if len(found) == 1 else None


def _evaluate(op: ir.Operation, c: ir.Value, a_candidates: list[ir.Value]):
    """(a, the known values of the body under c != a) for the first candidate a that makes
    the comparisons of c decide; known values are True, False or ZERO."""
    block = body_of(op)
    for a in a_candidates:
        known: dict = {}

        def value_of(v: ir.Value):
            if v in known:
                return known[v]
            owner = _owner(v)
            inside = owner is not None and owner.parent == op
            return ZERO if not inside and is_zero(v) else None

        for inner in block.operations:
            inner = inner.operation
            operands = list(inner.operands)
            name = inner.name
            if name == "arith.cmpi" and set(operands) == {a, c}:
                predicate = ir.IntegerAttr(inner.attributes["predicate"]).value
                if predicate in (0, 1):      # eq, ne
                    known[inner.results[0]] = predicate == 1
                continue
            if name == "arith.constant":
                if is_zero(inner.results[0]):
                    known[inner.results[0]] = ZERO
                continue
            values = [value_of(v) for v in operands]
            if name == "arith.ori" and (True in values or values == [False, False]):
                known[inner.results[0]] = True in values
            elif name == "arith.andi" and (False in values or values == [True, True]):
                known[inner.results[0]] = False not in values
            elif name == "arith.select" and values[0] in (True, False):
                chosen = values[1] if values[0] else values[2]
                if chosen is not None:
                    known[inner.results[0]] = chosen
            elif name in _CASTS and values[0] == ZERO:
                known[inner.results[0]] = ZERO
        yield a, known


def one_hot_plan(op: ir.Operation):
    """(class loop, a) when `op` is a foldable one-hot class sum (module docstring), else
    None."""
    if op.name != "linalg.generic" or len(op.results) != 1:
        return None
    ls = loop_structure(op)
    if ls.num_loops != 2 or len(ls.reduction_dims) != 1 or not ls.is_static:
        return None
    class_loop = ls.reduction_dims[0]
    if reduction_combiner(op) != "add" or class_loop in dim_positions(ls.output_map(0)):
        return None
    block = body_of(op)
    for i in range(ls.num_inputs):
        if class_loop in dim_positions(ls.maps[i]) and list(block.arguments[i].uses):
            return None
    c = _class_index(op, class_loop)
    if c is None:
        return None
    (total,) = terminator(block).operands
    adder = _owner(total)
    out = block.arguments[ls.num_inputs]
    if adder is None or adder.name not in ("arith.addf", "arith.addi") or \
            list(adder.operands).count(out) != 1 or len(list(out.uses)) != 1:
        return None
    term = [v for v in adder.operands if v != out]
    if len(term) != 1:
        return None
    candidates = []
    for use in c.uses:
        user = getattr(use.owner, "operation", use.owner)
        if user.name != "arith.cmpi":
            return None
        other = [v for v in user.operands if v != c]
        if len(other) != 1:
            return None
        if other[0] not in candidates:
            candidates.append(other[0])
    for a, known in _evaluate(op, c, candidates):
        if known.get(term[0]) == ZERO and not _reads(a, c):
            return class_loop, a
    return None


def _reads(value: ir.Value, c: ir.Value, limit: int = 64) -> bool:
    """Does `value` depend on `c` inside the body?"""
    if value == c:
        return True
    owner = _owner(value)
    if owner is None or owner.name == "linalg.generic" or limit == 0:
        return False
    return any(_reads(v, c, limit - 1) for v in owner.operands)


def rewrite(op: ir.Operation, class_loop: int, a: ir.Value, rewriter) -> ir.Operation:
    ls = loop_structure(op)
    (row_loop,) = [d for d in range(2) if d != class_loop]
    block = body_of(op)
    classes = ls.ranges[class_loop]
    kept = [i for i in range(ls.num_inputs) if class_loop not in dim_positions(ls.maps[i])
            and ir.RankedTensorType(op.operands[i].type).rank > 0]
    scalars = [i for i in range(ls.num_inputs)
               if ir.RankedTensorType(op.operands[i].type).rank == 0]

    def row_map(amap: ir.AffineMap) -> ir.AffineMap:
        return ir.AffineMap.get(1, 0, [ir.AffineDimExpr.get(0) if isinstance(e, ir.AffineDimExpr)
                                       else e for e in amap.results])

    def body(args):
        mapping = {block.arguments[i]: arg for i, arg in zip(kept, args)}
        for i in scalars:
            mapping[block.arguments[i]] = tensor.extract(op.operands[i], [])
        init = args[len(kept)]
        c = _class_index(op, class_loop)
        (total,) = terminator(block).operands
        adder = _owner(total)
        inside_body = lambda v: _owner(v) is not None and _owner(v).parent == op
        for inner in list(block.operations)[:-1]:
            inner = inner.operation
            if inner == adder or (inner.results and inner.results[0] == c):
                continue
            if c not in mapping and (a in mapping or not inside_body(a)):
                mapping[c] = mapping.get(a, a)   # the class is a(n)
            if inner.name == "linalg.index":     # the row loop, now the only one
                i64 = ir.IntegerType.get_signless(64)
                mapping[inner.results[0]] = linalg.IndexOp(ir.IntegerAttr.get(i64, 0)).result
                continue
            clone_op(inner, mapping)
        term = mapping[[v for v in adder.operands if v != block.arguments[ls.num_inputs]][0]]
        index = mapping.get(a, a)
        zero_index = arith.ConstantOp(ir.IndexType.get(), 0).result
        bound = arith.ConstantOp(ir.IndexType.get(), classes).result
        inside = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, index, zero_index),
                            arith.cmpi(arith.CmpIPredicate.slt, index, bound))
        zero = arith.ConstantOp(term.type, ir.FloatAttr.get(term.type, 0.0)
                                if not isinstance(term.type, ir.IntegerType)
                                else ir.IntegerAttr.get(term.type, 0)).result
        picked = arith.select(inside, term, zero)
        add = arith.addf if not isinstance(term.type, ir.IntegerType) else arith.addi
        return [add(init, picked)]

    init = op.operands[ls.num_inputs]
    inputs = [op.operands[i] for i in kept] + [init]
    out_map = row_map(ls.output_map(0))
    maps = [row_map(ls.maps[i]) for i in kept] + [out_map, out_map]
    with ir.InsertionPoint(op), op.location:
        t = ir.RankedTensorType(init.type)
        empty = tensor.EmptyOp(list(t.shape), t.element_type).result
        new = build_generic(inputs, [empty], maps, ["parallel"], body)
    rewriter.replace_op(op, [new.results[0]])
    return new.operation


class FoldOneHotClassSumsOp(TransformExt.Operation, name="fold_one_hot_class_sums"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for t in targets:
                        if not t.regions:
                            raise Illegal(t, "not a function")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                folded = []
                for t in targets:
                    for candidate in block_ops(t):
                        plan = one_hot_plan(candidate)
                        if plan is not None:
                            folded.append(rewrite(candidate, *plan, rewriter))
                results.set_ops(op.result, folded)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fold_one_hot_class_sums(func_handle: ir.Value) -> ir.Value:
    """Fold the one-hot class sums of each function of `func_handle` (module docstring);
    returns the per-row ops made."""
    return FoldOneHotClassSumsOp(func_handle).result


__all__ = ["FoldOneHotClassSumsOp", "fold_one_hot_class_sums"]
