"""narrow_vector_contract_operands: vector.contract ops whose multiplicands are arith.extf
results contract on the narrow values (the DPAS form f16 x f16 -> f32, bf16 x bf16 -> f32).

vector.contract promotes narrower multiplicands to the accumulator type itself, so
    contract(extf(a), extf(b), acc) = contract(a, b, acc)
exactly. When only one multiplicand narrows (or they narrow to different widths), the wider
one is rounded to its partner's type with an arith.truncf inserted for the contract only:
    contract(extf(a_f16), p_f32, acc) -> contract(a_f16, truncf(p_f32), acc)
which CHANGES the result by the rounding of p to f16 (relative error up to 2^-11 per
element for f16, 2^-8 for bf16): it is what a DPAS unit computes on an f16 model whose
importer kept an intermediate in f32. Other users of the wide values keep them; an extf
left without users is erased.

Legal for a contract when: at least one multiplicand is an arith.extf result; the narrow
element types are both f16 or both bf16 after the rounding (f16 x bf16 has no common DPAS
form); each extf extends to the accumulator's element type. Targets: vector.contract ops
equal to or nested in the target ops; a target that is itself a vector.contract that
cannot be narrowed is a silenceable failure (nothing changes), nested ones that cannot are
left as they are. Contracts are updated in place (handles to them stay valid).
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .common import Illegal, RewritesTargets, Success, defining_op, fail, payload_ops, walk_ops
from .dialect import TransformExt

NAME = "transform_ext.narrow_vector_contract_operands"
_NARROW = ("f16", "bf16")


def _element(t: ir.Type) -> ir.Type:
    return t.element_type if isinstance(t, ir.ShapedType) else t


def plan_contract(contract: ir.Operation):
    """(narrow element type, [(operand number, narrow value, needs truncf)]), or None when
    neither multiplicand is an extf result; raises Illegal when it cannot be narrowed."""
    acc_element = _element(contract.operands[2].type)
    narrow = []
    for i in (0, 1):
        v = contract.operands[i]
        producer = defining_op(v)
        if producer is not None and producer.name == "arith.extf":
            if _element(v.type) != acc_element:
                raise Illegal(contract, f"operand {i} extends to {_element(v.type)}, not to the "
                                        f"accumulator type {acc_element}")
            narrow.append(producer.operands[0])
        else:
            narrow.append(None)
    if all(n is None for n in narrow):
        return None
    values = [narrow[i] if narrow[i] is not None else contract.operands[i] for i in (0, 1)]
    types = [_element(v.type) for v in values]
    widths = [t.width for t in types]
    target = types[widths.index(min(widths))]
    if str(target) not in _NARROW:
        raise Illegal(contract, f"the narrow multiplicand type {target} is not f16 or bf16")
    for t in types:
        if t.width == target.width and t != target:
            raise Illegal(contract, f"the multiplicands narrow to different types {types[0]} and {types[1]}")
    plan = []
    for i in (0, 1):
        needs_trunc = types[i] != target
        if needs_trunc and not isinstance(types[i], ir.FloatType):
            raise Illegal(contract, f"operand {i} of type {types[i]} cannot be rounded to {target}")
        if narrow[i] is not None or needs_trunc:
            plan.append((i, values[i], needs_trunc))
    return target, plan


def _rewrite(contract: ir.Operation, plan, rewriter) -> None:
    target, changes = plan
    old = [contract.operands[i] for i in (0, 1)]
    for i, v, needs in changes:
        if needs:
            t = v.type
            narrow_type = ir.VectorType.get(list(t.shape), target, scalable=t.scalable_dims)
            with ir.InsertionPoint(contract), contract.location:
                v = arith.TruncFOp(narrow_type, v).result
        contract.operands[i] = v
    for v in old:
        producer = defining_op(v)
        if producer is not None and producer.name == "arith.extf" and not list(v.uses):
            rewriter.erase_op(producer)


class NarrowVectorContractOperandsOp(TransformExt.Operation, name="narrow_vector_contract_operands"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                plans = []
                try:
                    for target in targets:
                        for c in walk_ops(target, lambda o: o.name == "vector.contract"):
                            try:
                                p = plan_contract(c)
                            except Illegal:
                                if c == target:
                                    raise
                                continue
                            if p is None and c == target:
                                raise Illegal(c, "neither multiplicand is an arith.extf result")
                            if p:
                                plans.append((c, p))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for c, p in plans:
                    _rewrite(c, p, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def narrow_vector_contract_operands(target: ir.Value) -> None:
    """Contract on the narrow sources of extf'ed multiplicands in `target` (in place)."""
    NarrowVectorContractOperandsOp(target)


__all__ = ["NarrowVectorContractOperandsOp", "narrow_vector_contract_operands", "plan_contract"]
