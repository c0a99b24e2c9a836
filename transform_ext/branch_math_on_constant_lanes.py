"""branch_math_on_constant_lanes: a costly math op on a vector whose lanes may all be one
constant runs only when some lane is not.

    a = select(m, c, x)        y = scf.if (all lanes of m)      { f(c) }
    y = f(a)              ->                                     else { f(a) }

with f a math op of one operand that expands into a long sequence (exp, log, tanh, erf, the
trigonometric and hyperbolic functions: `COSTLY`) and c a splat constant. The same for
c on the false side (branch on "no lane of m") and for a = min/max(x, c), whose lanes
are all c when every x is >= c (minimumf: `oge`, NaN lanes are not c; minnumf: `uge`, a
NaN x gives c) or <= c (maximumf / maxnumf; a -0.0 lane against c = +0.0 counts as c, so
f's result may differ in the sign of a zero, as the schedules' `nsz` extrema may anyway).
ELU and SELU are imported as max(x, 0) + alpha (exp(min(x, 0)) - 1): on a vector of
non-negative x the exp is exp(0) = 1 in every lane and is skipped (PyTorch's own kernel
branches the same way); a vector with a lane below 0 pays one and-reduction of the mask
and a branch.

f(c) is the same op on the splat constant (folded by canonicalization where MLIR folds
it, else expanded with the other math ops and folded by LLVM), so both branches give the
value f gives for the lane. Only f moves into the else branch; a and its other users stay.
Scalar operands (no lanes to branch on) are left alone, and so are vectors computed from
a masked or possibly out-of-bounds read (`read_lanes_defined`): their padding lanes are
poison, and a branch on a reduction over poison is undefined in LLVM. The targets
(functions, loops) are only read; ops nested in them are rewritten in place.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, scf, transform, vector

from .common import (RewritesTargets, Success, all_in_bounds, constant_value, defining_op,
                     payload_ops, walk_ops)
from .dialect import TransformExt

NAME = "branch_math_on_constant_lanes"
COSTLY = frozenset(f"math.{n}" for n in (
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "tanh", "erf", "erfc", "sin",
    "cos", "tan", "atan", "asin", "acos", "sinh", "cosh", "asinh", "acosh", "atanh"))
# a = min/max(x, c) is c in every lane where cmpf(pred, x, c) holds
EXTREMUM_PREDICATE = {
    "arith.minimumf": arith.CmpFPredicate.OGE,
    "arith.minnumf": arith.CmpFPredicate.UGE,
    "arith.maximumf": arith.CmpFPredicate.OLE,
    "arith.maxnumf": arith.CmpFPredicate.ULE,
}


def _splat(value: ir.Value) -> bool:
    return isinstance(constant_value(value), ir.FloatAttr)


def constant_lanes(a: ir.Value):
    """(c, mask, when) for an operand `a` whose lanes are all the splat constant c exactly
    when every lane of `mask` is `when`; None when `a` is no such select or min/max."""
    producer = defining_op(a)
    if producer is None:
        return None
    if producer.name == "arith.select":
        m, t, f = producer.operands
        if not isinstance(m.type, ir.VectorType):
            return None
        if _splat(t) and not _splat(f):
            return t, m, True
        if _splat(f) and not _splat(t):
            return f, m, False
        return None
    if producer.name in EXTREMUM_PREDICATE:
        x, c = producer.operands
        if _splat(x) and not _splat(c):
            x, c = c, x
        if not _splat(c) or _splat(x):
            return None
        return c, (producer, x, c), True
    return None


def _mask(producer_x_c) -> ir.Value:
    producer, x, c = producer_x_c
    with ir.InsertionPoint(producer), producer.location:
        return arith.CmpFOp(EXTREMUM_PREDICATE[producer.name], x, c).result


def all_lanes(mask: ir.Value, when: bool, at: ir.Operation) -> ir.Value:
    """i1: every lane of `mask` is `when` (an and- or a negated or-reduction)."""
    with ir.InsertionPoint(at), at.location:
        flat = mask
        shape = ir.VectorType(mask.type).shape
        if len(shape) != 1:
            n = 1
            for d in shape:
                n *= d
            flat = vector.shape_cast(ir.VectorType.get([n], ir.IntegerType.get_signless(1)), mask)
        kind = vector.CombiningKind.AND if when else vector.CombiningKind.OR
        reduced = vector.ReductionOp(ir.IntegerType.get_signless(1), kind, flat).result
        if when:
            return reduced
        true = arith.ConstantOp(ir.IntegerType.get_signless(1), 1).result
        return arith.XOrIOp(reduced, true).result


def branch(op: ir.Operation, found) -> None:
    """Put `op` under the scf.if of the module docstring."""
    c, mask, when = found
    if isinstance(mask, tuple):
        mask = _mask(mask)

    def on_constant():
        clone = op.clone()
        clone.operands[0] = c
        return clone.results[0]

    run_unless(op, all_lanes(mask, when, op), on_constant)


def run_unless(op: ir.Operation, condition: ir.Value, instead) -> None:
    """Move `op` (one result) into the else branch of an scf.if on `condition`, whose then
    branch yields `instead()` (built there); the if's result replaces op's."""
    result = op.results[0]
    with ir.InsertionPoint(op), op.location:
        guard = scf.IfOp(condition, [result.type], has_else=True)
    with ir.InsertionPoint(guard.then_block), op.location:
        scf.YieldOp([instead()])
    result.replace_all_uses_with(guard.results[0])
    with ir.InsertionPoint(guard.else_block), op.location:
        yield_op = scf.YieldOp([result])
    op.move_before(yield_op)


def read_lanes_defined(value: ir.Value, limit: int = 256) -> bool:
    """Whether every lane of `value` is defined: no masked read (vector.mask,
    vector.maskedload, a transfer_read not in bounds in every dim) among the ops of
    `value`'s block it is computed from (at most `limit` of them, else False)."""
    block = value.owner if isinstance(value, ir.BlockArgument) else None
    seen, stack = set(), [value]
    while stack:
        producer = defining_op(stack.pop())
        if producer is None or producer in seen:
            continue
        if block is None:
            block = producer.block
        if producer.block != block:
            continue
        seen.add(producer)
        if len(seen) > limit:
            return False
        if producer.name in ("vector.mask", "vector.maskedload") or (
                producer.name == "vector.transfer_read" and not all_in_bounds(producer)):
            return False
        stack.extend(producer.operands)
    return True


def _candidate(op: ir.Operation) -> bool:
    return (op.name in COSTLY and len(op.operands) == 1 and len(op.results) == 1
            and isinstance(op.results[0].type, ir.VectorType))


class BranchMathOnConstantLanesOp(TransformExt.Operation, name=NAME):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                plan = []
                for target in payload_ops(state, op.target):
                    for inner in walk_ops(target, _candidate):
                        found = constant_lanes(inner.operands[0])
                        if found is not None and read_lanes_defined(inner.operands[0]):
                            plan.append((inner, found))
                for inner, found in plan:
                    branch(inner, found)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def branch_math_on_constant_lanes(target: ir.Value) -> None:
    """Branch each costly math op nested in `target` whose operand's lanes may all be one
    constant (module docstring)."""
    BranchMathOnConstantLanesOp(target)


__all__ = ["BranchMathOnConstantLanesOp", "COSTLY", "all_lanes", "branch_math_on_constant_lanes",
           "constant_lanes", "read_lanes_defined", "run_unless"]
