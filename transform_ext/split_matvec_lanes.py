"""split_matvec_lanes: a matrix-vector product's k split into (k / L, L), L partial sums per
row, summed across the lanes once at the end; and likewise a short product's, L partial sums
per pair of rows.

A target is a contraction C[b.., m..] = init + sum_k A[b.., m.., k] x[b.., k] (any linalg op:
linalg.matmul with n = 1, batch_matmul, a generic; unit n dims allowed) whose k is the
innermost dim of A, the operand with m dims: its rows are contiguous along k. With
K = L K1 + r (k = L k1 + l for k < L K1), it becomes
    P[b.., m.., l] = sum_k1 A[b.., m.., k1, l] x[b.., k1, l]      (P zero-filled; l parallel)
    C'[b.., m..]   = init + sum_l P[b.., m.., l]
    C[b.., m..]    = C' + sum_{L K1 <= k < K} A[b.., m.., k] x[b.., k]    (only when r > 0)
(L = `lanes`, or half of it when that divides K and `lanes` does not; the first op reads A
and x through tensor.expand_shape views [.., K1, L] of their first L K1 elements along k; the
last is the target itself on the r trailing elements of k). Tiled with its lanes along l, the
first op is elementwise in the vector lanes (vector loads of A's rows and of x, an FMA per
vector, L / lanes running sums per row) instead of one gather-like scalar load of A per row
and k. Exact in real arithmetic; floating-point sums are reassociated.

A short product C[m.., n..] = init + sum_k A[m.., k] B[n.., k] (x @ W^T for a small batch:
rows on both sides, at most `short_rows` on one of them, the short side; k innermost in both
inputs; at the top level of its function) is split the same way with L = `short_lanes`:
    P[n.., m.., l] = sum_k1 A[m.., k1, l] B[n.., k1, l]
the short side's dims innermost but the lanes (a register tile's partial sums contiguous),
its loops the other side's rows first, then the short side's (tiles of a few rows of W walk
the batch while those rows stay in L1).
Each step is an FMA per pair of rows with one vector of each: B is read once, in place, where
an outer-product kernel wants B^T (a transposed copy or pack of W per call: a [4, 4096] x
[4096, 4096]^T product ran 4x slower so). A product in a loop body is left alone: a
recurrent step's W^T copy is loop-invariant, and outer products beat dot products there (an
LSTM's steps ran 1.7x slower split).

Targets: func.func ops; every linalg op nested in them that qualifies (`split_plan`) is
rewritten, the others are left alone: a static-shaped contraction on tensors of floats with
one result, one k dim with K >= 2 L, an m dim and no n dim of extent > 1 (or the other way
round: the rows are then the n dims) or a short product, k the innermost dim of the inputs
holding the rows, those inputs not a linalg.transpose (k innermost in the view only: folded
away first by transform_ext.fold_transposes_into_matvecs), and a body without linalg.index.
A target that is not a func.func, lanes < 1, or short_rows > 0 with short_lanes < 1 is a
silenceable failure, nothing rewritten. The handle is only read.
"""

import math
from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.structure import dim_positions, is_linalg_op, loop_structure
from .common import (Illegal, RewritesTargets, Success, body_of, build_generic, clone_body,
                     defining_op, fail,
                     i64_array, payload_ops, reassociation_attr, strided_slice, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.split_matvec_lanes"


@dataclass(frozen=True)
class SplitPlan:
    """How to split one contraction: its k loop dim, extent K, L lanes, K1 = K // L."""

    k: int
    extent: int
    lanes: int
    short: frozenset[int] = frozenset()

    @property
    def chunks(self) -> int:
        return self.extent // self.lanes

    @property
    def remainder(self) -> int:
        return self.extent % self.lanes


def split_plan(op: ir.Operation, lanes: int, short_rows: int = 0,
               short_lanes: int = 0) -> SplitPlan | None:
    """The split of `op` (see the module docstring), or None when it does not qualify."""
    if not is_linalg_op(op) or len(op.results) != 1 or not linalg.isa_contraction_op(op):
        return None
    ls = loop_structure(op)
    if not ls.is_static or any(not isinstance(v.type, ir.RankedTensorType) for v in op.operands):
        return None
    if not isinstance(ir.RankedTensorType(op.results[0].type).element_type, ir.FloatType):
        return None
    dims = ls.contraction_dims()
    m_rows, n_rows = ({d for d in dims[side] if ls.ranges[d] > 1} for side in ("m", "n"))
    if len(dims["k"]) != 1 or not (m_rows or n_rows):
        return None
    short = frozenset()
    if m_rows and n_rows:
        if ls.fewest_rows() > short_rows or short_lanes < 1 or op.parent.name != "func.func":
            return None
        short = min(m_rows, n_rows, key=lambda rows: math.prod(ls.ranges[d] for d in rows))
        lanes = short_lanes
    k = dims["k"][0]
    if ls.ranges[k] % lanes and lanes % 2 == 0 and ls.ranges[k] % (lanes // 2) == 0:
        lanes //= 2  # no remainder
    if ls.ranges[k] < 2 * lanes:
        return None
    rows = [i for i in range(ls.num_inputs) if (m_rows | n_rows) & set(dim_positions(ls.maps[i]))]
    if len(rows) != (2 if m_rows and n_rows else 1) or \
            any(dim_positions(ls.maps[i])[-1:] != [k] for i in rows):
        return None
    if any(defining_op(op.operands[i]) is not None
           and defining_op(op.operands[i]).name == "linalg.transpose" for i in rows):
        return None  # k innermost in the view only (transform_ext.fold_transposes_into_matvecs)
    if walk_ops(op, lambda inner: inner.name == "linalg.index"):
        return None
    return SplitPlan(k, ls.ranges[k], lanes, frozenset(short))


def _head_operand(value: ir.Value, positions: list, plan: SplitPlan, kept: dict) -> ir.Value:
    """`value` without its axes of unit loop dims (a rank-reducing slice), its first L K1
    elements along k viewed as [.., K1, L, ..]."""
    t = ir.RankedTensorType(value.type)
    sizes = [plan.chunks * plan.lanes if p == plan.k else s for p, s in zip(positions, t.shape)]
    shape = [s for p, s in zip(positions, sizes) if p in kept]
    head = value
    if shape != list(t.shape):
        n = len(sizes)
        head = tensor.ExtractSliceOp(ir.RankedTensorType.get(shape, t.element_type), value, [], [],
                                     [], i64_array([0] * n), i64_array(sizes),
                                     i64_array([1] * n)).result
    kept_positions = [p for p in positions if p in kept]
    if plan.k not in kept_positions:
        return head
    axis = kept_positions.index(plan.k)
    expanded = shape[:axis] + [plan.chunks, plan.lanes] + shape[axis + 1:]
    groups = [[d] for d in range(axis)] + [[axis, axis + 1]] + \
             [[d + 1] for d in range(axis + 1, len(shape))]
    return tensor.ExpandShapeOp(ir.RankedTensorType.get(expanded, t.element_type), head,
                                reassociation_attr(groups), [], expanded).result


def _tail_operand(value: ir.Value, axis: int, plan: SplitPlan) -> ir.Value:
    """`value`'s last r elements along `axis`."""
    shape = list(ir.RankedTensorType(value.type).shape)
    offsets = [0] * len(shape)
    offsets[axis] = plan.chunks * plan.lanes
    sizes = shape[:axis] + [plan.remainder] + shape[axis + 1:]
    return strided_slice(value, offsets, sizes, [1] * len(shape))


def _head_map(positions: list, plan: SplitPlan, kept: dict) -> ir.AffineMap:
    """An operand's map over the kept loops and l (the last loop): a k result becomes
    (k1, l), axes of unit loop dims are gone."""
    exprs = []
    for p in positions:
        if p in kept:
            exprs.append(ir.AffineDimExpr.get(kept[p]))
        if p == plan.k:
            exprs.append(ir.AffineDimExpr.get(len(kept)))
    return ir.AffineMap.get(len(kept) + 1, 0, exprs)


def split(op: ir.Operation, plan: SplitPlan, rewriter) -> None:
    """Rewrite `op` by `plan` (see the module docstring)."""
    ls = loop_structure(op)
    kept = {}  # old loop dim -> new loop dim (unit dims are dropped)
    # a short product loops over the other side's rows, then the short side's: tiles of a
    # few rows of W walk the batch while those rows stay in L1
    order = range(ls.num_loops) if not plan.short else sorted(
        range(ls.num_loops), key=lambda d: (ls.iterators[d] == "reduction", d in plan.short))
    for d in order:
        if ls.ranges[d] != 1:
            kept[d] = len(kept)
    inputs = list(op.operands[:ls.num_inputs])
    init = op.operands[ls.num_inputs]
    out_type = ir.RankedTensorType(init.type)
    element = out_type.element_type
    out_positions = dim_positions(ls.output_map(0))
    # a short product's partial sums keep the rows of its short side together
    partial_positions = sorted((p for p in out_positions if p in kept),
                               key=lambda p: p in plan.short)
    block = body_of(op)
    with ir.InsertionPoint(op), op.location:
        heads = [_head_operand(v, dim_positions(m), plan, kept)
                 for v, m in zip(inputs, ls.maps[:ls.num_inputs])]
        head_maps = [_head_map(dim_positions(m), plan, kept) for m in ls.maps[:ls.num_inputs]]
        partial_shape = [ls.ranges[p] for p in partial_positions] + [plan.lanes]
        zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
        partial_init = linalg.fill(zero, outs=[tensor.EmptyOp(partial_shape, element).result])
        partial_map = ir.AffineMap.get(len(kept) + 1, 0,
                                       [ir.AffineDimExpr.get(kept[p]) for p in partial_positions]
                                       + [ir.AffineDimExpr.get(len(kept))])
        iterators = [ls.iterators[d] for d in kept] + ["parallel"]

        def partial_body(args):
            return clone_body(op, dict(zip(block.arguments, args)))

        partial = build_generic(heads, [partial_init], head_maps + [partial_map], iterators,
                                partial_body).result
        rank = out_type.rank
        # the sum over l: loops (the output's dims, l); the partials lack the unit axes
        reduced_map = ir.AffineMap.get(rank + 1, 0, [ir.AffineDimExpr.get(out_positions.index(p))
                                                     for p in partial_positions]
                                       + [ir.AffineDimExpr.get(rank)])
        keep = ir.AffineMap.get(rank + 1, 0, [ir.AffineDimExpr.get(d) for d in range(rank)])
        total = build_generic([partial], [init], [reduced_map, keep],
                              ["parallel"] * rank + ["reduction"],
                              lambda args: [arith.addf(args[1], args[0])]).result
        if plan.remainder:
            tails = [_tail_operand(v, dim_positions(m).index(plan.k), plan)
                     if plan.k in dim_positions(m) else v
                     for v, m in zip(inputs, ls.maps[:ls.num_inputs])]
            tail = op.clone()
            for i, value in enumerate(tails + [total]):
                tail.operands[i] = value
            total = tail.results[0]
    rewriter.replace_op(op, [total])


class SplitMatvecLanesOp(TransformExt.Operation, name="split_matvec_lanes"):
    target: ext.Operand[transform.AnyOpType]
    lanes: ir.IntegerAttr
    short_rows: ir.IntegerAttr
    short_lanes: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                lanes = ir.IntegerAttr(op.lanes).value
                short_rows = ir.IntegerAttr(op.short_rows).value
                short_lanes = ir.IntegerAttr(op.short_lanes).value
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "func.func":
                            raise Illegal(target, "not a func.func")
                        if lanes < 1:
                            raise Illegal(target, f"lanes = {lanes} must be >= 1")
                        if short_rows > 0 and short_lanes < 1:
                            raise Illegal(target, f"short_lanes = {short_lanes} must be >= 1 "
                                                  f"with short_rows = {short_rows}")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    for candidate in walk_ops(target, is_linalg_op):
                        plan = split_plan(candidate, lanes, short_rows, short_lanes)
                        if plan is not None:
                            split(candidate, plan, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def split_matvec_lanes(target: ir.Value, lanes: int, short_rows: int = 0,
                       short_lanes: int = 0) -> SplitMatvecLanesOp:
    """Split the matrix-vector products in the functions of `target` into `lanes` partial
    sums per row, and the products of at most `short_rows` rows on one side into
    `short_lanes` (see the module docstring)."""
    i64 = ir.IntegerType.get_signless(64)
    return SplitMatvecLanesOp(target, *(ir.IntegerAttr.get(i64, v)
                                        for v in (lanes, short_rows, short_lanes)))


__all__ = ["SplitMatvecLanesOp", "SplitPlan", "split_matvec_lanes", "split_plan"]
