"""expand_integer_powers: `math.fpowi x, n` as multiplications (x ** 2, x.pow(3), ...).

torch-mlir imports a float tensor raised to a Python integer as `math.fpowi %x, %n` with an
i64 exponent. LLVM's powi wants a scalar i32 exponent, so a vectorized fpowi fails to
lower; and powi is a libm-style call per lane anyway. With n a constant:
  n = 0: 1 (also for NaN and inf, as torch);  n = 1: x;
  n > 1: binary powering, x^n = prod over the set bits b of n of x^(2^b), the squares
         x^(2^b) = x^(2^(b-1)) * x^(2^(b-1)); n = 2 is x * x and n = 3 is (x * x) * x,
         bitwise what torch's CPU kernel computes for those exponents;
  n < 0: 1 / x^|n| (n = -1: 1 / x and n = -2: 1 / (x * x), again torch's own formulas).
An f16/bf16 x is raised in f32 and rounded once, as torch's kernels do, except bf16 with
n = 3 or -2, where torch multiplies in bf16, rounding each product (so does this: the
rounding is an explicit truncf/extf pair, which compute_elementwise_in_f32 keeps).
Other exponents go through a few roundings (one per multiply), like torch's std::pow
within a few ulp. A non-constant exponent, or one beyond +-64 (a long chain), becomes
`math.powf(x, sitofp(n))` (libm's pow is exact for integral exponents and takes negative
bases).

Targets: every `math.fpowi` nested in the target ops; any fpowi can be rewritten. The
target handle is only read; the fpowi ops are replaced in place.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform
from torch_mlir.dialects import math as mmath

from .common import RewritesTargets, Success, constant_value, payload_ops, walk_ops
from .dialect import TransformExt

MAX_UNROLLED = 64


def constant_exponent(op: ir.Operation) -> int | None:
    attr = constant_value(op.operands[1])
    return ir.IntegerAttr(attr).value if isinstance(attr, ir.IntegerAttr) else None


def _one(like: ir.Type) -> ir.Value:
    if isinstance(like, ir.VectorType):
        element = ir.FloatAttr.get(like.element_type, 1.0)
        return arith.constant(like, ir.DenseElementsAttr.get_splat(like, element))
    return arith.constant(like, ir.FloatAttr.get(like, 1.0))


def _power(x: ir.Value, n: int) -> ir.Value:
    """x^n for n >= 1 by binary powering (see the module docstring)."""
    result, square = None, x
    while True:
        if n & 1:
            result = square if result is None else arith.mulf(result, square)
        n >>= 1
        if not n:
            return result
        square = arith.mulf(square, square)


def _expand(op: ir.Operation) -> ir.Value:
    x, exponent = op.operands
    n = constant_exponent(op)
    if n is None or abs(n) > MAX_UNROLLED:
        ftype = x.type
        if isinstance(exponent.type, ir.VectorType):
            ftype = ir.VectorType.get(ir.VectorType(exponent.type).shape,
                                      ir.VectorType(x.type).element_type)
        return mmath.powf(x, arith.sitofp(ftype, exponent))
    if n == 0:
        return _one(x.type)
    narrow = x.type.element_type if isinstance(x.type, ir.VectorType) else x.type
    if not isinstance(narrow, (ir.F16Type, ir.BF16Type)):
        return _integral_power(x, n)
    wide = ir.F32Type.get()
    if isinstance(x.type, ir.VectorType):
        wide = ir.VectorType.get(ir.VectorType(x.type).shape, wide)
    xw = arith.extf(wide, x)
    if isinstance(narrow, ir.BF16Type) and n in (3, -2):
        square = arith.extf(wide, arith.truncf(x.type, arith.mulf(xw, xw)))
        power = arith.mulf(xw, square) if n == 3 else arith.divf(_one(wide), square)
    else:
        power = _integral_power(xw, n)
    return arith.truncf(x.type, power)


def _integral_power(x: ir.Value, n: int) -> ir.Value:
    power = _power(x, abs(n))
    return power if n > 0 else arith.divf(_one(x.type), power)


class ExpandIntegerPowersOp(TransformExt.Operation, name="expand_integer_powers"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                found = [p for t in targets for p in walk_ops(t, lambda o: o.name == "math.fpowi")]
                for p in found:
                    with ir.InsertionPoint(p), p.location:
                        value = _expand(p)
                    rewriter.replace_op(p, [value])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def expand_integer_powers(target: ir.Value) -> ExpandIntegerPowersOp:
    """Rewrite the `math.fpowi` ops nested in `target` (see the module docstring)."""
    return ExpandIntegerPowersOp(target)


__all__ = ["ExpandIntegerPowersOp", "expand_integer_powers", "MAX_UNROLLED"]
