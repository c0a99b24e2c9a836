"""The dims of a convolution, read from a linalg op's indexing maps.

A convolution (a named linalg conv op, or a generic of the same form) has two inputs, the
image X and the filter W, and one output Y:

    Y[b, g, f, o_1..o_d] += X[b, g, c, o_1 s_1 + k_1 t_1, ...] * W[g, f, c, k_1..k_d]

in any order of the dims within each operand. The dims are classified by the operands that
index them: batch b (X and Y), group g (all three: a depthwise channel or a group of a
grouped convolution), output channel f (W and Y), input channel c (X and W, a reduction),
image o_i (Y, and X through o_i s_i + k_i t_i), window k_i (W, and X through the same
expression, a reduction); s_i is the stride, t_i the dilation. An image expression may also
read as o_i s_i + k_i t_i with s_i or t_i = 1, or (a window of extent 1 dropped) o_i s_i.
The body multiplies the two inputs (possibly extended to the accumulator's type) and adds
the product to the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import linalg

from .structure import is_linalg_op, loop_structure


class NotConvolution(ValueError):
    """The op is not a convolution; the message says why."""


@dataclass(frozen=True)
class WindowExpr:
    """One image result of X's map: image dim `image` times `stride` plus window dim
    `window` (None: no window term) times `dilation`."""

    image: int
    stride: int
    window: int | None
    dilation: int


@dataclass
class ConvolutionDims:
    op: ir.Operation
    input_index: int          # the operand holding X (its map has the window expressions)
    filter_index: int         # the operand holding W
    batch: list[int]
    group: list[int]
    out_channel: list[int]
    in_channel: list[int]
    image: list[int]          # o_i, in the order of X's results
    window: list[int]         # k_i of the same results (None where the result has no window)
    strides: list[int]
    dilations: list[int]
    ranges: list[int | None]
    exprs: dict[int, WindowExpr]   # X's result position -> its window expression

    @property
    def window_extents(self) -> list[int]:
        return [self.ranges[k] if k is not None else 1 for k in self.window]


def linear_terms(expr) -> dict[int, int] | None:
    """{dim: coefficient} of a sum of dims times positive constants, None otherwise."""
    if isinstance(expr, ir.AffineDimExpr):
        return {expr.position: 1}
    if isinstance(expr, ir.AffineMulExpr):
        lhs, rhs = expr.lhs, expr.rhs
        if isinstance(lhs, ir.AffineConstantExpr):
            lhs, rhs = rhs, lhs
        if isinstance(lhs, ir.AffineDimExpr) and isinstance(rhs, ir.AffineConstantExpr) and rhs.value > 0:
            return {lhs.position: rhs.value}
        return None
    if isinstance(expr, ir.AffineAddExpr):
        lhs, rhs = linear_terms(expr.lhs), linear_terms(expr.rhs)
        if lhs is None or rhs is None or set(lhs) & set(rhs):
            return None
        return {**lhs, **rhs}
    return None


def _window_expr(expr, iterators: list[str]) -> WindowExpr | None:
    terms = linear_terms(expr)
    if terms is None or len(terms) > 2:
        return None
    parallel = [d for d in terms if iterators[d] == "parallel"]
    reduction = [d for d in terms if iterators[d] == "reduction"]
    if len(parallel) != 1 or len(reduction) > 1:
        return None
    o = parallel[0]
    k = reduction[0] if reduction else None
    return WindowExpr(o, terms[o], k, terms[k] if k is not None else 1)


def _dims_of(amap) -> set[int]:
    return {e.position for e in amap.results if isinstance(e, ir.AffineDimExpr)}


def convolution_dims(op, static: bool = True) -> ConvolutionDims:
    """The convolution dims of `op` (module docstring), or NotConvolution with the reason.
    static=False also takes ops with dynamic extents (a tile at an edge); their `ranges`
    hold None there."""
    op = getattr(op, "operation", op)
    if not is_linalg_op(op) or linalg.get_indexing_maps(op) is None:
        raise NotConvolution("not a structured linalg op")  # (a pack or unpack has no maps)
    ls = loop_structure(op)
    if ls.num_inputs != 2 or ls.num_outputs != 1:
        raise NotConvolution("does not have two inputs and one output")
    if static and not ls.is_static:
        raise NotConvolution("has dynamic shapes")
    out_map = ls.output_map(0)
    if not out_map.is_projected_permutation or len(out_map.results) != len(_dims_of(out_map)):
        raise NotConvolution("its output map is not a projected permutation")
    found = None
    for index in (0, 1):
        amap = ls.maps[index]
        exprs = {}
        for pos, e in enumerate(amap.results):
            if isinstance(e, ir.AffineDimExpr):
                continue
            w = _window_expr(e, ls.iterators)
            if w is None:
                raise NotConvolution(f"input {index} has the index expression {e} (wants dims "
                                     f"or image * stride + window * dilation)")
            exprs[pos] = w
        if exprs:
            if found is not None:
                raise NotConvolution("both inputs have window expressions")
            found = (index, exprs)
    if found is None:
        raise NotConvolution("no input has a window expression (image * stride + window * dilation)")
    x_index, exprs = found
    w_index = 1 - x_index
    w_map = ls.maps[w_index]
    if not w_map.is_projected_permutation or len(w_map.results) != len(_dims_of(w_map)):
        raise NotConvolution("its filter map is not a projected permutation")
    x_dims, w_dims, y_dims = _dims_of(ls.maps[x_index]), _dims_of(w_map), _dims_of(out_map)
    image = [w.image for w in exprs.values()]
    window = [w.window for w in exprs.values()]
    if len(set(image)) != len(image) or len({k for k in window if k is not None}) != \
            len([k for k in window if k is not None]):
        raise NotConvolution("an image or window dim appears in two window expressions")
    for o in image:
        if o not in y_dims or o in x_dims or o in w_dims:
            raise NotConvolution(f"image dim d{o} is not indexed by the output alone")
    for k in window:
        if k is not None and (k not in w_dims or k in x_dims or k in y_dims):
            raise NotConvolution(f"window dim d{k} is not a filter dim")
    classes = {"batch": [], "group": [], "out_channel": [], "in_channel": []}
    special = set(image) | {k for k in window if k is not None}
    for d in range(ls.num_loops):
        if d in special:
            continue
        where = (d in x_dims, d in w_dims, d in y_dims)
        kind = {(True, False, True): "batch", (True, True, True): "group",
                (False, True, True): "out_channel", (True, True, False): "in_channel"}.get(where)
        if kind is None or (kind == "in_channel") != (ls.iterators[d] == "reduction"):
            raise NotConvolution(f"dim d{d} is not a batch, group, channel, image or window dim")
        classes[kind].append(d)
    _check_body(op)
    return ConvolutionDims(op, x_index, w_index, classes["batch"], classes["group"],
                           classes["out_channel"], classes["in_channel"], image, window,
                           [w.stride for w in exprs.values()], [w.dilation for w in exprs.values()],
                           list(ls.ranges), exprs)


_EXTENSIONS = ("arith.extf", "arith.truncf")


def _check_body(op: ir.Operation) -> None:
    """Named convolutions are multiply-accumulates by definition; a generic's body must be
    `out + x * w` (the inputs possibly extended first)."""
    if op.name != "linalg.generic":
        if "conv" not in op.name:
            raise NotConvolution(f"{op.name} is not a convolution")
        return
    block = op.regions[0].blocks[0]
    ops = [o.operation for o in block.operations]
    names = [o.name for o in ops]
    core = [n for n in names if n not in _EXTENSIONS]
    if core != ["arith.mulf", "arith.addf", "linalg.yield"]:
        raise NotConvolution(f"its body computes {', '.join(names[:-1])} (wants out + x * w)")
    args = list(block.arguments)

    def source(value):
        owner = value.owner
        owner = getattr(owner, "operation", owner)
        while isinstance(owner, ir.Operation) and owner.name in _EXTENSIONS:
            value = owner.operands[0]
            owner = getattr(value.owner, "operation", value.owner)
        return value

    mul = ops[names.index("arith.mulf")]
    add = ops[names.index("arith.addf")]
    if {source(v) for v in mul.operands} != {args[0], args[1]}:
        raise NotConvolution("its body does not multiply the two inputs")
    if args[2] not in {source(v) for v in add.operands} or \
            mul.results[0] not in {source(v) for v in add.operands}:
        raise NotConvolution("its body does not add the product to the output")
    if ops[-1].operands[0] != add.results[0] and source(ops[-1].operands[0]) != add.results[0]:
        raise NotConvolution("its body does not yield the sum")


def is_convolution(op) -> bool:
    """Is `op` a convolution (static or not)?"""
    try:
        convolution_dims(op, static=False)
        return True
    except NotConvolution:
        return False
