"""expand_fast_exp: f32 `math.exp` on scalars (linalg bodies) as arith, with fewer operations
than lighthouse/targets/math_approx.py's general expansion and tiny results flushed to zero.

    xc = clamp(x, -86.64, 88.73)                      (NaN stays NaN)
    t  = xc log2 e,  k = (t + 1.5 2^23) - 1.5 2^23     (round to nearest, no conversion)
    r  = xc - k ln2_hi - k ln2_lo                       (|r| <= ln2 / 2, fma)
    p  = 2 P(r),  P the degree-6 near-minimax polynomial of e^r on [-ln2/2, ln2/2]
    e^x = p * 2^(k - 1), 2^(k - 1) built from bits: the low bits of t + 1.5 2^23 are k, so
          bits(t + 1.5 2^23) << 23 is k << 23, plus (127 - 1) << 23
with e^x = 0 for x < -86.64 (results under 2^-125 = 2.4e-38 are flushed, no denormals),
+inf past 88.72 (p * 2^127 overflows by itself), NaN for NaN (the integer steps never see a
float conversion, so NaN needs no special case: p is NaN). Relative error at most 1.2e-7
(about one ulp) on the rest. Meant for exps of non-positive numbers (a log-softmax, its
online corrections and its gradient), where flushing below 2.4e-38 changes nothing
measurable (the sums it feeds hold at least one term equal to 1).

Not lighthouse/targets/math_approx.py's exp (1 + r P_4(r) after roundeven, x clamped to
[-104, 88.75], denormal results kept by scaling twice by 2^(k/2) after an fptosi): that one
is exact to the edges for every kernel; this one saves the conversion, the second scaling
and a clamp in the cross-entropy's hot loop. Their roundings differ, so they stay two.

Rewritten: every math.exp on a scalar f32 nested in (or equal to) the targets. A target
that is itself a math.exp on another type (a vector, f16, bf16) is a silenceable failure
(nothing rewritten); nested ones are left alone. The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform
from torch_mlir.dialects import math as mmath

from .common import Illegal, RewritesTargets, Success, fail, payload_ops, walk_ops
from .dialect import TransformExt

NAME = "transform_ext.expand_fast_exp"
LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693145751953125, 1.428606765330187e-06
LOW, HIGH = -86.64, 88.73
# e^r ~ sum_j C_j r^j on [-ln2/2, ln2/2] (fitted by iteratively reweighted least squares on
# Chebyshev nodes; max relative error 1.1e-7 in f32 arithmetic)
POLY = (1.0, 1.0, 0.49999991059303284, 0.1666642129421234, 0.0416683591902256,
        0.008374771103262901, 0.0013829421950504184)
ROUNDER = 1.5 * 2.0 ** 23  # t + ROUNDER rounds t to an integer held in the low mantissa bits


def is_scalar_f32_exp(op: ir.Operation) -> bool:
    return op.name == "math.exp" and isinstance(op.results[0].type, ir.F32Type)


def _i(t, value: int) -> ir.Value:
    return arith.ConstantOp(t, ir.IntegerAttr.get(t, value)).result


def _c(t, value: float) -> ir.Value:
    return arith.ConstantOp(t, ir.FloatAttr.get(t, value)).result


def expansion(x: ir.Value) -> ir.Value:
    """e^x for a scalar f32 `x`, built at the current insertion point and location."""
    f32 = x.type
    i32 = ir.IntegerType.get_signless(32)
    xc = arith.minimumf(arith.maximumf(x, _c(f32, LOW)), _c(f32, HIGH))
    shifted = arith.addf(arith.mulf(xc, _c(f32, LOG2E)), _c(f32, ROUNDER))
    k = arith.subf(shifted, _c(f32, ROUNDER))
    r = mmath.fma(k, _c(f32, -LN2_HI), xc)
    r = mmath.fma(k, _c(f32, -LN2_LO), r)
    p = _c(f32, 2.0 * POLY[-1])
    for coef in reversed(POLY[:-1]):
        p = mmath.fma(p, r, _c(f32, 2.0 * coef))
    k_bits = arith.shli(arith.bitcast(i32, shifted), _i(i32, 23))
    scale = arith.bitcast(f32, arith.addi(k_bits, _i(i32, 126 << 23)))
    result = arith.mulf(p, scale)
    tiny = arith.cmpf(arith.CmpFPredicate.OLT, x, _c(f32, LOW))
    return arith.select(tiny, _c(f32, 0.0), result)


class ExpandFastExpOp(TransformExt.Operation, name="expand_fast_exp"):
    target: ext.Operand[transform.AnyOpType]

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
                found = [e for t in targets for e in walk_ops(t, is_scalar_f32_exp)]
                for exp in found:
                    with ir.InsertionPoint(exp), exp.location:
                        value = expansion(exp.operands[0])
                    rewriter.replace_op(exp, [value])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def expand_fast_exp(target: ir.Value) -> ExpandFastExpOp:
    """Expand the scalar f32 exps nested in `target` (see the module docstring)."""
    return ExpandFastExpOp(target)


__all__ = ["ExpandFastExpOp", "expand_fast_exp", "expansion", "is_scalar_f32_exp"]
