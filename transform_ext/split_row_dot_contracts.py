"""split_row_dot_contracts: a vector.contract that is a dot product per row,

    C[m] += sum_k A[m, k] B[m, k]      (both multiplicands indexed (m, k), a 1-D result)

becomes the elementwise product and a row reduction:

    %p = arith.mulf extf(A), extf(B)                (f32; operands narrower than the
    %c = vector.multi_reduction <add>, %p, %acc [1]   accumulator are widened first)

(D = rowsum(dO * O) of the attention backward, which vectorization folds into a contract
that no DPAS can run: DPAS multiplies matrices). Exact up to the order of the additions: a
product of two f16 or bf16 numbers is exact in f32.

Legal for a contraction when: it has two 2-D multiplicands of one shape, both with the map
(m, k) -> (m, k), the result map (m, k) -> (m), iterators [parallel, reduction], kind add,
a float accumulator vector, and no mask.

Rewritten: every vector.contract nested in (or equal to) the targets that is legal; the
others are left alone, except that a target that is itself an illegal vector.contract is a
silenceable failure (nothing rewritten). The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform, vector

from .common import Illegal, RewritesTargets, Success, fail, iterator_kinds, ops_named, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.split_row_dot_contracts"


def check_contract(op: ir.Operation) -> None:
    """Raise Illegal unless `op` is a row-dot vector.contract (see the module docstring)."""
    if op.name != "vector.contract":
        raise Illegal(op, "not a vector.contract")
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    rows = ir.AffineMap.get(2, 0, [ir.AffineDimExpr.get(0), ir.AffineDimExpr.get(1)])
    row = ir.AffineMap.get(2, 0, [ir.AffineDimExpr.get(0)])
    if maps != [rows, rows, row] or iterator_kinds(op) != ["parallel", "reduction"]:
        raise Illegal(op, "not a dot product per row (maps (m, k), (m, k) -> (m))")
    if "#vector.kind<add>" not in str(op.attributes["kind"]) or len(op.operands) != 3:
        raise Illegal(op, "not an additive, unmasked contraction")
    acc = op.operands[2].type
    if not isinstance(acc, ir.VectorType) or not isinstance(acc.element_type, ir.FloatType):
        raise Illegal(op, f"accumulator {acc} is not a float vector")


def split(op: ir.Operation) -> None:
    """Rewrite the legal contraction `op` (see the module docstring)."""
    acc = op.operands[2]
    element = ir.VectorType(acc.type).element_type
    with ir.InsertionPoint(op), op.location:
        factors = []
        for value in op.operands[:2]:
            t = ir.VectorType(value.type)
            if t.element_type != element:
                value = arith.extf(ir.VectorType.get(list(t.shape), element), value)
            factors.append(value)
        product = arith.mulf(*factors)
        reduced = vector.MultiDimReductionOp(ir.Attribute.parse("#vector.kind<add>"), product,
                                             acc, [1]).result
    op.results[0].replace_all_uses_with(reduced)
    op.erase()


class SplitRowDotContractsOp(TransformExt.Operation, name="split_row_dot_contracts"):
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
                            check_contract(contract)
                        except Illegal:
                            continue
                        split(contract)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def split_row_dot_contracts(target: ir.Value) -> SplitRowDotContractsOp:
    """Turn the row-dot contractions in `target` into products and row reductions."""
    return SplitRowDotContractsOp(target)


__all__ = ["SplitRowDotContractsOp", "check_contract", "split_row_dot_contracts"]
