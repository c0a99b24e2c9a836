"""forward_masked_writes: a vector.transfer_read that reads back, under the same mask, what
a masked vector.transfer_write wrote is a select of the written vector.

    %t = vector.transfer_write %v, %dest[%i..], %mask
    %x = vector.transfer_read %t[%i..], %pad, %mask
  =>  %x = arith.select %mask, %v, broadcast(%pad)

Exact: a lane the mask sets reads the element the write stored there, a lane it clears
reads %pad, whatever %dest held. (Canonicalization forwards only unmasked writes; a masked
edge tile of a matmul's output, unpacked into a fresh tensor and reduced in registers, would
otherwise be stored to a buffer allocated per tile and read back.) Legal for a read when: its
source is a vector.transfer_write result; both are masked by the same value, at the same
indices, with the same permutation map, in bounds in every dim, and the read's vector type
is the written vector's.

Rewritten: every vector.transfer_read nested in (or equal to) the targets that is legal;
the others are left alone, except that a target that is itself an illegal
vector.transfer_read is a silenceable failure (nothing rewritten). The reads are replaced;
the target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform, vector

from .common import Illegal, RewritesTargets, all_in_bounds, defining_op, replace_legal_reads
from .dialect import TransformExt

NAME = "transform_ext.forward_masked_writes"


def masked_write_of(read: ir.Operation) -> ir.Operation:
    """The masked vector.transfer_write whose vector `read` reads back (see the module
    docstring); raises Illegal when there is none."""
    if read.name != "vector.transfer_read":
        raise Illegal(read, "not a vector.transfer_read")
    write = defining_op(read.operands[0])
    if write is None or write.name != "vector.transfer_write":
        raise Illegal(read, "its source is not a vector.transfer_write result")
    rank = ir.ShapedType(read.operands[0].type).rank
    read_indices, read_mask = list(read.operands)[1:1 + rank], list(read.operands)[2 + rank:]
    write_indices, write_mask = list(write.operands)[2:2 + rank], list(write.operands)[2 + rank:]
    if not read_mask or not write_mask:
        raise Illegal(read, "a transfer is not masked")
    if read_mask[0] != write_mask[0]:
        raise Illegal(read, "the read and the write have different masks")
    if read_indices != write_indices:
        raise Illegal(read, "the read and the write are at different indices")
    if read.results[0].type != write.operands[0].type:
        raise Illegal(read, f"it reads {read.results[0].type}, the write wrote {write.operands[0].type}")
    if str(read.attributes["permutation_map"]) != str(write.attributes["permutation_map"]):
        raise Illegal(read, "the read and the write have different permutation maps")
    for transfer in (read, write):
        if not all_in_bounds(transfer):
            raise Illegal(read, f"the {transfer.name.split('_')[-1]} is not in bounds in every dim")
    return write


def _select_written(read: ir.Operation, write: ir.Operation) -> ir.Value:
    rank = ir.ShapedType(read.operands[0].type).rank
    pad, mask = read.operands[1 + rank], read.operands[2 + rank]
    padding = vector.BroadcastOp(read.results[0].type, pad).result
    return arith.SelectOp(mask, write.operands[0], padding).result


class ForwardMaskedWritesOp(TransformExt.Operation, name="forward_masked_writes"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return replace_legal_reads(NAME, op, rewriter, state, masked_write_of, _select_written)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def forward_masked_writes(target: ir.Value) -> ForwardMaskedWritesOp:
    """Forward masked writes to the reads in `target` that read them back (in place)."""
    return ForwardMaskedWritesOp(target)


__all__ = ["ForwardMaskedWritesOp", "forward_masked_writes", "masked_write_of"]
