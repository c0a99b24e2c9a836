"""forall_allocs_to_function: the buffers that the iterations of a function's scf.forall
allocate for themselves become disjoint slices of one function-level buffer.

    func.func @f(..) {
      scf.forall (%i) in (T) {
        %acc = memref.alloc() : memref<R x S x f32>
        .. %acc ..
      }
    }
  =>
    func.func @f(..) {
      %all = memref.alloc() : memref<(T * R) x S x f32>
      scf.forall (%i) in (T) {
        %acc = memref.subview %all[%i * R, 0] [R, S] [1, 1]
                 : memref<(T * R) x S x f32> to memref<R x S x f32, strided<[S, 1], offset: ?>>
        .. %acc ..
      }
    }

Iteration i (linearized over the forall's dims, row-major) owns rows [i R, (i + 1) R) of the
buffer: no two iterations share a byte, so the iterations stay independent. On a GPU, where
a forall iteration is a workgroup that cannot allocate global memory, this is how a
workgroup's state too large for registers and shared memory (the f32 accumulator of a deep
contraction) gets its own rows of device memory (then transform_ext.allocs_to_device).

Rewritten: every statically shaped memref.alloc (no operands, identity layout, default
memory space) directly in the body of a normalized scf.forall (lower bounds 0, steps 1,
static upper bounds) directly in a target function's body; its memref.dealloc ops are
erased. Legality first: the alloc's users must take a strided memref (vector transfers,
memref.subview, memref.load/store, memref.dealloc); else a silenceable failure naming the
user (nothing rewritten). The target handle is only read.
"""

import math

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, memref, transform

from .common import Illegal, RewritesTargets, Success, block_ops, fail, payload_ops, users
from .dialect import TransformExt

NAME = "transform_ext.forall_allocs_to_function"
DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()
STRIDED_USERS = ("vector.transfer_read", "vector.transfer_write", "memref.subview",
                 "memref.load", "memref.store", "memref.dealloc")


def _static_ints(op: ir.Operation, name: str) -> list[int]:
    return list(ir.DenseI64ArrayAttr(op.attributes[name]))


def _trip_counts(forall: ir.Operation) -> list[int] | None:
    """The forall's upper bounds when it is normalized and static, else None."""
    lower, upper, step = (_static_ints(forall, f"static{n}")
                          for n in ("LowerBound", "UpperBound", "Step"))
    if any(v != 0 for v in lower) or any(v != 1 for v in step) or DYNAMIC in upper:
        return None
    return upper


def _private_allocs(forall: ir.Operation) -> list[ir.Operation]:
    found = []
    for op in block_ops(forall.regions[0].blocks[0]):
        if op.name != "memref.alloc" or len(op.operands):
            continue
        t = ir.MemRefType(op.results[0].type)
        if t.memory_space is None and t.rank >= 1 and isinstance(t.layout, ir.AffineMapAttr) \
                and t.layout.value == ir.AffineMap.get_identity(t.rank):
            found.append(op)
    return found


def plan(func: ir.Operation) -> list[tuple[ir.Operation, list[int], list[ir.Operation]]]:
    """(forall, trip counts, its private allocs) for each forall of `func` that has any;
    Illegal naming a user of an alloc that takes no strided memref, or a forall that is not
    normalized."""
    if func.name != "func.func":
        raise Illegal(func, "not a func.func")
    found = []
    if not func.regions[0].blocks:  # a declaration
        return found
    for forall in (op for op in block_ops(func) if op.name == "scf.forall"):
        allocs = _private_allocs(forall)
        if not allocs:
            continue
        trips = _trip_counts(forall)
        if trips is None:
            raise Illegal(forall, "allocates buffers per iteration but is not normalized "
                                  "(lower bounds 0, steps 1, static upper bounds)")
        for alloc in allocs:
            for user in users(alloc.results[0]):
                if user.name not in STRIDED_USERS:
                    raise Illegal(user, "reads a buffer allocated per forall iteration and "
                                        "takes no strided memref")
        found.append((forall, trips, allocs))
    return found


def _linear_iteration(forall: ir.Operation, trips: list[int]) -> ir.Value:
    index = ir.IndexType.get()
    ivs = list(forall.regions[0].blocks[0].arguments)[:len(trips)]
    linear = ivs[0]
    for iv, trip in zip(ivs[1:], trips[1:]):
        linear = arith.addi(arith.muli(linear, arith.constant(index, trip)), iv)
    return linear


def rewrite(forall: ir.Operation, trips: list[int], allocs: list[ir.Operation],
            rewriter) -> None:
    """Each of `allocs` [R, ...] replaced by the rows [i R, (i + 1) R) of one buffer
    [prod(trips) R, ...] allocated before `forall`, i its linear iteration."""
    index = ir.IndexType.get()
    count = math.prod(trips)
    first = forall.regions[0].blocks[0].operations[0]
    with ir.InsertionPoint(first), forall.location:
        linear = _linear_iteration(forall, trips)
    for alloc in allocs:
        t = ir.MemRefType(alloc.results[0].type)
        shape = list(t.shape)
        with ir.InsertionPoint(forall), alloc.location:
            whole = memref.AllocOp(ir.MemRefType.get([count * shape[0]] + shape[1:],
                                                     t.element_type), [], []).result
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        sliced = ir.MemRefType.get(shape, t.element_type,
                                   ir.StridedLayoutAttr.get(DYNAMIC, strides))
        with ir.InsertionPoint(alloc), alloc.location:
            offset = arith.muli(linear, arith.constant(index, shape[0]))
            view = memref.SubViewOp(sliced, whole, [offset], [], [],
                                    [DYNAMIC] + [0] * (len(shape) - 1), shape,
                                    [1] * len(shape)).result
        for user in users(alloc.results[0]):
            if user.name == "memref.dealloc":
                rewriter.erase_op(user)
        rewriter.replace_op(alloc, [view])


class ForallAllocsToFunctionOp(TransformExt.Operation, name="forall_allocs_to_function"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    plans = [plan(func) for func in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for found in plans:
                    for forall, trips, allocs in found:
                        rewrite(forall, trips, allocs, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def forall_allocs_to_function(target: ir.Value) -> ForallAllocsToFunctionOp:
    """Give the per-iteration buffers of the foralls of the functions in `target` one
    function-level buffer each (see the module docstring)."""
    return ForallAllocsToFunctionOp(target)


__all__ = ["ForallAllocsToFunctionOp", "forall_allocs_to_function"]
