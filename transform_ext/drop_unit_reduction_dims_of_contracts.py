"""drop_unit_reduction_dims_of_contracts: a vector.contract with several reduction dims,
some of extent 1, loses those (its multiplicands reshaped without them), keeping at least
one reduction dim.

    C[m, n] += sum_{k1 < 1, k2 < K} A[m, k1, k2] B[k1, k2, n]
      ->  C[m, n] += sum_{k2 < K} A'[m, k2] B'[k2, n]

with A', B' the multiplicands without the unit dim (vector.shape_cast). The outer-product
lowering takes one reduction dim; with two it fell back to unrolling the contraction
element by element (a register tile of MinGPT's output projection, over a head and the head
dim, ran as one scalar FMA per element). Exact: the same products summed in the same order.

Rewritten: every vector.contract nested in the targets, not under a vector.mask (its mask
covers every dim), with two reduction dims or more and a reduction dim of extent 1; when
every reduction dim has extent 1 the innermost one stays. Others are left alone. A target
that is not a func.func is a silenceable failure (nothing rewritten). The handle is only
read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform, vector

from .analysis.structure import dim_positions
from .common import RewritesTargets, iterator_kinds, rewrite_functions, walk_ops
from .dialect import TransformExt

NAME = "transform_ext.drop_unit_reduction_dims_of_contracts"


def _extents(op: ir.Operation, positions: list[list[int]]) -> dict[int, int]:
    """Each loop dim's extent, read from the operand shapes that index it."""
    extents = {}
    for value, dims in zip(op.operands[:3], positions):
        shape = ir.VectorType(value.type).shape if isinstance(value.type, ir.VectorType) else []
        extents.update(zip(dims, shape))
    return extents


def unit_reduction_dims(op: ir.Operation) -> list[int]:
    """The reduction dims the rewrite drops from `op` (module docstring), [] when none."""
    if op.name != "vector.contract" or op.parent.name == "vector.mask":
        return []
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    positions = [dim_positions(m) for m in maps]
    if any(None in p for p in positions):
        return []
    kinds = iterator_kinds(op)
    reductions = [d for d, kind in enumerate(kinds) if kind == "reduction"]
    if len(reductions) < 2:
        return []
    extents = _extents(op, positions)
    units = [d for d in reductions if extents.get(d) == 1]
    if len(units) == len(reductions):
        units = units[:-1]
    return units


def rewrite(op: ir.Operation, dropped: list[int]) -> ir.Value:
    """The contraction without the `dropped` dims, built before `op`."""
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    positions = [dim_positions(m) for m in maps]
    kinds = iterator_kinds(op)
    kept = [d for d in range(len(kinds)) if d not in dropped]
    renumbered = {d: i for i, d in enumerate(kept)}
    with ir.InsertionPoint(op), op.location:
        operands, new_maps = [], []
        for value, dims in zip(op.operands[:3], positions):
            t = value.type
            if any(d in dropped for d in dims):
                shape = [s for d, s in zip(dims, ir.VectorType(t).shape) if d not in dropped]
                value = vector.shape_cast(ir.VectorType.get(shape, ir.VectorType(t).element_type), value)
            operands.append(value)
            new_maps.append(ir.AffineMap.get(len(kept), 0, [ir.AffineDimExpr.get(renumbered[d])
                                                            for d in dims if d not in dropped]))
        new = vector.ContractionOp(
            op.results[0].type, *operands,
            ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in new_maps]),
            ir.ArrayAttr.get([ir.Attribute.parse(f"#vector.iterator_type<{kinds[d]}>") for d in kept]),
            kind=op.attributes["kind"],
            fastmath=op.attributes["fastmath"] if "fastmath" in op.attributes else None)
    return new.result


class DropUnitReductionDimsOfContractsOp(TransformExt.Operation,
                                         name="drop_unit_reduction_dims_of_contracts"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            def rewrite_in(func, rewriter):
                for contract in walk_ops(func, lambda o: bool(unit_reduction_dims(o))):
                    rewriter.replace_op(contract, [rewrite(contract, unit_reduction_dims(contract))])

            return rewrite_functions(NAME, op, rewriter, state, rewrite_in)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def drop_unit_reduction_dims_of_contracts(func: ir.Value) -> DropUnitReductionDimsOfContractsOp:
    """Drop the unit reduction dims of the contractions in the functions of `func`."""
    return DropUnitReductionDimsOfContractsOp(func)


__all__ = ["DropUnitReductionDimsOfContractsOp", "drop_unit_reduction_dims_of_contracts",
           "unit_reduction_dims"]
