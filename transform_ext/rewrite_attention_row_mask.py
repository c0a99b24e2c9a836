"""rewrite_attention_row_mask: SDPA's fully-masked-row guard read from the row maximum.

torch-mlir lowers SDPA's softmax with a guard (PyTorch's "safe softmax"):
    rows = all_j(s_ij == -inf),   P = select(rows_i, 0, softmax(s)_ij),   O = P @ V.
Since all_j(s_ij == -inf) <=> max_j s_ij == -inf, the guard is rewritten to read the
row maximum m = R1(s):
    O = select(m_i == -inf, 0, normalize(E @ V))
The AND-reduction over keys disappears, the contraction reads E directly (no select in front
of it: the DPAS form), and the mask is applied after the contraction on the normalized
result, where a fully masked row's 0/0 would otherwise give NaN. Inside a fused key loop
(fuse_dependent_reduction_ops) masked tiles contribute exp(-inf) = 0, so no NaN is live
there.

Operands: `reduction` (R1: the max over keys of s) and `contraction` (P @ V). Matched:
  - P: an elementwise generic yielding select(pred, 0, v) where pred is a per-row tensor
    broadcast along the keys (i1, or i8 after boolean widening);
  - pred: an AND-reduction over the keys of (s == -inf) with s R1's input (the comparison may
    go through extf), starting from true; or already a comparison of R1's result with -inf;
  - the normalized result: the contraction's only user when it is elementwise (the division
    by the row sum), else the contraction itself.
The result handle holds the new select op applied to the normalized result.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.dims import DimClasses
from .analysis.structure import loop_structure
from .common import (Illegal, RewritesTargets, Success, defining_op, fail, is_linalg, payload_ops,
                     result_users)
from .dialect import TransformExt

NAME = "transform_ext.rewrite_attention_row_mask"


def _body(op):
    return op.regions[0].blocks[0]


def _yielded(op):
    body = _body(op)
    return body.operations[len(body.operations) - 1].operands


def _through_casts(value):
    """Skip arith.extf/extui/trunci/index casts inside a body."""
    while True:
        p = defining_op(value)
        if p is None or p.name not in ("arith.extf", "arith.extui", "arith.trunci", "arith.extsi"):
            return value
        value = p.operands[0]


def _is_float_const(value, target: float) -> bool:
    p = defining_op(value)
    if p is None or p.name != "arith.constant":
        return False
    attr = p.attributes["value"]
    return isinstance(attr, ir.FloatAttr) and attr.value == target


def _is_zero_operand(op, value) -> bool:
    """A body value that is 0.0: a constant, or a block arg of a zero splat operand."""
    if _is_float_const(value, 0.0):
        return True
    if isinstance(value, ir.BlockArgument) and value.owner == _body(op):
        operand = op.operands[value.arg_number]
        p = defining_op(operand)
        if p is not None and p.name == "arith.constant":
            attr = p.attributes["value"]
            return isinstance(attr, ir.DenseElementsAttr) and attr.is_splat and \
                attr.get_splat_value().value == 0
        if p is not None and p.name == "linalg.fill":
            return _is_float_const(p.operands[0], 0.0)
    return False


def _match_select(contraction, classes, axis_key):
    """The select generic producing the contraction's P operand: (op, pred idx, v idx)."""
    for operand in list(contraction.operands)[: loop_structure(contraction).num_inputs]:
        op = defining_op(operand)
        if op is None or op.name != "linalg.generic" or len(op.results) != 1:
            continue
        ls = loop_structure(op)
        if ls.reduction_dims or len(_yielded(op)) != 1:
            continue
        sel = defining_op(_yielded(op)[0])
        if sel is None or sel.name != "arith.select":
            continue
        cond, a, b = sel.operands
        if not _is_zero_operand(op, a):
            continue
        cond = _through_casts(cond)
        if not (isinstance(cond, ir.BlockArgument) and isinstance(b, ir.BlockArgument)):
            continue
        if cond.owner != _body(op) or b.owner != _body(op):
            continue
        return op, cond.arg_number, b.arg_number
    return None


def _is_all_inf_rows(rows_value, x_value) -> bool:
    """rows = AND over keys of (x == -inf), starting from true."""
    op = defining_op(rows_value)
    if op is None or not is_linalg(op) or len(op.results) != 1:
        return False
    ls = loop_structure(op)
    if len(ls.reduction_dims) != 1 or ls.num_inputs != 1:
        return False
    comb = defining_op(_through_casts(_yielded(op)[0]))
    if comb is None or comb.name != "arith.andi":
        return False
    cmp_op = defining_op(op.operands[0])
    if cmp_op is None or cmp_op.name != "linalg.generic" or loop_structure(cmp_op).reduction_dims:
        return False
    cmpf = defining_op(_through_casts(_yielded(cmp_op)[0]))
    if cmpf is None or cmpf.name != "arith.cmpf" or \
            ir.IntegerAttr(cmpf.attributes["predicate"]).value != int(arith.CmpFPredicate.OEQ):
        return False
    lhs, rhs = cmpf.operands
    lhs, rhs = _through_casts(lhs), _through_casts(rhs)
    arg = lhs if isinstance(lhs, ir.BlockArgument) else rhs
    other = rhs if arg is lhs else lhs
    if not isinstance(arg, ir.BlockArgument) or not _is_float_const(other, float("-inf")):
        return False
    return cmp_op.operands[arg.arg_number] == x_value


def _is_max_is_ninf(rows_value, m_value) -> bool:
    op = defining_op(rows_value)
    if op is None or op.name != "linalg.generic" or loop_structure(op).reduction_dims:
        return False
    cmpf = defining_op(_through_casts(_yielded(op)[0]))
    if cmpf is None or cmpf.name != "arith.cmpf":
        return False
    args = [_through_casts(v) for v in cmpf.operands]
    return any(isinstance(a, ir.BlockArgument) and op.operands[a.arg_number] == m_value for a in args) \
        and any(_is_float_const(a, float("-inf")) for a in args)


def _producers_up_to(op, stop, limit: int = 16):
    """`op` and the linalg ops between it and `stop` (those depending on `stop`'s result).

    Only this chain relates the rows of `stop` to the select's dims; unrelated producers
    could tie dims together through a shared input (e.g. one iota read as both the query
    and the key index of a square causal mask)."""
    target = stop.results[0]
    memo: dict = {}

    def depends(o) -> bool:
        if o in memo:
            return memo[o]
        memo[o] = False
        for v in o.operands:
            if v == target:
                memo[o] = True
                return True
            p = defining_op(v)
            if p is not None and p.block == op.block and is_linalg(p) and depends(p):
                memo[o] = True
                return True
        return False

    found, pending = [], [op]
    while pending and len(found) < limit:
        cur = pending.pop()
        if cur in found or cur == stop:
            continue
        found.append(cur)
        for v in cur.operands:
            p = defining_op(v)
            if p is not None and p.block == op.block and is_linalg(p) and p != stop and depends(p):
                pending.append(p)
    return found


def analyze(r1, contraction):
    for op, role in ((r1, "reduction"), (contraction, "contraction")):
        if not is_linalg(op) or len(op.results) != 1:
            raise Illegal(op, f"the {role} must be a single-result linalg op")
    ls1 = loop_structure(r1)
    if len(ls1.reduction_dims) != 1:
        raise Illegal(r1, "the reduction must reduce exactly one dim (the keys)")
    classes = DimClasses([r1, contraction])
    axis_key = (r1, ls1.reduction_dims[0])
    found = _match_select(contraction, classes, axis_key)
    if found is None:
        raise Illegal(contraction, "no select(rows, 0, P) feeds the contraction")
    select_op, pred_idx, value_idx = found
    for op in _producers_up_to(select_op, r1):
        classes.add_op(op)
    rows = select_op.operands[pred_idx]
    x = r1.operands[0]
    m = r1.results[0]
    if not (_is_all_inf_rows(rows, x) or _is_max_is_ninf(rows, m)):
        raise Illegal(select_op, "its condition is neither all(s == -inf) over the keys of the "
                                 "reduction's input nor (max == -inf)")
    ls_sel = loop_structure(select_op)
    pmap = ls_sel.maps[pred_idx]
    if any(d is not None and classes.same((select_op, d), axis_key)
           for d in [getattr(e, "position", None) for e in pmap.results]):
        raise Illegal(select_op, "the row condition varies along the keys")
    out = contraction.results[0]
    users = [u.owner for u in out.uses]
    users = [u.operation if isinstance(u, ir.OpView) else u for u in users]
    target = contraction
    if len(users) == 1 and is_linalg(users[0]) and not loop_structure(users[0]).reduction_dims \
            and len(users[0].results) == 1:
        target = users[0]
        classes.add_op(target)
    result = target.results[0]
    dims = []
    for p in range(m.type.rank):
        q = classes.value_dim_like(result, (m, p))
        if q is None:
            raise Illegal(target, "the normalized result does not keep the rows of the reduction")
        dims.append(q)
    return select_op, value_idx, rows, target, dims


def _rows_from_max(r1, rows):
    """A tensor like `rows` holding (m == -inf) for R1's result m, built right after R1."""
    m = r1.results[0]
    rtype = rows.type
    rank = rtype.rank
    with ir.InsertionPoint.after(r1), r1.location:
        empty = tensor.EmptyOp(list(rtype.shape), rtype.element_type).result
        ident = ir.AffineMapAttr.get(ir.AffineMap.get_identity(rank))
        iters = ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * rank)
        op = linalg.GenericOp([rtype], [m], [empty], ir.ArrayAttr.get([ident, ident]), iters)
        block = op.regions[0].blocks.append(m.type.element_type, rtype.element_type)
        with ir.InsertionPoint(block):
            mv = block.arguments[0]
            ninf = arith.ConstantOp(mv.type, ir.FloatAttr.get(mv.type, float("-inf"))).result
            is_masked = arith.cmpf(arith.CmpFPredicate.OEQ, mv, ninf)
            if rtype.element_type != is_masked.type:
                is_masked = arith.extui(rtype.element_type, is_masked)
            linalg.YieldOp([is_masked])
    return op.result


def rewrite(r1, contraction, plan, rewriter):
    select_op, value_idx, rows, target, dims = plan
    m = r1.results[0]
    result = target.results[0]
    rtype = result.type
    rank = rtype.rank
    already_masked = rows in list(target.operands)
    # 1. rows = (m == -inf) for every user (the guard's AND-reduction becomes dead)
    if list(rows.type.shape) == list(m.type.shape):
        new_rows = _rows_from_max(r1, rows)
        rows.replace_all_uses_with(new_rows)
    # 2. the contraction reads E directly
    for i, operand in enumerate(contraction.operands):
        if operand == select_op.results[0]:
            contraction.operands[i] = select_op.operands[value_idx]
    if already_masked:
        _erase_guard(select_op, rows, rewriter)
        return target
    # 3. out = select(m == -inf, 0, normalized), after the normalized result
    with ir.InsertionPoint.after(target), target.location:
        empty = tensor.EmptyOp(list(rtype.shape), rtype.element_type).result
        maps = [ir.AffineMap.get_identity(rank),
                ir.AffineMap.get(rank, 0, [ir.AffineDimExpr.get(q) for q in dims]),
                ir.AffineMap.get_identity(rank)]
        iters = ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * rank)
        masked = linalg.GenericOp([rtype], [result, m], [empty],
                                  ir.ArrayAttr.get([ir.AffineMapAttr.get(x) for x in maps]), iters)
        block = masked.regions[0].blocks.append(rtype.element_type, m.type.element_type,
                                                rtype.element_type)
        with ir.InsertionPoint(block):
            val, mv = block.arguments[0], block.arguments[1]
            ninf = arith.ConstantOp(mv.type, ir.FloatAttr.get(mv.type, float("-inf"))).result
            zero = arith.ConstantOp(val.type, ir.FloatAttr.get(val.type, 0.0)).result
            is_masked = arith.cmpf(arith.CmpFPredicate.OEQ, mv, ninf)
            linalg.YieldOp([arith.select(is_masked, zero, val)])
    result.replace_all_uses_except(masked.result, masked.operation)
    _erase_guard(select_op, rows, rewriter)
    return masked.operation


def _erase_guard(select_op, rows, rewriter) -> None:
    doomed = []
    for op in _dead_chain(select_op.results[0]) + _dead_chain(rows):
        if op not in doomed:
            doomed.append(op)
    for op in doomed:
        rewriter.erase_op(op)


def _dead_chain(value):
    """The op defining `value` and its producers that become unused, in erase order."""
    order = []
    pending = [defining_op(value)]
    while pending:
        op = pending.pop()
        if op is None or op in order:
            continue
        remaining = [u for u in result_users(op) if u not in order]
        if remaining:
            continue
        order.append(op)
        if op.name in ("linalg.generic", "linalg.fill", "tensor.empty", "arith.constant"):
            pending.extend(defining_op(v) for v in op.operands)
    return order


class RewriteAttentionRowMaskOp(TransformExt.Operation, name="rewrite_attention_row_mask"):
    reduction: ext.Operand[transform.AnyOpType]
    contraction: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                r1s = payload_ops(state, op.reduction)
                cs = payload_ops(state, op.contraction)
                if len(r1s) != len(cs):
                    return fail(NAME, Illegal(op.operation, f"{len(r1s)} reductions for "
                                                            f"{len(cs)} contractions"))
                try:
                    plans = [analyze(r1, c) for r1, c in zip(r1s, cs)]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                new = [rewrite(r1, c, p, rewriter) for r1, c, p in zip(r1s, cs, plans)]
                results.set_ops(op.result, new)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def rewrite_attention_row_mask(reduction: ir.Value, contraction: ir.Value) -> ir.Value:
    """Rewrite SDPA's masked-row guard to read `reduction`'s max; returns the new select op."""
    return RewriteAttentionRowMaskOp(reduction, contraction).result
