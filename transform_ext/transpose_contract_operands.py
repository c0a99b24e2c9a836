"""transpose_contract_operands: every 2-D vector.contract C[m, n] += sum_k A B gets its
multiplicands in the DPAS form A[m, k], B[k, n]: a multiplicand indexed the other way round
(B as [n, k]: K read as stored, for Q K^T; A as [k, m]) is transposed by a vector.transpose
and its indexing map becomes the canonical one.

    vector.contract {indexing_maps = [(m, n, k) -> (m, k), (m, n, k) -> (n, k), (m, n, k) -> (m, n)]} %a, %b, %c
  =>
    %bt = vector.transpose %b, [1, 0]
    vector.contract {indexing_maps = [(m, n, k) -> (m, k), (m, n, k) -> (k, n), (m, n, k) -> (m, n)]} %a, %bt, %c

Exact: the same products are summed (the 2-D block load then reads B transposed). Legal
for a contraction with three indexing maps over three loops, the result map (m, n, k) ->
(m, n) and a reduction third loop; multiplicands with other maps are left as they are.

Rewritten: every vector.contract nested in (or equal to) the targets that is legal; the
others are left alone, except that a target that is itself an illegal vector.contract is a
silenceable failure (nothing rewritten). Contractions are updated in place (handles to
them stay valid); the target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform, vector

from .common import Illegal, RewritesTargets, Success, fail, iterator_kinds, ops_named, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.transpose_contract_operands"


def _map(a: int, b: int) -> ir.AffineMap:
    return ir.AffineMap.get(3, 0, [ir.AffineDimExpr.get(a), ir.AffineDimExpr.get(b)])


def check_contract(op: ir.Operation) -> list[ir.AffineMap]:
    """The indexing maps of a legal 2-D contraction `op`; raises Illegal otherwise."""
    if op.name != "vector.contract":
        raise Illegal(op, "not a vector.contract")
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    kinds = iterator_kinds(op)
    if len(maps) != 3 or maps[2] != _map(0, 1) or len(kinds) != 3 or kinds[2] != "reduction":
        raise Illegal(op, "not a contraction C[m, n] += A B over a third reduction loop k")
    return maps


def _transpose(value: ir.Value) -> ir.Value:
    t = ir.VectorType(value.type)
    swapped = ir.VectorType.get(list(t.shape)[::-1], t.element_type)
    return vector.TransposeOp(swapped, value, [1, 0]).result


def canonicalize_operands(op: ir.Operation, maps: list[ir.AffineMap]) -> None:
    """Transpose the multiplicands of `op` indexed (k, m) / (n, k) (see the docstring)."""
    canonical = [_map(0, 2), _map(2, 1)]
    swapped = [_map(2, 0), _map(1, 2)]
    changed = False
    for i in (0, 1):
        if maps[i] == swapped[i]:
            with ir.InsertionPoint(op), op.location:
                op.operands[i] = _transpose(op.operands[i])
            maps[i] = canonical[i]
            changed = True
    if changed:
        op.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(a) for a in maps])


class TransposeContractOperandsOp(TransformExt.Operation, name="transpose_contract_operands"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name == "vector.contract":
                            check_contract(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    for contract in ops_named(target, "vector.contract"):
                        try:
                            maps = check_contract(contract)
                        except Illegal:
                            continue
                        canonicalize_operands(contract, maps)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def transpose_contract_operands(target: ir.Value) -> TransposeContractOperandsOp:
    """Put the multiplicands of the 2-D contractions in `target` in DPAS form (in place)."""
    return TransposeContractOperandsOp(target)


__all__ = ["TransposeContractOperandsOp", "transpose_contract_operands", "check_contract"]
