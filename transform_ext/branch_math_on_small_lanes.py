"""branch_math_on_small_lanes: erf (tanh) of a vector whose lanes all lie in the range of
its small-argument polynomial runs only that polynomial.

    y = math.erf(x)   ->   y = scf.if (every lane |x| < 0.875) { x P(x^2) }
                                  else                         { math.erf(x) }

transform_ext.expand_math computes erf as a select between x P(x^2) (|x| < 0.875) and
1 - Q(|x|) (Q a degree-15 polynomial of erfc) over every lane, and tanh between
x + x^3 P(x^2) (|x| < 0.625) and an exp and a division; the then branch is the same small
polynomial (expand_math.SMALL_ARGUMENTS), so each lane gets the value it gets either way.
A GELU of inputs in [0, 1) (x / sqrt(2) < 0.71) then skips the long polynomial on every
vector; a vector with a lane past the bound pays an absolute value, a compare, an
and-reduction and a branch. f16 / bf16 vectors are widened to f32 and rounded back, as
expand_math does. Vectors computed from a masked or possibly out-of-bounds read are left
alone (branch_math_on_constant_lanes.read_lanes_defined: a reduction over poison lanes is
undefined). The targets are only read; the math ops nested in them are rewritten in place.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform
from torch_mlir.dialects import math as mmath

from .branch_math_on_constant_lanes import all_lanes, read_lanes_defined, run_unless
from .common import RewritesTargets, Success, payload_ops, walk_ops
from .dialect import TransformExt
from .exp_expansion import F32Builder
from .expand_math import SMALL_ARGUMENTS

FLOATS = ("f32", "f16", "bf16")


def _candidate(op: ir.Operation) -> bool:
    if op.name not in SMALL_ARGUMENTS or len(op.operands) != 1 or len(op.results) != 1:
        return False
    t = op.results[0].type
    return isinstance(t, ir.VectorType) and str(t.element_type) in FLOATS


def _branch(op: ir.Operation) -> None:
    bound, small = SMALL_ARGUMENTS[op.name]
    x = op.operands[0]
    vtype = ir.VectorType(op.results[0].type)
    narrow = str(vtype.element_type) != "f32"
    with ir.InsertionPoint(op), op.location:
        b = F32Builder(vtype)
        wide = arith.extf(b.ftype, x) if narrow else x
        inside = arith.CmpFOp(arith.CmpFPredicate.OLT, mmath.absf(wide), b.f(bound)).result

    def on_small():
        value = small(F32Builder(vtype), wide)
        return arith.truncf(vtype, value) if narrow else value

    run_unless(op, all_lanes(inside, True, op), on_small)


class BranchMathOnSmallLanesOp(TransformExt.Operation, name="branch_math_on_small_lanes"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = [inner for target in payload_ops(state, op.target)
                         for inner in walk_ops(target, _candidate)
                         if read_lanes_defined(inner.operands[0])]
                for inner in found:
                    _branch(inner)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def branch_math_on_small_lanes(target: ir.Value) -> None:
    """Branch each vector erf / tanh nested in `target` on its lanes all being small
    (module docstring)."""
    BranchMathOnSmallLanesOp(target)


__all__ = ["BranchMathOnSmallLanesOp", "branch_math_on_small_lanes"]
