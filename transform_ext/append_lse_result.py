"""append_lse_result: the attention's per-row log-sum-exp as one more function result.

For the attention in each target function (transform_ext/analysis/attention.py: row max m,
row sum l = sum_j exp(S_ij - m_i), output O):

    lse_i = m_i + log(l_i) = log sum_j exp(S_ij)        (-inf on fully masked rows: m_i = -inf)

computed by one linalg.generic that also passes O through, (O, lse broadcast along the
value dim) = g(O, m, l), with lse read back as the slice of value column 0; the function
returns g's O where it returned O (through the one reshape between them, which then reads
g's O: a head merge), and lse, reshaped as that reshape reshapes O's rows. The query-block
forall tiling O's producer then computes lse from each block's final m and l. lse is
rounded to O's element type.

Preconditions (checked before anything changes; a violation is a silenceable failure naming
the op): the target function holds one attention; m and l are [..., queries] of O's shape
[..., queries, values]; a reshape between O and the result keeps the value dim a group of
its own.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, tensor, transform
from torch_mlir.dialects import func as func_dialect
from torch_mlir.dialects import math as math_dialect

from .analysis.attention import AttentionOps, NotAttention, attention_in
from .common import (Illegal, RewritesTargets, Success, block_ops, build_generic, defining_op,
                     fail, payload_ops, reassociation_attr)
from .dialect import TransformExt
from .fold_reshape_ops_by_expansion import reassociation

NAME = "transform_ext.append_lse_result"
RESHAPES = ("tensor.expand_shape", "tensor.collapse_shape")


def plan(func: ir.Operation) -> tuple[AttentionOps, ir.Operation | None]:
    """(the attention, the reshape between its output and the first result or None);
    raises Illegal when the preconditions fail."""
    if func.name != "func.func":
        raise Illegal(func, "not a function")
    try:
        ops = attention_in(func)
    except NotAttention as exc:
        raise Illegal(func, str(exc))
    out = ops.output.results[0]
    shape = list(out.type.shape)
    m, l = ops.row_max.results[0], ops.row_sum.results[0]
    if list(m.type.shape) != shape[:-1] or list(l.type.shape) != shape[:-1]:
        raise Illegal(ops.output, "the row max and sum are not [..., queries] of the output")
    ret = block_ops(func)[-1]
    first = defining_op(ret.operands[0]) if ret.operands[0] != out else None
    if first is None or first.name not in RESHAPES or first.operands[0] != out:
        return ops, None
    groups = reassociation(first)
    result = first.results[0].type
    if groups[-1] != [result.rank - 1 if first.name == "tensor.expand_shape"
                      else first.operands[0].type.rank - 1]:
        raise Illegal(first, "the output's value dim is reshaped on its way to the result")
    return ops, first


def lse_beside_output(ops: AttentionOps, at: ir.Operation, etype: ir.Type | None = None):
    """(g, lse): g = the generic (O, lse broadcast along the value dim) = g(O, m, l) built
    before `at`, lse its [..., L] slice, in `etype` (default O's element type); the caller
    redirects O's readers to g's O."""
    out = ops.output.results[0]
    m, l = ops.row_max.results[0], ops.row_sum.results[0]
    shape = list(out.type.shape)
    rank = len(shape)
    ident = ir.AffineMap.get_identity(rank)
    rows = ir.AffineMap.get(rank, 0, [ir.AffineDimExpr.get(d) for d in range(rank - 1)])
    etype = etype or out.type.element_type
    with ir.InsertionPoint(at), at.location:
        outs = [tensor.EmptyOp(shape, out.type.element_type).result,
                tensor.EmptyOp(shape, etype).result]

        def body(args):
            o, mv, lv = args[:3]
            # a fully masked row (m = -inf) has lse = -inf whatever its l (0, or NaN where
            # the sum was left unguarded: only O's guard reads the row max)
            ninf = arith.constant(mv.type, float("-inf"))
            masked = arith.cmpf(arith.CmpFPredicate.OEQ, mv, ninf)
            lse = arith.select(masked, ninf, arith.addf(mv, math_dialect.log(lv)))
            if lse.type != etype:
                lse = arith.truncf(etype, lse)
            return [o, lse]

        both = build_generic([out, m, l], outs, [ident, rows, rows, ident, ident],
                             ["parallel"] * rank, body)
        sizes = shape[:-1] + [1]
        lse_type = ir.RankedTensorType.get(shape[:-1], etype)
        lse = tensor.ExtractSliceOp(lse_type, both.results[1], [], [], [], [0] * rank, sizes,
                                    [1] * rank).result
    return both, lse


def append(func: ir.Operation, ops: AttentionOps, reshape: ir.Operation | None, rewriter) -> None:
    ret = block_ops(func)[-1]
    out = ops.output.results[0]
    both, lse = lse_beside_output(ops, ret)
    for i, v in enumerate(ret.operands):
        if v == out:
            ret.operands[i] = both.results[0]
    if reshape is not None:
        reshape.operands[0] = both.results[0]
        reshape.move_after(getattr(both, "operation", both))
        lse = _reshape_rows_like(reshape, lse, ret)
    results = list(ret.operands) + [lse]
    with ir.InsertionPoint(ret), ret.location:
        func_dialect.ReturnOp(results)
    rewriter.erase_op(ret)
    block = func.regions[0].blocks[0]
    fn_type = ir.FunctionType.get([a.type for a in block.arguments], [v.type for v in results])
    func.attributes["function_type"] = ir.TypeAttr.get(fn_type)


def _reshape_rows_like(reshape: ir.Operation, rows: ir.Value, before: ir.Operation) -> ir.Value:
    """`rows` ([..., L], the output without its value dim) reshaped the way `reshape`
    reshapes the output, so it has the model's leading dims (built before `before`)."""
    groups = reassociation(reshape)[:-1]
    result = reshape.results[0].type
    with ir.InsertionPoint(before), reshape.location:
        rtype = ir.RankedTensorType.get(list(result.shape)[:-1], rows.type.element_type)
        if reshape.name == "tensor.expand_shape":
            return tensor.ExpandShapeOp(rtype, rows, reassociation_attr(groups), [],
                                        list(result.shape)[:-1]).result
        return tensor.CollapseShapeOp(rtype, rows, reassociation_attr(groups)).result


class AppendLseResultOp(TransformExt.Operation, name="append_lse_result"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    plans = [plan(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target, (ops, reshape) in zip(targets, plans):
                    append(target, ops, reshape, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def append_lse_result(func: ir.Value) -> None:
    """Return the attention's per-row log-sum-exp from each function of `func` as one more
    result (see the module docstring)."""
    AppendLseResultOp(func)


__all__ = ["AppendLseResultOp", "append_lse_result", "lse_beside_output"]
