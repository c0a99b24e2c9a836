"""refresh_function_type: a function's type becomes what its body says it is.

For a func.func whose entry block has arguments a_1..a_n and whose `func.return` returns
v_1..v_m, the `function_type` attribute is set to (type(a_1), ..., type(a_n)) ->
(type(v_1), ..., type(v_m)). A rewrite that retypes block arguments in place (i1 tensors
stored as i8) or returns one more value (the kernel-reported error code) leaves the
signature stale; this makes the function valid again. A function whose type already
matches its body is unchanged.

Targets: func.func ops with a body ending in func.return (else a silenceable failure
naming the op, nothing changed). The handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, RewritesTargets, Success, fail, payload_ops, terminator
from .dialect import TransformExt

NAME = "transform_ext.refresh_function_type"


def check_function(func: ir.Operation) -> None:
    """Raise Illegal unless `func` is a func.func with a body ending in func.return."""
    if func.name != "func.func":
        raise Illegal(func, "not a func.func")
    if not len(func.regions[0].blocks):
        raise Illegal(func, "has no body (a declaration)")
    if terminator(func.regions[0].blocks[0]).name != "func.return":
        raise Illegal(func, "its entry block does not end in func.return")


def refresh_function_type_of(func: ir.Operation) -> None:
    """Set `func`'s function_type from its entry block's arguments and returned values."""
    block = func.regions[0].blocks[0]
    ret = terminator(block)
    fn_type = ir.FunctionType.get([a.type for a in block.arguments], [v.type for v in ret.operands])
    func.attributes["function_type"] = ir.TypeAttr.get(fn_type)


class RefreshFunctionTypeOp(TransformExt.Operation, name="refresh_function_type"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        check_function(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    refresh_function_type_of(target)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def refresh_function_type(target: ir.Value) -> RefreshFunctionTypeOp:
    """Set the function_type of the functions in `target` from their bodies."""
    return RefreshFunctionTypeOp(target)


__all__ = ["RefreshFunctionTypeOp", "refresh_function_type", "refresh_function_type_of",
           "check_function"]
