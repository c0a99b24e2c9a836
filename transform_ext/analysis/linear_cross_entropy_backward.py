"""The backward of a loss over the logits of a linear layer, as a joint graph imports it.

With S = h W^T (analysis/logits.py) the loss reads, the backward is

    G = E(S, ...)        elementwise over [N, V] (the loss's d logits: softmax minus the
                         one-hot, smoothed, weighted and scaled as the loss is)
    dh = G W             a contraction over the classes       ([N, D], or dh^T = W^T G^T)
    dW = G^T h           a contraction over the rows           ([V, D], or dW^T = h^T G)
    db = sum_n G         a reduction over the rows             ([V], or [1, V]); after the
                         restructure of the loss it may read S itself, E inlined in its body:
                         any reduction over the rows of a function of S or G (a "column sum")

(G, W and h read directly or through 2-D linalg.transpose ops; a transposed result is the
backward of a transposed view, d(h^T) = (G W)^T).

`linear_cross_entropy_backward_in(block)` finds them (any may be missing, one at least is
there) or raises NotLinearCrossEntropyBackward with the reason: at most one elementwise
reader of S with S's shape (G); every reader of G one of the above (through transposes of
G); the contractions multiply-add into zeros in f32, reading W and h as S does; G and the
column sums read no other [N, V] tensor than S, G and function arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir

from ..common import is_zero, user_op
from .classify import is_contraction, reduction_combiner
from .logits import LogitsContraction, NotLogits, row_max_logits, transposed_source
from .structure import dim_positions, is_linalg_op, loop_structure


class NotLinearCrossEntropyBackward(Exception):
    """No fusable backward of a loss over linear logits; the message is the reason."""


@dataclass
class RowsAndClasses:
    """A 2-loop op over [rows, classes] reading S (or G): which loop is which."""

    op: ir.Operation
    rows_loop: int
    class_loop: int


@dataclass
class LinearCrossEntropyBackward:
    logits: LogitsContraction
    gradient: RowsAndClasses | None  # G = E(S, ...), when a contraction reads it
    d_rows: ir.Operation | None      # dh = G W
    d_weight: ir.Operation | None    # dW = G^T h
    column_sums: list                # RowsAndClasses: reductions over the rows (db)
    transposes: list                 # linalg.transpose ops of G (read by dW only)
    transposed: tuple = ()           # the roles ("rows", "weight") whose result is transposed

    @property
    def replaced(self) -> list[ir.Operation]:
        return [op for op in (self.d_rows, self.d_weight) if op is not None] + \
            [c.op for c in self.column_sums]


def _readers(value: ir.Value) -> list[ir.Operation]:
    found = []
    for use in value.uses:
        op = user_op(use)
        if op not in found:
            found.append(op)
    return found


def _rows_and_classes(op: ir.Operation, value: ir.Value, transposed: bool = False):
    """(rows loop, class loop) of a 2-loop linalg.generic reading `value` ([rows, classes],
    or [classes, rows] when `transposed`) through plain dims; None otherwise."""
    if not is_linalg_op(op) or op.name != "linalg.generic" or len(op.results) != 1:
        return None
    ls = loop_structure(op)
    if ls.num_loops != 2 or not ls.is_static:
        return None
    index = list(op.operands).index(value)
    if index >= ls.num_inputs:
        return None
    dims = dim_positions(ls.maps[index])
    if len(dims) != 2 or None in dims or dims[0] == dims[1]:
        return None
    return (dims[1], dims[0]) if transposed else (dims[0], dims[1])


def _check_inputs(op: ir.Operation, tiled: set, rows_loop: int, class_loop: int, what: str):
    """`op` reads every tensor through plain dims or unit constants, and the [N, V] ones
    are in `tiled` (S, G) or function arguments."""
    ls = loop_structure(op)
    for value, amap in zip(list(op.operands)[:ls.num_inputs], ls.maps):
        if not _broadcast_map(amap):
            raise NotLinearCrossEntropyBackward(f"{what} reads a tensor through a "
                                                f"non-projected indexing map")
        if value not in tiled and isinstance(value.type, ir.RankedTensorType) and \
                {rows_loop, class_loop} <= set(p for p in dim_positions(amap) if p is not None) \
                and not isinstance(value, ir.BlockArgument):
            raise NotLinearCrossEntropyBackward(f"{what} reads an [N, V] tensor computed in "
                                                f"the function besides the logits")


def _gradient(logits: LogitsContraction) -> RowsAndClasses | None:
    """G: the elementwise reader of S with S's shape (None: there is none)."""
    s = logits.result
    shape = list(ir.RankedTensorType(s.type).shape)
    found = []
    for op in _readers(s):
        loops = _rows_and_classes(op, s)
        if loops is None or loop_structure(op).reduction_dims or \
                list(ir.RankedTensorType(op.results[0].type).shape) != shape:
            continue
        found.append(RowsAndClasses(op, *loops))
    if len(found) > 1:
        raise NotLinearCrossEntropyBackward(
            f"expected one elementwise op over the logits computing their gradient, found "
            f"{len(found)}")
    if not found:
        return None
    g = found[0]
    if dim_positions(loop_structure(g.op).output_map(0)) != [g.rows_loop, g.class_loop]:
        raise NotLinearCrossEntropyBackward("the gradient of the logits is not computed "
                                            "[rows, classes] from them")
    _check_inputs(g.op, {s}, g.rows_loop, g.class_loop, "the gradient of the logits")
    return g


def _column_sum(op: ir.Operation, value: ir.Value, tiled: set,
                transposed: bool = False) -> RowsAndClasses | None:
    """A reduction over the rows of a function of `value` (S or G), written per class; None
    when `op` is not one."""
    loops = _rows_and_classes(op, value, transposed)
    if loops is None:
        return None
    rows_loop, class_loop = loops
    ls = loop_structure(op)
    out = ls.output_map(0)
    if ls.reduction_dims != [rows_loop] or reduction_combiner(op) is None or \
            [d for d in dim_positions(out) if d is not None] != [class_loop] or \
            not all(d is not None or _is_zero_expr(e) for d, e in zip(dim_positions(out), out.results)):
        return None
    _check_inputs(op, tiled, rows_loop, class_loop, "a reduction over the rows")
    return RowsAndClasses(op, rows_loop, class_loop)


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
    """('rows' (dh) or 'weight' (dW), whether the result is transposed) for a contraction
    reading G (or G^T when `transposed`); NotLinearCrossEntropyBackward otherwise."""
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
    s = logits.result
    g = _gradient(logits)
    tiled = {s} | ({g.op.results[0]} if g is not None else set())
    sums = [c for c in (_column_sum(op, s, tiled) for op in _readers(s)) if c is not None]
    roles: dict[str, ir.Operation] = {}
    flipped = []
    transposes = []
    pending = [(op, g.op.results[0], False) for op in _readers(g.op.results[0])] if g else []
    while pending:
        op, value, transposed = pending.pop(0)
        traced = transposed_source(op.results[0]) if op.name == "linalg.transpose" else None
        if traced is not None:
            transposes.append(op)
            pending.extend((r, op.results[0], not transposed) for r in _readers(op.results[0]))
            continue
        column = _column_sum(op, value, tiled, transposed)
        if column is not None:
            if transposed:
                raise NotLinearCrossEntropyBackward("a reduction over the rows reads the "
                                                    "gradient of the logits transposed")
            sums.append(column)
            continue
        role, flip = _classify(op, value, transposed, logits)
        if role in roles:
            raise NotLinearCrossEntropyBackward(f"the gradient of the logits has two {role} "
                                                f"contractions")
        roles[role] = op
        if flip:
            flipped.append(role)
    if not roles and not sums:
        raise NotLinearCrossEntropyBackward("no gradient of the logits is computed")
    return LinearCrossEntropyBackward(logits, g if roles or any(
        g is not None and g.op.results[0] in list(c.op.operands) for c in sums) else None,
        roles.get("rows"), roles.get("weight"), sums, transposes, tuple(flipped))
