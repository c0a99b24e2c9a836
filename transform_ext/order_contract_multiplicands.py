"""order_contract_multiplicands: a vector.contract whose left multiplicand runs along the
accumulator's lanes and whose right one does not gets its multiplicands swapped.

    C[m, n] += sum_k B[k, n] A[k, m]   ->   C[m, n] += sum_k A[k, m] B[k, n]

The outer-product lowering of a contraction broadcasts each element of the left
multiplicand and multiplies the right one as a vector: with the lanes (C's innermost dim n)
on the left, a [MR, NR] register tile became NR FMAs of MR-lane vectors per k and a
transpose of the tile (a product whose body multiplies B by A: the matmul schedule's
folded result transpose, transform_ext.fold_result_transposes_into_contractions, ran 10x
slower). Exact: a float product does not depend on its operands' order; the swap only moves
the operands and their indexing maps (masks stay: they cover the loops, not the operands).

Rewritten: every vector.contract nested in the targets with kind add, a float accumulator
vector whose innermost dim is read as a dim by the right multiplicand and not by the left
one; others are left alone. A target that is not a func.func is a silenceable failure
(nothing rewritten). Contractions are updated in place; the handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import dim_positions
from .common import RewritesTargets, rewrite_functions, walk_ops
from .dialect import TransformExt

NAME = "transform_ext.order_contract_multiplicands"


def lanes_on_the_left(op: ir.Operation) -> bool:
    """Is `op` a float add-kind vector.contract whose accumulator's innermost dim only the
    right multiplicand reads?"""
    if op.name != "vector.contract" or "#vector.kind<add>" not in str(op.attributes["kind"]):
        return False
    acc = op.operands[2].type
    if not isinstance(acc, ir.VectorType) or acc.rank == 0 or not isinstance(acc.element_type, ir.FloatType):
        return False
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    lhs, rhs, out = (dim_positions(m) for m in maps)
    lane = out[-1]
    return lane is not None and lane in lhs and lane not in rhs


def swap(op: ir.Operation) -> None:
    """Swap `op`'s multiplicands and their indexing maps in place."""
    maps = list(ir.ArrayAttr(op.attributes["indexing_maps"]))
    op.attributes["indexing_maps"] = ir.ArrayAttr.get([maps[1], maps[0], maps[2]])
    lhs, rhs = op.operands[0], op.operands[1]
    op.operands[0], op.operands[1] = rhs, lhs


class OrderContractMultiplicandsOp(TransformExt.Operation, name="order_contract_multiplicands"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            def rewrite_in(func, rewriter):
                for contract in walk_ops(func, lanes_on_the_left):
                    swap(contract)

            return rewrite_functions(NAME, op, rewriter, state, rewrite_in)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def order_contract_multiplicands(func: ir.Value) -> OrderContractMultiplicandsOp:
    """Put the lanes' multiplicand on the right in the contractions of the functions of `func`."""
    return OrderContractMultiplicandsOp(func)


__all__ = ["OrderContractMultiplicandsOp", "lanes_on_the_left", "order_contract_multiplicands"]
