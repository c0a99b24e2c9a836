"""Recognizing a cross-entropy over the logits of a linear layer.

`recognize` is the cheap test the family registry runs on an import: a log-softmax (max,
exp, log) whose row max reads a contraction without batch dims, through elementwise ops and
reshapes (the logits h W^T [+ b] of F.linear / nn.Linear, viewed as [N, V]), in a function
taking i32/i64 targets (an attention's backward has a log-sum-exp over a contraction too). The plan (plan.py) then says
whether the schedule takes it, or why not.
"""

from __future__ import annotations

from torch_mlir import ir

from transform_ext.analysis.classify import is_contraction
from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import block_ops, defining_op, walk_ops

from ..generic import single_func

RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")


class NotLinearCrossEntropy(Exception):
    """The payload is not a loss over linear logits this schedule takes; the message is the
    reason."""


def linear_cross_entropy_func(payload: ir.Module) -> ir.Operation:
    return single_func(payload, NotLinearCrossEntropy)


def _reads_contraction(value: ir.Value) -> bool:
    """`value` is computed from a contraction through elementwise linalg ops and reshapes
    (first operands)."""
    for _ in range(64):
        producer = defining_op(value)
        if producer is None:
            return False
        if producer.name in RESHAPES:
            value = producer.operands[0]
            continue
        if not is_linalg_op(producer):
            return False
        if is_contraction(producer):
            return not loop_structure(producer).contraction_dims()["batch"]
        ls = loop_structure(producer)
        if ls.reduction_dims:
            return False
        value = producer.operands[0]
    return False


def recognize(payload: ir.Module) -> bool:
    """Cheap test: a log-softmax (max, exp, log) whose max reduction reads a contraction
    without batch dims, in a function taking i32/i64 tensors (the targets; an attention's
    log-sum-exp has none, its masks are booleans)."""
    names = {op.name for op in walk_ops(payload.operation, lambda op: True)}
    if not {"arith.maximumf", "math.exp", "math.log"} <= names:
        return False
    funcs = [op.operation for op in payload.body.operations if op.operation.name == "func.func"]
    for func in funcs:
        if not any(isinstance(a.type, ir.RankedTensorType) and
                   isinstance(a.type.element_type, ir.IntegerType) and
                   ir.IntegerType(a.type.element_type).width >= 32
                   for a in func.regions[0].blocks[0].arguments):
            continue
        for op in block_ops(func):
            if not is_linalg_op(op) or not op.regions or \
                    "reduction" not in loop_structure(op).iterators:
                continue
            if walk_ops(op, lambda o: o.name == "arith.maximumf") and _reads_contraction(op.operands[0]):
                return True
    return False
