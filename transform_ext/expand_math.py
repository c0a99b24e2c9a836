"""expand_math: polynomial expansions of math.exp / log / log1p / tanh / erf, and asinh /
acosh / atanh through log and log1p (f32 arithmetic).

This MLIR build has no `math-polynomial-approximation` pass, LLVM scalarizes vector `exp` &
co. into libm calls, and XeVM has no lowering of math.erf. `expand_math_in(op)` (the CPU
lowering, on the module) and the transform op `transform_ext.expand_math` (a schedule's
step, e.g. the XeGPU @vectorize's erf) rewrite each such op nested in the targets, on f32
(scalar or vector; f16/bf16 are computed in f32), into arith/math ops that vectorize:

exp(x):  transform_ext/exp_expansion.py's expansion with subnormals kept (`exp(b, x,
         subnormals=True)`): r = x - k ln2, e^r = 1 + r P(r), times 2^k by ldexp (one
         vscalefps on AVX-512 hosts, `ldexp=True`) or two scalings by exponent bits; x is
         clamped to [-104, 88.75]; denormal results and overflow to inf are rounded once;
         NaN propagates.
log(x):  x = m 2^e with m in [sqrt(1/2), sqrt(2)) (denormals scaled by 2^23 first),
         log(m) = 2 atanh(s), s = (m-1)/(m+1), odd series to s^13; + e ln2 (hi/lo).
         log(0) = -inf, log(x<0) = NaN, log(inf) = inf.
log1p(x): u = 1 + x rounded, log1p(x) = log(u) * x / (u - 1) (the rounding error of u
         cancels in the ratio: within a few ulp of log's accuracy); x itself where u = 1
         (|x| < 2^-24, and -0 stays -0); log(u) where u = inf (x / (u - 1) would be NaN).
         softplus (log1p(exp(x))) vectorizes with it.
tanh(x): |x| < 0.625: x + x^3 P(x^2) (fitted, tools/fit_math_polynomials.py);
         else sign(x) (1 - 2 / (exp(2|x|) + 1)).
erf(x):  |x| < 0.875: x P(x^2); |x| < 4: sign(x) (1 - Q(x)), Q a polynomial of erfc to
         an absolute error (1 - Q lies in [0.78, 1): no exp needed), of degree 15, summed
         by Estrin's scheme (a Horner chain of 15 fmas bounded a GELU loop by its
         latency: KernelBench 26 on AVX2 17% faster); else sign(x).
expm1(x): |x| < 0.35: x + x^2 P(x), P the Taylor series to x^6 / 8! (its remainder is below
         1e-9 of x); else exp(x) - 1 (exp(x) >= 0.7: the subtraction keeps a few ulp).
         exp(x) - 1 alone (LLVM's lowering) lost every digit below |x| ~ 1e-4.
asinh(x): sign(x) log1p(a + a^2 / (1 + sqrt(1 + a^2))), a = |x|; log(a) + ln2 for
         a > 2^12 (a^2 would overflow; the dropped 1 / (4 a^2) is below an ulp).
acosh(x): log1p(t + sqrt(t (t + 2))), t = x - 1; log(x) + ln2 for x > 2^12; NaN below 1.
atanh(x): sign(x) log1p(2a / (1 - a)) / 2: inf at 1, NaN past it.
Each is accurate to a few ulp in f32 (tests/lighthouse/test_math_approx.py measures it).

The transform op: `ops` names the math ops to expand (others stay, e.g. a target whose
native math lacks only erf); a name without an expansion is a silenceable failure, nothing
rewritten. Math ops on other element types (f64) are left alone. The targets stay; the
math ops nested in them are replaced outside the interpreter's rewriter, so the target
handle is consumed and returned (common.RewritesNestedOps).
"""


import math

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform
from torch_mlir.dialects import math as mmath

from .common import Illegal, RewritesNestedOps, Success, fail, payload_ops
from .dialect import TransformExt
from .exp_expansion import LN2_HI, LN2_LO, F32Builder, exp

NAME = "transform_ext.expand_math"

TANH_SMALL = (-0.3333333333035862, 0.13333332154888608, -0.05396771291885392,
              0.021860591491489407, -0.008794120486864164, 0.003312842205597287,
              -0.0008675354517920214)
ERF_SMALL = (1.128379166999535, -0.37612636733829974, 0.1128374098053152,
             -0.026861968583732354, 0.005207621292591474, -0.0008220516094397151,
             8.714052200816049e-05)
ERFC_MID, ERFC_HALF = 2.4375, 1.5625
ERFC_POLY = (0.0005665420852012701, -0.004633968384757013, 0.017649129246993724,
             -0.04104179773194109, 0.06378818091073694, -0.06710732696385123,
             0.043703189925031555, -0.008613352306108206, -0.014806987984083817,
             0.016845318715217755, -0.006098805336870811, -0.002940715992889025,
             0.003763388165530214, -0.0007159615849511531, -0.0006021613729341735,
             0.00024534371142015095)

EXPANDED = ("math.exp", "math.log", "math.log1p", "math.expm1", "math.tanh", "math.erf",
            "math.asinh", "math.acosh", "math.atanh")
EXPM1_SMALL_BOUND = 0.35
EXPM1_SMALL = tuple(1.0 / math.factorial(n) for n in range(2, 9))
LARGE_INVERSE_HYPERBOLIC = 4096.0


def _exp(b: F32Builder, x):
    return exp(b, x, subnormals=True)


def _log(b: F32Builder, x):
    P = arith.CmpFPredicate
    tiny = b.cmp(P.OLT, x, b.f(1.1754943508222875e-38))
    xs = arith.select(tiny, arith.mulf(x, b.f(8388608.0)), x)
    bias = arith.select(tiny, b.i(127 + 23), b.i(127))
    bits = arith.bitcast(b.itype, xs)
    e = arith.subi(arith.shrsi(bits, b.i(23)), bias)
    m = arith.bitcast(b.ftype, arith.ori(arith.andi(bits, b.i(0x7FFFFF)), b.i(0x3F800000)))
    big = b.cmp(P.OGT, m, b.f(1.4142135623730951))
    m = arith.select(big, arith.mulf(m, b.f(0.5)), m)
    e = arith.select(big, arith.addi(e, b.i(1)), e)
    f = arith.subf(m, b.f(1.0))
    s = arith.divf(f, arith.addf(m, b.f(1.0)))
    s2 = arith.mulf(s, s)
    series = b.horner(s2, (2.0, 2.0 / 3, 2.0 / 5, 2.0 / 7, 2.0 / 9, 2.0 / 11, 2.0 / 13))
    logm = arith.mulf(s, series)
    ef = arith.sitofp(b.ftype, e)
    result = arith.addf(mmath.fma(ef, b.f(LN2_LO), logm), arith.mulf(ef, b.f(LN2_HI)))
    result = arith.select(b.cmp(P.OEQ, x, b.f(0.0)), b.f(-math.inf), result)
    result = arith.select(b.cmp(P.OEQ, x, b.f(math.inf)), b.f(math.inf), result)
    return arith.select(b.cmp(P.OGE, x, b.f(0.0)), result, b.f(math.nan))  # NaN and x < 0


def _log1p(b: F32Builder, x):
    P = arith.CmpFPredicate
    u = arith.addf(x, b.f(1.0))
    d = arith.subf(u, b.f(1.0))
    result = arith.mulf(_log(b, u), arith.divf(x, d))
    result = arith.select(b.cmp(P.OEQ, d, b.f(0.0)), x, result)
    return arith.select(b.cmp(P.OEQ, u, b.f(math.inf)), b.f(math.inf), result)


def _sign_like(b: F32Builder, value, x):
    """copysign(value, x) for value >= 0."""
    return mmath.copysign(value, x)


def tanh_small(b: F32Builder, x):
    """tanh(x) for |x| < TANH_SMALL_BOUND: x + x^3 P(x^2)."""
    x2 = arith.mulf(x, x)
    return mmath.fma(arith.mulf(x2, x), b.horner(x2, TANH_SMALL), x)


def erf_small(b: F32Builder, x):
    """erf(x) for |x| < ERF_SMALL_BOUND: x P(x^2)."""
    return arith.mulf(x, b.horner(arith.mulf(x, x), ERF_SMALL))


TANH_SMALL_BOUND, ERF_SMALL_BOUND = 0.625, 0.875
# math op -> (bound, its polynomial for |x| < bound), as _tanh and _erf select them
SMALL_ARGUMENTS = {"math.tanh": (TANH_SMALL_BOUND, tanh_small),
                   "math.erf": (ERF_SMALL_BOUND, erf_small)}


def _tanh(b: F32Builder, x):
    P = arith.CmpFPredicate
    a = mmath.absf(x)
    e = _exp(b, arith.mulf(a, b.f(2.0)))
    large = arith.subf(b.f(1.0), arith.divf(b.f(2.0), arith.addf(e, b.f(1.0))))
    return arith.select(b.cmp(P.OLT, a, b.f(TANH_SMALL_BOUND)), tanh_small(b, x),
                        _sign_like(b, large, x))


def _erf(b: F32Builder, x):
    P = arith.CmpFPredicate
    a = mmath.absf(x)
    t = arith.mulf(arith.subf(a, b.f(ERFC_MID)), b.f(1.0 / ERFC_HALF))
    mid = arith.subf(b.f(1.0), b.estrin(t, ERFC_POLY))
    mid = arith.select(b.cmp(P.ULT, a, b.f(4.0)), mid, b.f(1.0))  # NaN stays NaN
    return arith.select(b.cmp(P.OLT, a, b.f(ERF_SMALL_BOUND)), erf_small(b, x),
                        _sign_like(b, mid, x))


def _expm1(b: F32Builder, x):
    P = arith.CmpFPredicate
    small = mmath.fma(arith.mulf(x, x), b.horner(x, EXPM1_SMALL), x)
    large = arith.subf(_exp(b, x), b.f(1.0))
    return arith.select(b.cmp(P.OLT, mmath.absf(x), b.f(EXPM1_SMALL_BOUND)), small, large)


def _log_twice(b: F32Builder, a):
    """log(2a) = log(a) + ln2, the inverse hyperbolics of a > LARGE_INVERSE_HYPERBOLIC."""
    return arith.addf(_log(b, a), b.f(math.log(2.0)))


def _asinh(b: F32Builder, x):
    P = arith.CmpFPredicate
    a = mmath.absf(x)
    a2 = arith.mulf(a, a)
    root = arith.addf(b.f(1.0), mmath.sqrt(arith.addf(b.f(1.0), a2)))
    small = _log1p(b, arith.addf(a, arith.divf(a2, root)))
    big = b.cmp(P.OGT, a, b.f(LARGE_INVERSE_HYPERBOLIC))
    return _sign_like(b, arith.select(big, _log_twice(b, a), small), x)


def _acosh(b: F32Builder, x):
    P = arith.CmpFPredicate
    t = arith.subf(x, b.f(1.0))
    small = _log1p(b, arith.addf(t, mmath.sqrt(arith.mulf(t, arith.addf(t, b.f(2.0))))))
    big = b.cmp(P.OGT, x, b.f(LARGE_INVERSE_HYPERBOLIC))
    result = arith.select(big, _log_twice(b, x), small)
    return arith.select(b.cmp(P.ULT, x, b.f(1.0)), b.f(math.nan), result)


def _atanh(b: F32Builder, x):
    a = mmath.absf(x)
    ratio = arith.divf(arith.mulf(a, b.f(2.0)), arith.subf(b.f(1.0), a))
    return _sign_like(b, arith.mulf(_log1p(b, ratio), b.f(0.5)), x)


_IMPLS = {"math.exp": _exp, "math.log": _log, "math.log1p": _log1p, "math.expm1": _expm1,
          "math.tanh": _tanh, "math.erf": _erf, "math.asinh": _asinh, "math.acosh": _acosh,
          "math.atanh": _atanh}


def _element_type(t: ir.Type) -> ir.Type:
    return t.element_type if isinstance(t, ir.VectorType) else t


def expand_math_in(root: ir.Operation, ops=EXPANDED, ldexp: bool = False) -> int:
    """Rewrite every op named in `ops` (default: all of EXPANDED) on f32/f16/bf16
    (scalar or vector) nested in `root` into its polynomial; return the count. `ldexp`:
    scale by powers of two with LLVM's ldexp (for targets where it is one instruction,
    AVX-512)."""
    unknown = set(ops) - set(EXPANDED)
    if unknown:
        raise ValueError(f"expand_math: no expansion of {sorted(unknown)}; known: {list(EXPANDED)}")
    targets = []

    def visit(op):
        if op.name in ops:
            if str(_element_type(op.results[0].type)) in ("f32", "f16", "bf16"):
                targets.append(op)
        return ir.WalkResult.ADVANCE

    root.walk(visit)
    with root.context:
        for op in targets:
            with ir.InsertionPoint(op), op.location:
                value = op.operands[0]
                rtype = op.results[0].type
                b = F32Builder(rtype, ldexp)
                wide = value if str(_element_type(rtype)) == "f32" else arith.extf(b.ftype, value)
                result = _IMPLS[op.name](b, wide)
                if str(_element_type(rtype)) != "f32":
                    result = arith.truncf(rtype, result)
            op.results[0].replace_all_uses_with(result)
            op.erase()
    return len(targets)


class ExpandMathOp(TransformExt.Operation, name="expand_math"):
    target: ext.Operand[transform.AnyOpType]
    ops: ir.ArrayAttr
    ldexp: ir.IntegerAttr  # i1
    transformed: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                names = [ir.StringAttr(a).value for a in ir.ArrayAttr(op.ops)]
                targets = payload_ops(state, op.target)
                try:
                    for name in names:
                        if name not in EXPANDED and targets:
                            raise Illegal(targets[0], f"no expansion of {name} (known: "
                                                      f"{', '.join(EXPANDED)})")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    expand_math_in(target, names, bool(ir.IntegerAttr(op.ldexp).value))
                results.set_ops(op.transformed, targets)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesNestedOps


def expand_math(target: ir.Value, ops=EXPANDED, ldexp: bool = False) -> ir.Value:
    """Expand the math ops named in `ops` nested in `target`; returns the target handle."""
    return ExpandMathOp(target, ir.ArrayAttr.get([ir.StringAttr.get(n) for n in ops]),
                        ir.IntegerAttr.get(ir.IntegerType.get_signless(1), int(ldexp))).transformed


__all__ = ["ExpandMathOp", "expand_math", "expand_math_in", "EXPANDED", "SMALL_ARGUMENTS", "erf_small",
           "tanh_small"]
