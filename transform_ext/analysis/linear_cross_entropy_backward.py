"""The backward of a loss over the logits of a linear layer, as a joint graph imports it.

With S = h W^T (analysis/logits.py) the loss reads, the backward is

    G = E(S, ...)        elementwise over [N, V] (the loss's d logits: softmax minus the
                         one-hot, smoothed, weighted and scaled as the loss is)
    dh = G W             a contraction over the classes       ([N, D], or dh^T = W^T G^T)
    dW = G^T h           a contraction over the rows           ([V, D], or dW^T = h^T G)
    db = sum_n G         a sum over the rows                   ([V], or [1, V])

(G, W and h read directly or through 2-D linalg.transpose ops; a transposed result is the
backward of a transposed view, d(h^T) = (G W)^T).
`linear_cross_entropy_backward_in(block)` finds them (any of dh, dW, db may be missing, at
least one is there) or raises NotLinearCrossEntropyBackward with the reason: G must be the
one elementwise reader of S with S's shape; every reader of G must be one of the three
(through transposes of G); the contractions multiply-add into zeros in f32, reading W and h
as S does; G reads no other [N, V] tensor than S and function arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir

from ..common import defining_op, is_zero, user_op
from .classify import is_contraction, reduction_combiner
from .logits import LogitsContraction, NotLogits, row_max_logits, transposed_source
from .structure import dim_positions, is_linalg_op, loop_structure


class NotLinearCrossEntropyBackward(Exception):
    """No fusable backward of a loss over linear logits; the message is the reason."""


@dataclass
class LinearCrossEntropyBackward:
    logits: LogitsContraction
    gradient: ir.Operation           # G = E(S, ...), [N, V] or its transpose layout
    rows_loop: int                   # G's loop dim over the rows
    class_loop: int                  # G's loop dim over the classes
    d_rows: ir.Operation | None      # dh = G W
    d_weight: ir.Operation | None    # dW = G^T h
    d_bias: ir.Operation | None      # db = sum_n G
    transposes: list                 # linalg.transpose ops of G (read by dW only)
    transposed: tuple = ()           # the roles ("rows", "weight") whose result is transposed

    @property
    def replaced(self) -> list[ir.Operation]:
        return [op for op in (self.d_rows, self.d_weight, self.d_bias) if op is not None]


def _readers(value: ir.Value) -> list[ir.Operation]:
    found = []
    for use in value.uses:
        op = user_op(use)
        if op not in found:
            found.append(op)
    return found


def _gradient(logits: LogitsContraction) -> tuple[ir.Operation, int, int]:
    """G, its rows loop and its class loop."""
    s = logits.result
    shape = list(ir.RankedTensorType(s.type).shape)
    found = []
    for op in _readers(s):
        if not is_linalg_op(op) or op.name != "linalg.generic":
            continue
        ls = loop_structure(op)
        if ls.reduction_dims or len(op.results) != 1 or ls.num_loops != 2:
            continue
        if list(ir.RankedTensorType(op.results[0].type).shape) != shape:
            continue
        found.append(op)
    if len(found) != 1:
        raise NotLinearCrossEntropyBackward(
            f"expected one elementwise op over the logits computing their gradient, found "
            f"{len(found)}")
    g = found[0]
    ls = loop_structure(g)
    index = list(g.operands).index(s)
    rows_loop, class_loop = dim_positions(ls.maps[index])
    if rows_loop is None or class_loop is None or \
            dim_positions(ls.output_map(0)) != [rows_loop, class_loop]:
        raise NotLinearCrossEntropyBackward("the gradient of the logits is not computed "
                                            "[rows, classes] from them")
    for value, amap in zip(list(g.operands)[:ls.num_inputs], ls.maps):
        if not amap.is_projected_permutation and not _broadcast_map(amap):
            raise NotLinearCrossEntropyBackward("the gradient reads a tensor through a "
                                                "non-projected indexing map")
        if value != s and isinstance(value.type, ir.RankedTensorType) and \
                {rows_loop, class_loop} <= set(p for p in dim_positions(amap) if p is not None) \
                and not isinstance(value, ir.BlockArgument):
            raise NotLinearCrossEntropyBackward("the gradient reads an [N, V] tensor computed "
                                                "in the function besides the logits")
    return g, rows_loop, class_loop


def _broadcast_map(amap: ir.AffineMap) -> bool:
    """Results that are loop dims (distinct) or the constant 0 (a unit dim)."""
    dims = []
    for expr in amap.results:
        if isinstance(expr, ir.AffineDimExpr):
            dims.append(expr.position)
        elif not (isinstance(expr, ir.AffineConstantExpr) and expr.value == 0):
            return False
    return len(dims) == len(set(dims))


def _multiply_add_into_zeros(op: ir.Operation, what: str) -> None:
    ls = loop_structure(op)
    if ls.num_outputs != 1 or not ls.is_static or not is_zero(op.operands[ls.num_inputs]):
        raise NotLinearCrossEntropyBackward(f"{what} ({op.name}) does not accumulate into zeros")
    if str(ir.RankedTensorType(op.results[0].type).element_type) != "f32":
        raise NotLinearCrossEntropyBackward(f"{what} ({op.name}) does not accumulate in f32")


def _classify(op: ir.Operation, g_value: ir.Value, transposed: bool,
              logits: LogitsContraction) -> tuple[str, bool]:
    """('rows' (dh), 'weight' (dW) or 'bias' (db), whether the result is transposed) for a
    reader `op` of G (or of G^T when `transposed`); NotLinearCrossEntropyBackward
    otherwise."""
    if not is_linalg_op(op):
        raise NotLinearCrossEntropyBackward(f"the gradient of the logits is read by {op.name}")
    ls = loop_structure(op)
    index = list(op.operands).index(g_value)
    if index >= ls.num_inputs:
        raise NotLinearCrossEntropyBackward("the gradient of the logits is an accumulator")
    g_dims = dim_positions(ls.maps[index])
    rows_dim, class_dim = (g_dims[1], g_dims[0]) if transposed else (g_dims[0], g_dims[1])
    out = dim_positions(ls.output_map(0)) if ls.num_outputs == 1 else None
    if is_contraction(op) and ls.num_inputs == 2:
        _multiply_add_into_zeros(op, "a contraction of the logits' gradient")
        other = op.operands[1 - index]
        direct = dim_positions(ls.maps[1 - index])
        traced = transposed_source(other)
        reduced = ls.reduction_dims
        for role, source, kept in (("rows", logits.weight, rows_dim),
                                   ("weight", logits.rows, class_dim)):
            summed = class_dim if role == "rows" else rows_dim
            if other == source:
                other_dims = direct
            elif traced is not None and traced[0] == source:  # dims of the source
                other_dims = direct[::-1]
            else:
                continue
            if reduced != [summed] or len(other_dims) != 2 or other_dims[0] != summed \
                    or out is None:
                continue
            if out == [kept, other_dims[1]]:
                return role, False
            if out == [other_dims[1], kept]:
                return role, True
        raise NotLinearCrossEntropyBackward(
            f"a contraction ({op.name}) of the logits' gradient is neither G W (d rows) nor "
            f"G^T h (d weight) with the layer's own h and W")
    if reduction_combiner(op) == "add" and ls.num_inputs == 1 and ls.reduction_dims == [rows_dim] \
            and out is not None and [d for d in out if d is not None] == [class_dim] \
            and all(d is not None or _is_zero_expr(e) for d, e in
                    zip(out, ls.output_map(0).results)):
        _multiply_add_into_zeros(op, "the sum of the logits' gradient over the rows")
        return "bias", False
    raise NotLinearCrossEntropyBackward(
        f"the gradient of the logits is read by {op.name}, which is not G W, G^T h or a sum "
        f"over the rows")


def _is_zero_expr(expr) -> bool:
    return isinstance(expr, ir.AffineConstantExpr) and expr.value == 0


def linear_cross_entropy_backward_in(block: ir.Block) -> LinearCrossEntropyBackward:
    """The backward of the loss over linear logits in `block` (see the module docstring)."""
    try:
        logits = row_max_logits(block)
    except NotLogits as exc:
        raise NotLinearCrossEntropyBackward(str(exc))
    g, rows_loop, class_loop = _gradient(logits)
    roles: dict[str, ir.Operation] = {}
    flipped = []
    transposes = []
    pending = [(op, g.results[0], False) for op in _readers(g.results[0])]
    while pending:
        op, value, transposed = pending.pop(0)
        traced = transposed_source(op.results[0]) if op.name == "linalg.transpose" else None
        if traced is not None:
            transposes.append(op)
            pending.extend((r, op.results[0], not transposed) for r in _readers(op.results[0]))
            continue
        role, flip = _classify(op, value, transposed, logits)
        if role in roles:
            raise NotLinearCrossEntropyBackward(f"the gradient of the logits has two {role} "
                                                f"contractions")
        roles[role] = op
        if flip:
            flipped.append(role)
    if not roles:
        raise NotLinearCrossEntropyBackward("nothing reads the gradient of the logits")
    return LinearCrossEntropyBackward(logits, g, rows_loop, class_loop, roles.get("rows"),
                                      roles.get("weight"), roles.get("bias"), transposes,
                                      tuple(flipped))
