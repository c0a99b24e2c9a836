"""narrow_contracts_for_dpas: every vector.contract gets f16/bf16 multiplicands with its f32
accumulator (the DPAS form f16 x f16 -> f32, bf16 x bf16 -> f32).

A multiplicand that is `arith.extf` of an f16/bf16 vector, possibly transposed (2-D
vector.transpose), is replaced by that vector, transposed the same way: exact, the
contraction promotes its multiplicands itself. Splat constant factors on the way are pulled
out of the contraction too,
    contract(extf(a) * c1, transpose(extf(b) * c2), acc)
        = contract(a, transpose(b), 0) * (c1 c2) + acc
(SDPA's scale, applied to Q and K; acc its additive mask): exact algebra, the product is
scaled in f32 instead of rounding a * c1 to f16 (with a zero splat accumulator the
addition is left out and the accumulator kept). A multiplicand computed in f32 (the
softmax probabilities P in P @ V) is truncated to the other multiplicand's f16/bf16 type,
the precision flash attention kernels use for P: this CHANGES the result by the rounding
of P (relative 2^-11 per element for f16, 2^-8 for bf16). Transposes, factors and
truncations are built before the contraction; the scaling after it, and the contraction's
other users read the scaled value.

Legal for a contraction when: its accumulator is an f32 vector; at least one multiplicand
is f16/bf16 or extf of f16/bf16 through transposes and splat factors (an f32 x f32
contraction has no DPAS form).

Rewritten: every vector.contract nested in (or equal to) the targets, one after the other;
any illegal one is a silenceable failure naming it (nothing rewritten). Contractions are
updated in place (handles to them stay valid); the target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform, vector

from .common import (Illegal, RewritesTargets, Success, constant_value, defining_op, fail,
                     ops_named, payload_ops)
from .dialect import TransformExt

NAME = "transform_ext.narrow_contracts_for_dpas"
DPAS_TYPES = ("f16", "bf16")


def _element(value: ir.Value) -> str:
    return str(ir.VectorType(value.type).element_type)


def _float_splat(value: ir.Value):
    """The FloatAttr a dense splat arith.constant vector holds, else None."""
    owner = defining_op(value)
    if owner is None or owner.name != "arith.constant":
        return None
    splat = constant_value(value)
    return splat if isinstance(splat, ir.FloatAttr) else None


def narrow_source(value: ir.Value):
    """(source, transposed, scale) with value = [transpose](extf(source) [* scale]) and
    source f16/bf16 (transposes and splat factors in any order); (None, False, 1.0)
    otherwise."""
    transposed, scale, current = False, 1.0, value
    while True:
        owner = defining_op(current)
        if owner is None:
            break
        if owner.name == "vector.transpose" and ir.VectorType(current.type).rank == 2:
            transposed, current = not transposed, owner.operands[0]
            continue
        if owner.name == "arith.mulf":
            factors = [(_float_splat(owner.operands[b]), owner.operands[a])
                       for a, b in ((0, 1), (1, 0))]
            factors = [(f, v) for f, v in factors if f is not None]
            if factors:
                scale *= factors[0][0].value
                current = factors[0][1]
                continue
        break
    if _element(current) in DPAS_TYPES:
        return current, transposed, scale
    owner = defining_op(current)
    if owner is not None and owner.name == "arith.extf":
        source = owner.operands[0]
        if _element(source) in DPAS_TYPES:
            return source, transposed, scale
    return None, False, 1.0


def check_contract(op: ir.Operation) -> None:
    """Raise Illegal when the contraction `op` has no DPAS form."""
    acc = op.operands[2].type
    if not isinstance(acc, ir.VectorType) or str(acc.element_type) != "f32":
        raise Illegal(op, f"it accumulates in {acc}; DPAS accumulates in f32")
    if all(narrow_source(op.operands[i])[0] is None for i in (0, 1)):
        raise Illegal(op, f"a contraction of two {_element(op.operands[1])} multiplicands has no "
                          "DPAS form (DPAS multiplies f16 or bf16)")


def _transpose(value: ir.Value) -> ir.Value:
    t = ir.VectorType(value.type)
    swapped = ir.VectorType.get(list(t.shape)[::-1], t.element_type)
    return vector.TransposeOp(swapped, value, [1, 0]).result


def narrow(op: ir.Operation) -> None:
    """Rewrite the legal contraction `op` (see the module docstring)."""
    splat = _float_splat(op.operands[2])
    zero_acc = splat is not None and splat.value == 0.0
    narrow_types, computed, scale = {}, [], 1.0
    for i in (0, 1):
        value = op.operands[i]
        source, transposed, factor = narrow_source(value)
        if source is None:
            computed.append(i)
            continue
        if source != value:
            with ir.InsertionPoint(op), op.location:
                op.operands[i] = _transpose(source) if transposed else source
        narrow_types[i] = _element(source)
        scale *= factor
    for i in computed:
        value = op.operands[i]
        target = ir.VectorType.get(list(ir.VectorType(value.type).shape),
                                   ir.Type.parse(narrow_types[1 - i]))
        with ir.InsertionPoint(op), op.location:
            op.operands[i] = arith.truncf(target, value)
    if scale == 1.0:
        return
    result = op.results[0]
    rtype = ir.VectorType(result.type)
    uses = list(result.uses)
    acc = op.operands[2]

    def splat_of(value):
        return arith.ConstantOp(rtype, ir.DenseElementsAttr.get_splat(
            rtype, ir.FloatAttr.get(rtype.element_type, value))).result

    with ir.InsertionPoint(op), op.location:
        if not zero_acc:    # the accumulator (a mask) is added after the scaling
            op.operands[2] = splat_of(0.0)
    with ir.InsertionPoint.after(op), op.location:
        scaled = arith.mulf(result, splat_of(scale))
        if not zero_acc:
            scaled = arith.addf(scaled, acc)
    for use in uses:
        use.owner.operands[use.operand_number] = scaled


class NarrowContractsForDpasOp(TransformExt.Operation, name="narrow_contracts_for_dpas"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        for contract in ops_named(target, "vector.contract"):
                            check_contract(contract)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    for contract in ops_named(target, "vector.contract"):
                        narrow(contract)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def narrow_contracts_for_dpas(target: ir.Value) -> NarrowContractsForDpasOp:
    """Give the contractions in `target` f16/bf16 multiplicands (in place)."""
    return NarrowContractsForDpasOp(target)


__all__ = ["DPAS_TYPES", "NarrowContractsForDpasOp", "narrow_contracts_for_dpas", "narrow_source"]
