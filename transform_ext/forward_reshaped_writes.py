"""forward_reshaped_writes: a vector.transfer_read of a reshaped tensor that a
vector.transfer_write wrote whole reads the written vector.

    %t = vector.transfer_write %v, %dest[0, .., 0]        %v : vector<S>
    %r = tensor.expand_shape / tensor.collapse_shape %t   (one or more reshapes)
    %x = vector.transfer_read %r[0, .., 0], %pad          %x : vector<S>
  =>  uses of %x read %v

Exact when the reshapes only add or drop unit dims and both transfers cover their whole
tensor: then every element of %x is the element of %v at the same position. Legal for a
read when: at least one reshape lies between it and the write; neither transfer is masked;
both are at constant index 0; the read's vector type is the written vector's; the non-unit
dims of each tensor are the vector's non-unit dims. (Canonicalization forwards a write to a
read only without a reshape in between: a tile whose unit dims were folded.)

Rewritten: every vector.transfer_read nested in (or equal to) the targets that is legal, one
after the other; the others are left alone, except that a target that is itself an illegal
vector.transfer_read is a silenceable failure (nothing rewritten). The reads are replaced
(erased); the target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, RewritesTargets, defining_op, replace_legal_reads
from .dialect import TransformExt

NAME = "transform_ext.forward_reshaped_writes"
RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")


def _constant_int(value: ir.Value):
    owner = defining_op(value)
    if owner is not None and owner.name == "arith.constant" and isinstance(
            owner.attributes["value"], ir.IntegerAttr):
        return ir.IntegerAttr(owner.attributes["value"]).value
    return None


def _covers(vtype: ir.VectorType, ttype: ir.RankedTensorType) -> bool:
    return [d for d in ttype.shape if d != 1] == [d for d in vtype.shape if d != 1]


def forwarded_value(read: ir.Operation) -> ir.Value:
    """The vector `read` reads (see the module docstring); raises Illegal when it is not
    a read of a reshaped whole-tensor write."""
    if read.name != "vector.transfer_read":
        raise Illegal(read, "not a vector.transfer_read")
    write, reshaped = defining_op(read.operands[0]), False
    while write is not None and write.name in RESHAPES:
        write, reshaped = defining_op(write.operands[0]), True
    if not reshaped:
        raise Illegal(read, "its source is not a tensor.expand_shape or tensor.collapse_shape")
    if write is None or write.name != "vector.transfer_write":
        raise Illegal(read, "the reshaped tensor is not a vector.transfer_write result")
    value = write.operands[0]
    rtype, vtype = ir.VectorType(read.results[0].type), ir.VectorType(value.type)
    source = ir.RankedTensorType(read.operands[0].type)
    written = ir.RankedTensorType(write.results[0].type)
    indices_read = list(read.operands)[1:1 + source.rank]
    indices_written = list(write.operands)[2:2 + written.rank]
    if len(read.operands) > 2 + source.rank or len(write.operands) > 2 + written.rank:
        raise Illegal(read, "a masked transfer")
    if rtype != vtype:
        raise Illegal(read, f"it reads {rtype}, the write wrote {vtype}")
    if not all(_constant_int(v) == 0 for v in indices_read + indices_written):
        raise Illegal(read, "a transfer at a nonzero or non-constant index")
    if not _covers(vtype, written) or not _covers(rtype, source):
        raise Illegal(read, "a transfer does not cover its whole tensor")
    return value


class ForwardReshapedWritesOp(TransformExt.Operation, name="forward_reshaped_writes"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return replace_legal_reads(NAME, op, rewriter, state, forwarded_value,
                                       lambda read, value: value)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def forward_reshaped_writes(target: ir.Value) -> ForwardReshapedWritesOp:
    """Forward whole-tensor writes through reshapes to the reads in `target` (in place)."""
    return ForwardReshapedWritesOp(target)


__all__ = ["ForwardReshapedWritesOp", "forward_reshaped_writes", "forwarded_value"]
