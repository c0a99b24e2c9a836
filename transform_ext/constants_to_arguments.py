"""constants_to_arguments: a function's frozen weights become trailing arguments.

    func.func @f(%x: A) -> R {
      %w = arith.constant dense<[...]> : tensor<K x T>       (not a splat, rank >= 1)
      .. %w ..
    }
  =>
    func.func @f(%x: A, %w: tensor<K x T>) -> R {
      .. %w ..
    }

A kernel on a device reads its weights from device memory, not from a host global: the
caller passes the values the constants held (the launcher's manifest lists them). Rewritten:
the `arith.constant` ops of ranked tensors with more than one distinct element directly in the
body of each target function, in their order, become arguments appended to the signature
(`function_type` follows); their uses read the arguments. Splats and rank-0 constants stay
(they are folded into the kernels). A target that is not a func.func with a body, or a
function some op of its module calls (the call would lack the new arguments), is a
silenceable failure (nothing rewritten). The handle stays valid (the functions are the same ops).
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, RewritesTargets, Success, fail, payload_ops, walk_ops
from .dialect import TransformExt

NAME = "transform_ext.constants_to_arguments"


def frozen_weights(func: ir.Operation) -> list[ir.Operation]:
    """The constants of `func`'s body that become arguments, in their order."""
    out = []
    for op in func.regions[0].blocks[0].operations:
        op = op.operation
        if op.name != "arith.constant" or not isinstance(op.results[0].type, ir.RankedTensorType):
            continue
        value = op.attributes["value"]
        if (isinstance(value, ir.DenseElementsAttr) and value.is_splat) or \
                op.results[0].type.rank == 0:
            continue
        out.append(op)
    return out


def _check(func: ir.Operation) -> None:
    if func.name != "func.func" or not len(func.regions[0].blocks):
        raise Illegal(func, "not a func.func with a body")
    name = ir.StringAttr(func.attributes["sym_name"]).value
    module = func.parent
    callers = walk_ops(module, lambda o: o.name == "func.call" and
                       ir.FlatSymbolRefAttr(o.attributes["callee"]).value == name) if module else []
    if callers:
        raise Illegal(func, f"called at {callers[0].location}: the call would lack the weights")


def _rewrite(func: ir.Operation) -> None:
    block = func.regions[0].blocks[0]
    moved = frozen_weights(func)
    for op in moved:
        arg = block.add_argument(op.results[0].type, op.location)
        op.results[0].replace_all_uses_with(arg)
        op.erase()
    if moved:
        fn_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
        new_type = ir.FunctionType.get([a.type for a in block.arguments], list(fn_type.results))
        func.attributes["function_type"] = ir.TypeAttr.get(new_type)


class ConstantsToArgumentsOp(TransformExt.Operation, name="constants_to_arguments"):
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
                for target in targets:
                    _rewrite(target)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def constants_to_arguments(target: ir.Value) -> ConstantsToArgumentsOp:
    """The frozen weights of the functions in `target` as trailing arguments (see the module
    docstring)."""
    return ConstantsToArgumentsOp(target)


__all__ = ["ConstantsToArgumentsOp", "constants_to_arguments", "frozen_weights"]
