"""drop_contraction_masks: a masked vector.contract that leaves its reduction dims whole
computes every lane.

    %r = vector.mask %m { vector.contract %a, %b, %acc }     ->     %r = vector.contract %a, %b, %acc

A vector.mask without a passthru value leaves the masked-off lanes of its result undefined,
and a contraction's result lane (i, j) reads only the terms of that lane: when the mask
covers every reduction index (its sizes along the reduction dims are whole), the lanes it
keeps sum the same terms either way, and the others may hold any value, the contraction's
own included. The register tile of a convolution or matmul at the edge of its output is
vectorized at its nominal size with masks (its reads and writes keep theirs: the lanes
past the edge are never loaded or stored); without the mask on the contraction it lowers
to plain FMAs instead of FMAs and selects per step.

Targets: any ops; each vector.mask nested in them (themselves included) that wraps a
single vector.contract, has no passthru, and whose mask is a vector.create_mask or a
vector.constant_mask whose sizes along the reduction dims are constants covering them whole, is replaced by the
unmasked contraction; other masks are left alone (nothing is illegal). Result: none; the
handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import (RewritesTargets, Success, constant_value, defining_op, iterator_kinds,
                     payload_ops, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.drop_contraction_masks"


def _mask_sizes(mask: ir.Value) -> list[int | None] | None:
    """The sizes of a create_mask / constant_mask (None for a size that is not a
    constant), None when the mask is neither."""
    op = defining_op(mask)
    if op is None:
        return None
    if op.name == "vector.constant_mask":
        return list(ir.DenseI64ArrayAttr(op.attributes["mask_dim_sizes"]))
    if op.name == "vector.create_mask":
        sizes = []
        for v in op.operands:
            attr = constant_value(v)
            sizes.append(attr.value if isinstance(attr, ir.IntegerAttr) else None)
        return sizes
    return None


def _droppable(mask_op: ir.Operation) -> ir.Operation | None:
    """The contraction a vector.mask may drop its mask from, else None."""
    body = [op.operation for op in mask_op.regions[0].blocks[0].operations]
    if len(body) != 2 or body[0].name != "vector.contract" or len(mask_op.operands) != 1:
        return None
    contract = body[0]
    sizes = _mask_sizes(mask_op.operands[0])
    shape = list(ir.VectorType(mask_op.operands[0].type).shape)
    kinds = iterator_kinds(contract)
    if sizes is None or len(sizes) != len(kinds):
        return None
    whole = all(size is not None and size >= extent
                for size, extent, kind in zip(sizes, shape, kinds) if kind == "reduction")
    return contract if whole else None


def drop_masks(root: ir.Operation, rewriter) -> int:
    """Drop the masks of the contractions under `root`; returns how many."""
    masks = [op for op in walk_ops(root, lambda o: o.name == "vector.mask")]
    count = 0
    for mask_op in masks:
        contract = _droppable(mask_op)
        if contract is None:
            continue
        with ir.InsertionPoint(mask_op), mask_op.location:
            clone = contract.clone()
        rewriter.replace_op(mask_op, list(clone.results))
        count += 1
    return count


class DropContractionMasksOp(TransformExt.Operation, name="drop_contraction_masks"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                for t in targets:
                    drop_masks(t, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def drop_contraction_masks(target: ir.Value) -> DropContractionMasksOp:
    """Drop the masks of the contractions under `target` that keep their reductions whole."""
    return DropContractionMasksOp(target)


__all__ = ["DropContractionMasksOp", "drop_contraction_masks", "drop_masks"]
