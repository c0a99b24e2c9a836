"""inline_argument_producers: elementwise producers that compute from the function's
arguments only are computed in the bodies of the target ops that read them.

    %new = transform_ext.inline_argument_producers %consumers {gathers = false}

A producer P qualifies when it is a linalg.generic in the consumer's block with parallel
loops only and no cf.assert, whose inputs are arguments of that block (the function's),
arith.constant results or results of qualifying producers, and whose body reads no tensor
(`tensor.extract`) but, with `gathers`, a function argument or a constant (a frozen
weight) at computed indices (the target's weight w[y_i]). Each consumer inlines such producers as
inline_elementwise_producers does (C(.., P(a)[M(i)], ..) = C(.., body_P(a[..]), ..), the
same scalar operations on the same values: exact; P is erased once nothing reads it), first
input first, to a fixed point, consumers in handle order. The consumers then read the
arguments themselves: the cross-entropy's target check reads y only (it stays on the host),
a reduction over the rows reads y and w instead of per-row values of a kernel.

Legality first: every consumer is a linalg.generic on tensors; else a silenceable failure
naming it (nothing rewritten). The consumers' handle is consumed; the result holds the
rebuilt consumers, in order.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import (Illegal, ReplacesTargets, Success, block_ops, body_of, defining_op, fail,
                     is_argument_view, iterator_kinds, payload_ops)
from .dialect import TransformExt
from .inline_elementwise_producers import _check_consumer, inline_all

NAME = "transform_ext.inline_argument_producers"


def _is_gatherable(value: ir.Value, block: ir.Block) -> bool:
    """An argument of `block`, or a constant (a frozen weight: an argument on the GPU)."""
    p = defining_op(value)
    return is_argument_view(value, block) or (p is not None and p.name == "arith.constant")


def computes_from_arguments(op: ir.Operation, block: ir.Block, gathers: bool = False) -> bool:
    """Is `op` an elementwise function of the arguments of `block` (module docstring)?"""
    if op.name != "linalg.generic" or "reduction" in iterator_kinds(op):
        return False
    for inner in block_ops(body_of(op)):
        if inner.name == "cf.assert":
            return False
        if inner.name == "tensor.extract" and not (gathers and _is_gatherable(inner.operands[0],
                                                                              block)):
            return False
    for v in op.opview.inputs:
        p = defining_op(v)
        if is_argument_view(v, block) or (p is not None and p.name == "arith.constant"):
            continue
        if p is None or p.parent != op.parent or not computes_from_arguments(p, block, gathers):
            return False
    return True


class InlineArgumentProducersOp(TransformExt.Operation, name="inline_argument_producers"):
    consumers: ext.Operand[transform.AnyOpType]
    gathers: ir.IntegerAttr  # i1
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                consumers = payload_ops(state, op.consumers)
                gathers = bool(ir.IntegerAttr(op.gathers).value)
                try:
                    for c in consumers:
                        _check_consumer(c)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                rebuilt = []
                for c in consumers:
                    block = c.block
                    rebuilt.append(inline_all(
                        c, lambda p, block=block: computes_from_arguments(p, block, gathers),
                        rewriter=rewriter))
                results.set_ops(op.result, rebuilt)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def inline_argument_producers(consumers: ir.Value, gathers: bool = False) -> ir.Value:
    """Inline into `consumers` their producers computed from the function's arguments only
    (module docstring); returns the rebuilt consumers."""
    return InlineArgumentProducersOp(
        consumers, ir.IntegerAttr.get(ir.IntegerType.get_signless(1), int(gathers))).result


__all__ = ["InlineArgumentProducersOp", "inline_argument_producers", "computes_from_arguments"]
