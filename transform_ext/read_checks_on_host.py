"""read_checks_on_host: the assertion generics of a function read host copies of their
buffers, before the first kernel.

    %checks = transform_ext.read_checks_on_host %func

For each target function (after bufferization), its checks are the linalg.generic ops
directly in its block whose body holds a cf.assert (the cross-entropy's 0 <= y < C for
counted targets). Each input buffer B of a check is copied once to a host buffer H:
    H = memref.alloc() ; gpu.memcpy H, B         (before the first check reading B)
the checks read H instead, and each H is freed (memref.dealloc) before the function's
return; a check placed after the function's first scf.forall (a kernel) moves before it
first (its buffers must not depend on a kernel: they are the function's arguments).
The check then asserts on the same values on the host, before any kernel runs, so a bad
target stops the program with its message. Functions without checks are left alone.

Legality first: every input of every check is a memref (the function is bufferized); else
a silenceable failure naming the check (nothing rewritten). A target that is not a
func.func is a failure too. The result holds the checks, in order (the same ops: the
handle stays valid), e.g. for transform.structured.convert_to_loops.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, gpu, memref, transform

from .common import (Illegal, RewritesTargets, Success, block_ops, body_of, fail, payload_ops,
                     terminator)
from .dialect import TransformExt

NAME = "transform_ext.read_checks_on_host"


def host_checks(func: ir.Operation) -> list[ir.Operation]:
    """The linalg.generic ops of `func`'s block that assert in their bodies."""
    return [op for op in block_ops(func) if op.name == "linalg.generic" and any(
        o.operation.name == "cf.assert" for o in body_of(op).operations)]


def _check(op: ir.Operation) -> None:
    for v in op.opview.inputs:
        if not isinstance(v.type, ir.MemRefType):
            raise Illegal(op, f"reads a {v.type}, not a buffer (bufferize first)")


def read_on_host(func: ir.Operation, checks: list) -> None:
    block = func.regions[0].blocks[0]
    first_kernel = next((op for op in block_ops(block) if op.name == "scf.forall"), None)
    copies = {}
    for op in checks:
        if first_kernel is not None and not op.is_before_in_block(first_kernel):
            op.move_before(first_kernel)
        with ir.InsertionPoint(op), op.location:
            for i, v in enumerate(list(op.opview.inputs)):
                if v not in copies:
                    host = memref.AllocOp(ir.MemRefType(v.type), [], []).result
                    gpu.MemcpyOp(None, [], host, v)
                    copies[v] = host
                op.operands[i] = copies[v]
    ret = terminator(block)
    for host in copies.values():
        with ir.InsertionPoint(ret), ret.location:
            memref.DeallocOp(host)


class ReadChecksOnHostOp(TransformExt.Operation, name="read_checks_on_host"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                found = []
                try:
                    for t in targets:
                        if t.name != "func.func":
                            raise Illegal(t, "not a func.func")
                        checks = host_checks(t)
                        for c in checks:
                            _check(c)
                        found.append((t, checks))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for t, checks in found:
                    read_on_host(t, checks)
                results.set_ops(op.result, [c for _, checks in found for c in checks])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def read_checks_on_host(func: ir.Value) -> ir.Value:
    """Give the checks of `func` host copies of their buffers (module docstring); returns
    the checks."""
    return ReadChecksOnHostOp(func).result


__all__ = ["ReadChecksOnHostOp", "read_checks_on_host", "host_checks"]
