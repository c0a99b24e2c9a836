"""fold_reads_of_splat_writes: an in-bounds vector.transfer_read of a tensor that a
vector.transfer_write of a splat constant wrote whole (possibly through reshapes) is that
splat.

    %t = vector.transfer_write %cst, %dest[0, .., 0]   %cst = arith.constant dense<c> : vector<S>,
                                                       %dest : tensor<S>
    %r = tensor.expand_shape / tensor.collapse_shape %t   (zero or more reshapes)
    %x = vector.transfer_read %r[..] {in_bounds = [true, ..]} : vector<R>
  =>  %x = arith.constant dense<c> : vector<R>

Exact: every element of %t, hence of %r, is c, and an in-bounds unmasked read reads only
elements of %r. The initial values of loop-carried tiles (-inf maxima, zero sums) then need
no buffer. Legal for a read when: its source is such a write (through tensor reshapes
only); the written vector has the written tensor's shape and is a dense splat
arith.constant; the write is unmasked at constant index 0; the read is unmasked and in
bounds in every dim.

Rewritten: every vector.transfer_read nested in (or equal to) the targets that is legal, one
after the other; the others are left alone, except that a target that is itself an illegal
vector.transfer_read is a silenceable failure (nothing rewritten). The reads are replaced by
the new constants; the target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .common import (Illegal, RewritesTargets, all_in_bounds, constant_value, defining_op,
                     replace_legal_reads)
from .dialect import TransformExt

NAME = "transform_ext.fold_reads_of_splat_writes"
RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")


def _is_constant_zero(value: ir.Value) -> bool:
    owner = defining_op(value)
    return (owner is not None and owner.name == "arith.constant"
            and isinstance(owner.attributes["value"], ir.IntegerAttr)
            and ir.IntegerAttr(owner.attributes["value"]).value == 0)


def read_splat(read: ir.Operation) -> ir.Attribute:
    """The splat element `read` reads (see the module docstring); raises Illegal when it is
    not an in-bounds read of a whole-tensor splat write."""
    if read.name != "vector.transfer_read":
        raise Illegal(read, "not a vector.transfer_read")
    write = defining_op(read.operands[0])
    while write is not None and write.name in RESHAPES:
        write = defining_op(write.operands[0])
    if write is None or write.name != "vector.transfer_write":
        raise Illegal(read, "its source is not a vector.transfer_write result")
    written, dest = write.operands[0], ir.RankedTensorType(write.results[0].type)
    splat = None
    producer = defining_op(written)
    if producer is not None and producer.name == "arith.constant":
        splat = constant_value(written)
    if splat is None:
        raise Illegal(read, "the written vector is not a splat constant")
    if list(ir.VectorType(written.type).shape) != list(dest.shape):
        raise Illegal(read, "the write does not cover its whole tensor")
    if len(write.operands) > 2 + dest.rank or not all(
            _is_constant_zero(v) for v in list(write.operands)[2:2 + dest.rank]):
        raise Illegal(read, "the write is masked or not at index 0")
    source = ir.RankedTensorType(read.operands[0].type)
    if len(read.operands) > 2 + source.rank or not all_in_bounds(read):
        raise Illegal(read, "the read is masked or not in bounds")
    return splat


def _splat_constant(read: ir.Operation, splat: ir.Attribute) -> ir.Value:
    rtype = ir.VectorType(read.results[0].type)
    return arith.ConstantOp(rtype, ir.DenseElementsAttr.get_splat(rtype, splat)).result


class FoldReadsOfSplatWritesOp(TransformExt.Operation, name="fold_reads_of_splat_writes"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return replace_legal_reads(NAME, op, rewriter, state, read_splat, _splat_constant)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fold_reads_of_splat_writes(target: ir.Value) -> FoldReadsOfSplatWritesOp:
    """Fold the reads of whole-tensor splat writes in `target` to constants (in place)."""
    return FoldReadsOfSplatWritesOp(target)


__all__ = ["FoldReadsOfSplatWritesOp", "fold_reads_of_splat_writes", "read_splat"]
