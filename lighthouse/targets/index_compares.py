"""Lane-index compares in 32-bit lanes.

A one-hot mask compares each lane's class index with a row's target:

    %t = vector.broadcast %y : index to vector<64xindex>
    %c = arith.addi (vector.broadcast %j : index to vector<64xindex>), dense<[0, 1, .., 63]>
    %m = arith.cmpi ne, %t, %c : vector<64xindex>

On 64-bit lanes that is, per 64 lanes, 8 compares of 8 lanes, 8 ors forming the lane
indices and 7 mask merges: 23 of the ~130 ops a bf16 cross-entropy backward's gradient
sweep spent per 64 classes. `narrow_iota_compares` compares the scalar difference instead:
y == j + c exactly when d = y - j (wrapping) equals c, and for constants c that fit in 32
bits that is trunc32(d) == c32 where d fits in 32 bits:

    %d = arith.subi %y, %j : index        %fits = (sext(trunc32(d)) == d)
    %m = arith.cmpi ne, (vector.broadcast trunc32(d)), dense<[0, 1, .., 63] : i32>
         or not %fits  (eq: and %fits)

one compare per 16 lanes. Exact for eq and ne on index or i64 lanes, whatever the values.
Both sides may be reached through vector.shape_cast; the scalar side is a broadcast of a
scalar, the other a broadcast scalar plus a dense integer constant whose values fit in 32
bits, or such a constant alone (a remainder tile's lane indices: j = 0).
"""

from __future__ import annotations

import math

import numpy as np
from torch_mlir import ir
from torch_mlir.dialects import arith, vector

from transform_ext.common import defining_op

_WIDE = ("index", "i64")


def _through_casts(value: ir.Value) -> ir.Value:
    op = defining_op(value)
    while op is not None and op.name == "vector.shape_cast":
        value = op.operands[0]
        op = defining_op(value)
    return value


def _broadcast_scalar(value: ir.Value) -> ir.Value | None:
    """The scalar `value` broadcasts (through shape casts), or None."""
    op = defining_op(_through_casts(value))
    if op is None or op.name != "vector.broadcast" or isinstance(op.operands[0].type, ir.VectorType):
        return None
    return op.operands[0]


def _constant_ints(value: ir.Value) -> list[int] | None:
    op = defining_op(value)
    if op is None or op.name != "arith.constant":
        return None
    attr = op.attributes["value"]
    if not isinstance(attr, ir.DenseIntElementsAttr):
        return None
    attr = ir.DenseIntElementsAttr(attr)
    if attr.is_splat:
        count = math.prod(ir.VectorType(value.type).shape)
        return [int(ir.IntegerAttr(attr.get_splat_value()).value)] * count
    return [int(v) for v in attr]


def _fits_32_bits(values: list[int] | None) -> bool:
    return values is not None and all(-2**31 <= v < 2**31 for v in values)


def _iota_plus(value: ir.Value) -> tuple[ir.Value | None, ir.Value] | None:
    """(scalar j, constant vector c) when `value` is broadcast(j) + c (either order), or
    (None, c) when it is the constant c itself (j = 0: a remainder tile's lane indices)."""
    if _fits_32_bits(_constant_ints(_through_casts(value))):
        return None, _through_casts(value)
    op = defining_op(_through_casts(value))
    if op is None or op.name != "arith.addi":
        return None
    for a, b in (op.operands, reversed(list(op.operands))):
        j = _broadcast_scalar(a)
        c = _constant_ints(b)
        if j is not None and _fits_32_bits(c):
            return j, b
    return None


def _candidate(op: ir.Operation):
    if op.name != "arith.cmpi" or not isinstance(op.operands[0].type, ir.VectorType):
        return None
    predicate = ir.IntegerAttr(op.attributes["predicate"]).value
    if predicate not in (arith.CmpIPredicate.eq, arith.CmpIPredicate.ne):
        return None
    if str(ir.VectorType(op.operands[0].type).element_type) not in _WIDE:
        return None
    a, b = op.operands
    for scalar_side, iota_side in ((a, b), (b, a)):
        y = _broadcast_scalar(scalar_side)
        iota = _iota_plus(iota_side)
        if y is not None and iota is not None and (iota[0] is None or y.type == iota[0].type):
            return predicate, y, iota[0], iota[1]
    return None


def narrow_iota_compares(payload: ir.Module) -> int:
    """Rewrite every eq / ne compare of a broadcast scalar with broadcast(j) + c on index or
    i64 lanes into one on i32 lanes (module docstring). Returns the number rewritten."""
    found = []

    def visit(op):
        match = _candidate(op)
        if match is not None:
            found.append((op, match))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        i32 = ir.IntegerType.get_signless(32)
        for op, (predicate, y, j, constant) in found:
            shape = ir.VectorType(op.operands[0].type).shape
            lanes32 = ir.VectorType.get(shape, i32)
            bools = ir.VectorType.get(shape, ir.IntegerType.get_signless(1))
            with ir.InsertionPoint(op), op.location:
                d = y if j is None else arith.subi(y, j)
                if isinstance(d.type, ir.IndexType):
                    d32 = arith.index_cast(i32, d)
                    back = arith.index_cast(d.type, d32)
                else:
                    d32 = arith.trunci(i32, d)
                    back = arith.extsi(d.type, d32)
                fits = arith.cmpi(arith.CmpIPredicate.eq, back, d)
                c32 = arith.constant(lanes32, ir.DenseElementsAttr.get(
                    np.array(_constant_ints(constant), dtype=np.int32).reshape(shape),
                    type=lanes32))
                lanes = arith.cmpi(predicate, vector.broadcast(lanes32, d32), c32)
                if predicate == arith.CmpIPredicate.eq:
                    value = arith.andi(lanes, vector.broadcast(bools, fits))
                else:
                    outside = arith.xori(fits, arith.constant(ir.IntegerType.get_signless(1), 1))
                    value = arith.ori(lanes, vector.broadcast(bools, outside))
            op.results[0].replace_all_uses_with(value)
            op.erase()
    return len(found)
