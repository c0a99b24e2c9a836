"""fold_casts_into_contractions: a contraction reads the tensors its operands were widened or
transposed from, in place.

A contraction C (a linalg.generic: sum over its reduction dims of its body) reading operand
T through map M where T is

    P(X)  an elementwise linalg.generic of one input whose body only widens (arith.extf):
          C reads X through M composed with P's maps and widens it in its own body;
    X^T   a linalg.transpose of X, when the composed map reads X with a reduction dim
          innermost (along its contiguous dim, as the micro-kernels want: W^T [D, V] is
          read as W [V, D] in place; a transposed copy of h stays),

so C no longer needs T: torch-mlir's bf16 linear layer widens h and W^T to f32 copies
([D, V] for the weight) before its f32 matmul; folded, the matmul reads the bf16 h and W,
widening each element as it multiplies (arith.extf: the contraction stays one to linalg's
contraction interface). Exact: extf is, and a transpose only moves elements. Repeated to a fixed point (the widening of a transpose); T's producer is erased
when nothing else reads it.

Targets: linalg.generic contractions (generalize named ones first); any other target is a
silenceable failure naming it (nothing rewritten). The targets are rebuilt: the result
holds them, in order (the target handle is consumed).
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .analysis.classify import is_contraction
from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, body_of, defining_op, fail,
                     payload_ops, rebuild_generic, terminator)
from .dialect import TransformExt

NAME = "transform_ext.fold_casts_into_contractions"


def is_widening(op: ir.Operation | None) -> bool:
    """A one-input elementwise generic whose body yields extf(input)."""
    if op is None or op.name != "linalg.generic" or len(op.results) != 1:
        return False
    ls = loop_structure(op)
    if ls.num_inputs != 1 or ls.reduction_dims or not ls.output_map(0).is_permutation \
            or not ls.maps[0].is_permutation:
        return False
    body = list(body_of(op).operations)
    return len(body) == 2 and body[0].operation.name == "arith.extf" and \
        body[0].operation.operands[0] == body_of(op).arguments[0] and \
        terminator(body_of(op)).operands[0] == body[0].operation.results[0]


def _transpose(op: ir.Operation | None) -> bool:
    return op is not None and op.name == "linalg.transpose"


def source_map(producer: ir.Operation, amap: ir.AffineMap) -> ir.AffineMap:
    """The map C reads the producer's input through: amap, then producer's output ->
    input."""
    ls = loop_structure(producer)
    if producer.name == "linalg.transpose":
        perm = list(ir.DenseI64ArrayAttr(producer.attributes["permutation"]))
        # out[i] = in[perm^-1 ...]: out dim j holds input dim perm[j]
        results = [None] * len(perm)
        for j, p in enumerate(perm):
            results[p] = amap.results[j]
        return ir.AffineMap.get(amap.n_dims, 0, results)
    out_to_loops = ls.output_map(0)
    # loop d of P is out dim position of d in P's output map
    loop_expr = {}
    for pos, expr in enumerate(out_to_loops.results):
        loop_expr[ir.AffineDimExpr(expr).position] = amap.results[pos]
    return ir.AffineMap.get(amap.n_dims, 0,
                            [loop_expr[ir.AffineDimExpr(e).position] for e in ls.maps[0].results])


def _reduction_innermost(op: ir.Operation, amap: ir.AffineMap) -> bool:
    last = amap.results[len(amap.results) - 1]
    return isinstance(last, ir.AffineDimExpr) and \
        loop_structure(op).iterators[ir.AffineDimExpr(last).position] == "reduction"


def foldable(op: ir.Operation) -> list[int]:
    """The inputs of `op` made by a widening generic, or by a transpose read with a
    reduction dim innermost once folded."""
    ls = loop_structure(op)
    found = []
    for i in range(ls.num_inputs):
        producer = defining_op(op.operands[i])
        if is_widening(producer) or _transpose(producer) and \
                _reduction_innermost(op, source_map(producer, ls.maps[i])):
            found.append(i)
    return found


def fold(op: ir.Operation, rewriter) -> ir.Operation:
    """`op` rebuilt once with every foldable input read from its source; returns the new
    op."""
    ls = loop_structure(op)
    block = body_of(op)
    folded = foldable(op)
    inputs, maps, widen = [], [], []
    for i in range(ls.num_inputs):
        value, amap = op.operands[i], ls.maps[i]
        producer = defining_op(value)
        if i in folded:
            widen.append(is_widening(producer) and
                         ir.RankedTensorType(producer.results[0].type).element_type)
            amap = source_map(producer, amap)
            value = producer.operands[0]
        else:
            widen.append(None)
        inputs.append(value)
        maps.append(amap)

    def mapping_of(args):
        mapping = {block.arguments[i]: arith.extf(widen[i], args[i]) if widen[i] else args[i]
                   for i in range(ls.num_inputs)}
        for j in range(ls.num_outputs):
            mapping[block.arguments[ls.num_inputs + j]] = args[ls.num_inputs + j]
        return mapping

    return rebuild_generic(op, inputs, maps, mapping_of, rewriter)


class FoldCastsIntoContractionsOp(TransformExt.Operation, name="fold_casts_into_contractions"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "linalg.generic" or not is_contraction(target):
                            raise Illegal(target, "not a linalg.generic contraction")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                rebuilt = []
                for target in targets:
                    while foldable(target):
                        producers = [defining_op(target.operands[i]) for i in foldable(target)]
                        new = fold(target, rewriter)
                        for producer in producers:
                            if not any(list(r.uses) for r in producer.results):
                                rewriter.erase_op(producer)
                        target = new
                    rebuilt.append(target)
                results.set_ops(op.result, rebuilt)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def fold_casts_into_contractions(target: ir.Value) -> ir.Value:
    """Fold the widenings and transposes of each target contraction's inputs into it (see
    the module docstring); returns the rebuilt contractions."""
    return FoldCastsIntoContractionsOp(target).result


__all__ = ["FoldCastsIntoContractionsOp", "fold_casts_into_contractions", "is_widening", "source_map"]
