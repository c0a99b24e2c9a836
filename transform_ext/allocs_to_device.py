"""allocs_to_device: the buffers a host function allocates for its kernels live in device
memory.

    func.func @f(..) {
      %b = memref.alloc() : memref<S>
      ..
      return
    }
  =>
    func.func @f(..) {
      %b = gpu.alloc () : memref<S>
      ..
      gpu.dealloc %b : memref<S>
      return
    }

Every statically shaped memref.alloc (no operands) directly in a function's body becomes a
gpu.alloc, freed by a gpu.dealloc before the function's terminator (in allocation order):
the buffers between kernels, which the host never reads. Allocs nested in regions, and
dynamically shaped ones, are left alone. Legal for a func.func whose body is one block (a
declaration has nothing to rewrite).

Rewritten: the target functions; a target that is not a func.func, or one of several
blocks, is a silenceable failure (nothing rewritten). The allocs are replaced; the target
handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, gpu, transform

from .common import Illegal, RewritesTargets, Success, block_ops, fail, payload_ops, terminator
from .dialect import TransformExt

NAME = "transform_ext.allocs_to_device"


def _check(func: ir.Operation) -> None:
    if func.name != "func.func":
        raise Illegal(func, "not a func.func")
    if len(func.regions[0].blocks) > 1:
        raise Illegal(func, f"a body of {len(func.regions[0].blocks)} blocks (one expected)")


class AllocsToDeviceOp(TransformExt.Operation, name="allocs_to_device"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        _check(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for func in targets:
                    if not func.regions[0].blocks:
                        continue
                    block = func.regions[0].blocks[0]
                    ret = terminator(block)
                    for alloc in block_ops(block):
                        if alloc.name != "memref.alloc" or len(alloc.operands):
                            continue
                        with ir.InsertionPoint(alloc), alloc.location:
                            device = gpu.AllocOp(alloc.results[0].type, None, [], [], [])
                        with ir.InsertionPoint(ret), alloc.location:
                            gpu.DeallocOp(None, [], device.results[0])
                        rewriter.replace_op(alloc, [device.results[0]])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def allocs_to_device(target: ir.Value) -> AllocsToDeviceOp:
    """Put the function-level buffers of the functions in `target` in device memory."""
    return AllocsToDeviceOp(target)


__all__ = ["AllocsToDeviceOp", "allocs_to_device"]
