"""scalarize_rank0_writes: a 0-d vector written to a rank-0 buffer becomes a scalar store.

    transform_ext.scalarize_rank0_writes %func

Every vector.transfer_write of a vector<T> (rank 0) nested in the targets,
    vector.transfer_write %v, %m[] : vector<T>, memref<T>
becomes
    %s = vector.extract %v[] : T from vector<T> ; memref.store %s, %m[] : memref<T>
the same element to the same place. A 0-d vector has no lane layout on the GPU; every lane
storing the same scalar does (a rank-0 loss). Writes of vectors of rank >= 1 are left alone.

Legality first: each such write writes into a rank-0 memref without a mask; else a
silenceable failure naming the write (nothing rewritten). The target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, memref, transform, vector

from .common import Illegal, RewritesTargets, Success, fail, ops_named, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.scalarize_rank0_writes"


def rank0_writes(root: ir.Operation) -> list[ir.Operation]:
    return [w for w in ops_named(root, "vector.transfer_write")
            if ir.VectorType(w.operands[0].type).rank == 0]


def _check(write: ir.Operation) -> None:
    dest = write.operands[1].type
    if len(write.operands) != 2 or not isinstance(dest, ir.MemRefType) or ir.MemRefType(dest).rank:
        raise Illegal(write, f"writes a 0-d vector into {dest} (with {len(write.operands) - 2} "
                             "index or mask operands): only a rank-0 memref is scalarized")


class ScalarizeRank0WritesOp(TransformExt.Operation, name="scalarize_rank0_writes"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                writes = [w for t in payload_ops(state, op.target) for w in rank0_writes(t)]
                try:
                    for w in writes:
                        _check(w)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for w in writes:
                    with ir.InsertionPoint(w), w.location:
                        scalar = vector.ExtractOp(w.operands[0], [], []).result
                        memref.StoreOp(scalar, w.operands[1], [])
                    rewriter.erase_op(w)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def scalarize_rank0_writes(target: ir.Value) -> ScalarizeRank0WritesOp:
    """Rank-0 vector writes in `target` as scalar stores (module docstring)."""
    return ScalarizeRank0WritesOp(target)


__all__ = ["ScalarizeRank0WritesOp", "scalarize_rank0_writes"]
