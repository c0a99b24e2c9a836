"""The one f32 exp expansion (arith and math.fma on a scalar or a vector) and the f32
builder it shares with transform_ext/expand_math.py's log, tanh and erf.

    xc = clamp(x, LOW, 88.75)                        (NaN stays NaN)
    s  = fma(xc, log2 e, 1.5 2^23),  k = s - 1.5 2^23  (k = round-to-even(xc log2 e), one
                                                      rounding, no float-int conversion)
    r  = xc - k ln2_hi - k ln2_lo                      (|r| <= ln2 / 2, fma; ln2_hi k exact)
    e^r = 1 + r P(r),  P of degree 5 fitted by tools/fit_math_polynomials.py (EXP_POLY),
                       2.1e-9 relative: the f32 roundings dominate
    e^x = e^r 2^k, k read from the low bits of s (bits(s) = bits(1.5 2^23) + k)

Only the scaling by 2^k differs, by `subnormals`:
- True (every math.exp of the CPU target): LOW = -104 (k >= -150); 2^k is applied as
  2^(k >> 1) 2^(k - (k >> 1)), both normal powers of two, so a denormal result is rounded
  once and 0 is reached only below half the smallest denormal; or by one `llvm.ldexp`
  (`ldexp=True`: one vscalefps on AVX-512).
- False (the exps of non-positive log-softmax arguments, transform_ext.expand_fast_exp):
  LOW = -87.5 (k >= -126) and e^x = (2 + r 2P(r)) 2^(k - 1), 2^(k - 1) built by shifting
  bits(s) into the exponent field: (bits(s) << 23) + (126 << 23) is the bit pattern of
  2^(k - 1) for k in [-125, 128] and of +0.0 for k = -126. Results below 2^-125.5
  (1.7e-38, x < -86.99) are 0 (no denormals, no compare and select needed). The last
  product is written fma(p, 2^(k - 1), -0.0), the same value (y + -0.0 = y for every y;
  LLVM makes it one multiply): an arith.mulf there, summed by the reduction that reads the
  exp, would be made a vector.contract by the vectorizer's reduction-to-contract patterns,
  which the CPU lowering scalarizes lane by lane.

Both: +inf past ln(FLT_MAX) = 88.7228 (the last product overflows, rounded once), NaN for
NaN (p is NaN, whatever scale the integer steps make of the NaN bits),
e^-inf = 0, e^-0 = 1. Error: about one ulp on normal results (tests/lighthouse/
test_math_approx.py, tests/transform_ext/test_expand_fast_exp.py measure it).

`short` (softmax weights: exps of non-positive numbers summed with a 1) spends two fmas
less: r = xc - k ln2 with one constant (ln2 rounded to f32: an error of |k| 1.9e-9 in r)
and e^r = 1 + r P(r) with P of degree 4 (EXP_POLY_SHORT, 9.7e-8 relative). Within 2.5 ulp
for x in [-20, 0], 6 ulp on the rest. The exp pass of the CPU attention's key loop is bound
by its fmas (the micro-kernels around it fill both fma pipes): 9 per vector, 7 with `short`.
"""

from __future__ import annotations

import math
import struct

from torch_mlir import ir
from torch_mlir.dialects import arith
from torch_mlir.dialects import math as mmath

LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693145751953125, 1.428606765330187e-06  # ln2_hi: 16 significant bits
# e^r ~ 1 + r P(r) on |r| <= 0.35, max relative error 2.1e-9 (tools/fit_math_polynomials.py)
EXP_POLY = (1.000000034057553, 0.4999999385672862, 0.16666421995924127, 0.041668056015238875,
            0.008374955984056773, 0.0013842721967858374)
# e^r ~ 1 + r P(r) on |r| <= 0.35, P of degree 4, max relative error 9.7e-8 (the same tool)
EXP_POLY_SHORT = (0.9999996894523011, 0.4999911565246342, 0.1666767495445877,
                  0.0419025048321964, 0.00828946775276217)
LN2 = 0.6931471805599453  # the `short` reduction's one constant (rounded to f32 when emitted)
ROUNDER = 1.5 * 2.0 ** 23  # s = t + ROUNDER rounds t to the integer held in s's low bits
HIGH = 88.75               # e^HIGH overflows; k <= 128
LOW_SUBNORMAL = -104.0     # e^LOW rounds to 0; k >= -150, both halves of k >= -75
LOW_FLUSH = -87.5          # k >= -126, the scale 2^(k-1) of k = -126 is +0.0


class F32Builder:
    """Emits f32 (and i32) arith over the shape of `like` (a scalar or a vector type), with
    one splat constant per value, at the current insertion point and location."""

    def __init__(self, like: ir.Type, ldexp: bool = False):
        self.ldexp = ldexp
        self.f32 = ir.F32Type.get()
        self.i32 = ir.IntegerType.get_signless(32)
        self.shape = list(like.shape) if isinstance(like, ir.VectorType) else None
        self.ftype = self._typed(self.f32)
        self.itype = self._typed(self.i32)
        self._consts: dict = {}

    def _typed(self, elem):
        return ir.VectorType.get(self.shape, elem) if self.shape is not None else elem

    def f(self, value: float):
        key = ("f", float(value))
        if key not in self._consts:
            attr = ir.FloatAttr.get(self.f32, value)
            if self.shape is not None:
                attr = ir.DenseElementsAttr.get_splat(self.ftype, attr)
            self._consts[key] = arith.constant(self.ftype, attr)
        return self._consts[key]

    def i(self, value: int):
        key = ("i", int(value))
        if key not in self._consts:
            attr = ir.IntegerAttr.get(self.i32, value)
            if self.shape is not None:
                attr = ir.DenseElementsAttr.get_splat(self.itype, attr)
            self._consts[key] = arith.constant(self.itype, attr)
        return self._consts[key]

    def horner(self, x, coefs):
        """sum_j coefs[j] x^j by a chain of fmas (the most accurate order)."""
        acc = self.f(coefs[-1])
        for c in reversed(coefs[:-1]):
            acc = mmath.fma(acc, x, self.f(c))
        return acc

    def estrin(self, x, coefs):
        """sum_j coefs[j] x^j by Estrin's scheme: pairs c_2i + c_2i+1 x by fma, then pairs of
        those joined by x^2, x^4, ... (depth 1 + log2 of the terms, where Horner's fma chain
        is as deep as the degree: for erf's degree 15, the latency that bounded a GELU loop;
        short polynomials keep Horner's order, as fast there and more accurate)."""
        terms = [mmath.fma(self.f(coefs[i + 1]), x, self.f(coefs[i])) if i + 1 < len(coefs)
                 else self.f(coefs[i]) for i in range(0, len(coefs), 2)]
        power = x
        while len(terms) > 1:
            power = arith.mulf(power, power)
            terms = [mmath.fma(terms[i + 1], power, terms[i]) if i + 1 < len(terms) else terms[i]
                     for i in range(0, len(terms), 2)]
        return terms[0]

    def cmp(self, pred, a, b):
        return arith.cmpf(pred, a, b)

    def pow2(self, k):
        """2^k as f32 for an i32 k in [-126, 127]."""
        return arith.bitcast(self.ftype, arith.shli(arith.addi(k, self.i(127)), self.i(23)))

    def ldexp_call(self, p, k):
        """p * 2^k by llvm.ldexp (k i32), one call over the flattened vector."""
        from torch_mlir.dialects import llvm, vector

        if self.shape is None:
            return llvm.call_intrinsic(self.f32, "llvm.ldexp.f32.i32", [p, k], [], [])
        n = math.prod(self.shape)
        flat_f = ir.VectorType.get([n], self.f32)
        flat_i = ir.VectorType.get([n], self.i32)
        r = llvm.call_intrinsic(flat_f, f"llvm.ldexp.v{n}f32.v{n}i32",
                                [vector.shape_cast(flat_f, p), vector.shape_cast(flat_i, k)], [], [])
        return vector.shape_cast(self.ftype, r)


def _bits(value: float) -> int:
    """The bit pattern of f32 `value` as a signed i32."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def exp(b: F32Builder, x, *, subnormals: bool = True, short: bool = False):
    """e^x for an f32 scalar or vector `x` of `b`'s shape (see the module docstring)."""
    low = LOW_SUBNORMAL if subnormals else LOW_FLUSH
    xc = arith.minimumf(arith.maximumf(x, b.f(low)), b.f(HIGH))
    s = mmath.fma(xc, b.f(LOG2E), b.f(ROUNDER))
    k = arith.subf(s, b.f(ROUNDER))
    if short:
        r = mmath.fma(k, b.f(-LN2), xc)
    else:
        r = mmath.fma(k, b.f(-LN2_HI), xc)
        r = mmath.fma(k, b.f(-LN2_LO), r)
    poly = EXP_POLY_SHORT if short else EXP_POLY
    if not subnormals:  # (2 + r 2P(r)) 2^(k-1): doubling the coefficients is exact
        p = mmath.fma(r, b.horner(r, [2.0 * c for c in poly]), b.f(2.0))
        k_bits = arith.shli(arith.bitcast(b.itype, s), b.i(23))
        scale = arith.bitcast(b.ftype, arith.addi(k_bits, b.i(126 << 23)))
        return mmath.fma(p, scale, b.f(-0.0))  # p scale exactly: see the module docstring
    p = mmath.fma(r, b.horner(r, poly), b.f(1.0))
    ki = arith.subi(arith.bitcast(b.itype, s), b.i(_bits(ROUNDER)))
    if b.ldexp:
        return b.ldexp_call(p, ki)
    k1 = arith.shrsi(ki, b.i(1))
    k2 = arith.subi(ki, k1)
    return arith.mulf(arith.mulf(p, b.pow2(k1)), b.pow2(k2))


__all__ = ["EXP_POLY", "EXP_POLY_SHORT", "F32Builder", "LN2_HI", "LN2_LO", "exp"]
