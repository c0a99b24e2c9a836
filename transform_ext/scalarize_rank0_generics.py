"""scalarize_rank0_generics: a linalg.generic with no loops becomes its body on scalars.

A generic over rank-0 tensors (a mean's final division, a loss's ignore test, an assertion
on one target) runs its body once:
    %r = linalg.generic {iterator_types = []} ins(%a : tensor<f32>, %s : f32)
                                               outs(%i : tensor<f32>) { body(a, s, i) }
becomes
    %a0 = tensor.extract %a[]  ;  %i0 = tensor.extract %i[]
    %y = body(%a0, %s, %i0)    ;  %r = tensor.from_elements %y : tensor<f32>
(a generic without results leaves its body, e.g. its cf.asserts, in place). Exact: the same
ops on the same values. It keeps the vectorizer away from 0-d bodies, which it turns into
invalid IR when they read a tensor (`tensor.extract` of a gathered logit: a vector<f32>
selected with a scalar).

Targets: every linalg.generic with zero loops nested in the target ops. Legality: tensor
semantics (each init a rank-0 tensor); a rank-0 generic on buffers is a silenceable
failure. The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .common import Illegal, RewritesTargets, Success, clone_op, fail, payload_ops, walk_ops
from .dialect import TransformExt

NAME = "transform_ext.scalarize_rank0_generics"


def is_rank0_generic(op: ir.Operation) -> bool:
    return op.name == "linalg.generic" and len(ir.ArrayAttr(op.attributes["iterator_types"])) == 0


def _check(op: ir.Operation) -> None:
    for v in op.operands:
        if isinstance(v.type, ir.ShapedType) and not isinstance(v.type, ir.RankedTensorType):
            raise Illegal(op, f"it works on buffers ({v.type})")
    if len(op.opview.outputs) != len(op.results):
        raise Illegal(op, "it writes buffers (its inits are not tensors)")


def _scalarize(op: ir.Operation, rewriter) -> None:
    body = op.regions[0].blocks[0]
    mapping = {}
    with ir.InsertionPoint(op), op.location:
        for arg, value in zip(body.arguments, op.operands):
            mapping[arg] = (tensor.extract(value, []) if isinstance(value.type, ir.RankedTensorType)
                            else value)
        ops = list(body.operations)
        for inner in ops[:-1]:
            clone_op(inner.operation, mapping)
        yielded = [mapping.get(v, v) for v in ops[-1].operands]
        results = [tensor.from_elements(r.type, [y]) for r, y in zip(op.results, yielded)]
    if results:
        rewriter.replace_op(op, results)
    else:
        rewriter.erase_op(op)


class ScalarizeRank0GenericsOp(TransformExt.Operation, name="scalarize_rank0_generics"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                found = [g for t in targets for g in walk_ops(t, is_rank0_generic)]
                try:
                    for g in found:
                        _check(g)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for g in found:
                    _scalarize(g, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def scalarize_rank0_generics(target: ir.Value) -> ScalarizeRank0GenericsOp:
    """Replace the loop-free generics nested in `target` by scalar code."""
    return ScalarizeRank0GenericsOp(target)


__all__ = ["ScalarizeRank0GenericsOp", "scalarize_rank0_generics", "is_rank0_generic"]
