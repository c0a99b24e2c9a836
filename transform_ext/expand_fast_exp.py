"""expand_fast_exp: f32 `math.exp` on scalars (linalg bodies) as arith, by the one exp
expansion (transform_ext/exp_expansion.py) with tiny results flushed (`subnormals=False`):

    e^x = (2 + r 2P(r)) 2^(k - 1),  k = round(x log2 e),  r = x - k ln2,  x clamped to
          [-87.5, 88.75], 2^(k - 1) made by shifting the rounded sum's bits into the exponent

with e^x = 0 below 2^-125.5 (x < -86.99: no denormals), +inf past 88.7228, NaN for NaN,
about one ulp on the rest. Meant for exps of non-positive numbers (a log-softmax, its online
corrections and its gradient), where flushing below 1.7e-38 changes nothing measurable (the
sums it feeds hold at least one term equal to 1); it saves the second scaling and the
float-int conversion of the general expansion (`subnormals=True`, the CPU target's).
With `short` (softmax weights: the CPU attention's key loops; the cross-entropy family's
exps when its results are f16 or bf16), the expansion's short form (two fmas fewer): within
2.5 ulp for x in [-20, 0], 6 ulp on the rest.

Rewritten, once each: every math.exp on a scalar f32 nested in (or equal to) the targets. A target
that is itself a math.exp on another type (a vector, f16, bf16) is a silenceable failure
(nothing rewritten); nested ones are left alone. The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, RewritesTargets, Success, fail, payload_ops, walk_ops
from .dialect import TransformExt
from .exp_expansion import F32Builder, exp

NAME = "transform_ext.expand_fast_exp"


def is_scalar_f32_exp(op: ir.Operation) -> bool:
    return op.name == "math.exp" and isinstance(op.results[0].type, ir.F32Type)


class ExpandFastExpOp(TransformExt.Operation, name="expand_fast_exp"):
    target: ext.Operand[transform.AnyOpType]
    short: ir.IntegerAttr  # i1

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name == "math.exp" and not is_scalar_f32_exp(target):
                            raise Illegal(target, f"exp on {target.results[0].type}: only "
                                                  f"scalar f32 is expanded")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                short = bool(ir.IntegerAttr(op.short).value)
                # once each, also when targets nest (a loop and a loop inside it)
                found = list(dict.fromkeys(
                    e for t in targets for e in walk_ops(t, is_scalar_f32_exp)))
                for exp_op in found:
                    x = exp_op.operands[0]
                    with ir.InsertionPoint(exp_op), exp_op.location:
                        value = exp(F32Builder(x.type), x, subnormals=False, short=short)
                    rewriter.replace_op(exp_op, [value])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def expand_fast_exp(target: ir.Value, short: bool = False) -> ExpandFastExpOp:
    """Expand the scalar f32 exps nested in `target` (see the module docstring)."""
    return ExpandFastExpOp(target, ir.IntegerAttr.get(ir.IntegerType.get_signless(1), int(short)))


__all__ = ["ExpandFastExpOp", "expand_fast_exp", "is_scalar_f32_exp"]
