"""trim_window_inputs: an input read through window expressions is sliced to the elements
its windows reach.

A pooling's input dim indexed by o*s + k*d (o an output dim, k a window dim, a reduction)
reads indices up to (O-1)*s + (K-1)*d; torch's floor mode and padding leave rows past that
unread (KernelBench-style 3-D poolings: a padded H of 20 under one window of 12). Folding
unit dims (`linalg-fold-unit-extent-dims`) turns o*s + k*d with O = 1 into k*d, a plain dim
k when d = 1, and linalg then requires the input's extent there to equal K: 20 != 12, an
invalid op, and the generic schedule fell back to loops. Here such an input is sliced to
(O-1)*s + (K-1)*d + 1 along that dim first (an extract_slice at offset 0; the op reads the
same elements).

Targets: nested in the target ops, linalg ops with static tensor operands; each input
result that is a sum of two or more dims times positive constants, one of them a reduction
dim, and all but one of extent 1, that one with coefficient 1 (what folding leaves a plain
dim), is trimmed where it reaches less than the input's extent; other reads stay as they
are (a padded input stays a tensor.pad for the schedule's pad-aware steps). The ops are
updated in place; never fails. The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.convolution import linear_terms
from .analysis.structure import is_linalg_op, loop_structure
from .common import RewritesTargets, Success, is_static_tensor, planned_ops, strided_slice
from .dialect import TransformExt


def reached_extents(op: ir.Operation) -> dict[int, list[int]] | None:
    """{input index: its extents trimmed to what its window expressions reach}, for the
    inputs with a window dim reaching less than its extent; None when there are none."""
    if not is_linalg_op(op) or not all(is_static_tensor(v) for v in op.operands):
        return None
    ls = loop_structure(op)
    if not ls.is_static:
        return None
    trimmed = {}
    for i in range(ls.num_inputs):
        shape = list(ir.RankedTensorType(op.operands[i].type).shape)
        reach = list(shape)
        for pos, expr in enumerate(ls.maps[i].results):
            terms = linear_terms(expr)
            if terms is None or len(terms) < 2 or not any(d in ls.reduction_dims for d in terms):
                continue
            wide = [(d, c) for d, c in terms.items() if ls.ranges[d] > 1]
            if len(wide) != 1 or wide[0][1] != 1:
                continue  # folding unit dims leaves no plain dim here
            reach[pos] = min(shape[pos], sum(c * (ls.ranges[d] - 1) for d, c in terms.items()) + 1)
        if reach != shape:
            trimmed[i] = reach
    return trimmed or None


class TrimWindowInputsOp(TransformExt.Operation, name="trim_window_inputs"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                for p, plan in planned_ops(state, op.target, reached_extents):
                    with ir.InsertionPoint(p), p.location:
                        for i, reach in plan.items():
                            value = p.operands[i]
                            p.operands[i] = strided_slice(value, [0] * len(reach), reach, [1] * len(reach))
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def trim_window_inputs(target: ir.Value) -> TrimWindowInputsOp:
    """Slice the window-read inputs of the linalg ops nested in `target` to what their
    windows reach (module docstring)."""
    return TrimWindowInputsOp(target)


__all__ = ["TrimWindowInputsOp", "reached_extents", "trim_window_inputs"]
