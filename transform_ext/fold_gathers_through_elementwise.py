"""fold_gathers_through_elementwise: a gather (`tensor.extract` in a linalg body) from the
result of an elementwise linalg.generic reads what that result is made of.

A body reads one element T[idx] of a tensor T produced by an elementwise generic
P(a_1, ..., a_n) (all loops parallel, output through a permutation, plain dims and
constants in its input maps, no cf.assert or region in its body). Since
    T[idx] = body_P(a_1[M_1(l)], ..., a_n[M_n(l)]),   l the loop point of P writing idx,
the extract becomes P's body applied to extracts of P's inputs (`linalg.index d` of P
becomes the index l_d). Through tensor.expand_shape the indices are linearized per
reassociation group: E[i_1, .., i_g, ..] = T[.., (..(i_1 s_2 + i_2) s_3 + ..), ..] (unit dims
contribute nothing). Exact: the same scalar ops on the same values. Repeated to a fixed
point, a gather from log_softmax(x) = x - m - log(l) becomes x[i, y] - m[i] - log(l[i]):
the [N, C] tensor is no longer read and dies.

Targets: function-like ops; the gathers are those in the bodies of the linalg ops of their
entry block. A target without a region (no body to fold in) is a silenceable failure
(nothing rewritten). The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.maps import Const, terms
from .common import (Illegal, RewritesTargets, Success, body_of, clone_op, defining_op, fail,
                     iterator_kinds, payload_ops, terminator)
from .dialect import TransformExt

NAME = "transform_ext.fold_gathers_through_elementwise"


def elementwise_source(value: ir.Value) -> ir.Operation | None:
    """The generic producing `value` when it is elementwise with a permutation output map and
    simple input maps (plain dims and constants), else None."""
    op = defining_op(value)
    if op is None or op.name != "linalg.generic" or len(op.results) != 1:
        return None
    if any(k != "parallel" for k in iterator_kinds(op)):
        return None
    maps = [terms(m) for m in linalg.get_indexing_maps(op)]
    if any(t is None for t in maps):
        return None
    out = maps[-1]
    if sorted(t for t in out if not isinstance(t, Const)) != list(range(len(out))) or \
            any(isinstance(t, Const) for t in out):
        return None
    for inner in body_of(op).operations:
        if inner.operation.name == "cf.assert" or len(inner.operation.regions):
            return None
    return op


def index_constant(n: int) -> ir.Value:
    return arith.ConstantOp(ir.IndexType.get(), ir.IntegerAttr.get(ir.IndexType.get(), n)).result


def _fold_into_producer_body(extract: ir.Operation, producer: ir.Operation, rewriter) -> None:
    maps = [terms(m) for m in linalg.get_indexing_maps(producer)]
    out_terms = maps[-1]
    indices = list(extract.operands)[1:]
    loop_index = {d: indices[pos] for pos, d in enumerate(out_terms)}
    n_in = len(producer.operands) - 1
    body = body_of(producer)
    mapping: dict = {}
    with ir.InsertionPoint(extract), extract.location:
        for k in range(n_in + 1):
            operand = producer.operands[k]
            arg = body.arguments[k]
            if not list(arg.uses):
                continue
            if not isinstance(operand.type, ir.RankedTensorType):
                mapping[arg] = operand
                continue
            idx = [index_constant(t.value) if isinstance(t, Const) else loop_index[t]
                   for t in maps[k]]
            mapping[arg] = tensor.ExtractOp(operand, idx).result
        for inner in body.operations:
            if inner.operation.name == "linalg.index":
                d = ir.IntegerAttr(inner.operation.attributes["dim"]).value
                mapping[inner.operation.results[0]] = loop_index[d]
        for inner in list(body.operations)[:-1]:
            inner = inner.operation
            if inner.name == "linalg.index":
                continue
            clone_op(inner, mapping)
        yielded = terminator(body).operands[0]
        value = mapping.get(yielded, yielded)
    rewriter.replace_op(extract, [value])


def _fold_through_expand(extract: ir.Operation, expand: ir.Operation, rewriter) -> None:
    groups = [[ir.IntegerAttr(i).value for i in g] for g in expand.opview.reassociation]
    shape = list(expand.results[0].type.shape)
    indices = list(extract.operands)[1:]
    with ir.InsertionPoint(extract), extract.location:
        new_indices = []
        for g in groups:
            value = None
            for d in g:
                if shape[d] == 1:
                    continue  # the index of a unit dim is 0
                value = indices[d] if value is None else arith.addi(
                    arith.muli(value, index_constant(shape[d])), indices[d])
            new_indices.append(value if value is not None else index_constant(0))
        new = tensor.ExtractOp(expand.operands[0], new_indices).result
    rewriter.replace_op(extract, [new])


def extracts_in(op: ir.Operation) -> list[ir.Operation]:
    return [o.operation for o in body_of(op).operations if o.operation.name == "tensor.extract"]


def linalg_ops_of(func: ir.Operation) -> list[ir.Operation]:
    """The linalg ops (with a body) of `func`'s entry block."""
    return [o.operation for o in func.regions[0].blocks[0].operations
            if o.operation.name.startswith("linalg.") and o.operation.regions]


def fold_gathers(func: ir.Operation, rewriter) -> int:
    """Fold every gather from an elementwise producer (to a fixed point); returns the count."""
    count = 0
    changed = True
    while changed:
        changed = False
        for op in linalg_ops_of(func):
            for extract in extracts_in(op):
                source = defining_op(extract.operands[0])
                if source is not None and source.name == "tensor.expand_shape":
                    _fold_through_expand(extract, source, rewriter)
                    count += 1
                    changed = True
                    continue
                producer = elementwise_source(extract.operands[0])
                if producer is None:
                    continue
                _fold_into_producer_body(extract, producer, rewriter)
                count += 1
                changed = True
    return count


def check_has_body(target: ir.Operation) -> None:
    if not len(target.regions) or not len(target.regions[0].blocks):
        raise Illegal(target, "it has no body (target a function)")


class FoldGathersThroughElementwiseOp(TransformExt.Operation,
                                      name="fold_gathers_through_elementwise"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        check_has_body(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    fold_gathers(target, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fold_gathers_through_elementwise(target: ir.Value) -> FoldGathersThroughElementwiseOp:
    """Fold the gathers of `target`'s linalg ops through their elementwise producers."""
    return FoldGathersThroughElementwiseOp(target)


__all__ = ["FoldGathersThroughElementwiseOp", "fold_gathers_through_elementwise",
           "check_has_body", "extracts_in", "linalg_ops_of", "index_constant"]
