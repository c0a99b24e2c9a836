"""The body of a pooling: y = combine(y, f(x)), f a chain of single-operand arith ops on the
input (an extf), combine a max, min or sum of that and the accumulator.
"""

import math
from dataclasses import dataclass

from torch_mlir import ir

EXTREMA = ("arith.maximumf", "arith.minimumf", "arith.maxnumf", "arith.minnumf",
           "arith.maxsi", "arith.minsi", "arith.maxui", "arith.minui")
SUMS = ("arith.addf", "arith.addi")


@dataclass
class PoolingBody:
    convert: list[ir.Operation]   # f: the body's ops on the input
    combine: ir.Operation
    input_first: bool             # combine(f(x), acc) rather than combine(acc, f(x))


def pooling_body(op: ir.Operation, combines=EXTREMA) -> PoolingBody | None:
    """The body of linalg op `op` as f(x) then one of `combines` with the accumulator, the
    inputs after the first unread; None for any other body."""
    body = op.regions[0].blocks[0]
    x, acc = body.arguments[0], body.arguments[len(op.operands) - 1]
    ops = list(body.operations)
    if len(ops) < 2 or ops[-2].name not in combines or ops[-1].operands[0] != ops[-2].results[0]:
        return None
    value = x
    for inner in ops[:-2]:
        if not inner.name.startswith("arith.") or len(inner.operands) != 1 or len(inner.results) != 1 \
                or inner.regions or inner.operands[0] != value:
            return None
        value = inner.results[0]
    combine = ops[-2]
    operands = list(combine.operands)
    if operands == [value, acc]:
        input_first = True
    elif operands == [acc, value]:
        input_first = False
    else:
        return None
    if any(len(list(body.arguments[i].uses)) for i in range(1, len(op.operands) - 1)):
        return None
    return PoolingBody(ops[:-2], combine, input_first)


def identity_attr(combine: ir.Operation) -> ir.Attribute:
    """The constant c with combine(c, v) = v for every v combine meets: -0.0 for addf (0.0 +
    -0.0 is +0.0), -inf / +inf for the float max / min (maxnumf's NaN identity gives the same
    results: a NaN is dropped either way), the extremes of the integer type."""
    t = combine.results[0].type
    name = combine.name
    if isinstance(t, ir.IntegerType):
        width = ir.IntegerType(t).width
        value = {"arith.addi": 0, "arith.maxsi": -(1 << (width - 1)), "arith.minsi": (1 << (width - 1)) - 1,
                 "arith.maxui": 0, "arith.minui": -1}[name]
        return ir.IntegerAttr.get(t, value)
    value = {"arith.addf": -0.0, "arith.maximumf": -math.inf, "arith.maxnumf": -math.inf,
             "arith.minimumf": math.inf, "arith.minnumf": math.inf}[name]
    return ir.FloatAttr.get(t, value)


def is_identity(combine: ir.Operation, attr) -> bool:
    """Is the constant `attr` (a float or integer attribute, or None) `identity_attr(combine)`:
    the same float with the same sign, or the same integer bits?"""
    if not isinstance(attr, (ir.FloatAttr, ir.IntegerAttr)):
        return False
    want = identity_attr(combine)
    if isinstance(attr, ir.FloatAttr) != isinstance(want, ir.FloatAttr):
        return False
    if isinstance(attr, ir.FloatAttr):
        return attr.value == want.value and math.copysign(1.0, attr.value) == math.copysign(1.0, want.value)
    mask = (1 << ir.IntegerType(attr.type).width) - 1
    return attr.value & mask == want.value & mask


__all__ = ["EXTREMA", "SUMS", "PoolingBody", "identity_attr", "is_identity", "pooling_body"]
