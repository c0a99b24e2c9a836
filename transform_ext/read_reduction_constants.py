"""read_reduction_constants: the constant term of a reduction is read from a splat tensor.

A linalg.generic reduction whose body yields combine(acc, c) with c a scalar arith.constant
(the restructured cross-entropy's coefficient sum sum_c 1 of label smoothing) gets one more
input, a splat constant holding c over the extents of its reduction dims, read through
them, and combines that element instead:

    R[i] = R[i] (+) c (+) c ...  ==  R[i] (+) C[k_1] (+) C[k_2] ...,   C = splat(c)

The same values in the same order. Why: linalg's vectorizer treats a constant term as one
scalar, not as one per iteration of the vectorized reduction dim, and combines it once per
vector instead of once per element (sum_c 1 over 40 classes came out 1).

Targets: every linalg.generic nested in the target ops. Never fails; rewritten ops are
replaced in other handles; the target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .analysis.classify import COMBINERS
from .analysis.structure import loop_structure
from .common import (RewritesTargets, Success, body_of, defining_op, payload_ops,
                     rebuild_generic, terminator, walk_ops)
from .dialect import TransformExt


def constant_term(op: ir.Operation) -> ir.Operation | None:
    """The arith.constant combined with the accumulator by a one-result reduction, if any."""
    if op.name != "linalg.generic" or len(op.results) != 1:
        return None
    ls = loop_structure(op)
    if not ls.reduction_dims or not ls.is_static:
        return None
    block = body_of(op)
    acc = block.arguments[len(block.arguments) - 1]
    combine = defining_op(terminator(block).operands[0])
    combiners = {name for kind in ("add", "mul", "max", "min") for name in COMBINERS[kind]}
    if combine is None or combine.name not in combiners or len(combine.operands) != 2 \
            or acc not in list(combine.operands):
        return None
    term = combine.operands[1] if combine.operands[0] == acc else combine.operands[0]
    producer = defining_op(term)
    if producer is None or producer.name != "arith.constant" or \
            isinstance(term.type, ir.ShapedType):
        return None
    return producer


def rewrite(op: ir.Operation, constant: ir.Operation, rewriter) -> None:
    ls = loop_structure(op)
    block = body_of(op)
    dims = ls.reduction_dims
    with ir.InsertionPoint(op), op.location:
        t = ir.RankedTensorType.get([ls.ranges[d] for d in dims], constant.results[0].type)
        splat = arith.ConstantOp(t, ir.DenseElementsAttr.get_splat(
            t, constant.attributes["value"])).result
    amap = ir.AffineMap.get(ls.num_loops, 0, [ir.AffineDimExpr.get(d) for d in dims])
    n_in = ls.num_inputs

    def mapping_of(args):
        mapping = {block.arguments[i]: args[i] for i in range(n_in)}
        for j in range(ls.num_outputs):
            mapping[block.arguments[n_in + j]] = args[n_in + 1 + j]
        mapping[constant.results[0]] = args[n_in]  # (a constant in the body is not cloned)
        return mapping

    rebuild_generic(op, list(op.operands)[:n_in] + [splat], ls.maps[:n_in] + [amap], mapping_of,
                    rewriter, skip=(constant,))


class ReadReductionConstantsOp(TransformExt.Operation, name="read_reduction_constants"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                for target in payload_ops(state, op.target):
                    found = [(g, constant_term(g)) for g in walk_ops(target, lambda o: o.name == "linalg.generic")]
                    for generic, constant in found:
                        if constant is not None:
                            rewrite(generic, constant, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def read_reduction_constants(target: ir.Value) -> ReadReductionConstantsOp:
    """Read the constant terms of the reductions nested in `target` from splat tensors (see
    the module docstring)."""
    return ReadReductionConstantsOp(target)


__all__ = ["ReadReductionConstantsOp", "read_reduction_constants"]
