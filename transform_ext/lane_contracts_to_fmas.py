"""lane_contracts_to_fmas: a vector.contract that is elementwise along its lanes, its
reductions of extent 1, as FMAs on the accumulator's shape.

    C[p..] += sum_{r.. of extent 1} A[..] B[..]      (every lane of C a product of one lane
                                                      of A and one of B)
      ->  C = fma(bcast_C(A), bcast_C(B), C)

where bcast_C(X) drops X's unit reduction dims (vector.shape_cast), broadcasts it over the
parallel dims it lacks and transposes it into C's dim order. This is the step of a
mat-vec's split k (transform_ext.split_matvec_lanes): P[m, l] += A[m, k1, l] x[k1, l], whose
lane dim l is read by both operands (a batch dim of the contraction, no outer product to
form). The outer-product lowering unrolls such a contraction to one scalar FMA per lane;
here each vector of C is one FMA, x broadcast over the rows. It is also the step of a
vector-matrix product y[b, m] += A[b, k, m] x[b, k] with one element of x (b and k of
extent 1): an FMA of A's run with x broadcast (with bf16 operands and a batch dim, the
contraction lowering extracted every lane into a one-lane vector). Operands narrower than
the accumulator are widened first (arith.extf: exact). Exact up to the rounding of the
fused multiply-add, which the outer-product lowering also fuses.

Rewritten: every vector.contract nested in the targets with kind add, a float vector
accumulator whose last dim is a parallel loop read as the last dim of both operands (or of
one, the other holding one element), all reduction dims of extent 1, and not under a
vector.mask; others (outer products, masked edge tiles, real reductions) are left alone.
A target that is not a func.func is a silenceable failure (nothing rewritten). The handle
is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform, vector

from .analysis.structure import dim_positions
from .common import Illegal, RewritesTargets, Success, fail, iterator_kinds, payload_ops, walk_ops
from .dialect import TransformExt

NAME = "transform_ext.lane_contracts_to_fmas"


def is_lane_contract(op: ir.Operation) -> bool:
    """Does the rewrite take `op` (see the module docstring)?"""
    if op.name != "vector.contract" or op.parent.name == "vector.mask" or len(op.operands) != 3:
        return False
    if "#vector.kind<add>" not in str(op.attributes["kind"]):
        return False
    acc = op.operands[2].type
    if not isinstance(acc, ir.VectorType) or not isinstance(acc.element_type, ir.FloatType):
        return False
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    positions = [dim_positions(m) for m in maps]
    if any(None in p for p in positions):
        return False
    kinds = iterator_kinds(op)
    lane = positions[2][-1]
    if kinds[lane] != "parallel":
        return False
    along = [p[-1] == lane for p in positions[:2]]
    single = [all(s == 1 for s in ir.VectorType(v.type).shape) for v in op.operands[:2]]
    if not any(along) or not all(a or s for a, s in zip(along, single)):
        return False
    for value, dims in zip(op.operands[:2], positions[:2]):
        shape = ir.VectorType(value.type).shape
        if any(kinds[d] == "reduction" and s != 1 for d, s in zip(dims, shape)):
            return False
    return True


def _on_accumulator(value: ir.Value, dims: list[int], acc_dims: list[int], acc: ir.VectorType,
                    kinds: list[str]) -> ir.Value:
    """`value` (an operand read through loop `dims`) widened, its unit reduction dims dropped,
    broadcast over the accumulator dims it lacks and in their order."""
    t = ir.VectorType(value.type)
    element = acc.element_type
    if t.element_type != element:
        value = arith.extf(ir.VectorType.get(t.shape, element), value)
    kept = [(d, s) for d, s in zip(dims, t.shape) if kinds[d] == "parallel"]
    if len(kept) != len(dims):
        value = vector.shape_cast(ir.VectorType.get([s for _, s in kept], element), value)
    missing = [d for d in acc_dims if d not in [d for d, _ in kept]]
    order = missing + [d for d, _ in kept]
    shape = [acc.shape[acc_dims.index(d)] for d in order]
    if missing:
        value = vector.broadcast(ir.VectorType.get(shape, element), value)
    if order != acc_dims:
        value = vector.transpose(acc, value, [order.index(d) for d in acc_dims])
    return value


def rewrite(op: ir.Operation, rewriter) -> None:
    """Replace the lane contract `op` by an FMA (see the module docstring)."""
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    positions = [dim_positions(m) for m in maps]
    kinds = iterator_kinds(op)
    acc = ir.VectorType(op.operands[2].type)
    with ir.InsertionPoint(op), op.location:
        lhs, rhs = (_on_accumulator(v, p, positions[2], acc, kinds)
                    for v, p in zip(op.operands[:2], positions[:2]))
        fma = vector.FMAOp(lhs, rhs, op.operands[2]).result
    rewriter.replace_op(op, [fma])


class LaneContractsToFmasOp(TransformExt.Operation, name="lane_contracts_to_fmas"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "func.func":
                            raise Illegal(target, "not a func.func")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    for contract in walk_ops(target, is_lane_contract):
                        rewrite(contract, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def lane_contracts_to_fmas(func: ir.Value) -> LaneContractsToFmasOp:
    """Lower the lane-elementwise contractions in the functions of `func` to FMAs."""
    return LaneContractsToFmasOp(func)


__all__ = ["LaneContractsToFmasOp", "is_lane_contract", "lane_contracts_to_fmas"]
