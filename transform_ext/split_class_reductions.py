"""split_class_reductions: a sum over the rows and the classes at once (the mean of a loss
with probability targets) becomes a sum over the classes per row, then a sum over the rows:
    init + sum_{r, c} t_{r, c} = init + sum_r (sum_c t_{r, c})
(exact in real arithmetic; in floating point the sum is reassociated, row by row). Then the
per-row sums can join the fused class loop.

Target: the axis op, a reduction with one reduction dim (the row max of a log_softmax);
the classes are the loop dims that run with its reduced dim (transform_ext/analysis/dims.py
over the linalg ops of its block). Rewritten: every additive float reduction (one result,
body yielding addf(term, acc)) of that block with several reduction dims of which exactly
one is a class dim; other ops are left alone. Legality first: the target holds one op with
one reduction dim, and every op rewritten has each loop but the class one indexed by an
operand (the per-row sums' shape). Else a silenceable failure naming the op (nothing
rewritten). The handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.dims import DimClasses
from .analysis.maps import Const, make_map, terms
from .analysis.structure import is_linalg_op, loop_structure
from .common import (Illegal, RewritesTargets, Success, block_ops, body_of, build_generic,
                     defining_op, fail, iterator_kinds, payload_ops, terminator)
from .dialect import TransformExt

NAME = "transform_ext.split_class_reductions"
_ADDITIVE = ("arith.addf",)


def combiner_term(op: ir.Operation):
    """(term, accumulator) when the body yields addf(term, acc), else None."""
    block = body_of(op)
    y = terminator(block).operands
    if len(y) != 1:
        return None
    add = defining_op(y[0])
    acc = block.arguments[len(block.arguments) - 1]
    if add is None or add.name not in _ADDITIVE or add.block != block:
        return None
    a, b = add.operands
    if b == acc and a != acc:
        return a, acc
    if a == acc and b != acc:
        return b, acc
    return None


def is_additive_float_reduction(op: ir.Operation) -> bool:
    return op.name == "linalg.generic" and len(op.results) == 1 and \
        combiner_term(op) is not None and \
        isinstance(op.results[0].type.element_type, ir.FloatType)


def _row_shape(op: ir.Operation, class_loop: int) -> list[int]:
    """The extents of the loops but `class_loop` (the per-row sums' shape)."""
    view = op.opview
    maps = [terms(m.value) for m in view.indexing_maps]
    shape = []
    for d in range(len(iterator_kinds(op))):
        if d == class_loop:
            continue
        for v, t in zip(list(view.inputs) + list(view.outputs), maps):
            if isinstance(v.type, ir.RankedTensorType) and d in t:
                shape.append(v.type.shape[t.index(d)])
                break
        else:
            raise Illegal(op, f"no operand is indexed by its loop {d}")
    return shape


def split_class_reduction(op: ir.Operation, class_loop: int, rewriter) -> None:
    """Rewrite the additive reduction `op` over `class_loop` and other loops (see the module
    docstring)."""
    kinds = iterator_kinds(op)
    ftype = op.results[0].type.element_type
    view = op.opview
    maps = [terms(m.value) for m in view.indexing_maps]
    n_loops = len(kinds)
    kept = [d for d in range(n_loops) if d != class_loop]
    shape = _row_shape(op, class_loop)
    block = body_of(op)
    with op.context, op.location, ir.InsertionPoint(op):
        empty = tensor.EmptyOp(shape, ftype).result
        zero = arith.ConstantOp(ftype, ir.FloatAttr.get(ftype, 0.0)).result
        init = linalg.fill(zero, outs=[empty])
        row_map = make_map(n_loops, kept)

        def inner_body(args):
            mapping = {a: b for a, b in zip(block.arguments, args)}
            for inner in list(block.operations)[:-1]:
                clone = inner.operation.clone()
                for i, v in enumerate(clone.operands):
                    if v in mapping:
                        clone.operands[i] = mapping[v]
                for r_old, r_new in zip(inner.operation.results, clone.results):
                    mapping[r_old] = r_new
            return [mapping.get(v, v) for v in terminator(block).operands]

        in_maps = [m.value for m in view.indexing_maps][:len(view.inputs)]
        inner_kinds = ["reduction" if d == class_loop else "parallel" for d in range(n_loops)]
        inner = build_generic(list(view.inputs), [init], in_maps + [row_map], inner_kinds,
                              inner_body, name_from=op)
        position = {d: i for i, d in enumerate(kept)}
        out_map = make_map(len(kept), [t if isinstance(t, Const) else position[t] for t in maps[-1]])
        outer = build_generic([inner.results[0]], [view.outputs[0]],
                              [ir.AffineMap.get_identity(len(kept)), out_map],
                              [kinds[d] for d in kept], lambda a: [arith.addf(a[0], a[1])])
    rewriter.replace_op(op, [outer.results[0]])


def axis_of(target_ops: list) -> tuple:
    """(the axis op, its reduction dim, the linalg ops of its block, their DimClasses)."""
    if len(target_ops) != 1:
        raise Illegal(target_ops[0] if target_ops else None,
                      f"the target must be one reduction (the row max), got {len(target_ops)} ops")
    axis = target_ops[0]
    if not is_linalg_op(axis) or len(loop_structure(axis).reduction_dims) != 1:
        raise Illegal(axis, "the target is not a reduction over one dim")
    ops = [op for op in block_ops(axis.block) if is_linalg_op(op)]
    return axis, loop_structure(axis).reduction_dims[0], ops, DimClasses(ops)


def plan(target_ops: list) -> list:
    """(op, class loop) of every reduction to split; raises Illegal."""
    axis, k, ops, classes = axis_of(target_ops)
    found = []
    for op in ops:
        if op == axis:
            continue
        ls = loop_structure(op)
        loops = [l for l in ls.reduction_dims if classes.same((op, l), (axis, k))]
        if len(ls.reduction_dims) > 1 and len(loops) == 1 and is_additive_float_reduction(op):
            _row_shape(op, loops[0])
            found.append((op, loops[0]))
    return found


class SplitClassReductionsOp(TransformExt.Operation, name="split_class_reductions"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    todo = plan(targets)
                except Illegal as illegal:
                    if illegal.payload is None:
                        illegal.payload = op.operation
                    return fail(NAME, illegal)
                for reduction, class_loop in todo:
                    split_class_reduction(reduction, class_loop, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def split_class_reductions(target: ir.Value) -> SplitClassReductionsOp:
    """Split the sums over rows and classes of `target`'s block per row (see the module
    docstring); `target`: the row max."""
    return SplitClassReductionsOp(target)


__all__ = ["SplitClassReductionsOp", "split_class_reductions", "axis_of", "combiner_term"]
