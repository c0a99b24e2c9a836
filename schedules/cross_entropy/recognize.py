"""Recognizing a cross-entropy (or log-softmax) in a payload and finding its ops.

`recognize` is the cheap test the family registry runs on an import; `find_cross_entropy`
the ops of the restructured loss (fuse.py steps 1-2): the row max over the classes, the
class sums, the gradient and the root tiled into the row forall, or NotCrossEntropy saying
why the payload is not one the schedule takes. `find_logits` is the function argument the
row max reads; `refuse_empty` and `has_rank0_reshape` what the plan (plan.py) reads before
the first step.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir

from transform_ext.analysis.classify import reduction_combiner
from transform_ext.analysis.dims import DimClasses
from transform_ext.analysis.structure import dim_positions, is_linalg_op, loop_structure
from transform_ext.common import Illegal, block_ops, defining_op, depends_on, walk_ops
from transform_ext.merge_elementwise import check_mergeable

from ..generic import single_func


class NotCrossEntropy(Exception):
    """The payload is not a cross-entropy this schedule takes; the message is the reason."""


@dataclass
class CrossEntropyOps:
    """The ops of one restructured cross-entropy (payload ops)."""

    row_max: ir.Operation          # m = max_c x
    class_sums: list               # reductions over the classes (exp-sum and siblings)
    gradient: ir.Operation | None  # the [.., C, ..] elementwise op writing d x, if any
    root: ir.Operation             # the op tiled into the row forall
    class_dim: int                 # of row_max's iteration space
    row_dims: list                 # loop dims of `root` running over the rows
    gradients: list                # every gradient op (several: to merge first; root and
                                   # gradient are None until then)


def cross_entropy_func(payload: ir.Module) -> ir.Operation:
    return single_func(payload, NotCrossEntropy)


def recognize(payload: ir.Module) -> bool:
    """Cheap test: a log_softmax (max, exp, log) and no matmul."""
    names = {op.name for op in walk_ops(payload.operation, lambda op: True)}
    return {"arith.maximumf", "math.exp", "math.log"} <= names and \
        not any(n.startswith(("linalg.batch_matmul", "linalg.matmul")) for n in names)


def refuse_empty(payload: ir.Module) -> None:
    """A function argument with a zero-size dim (no rows: N = 0) has nothing to fuse."""
    for arg in cross_entropy_func(payload).regions[0].blocks[0].arguments:
        if isinstance(arg.type, ir.RankedTensorType) and 0 in list(arg.type.shape):
            raise NotCrossEntropy(f"an input is empty ({arg.type})")


def has_rank0_reshape(payload: ir.Module) -> bool:
    found = []

    def visit(op):
        if op.name in ("tensor.expand_shape", "tensor.collapse_shape") and any(
                v.type.rank == 0 for v in list(op.operands)[:1] + list(op.results)):
            found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return bool(found)


def _row_max(func: ir.Operation) -> ir.Operation:
    maxes = [op for op in block_ops(func) if is_linalg_op(op) and reduction_combiner(op) == "max"
             and len(loop_structure(op).reduction_dims) == 1]
    if len(maxes) != 1:
        raise NotCrossEntropy(f"expected one row max over the classes (log_softmax), found {len(maxes)}")
    return maxes[0]


def find_logits(func: ir.Operation) -> ir.Value:
    """The function argument the row max reduces (directly or through elementwise ops), or
    its reshape when that is what the ops read (one row: [1, C] folded to [C])."""
    value = _row_max(func).operands[0]
    while not isinstance(value, ir.BlockArgument):
        op = defining_op(value)
        if op is not None and op.name in ("tensor.collapse_shape", "tensor.expand_shape") and \
                isinstance(op.operands[0], ir.BlockArgument):
            return value
        if op is None or not is_linalg_op(op) or not loop_structure(op).is_elementwise:
            raise NotCrossEntropy("the row max does not read a function argument (the logits)")
        value = op.operands[0]
    return value


def find_cross_entropy(payload: ir.Module) -> CrossEntropyOps:
    """Locate the row max, the class sums, the gradient and the root (or say why not; with
    several gradients only them: they are merged into one op first)."""
    func = cross_entropy_func(payload)
    ops = [op for op in block_ops(func) if is_linalg_op(op)]
    maxes = [op for op in ops if reduction_combiner(op) == "max"
             and len(loop_structure(op).reduction_dims) == 1]
    if len(maxes) != 1:
        raise NotCrossEntropy(f"expected one row max over the classes (log_softmax), found {len(maxes)}")
    row_max = maxes[0]
    class_dim = loop_structure(row_max).reduction_dims[0]
    _check_classes_innermost(row_max, class_dim)
    classes = DimClasses(ops)
    axis = (row_max, class_dim)
    m = row_max.results[0]

    def iterates_classes(op):
        return any(classes.same((op, l), axis) for l in range(loop_structure(op).num_loops))

    def reduces_classes(op):
        ls = loop_structure(op)
        return len(ls.reduction_dims) == 1 and classes.same((op, ls.reduction_dims[0]), axis)

    class_sums = [op for op in ops if op is not row_max and reduces_classes(op)]
    if not class_sums:
        raise NotCrossEntropy("no reduction over the classes besides the max")
    results = _returned_ops(func)
    x_elements = _numel(row_max.operands[0].type.shape)
    gradients = []
    for op in ops:
        if op is row_max or op in class_sums or not iterates_classes(op):
            continue
        ls = loop_structure(op)
        if _numel(ls.ranges) < x_elements:
            continue  # a loop over the classes only (weights, indices): no logits pass
        if op in results and not ls.reduction_dims and all(
                m.is_permutation for m in ls.maps[ls.num_inputs:]):
            gradients.append(op)
            continue
        raise NotCrossEntropy(f"{op.name} iterates over all the logits outside the fused "
                              f"pass ({'a reduction over the rows' if ls.reduction_dims else 'not a result'})")
    if len(gradients) > 1:
        if len({tuple(loop_structure(g).ranges) for g in gradients}) != 1:
            raise NotCrossEntropy("the gradients iterate over different spaces")
        try:
            check_mergeable(gradients)
        except Illegal as exc:
            raise NotCrossEntropy(f"the gradients cannot be merged into one op ({exc.reason})")
        return CrossEntropyOps(row_max, class_sums, None, None, class_dim, [], gradients)
    gradient = gradients[0] if gradients else None
    row_dims = [p for p in range(m.type.rank)]
    root = gradient if gradient is not None else last_row_op(ops, row_max, classes)
    root_rows = []
    for p in row_dims:
        for l in range(loop_structure(root).num_loops):
            if classes.same((root, l), (m, p)):
                root_rows.append(l)
    return CrossEntropyOps(row_max, class_sums, gradient, root, class_dim, root_rows, gradients)


def _check_classes_innermost(row_max: ir.Operation, class_dim: int) -> None:
    """The schedule runs its lanes along the classes: logits whose innermost dim is another
    one (log_softmax(x, dim=1) over [N, C, L], a segmentation loss) would be read across
    cache lines lane by lane (0.4-0.6x torch); the generic schedule reduces them across
    vectors along the contiguous dim instead (1.4-2.5x)."""
    ls = loop_structure(row_max)
    x = row_max.operands[0]
    read = dim_positions(ls.maps[0])
    inner = [d for d, extent in zip(read, x.type.shape) if extent != 1]
    if inner and inner[-1] != class_dim:
        raise NotCrossEntropy(f"the classes (extent {ls.ranges[class_dim]}) are not the innermost "
                              f"dim of the logits {x.type}")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _returned_ops(func: ir.Operation) -> list[ir.Operation]:
    """The ops computing the function's results (through reshapes: one row's gradient
    [C] is returned as [1, C])."""
    found = []
    for v in block_ops(func)[-1].operands:
        op = defining_op(v)
        while op is not None and op.name in ("tensor.expand_shape", "tensor.collapse_shape"):
            op = defining_op(op.operands[0])
        if op is not None:
            found.append(op)
    return found


def last_row_op(ops, row_max, classes) -> ir.Operation:
    """The last op over the rows (m's dims, all parallel) that depends on m."""
    m = row_max.results[0]
    last = None
    for op in ops:
        ls = loop_structure(op)
        if op is row_max or ls.reduction_dims or ls.num_loops != m.type.rank:
            continue
        if all(any(classes.same((op, l), (m, p)) for l in range(ls.num_loops))
               for p in range(m.type.rank)) and depends_on(op, m):
            last = op
    if last is None:
        raise NotCrossEntropy("no per-row op reads the log-softmax")
    return last
