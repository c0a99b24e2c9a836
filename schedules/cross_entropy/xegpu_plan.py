"""What the XeGPU lowering of a cross-entropy loss (xegpu.py) starts from: the family's
steps 1-3 recorded and the restructured loss checked (`analyze`: a LossGraph, or
NotLowerable naming the op or dimension that does not fit), the row kernel's tiles
(`plan_rows`: LossRowTiles, rows per workgroup and per subgroup, the column tile) and those
of the reductions over the rows (`plan_row_sums`: RowSumTiles), and LossKernel, one per
kernel the lowering outlines.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from torch_mlir import ir

import transform_ext
from transform_ext.analysis.loss_kernels import grouped, kernel_groups
from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import block_ops, is_argument_view
from transform_ext.sink_returned_reshapes import returned_reshapes

from ..common import place_of
from ..generic import single_func
from ..script import StepRecorder
from .fuse import merge_gradients, normalize, restructure
from .recognize import NotCrossEntropy, find_cross_entropy, find_logits, has_rank0_reshape

LANES = 16                      # lanes of a per-row tile in memory: the subgroup size
ROW_BYTES = 8 * 1024            # registers a subgroup may spend on its f32 tiles (as xegpu/rows.py)


class NotLowerable(ValueError):
    """The payload has no GPU form here; the message names the op and the reason."""


# ------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class LossRowTiles:
    """The row kernel: `rows` rows per workgroup, `rows_per_subgroup` per subgroup, the
    class loop in steps of `column_tile`; `grid` workgroups."""

    rows: int
    rows_per_subgroup: int
    classes: int
    column_tile: int
    grid: tuple[int, ...]
    subgroup_size: int = 16

    @property
    def subgroups(self) -> int:
        return self.rows // self.rows_per_subgroup

    @property
    def sg_layout(self) -> list[int]:
        return [self.subgroups, 1]

    @property
    def sg_data(self) -> tuple[int, int]:
        return (self.rows_per_subgroup, self.column_tile)

    @property
    def threads(self) -> int:
        return self.subgroups * self.subgroup_size


@dataclass(frozen=True)
class RowSumTiles:
    """A reduction over the rows: one workgroup of one subgroup, `row_tile` rows (lane form
    [row_tile, 16]) per loop step."""

    rows: int
    row_tile: int
    subgroup_size: int = 16
    grid: tuple[int, ...] = (1,)

    @property
    def sg_layout(self) -> list[int]:
        return [1, 1]

    @property
    def sg_data(self) -> tuple[int, int]:
        return (self.row_tile, LANES)

    @property
    def threads(self) -> int:
        return self.subgroup_size


@dataclass
class LossKernel:
    kind: str                 # "cross_entropy" (the row kernel) | "row_sum"
    description: str
    tiles: object


# ------------------------------------------------------------------------------ analysis

def loss_func(payload: ir.Module) -> ir.Operation:
    return single_func(payload, NotLowerable)


def _has_assert(op: ir.Operation) -> bool:
    return op.name == "linalg.generic" and any(
        o.operation.name == "cf.assert" for o in op.regions[0].blocks[0].operations)


@dataclass
class LossGraph:
    """The restructured loss: its function, logits and the ops the lowering starts from."""

    func: ir.Operation
    logits: ir.Value
    rows: int
    classes: int
    row_max: ir.Operation
    gradient: ir.Operation | None


def _record_restructure(rec: StepRecorder):
    """The cross_entropy family's steps 1-3 (normalize, restructure, merge the gradients),
    recorded: the ops found after them, or NotCrossEntropy with the reason."""
    rec.step("normalize", normalize(not has_rank0_reshape(rec.trial)))
    find_logits(loss_func(rec.trial))
    rec.step("restructure", restructure)
    ops = find_cross_entropy(rec.trial)
    if len(ops.gradients) > 1:
        places = tuple(place_of(rec.trial.operation, g) for g in ops.gradients)
        rec.step("merge_gradients", merge_gradients(places))
        ops = find_cross_entropy(rec.trial)
    return ops


def analyze(rec: StepRecorder) -> LossGraph:
    """Restructure (the family's steps 1-3) and check the ops' kernels; NotLowerable when the
    payload is not a cross-entropy this lowering takes."""
    transform_ext.load(rec.trial.context)
    try:
        found = _record_restructure(rec)
    except NotCrossEntropy as exc:
        raise NotLowerable(f"cross-entropy: {exc}") from exc
    func = loss_func(rec.trial)
    block = func.regions[0].blocks[0]
    row_max = found.row_max
    x = find_logits(func)
    if x.type.rank != 2 or found.class_dim != 1 or loop_structure(row_max).num_loops != 2:
        raise NotLowerable(f"cross-entropy over logits {x.type}: the GPU lowering takes [N, C] "
                           "logits with the classes last (fold other dims into the rows first)")
    if not isinstance(x.type.element_type, ir.FloatType) or x.type.element_type.width not in (16, 32):
        raise NotLowerable(f"cross-entropy over {x.type.element_type} logits: f32, f16 or bf16 only")
    rows, classes = x.type.shape
    fn_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    for t in fn_type.results:
        if isinstance(t, ir.RankedTensorType) and t.rank != 0 \
                and math.prod(t.shape) != rows * classes:   # the gradient, maybe [B, T, C]
            raise NotLowerable(f"cross-entropy with a {t} result (reduction='none'): per-row "
                               "losses have no GPU store form yet (XeGPU has no lane layout for "
                               "a [rows] vector); use reduction='mean' or 'sum'")
    for op in block_ops(block):
        if op.name in ("func.return", "arith.constant", "tensor.empty"):
            continue
        if op.results and is_argument_view(op.results[0], block):
            continue   # [B, T, C] logits or [B, T] targets read as [B * T, C] / [B * T]
        if op in returned_reshapes(func):
            continue   # the [B * T, C] gradient returned as [B, T, C]
        if not is_linalg_op(op):
            raise NotLowerable(f"cross-entropy: {op.name} at {op.location} has no GPU kernel here")
        if not len(op.results) and not _has_assert(op):
            raise NotLowerable(f"cross-entropy: a result-less {op.name} at {op.location}")
    for op in grouped(block, "rows", kernel_groups(block, fills_by_readers=False)):
        _check_row_op(op, rows)
    return LossGraph(func, x, rows, classes, row_max, found.gradient)


def _check_row_op(op: ir.Operation, rows: int) -> None:
    """Loop 0 runs over the rows: every operand with a row dim has it first, indexed by d0."""
    ls = loop_structure(op)
    if not ls.is_static or ls.ranges[0] != rows or ls.iterators[0] != "parallel":
        raise NotLowerable(f"cross-entropy: {op.name} at {op.location} does not run over the "
                           f"{rows} rows in its first loop")
    for value, amap in zip(op.operands, ls.maps):
        results = list(amap.results)
        uses_d0 = [j for j, e in enumerate(results)
                   if isinstance(e, ir.AffineDimExpr) and e.position == 0]
        if uses_d0 not in ([], [0]):
            raise NotLowerable(f"cross-entropy: {op.name} at {op.location} reads rows in a "
                               "dim other than the first")


# --------------------------------------------------------------------------- parameters

def plan_rows(graph: LossGraph, *, subgroup_size: int, max_threads: int, min_workgroups: int,
              rows: int | None, column_tile: int | None) -> LossRowTiles:
    """Rows per workgroup: `rows`, else the largest of 64 .. 2 dividing N that leaves
    `min_workgroups` workgroups (2 rows per subgroup). Column tile: `column_tile`, else the
    largest multiple of the subgroup size dividing C whose two f32 copies per subgroup fit
    ROW_BYTES. NotLowerable names the dimension a tile does not divide."""
    n, c = graph.rows, graph.classes
    per_subgroup = 2
    limit = (max_threads // subgroup_size) * per_subgroup
    where = f"cross-entropy over [{n}, {c}] logits"
    if n % per_subgroup:
        raise NotLowerable(f"{where}: dimension 0 ({n} rows) is not a multiple of the rows per "
                           f"subgroup ({per_subgroup})")
    if rows is None:
        fitting = [r for r in (64, 32, 16, 8, 4, 2) if n % r == 0 and r <= limit]
        rows = next((r for r in fitting if n // r >= min_workgroups), fitting[-1])
    if n % rows or rows % per_subgroup or rows > limit:
        raise NotLowerable(f"{where}: dimension 0 ({n} rows) is not a multiple of the rows per "
                           f"workgroup ({rows}), or those of {per_subgroup} per subgroup, or "
                           f"{rows} rows need more than {max_threads} threads")
    if column_tile is None:
        fitting = [t for t in range(subgroup_size, c + 1, subgroup_size)
                   if c % t == 0 and 2 * per_subgroup * t * 4 <= ROW_BYTES]
        if not fitting:
            raise NotLowerable(f"{where}: dimension 1 ({c} classes) has no column tile (a "
                               f"multiple of {subgroup_size} dividing it) that fits the registers")
        column_tile = fitting[-1]
    if c % column_tile or column_tile % subgroup_size:
        raise NotLowerable(f"{where}: dimension 1 ({c} classes) is not a multiple of the column "
                           f"tile ({column_tile}), or that of the subgroup size ({subgroup_size})")
    return LossRowTiles(rows, per_subgroup, c, column_tile, (n // rows,), subgroup_size)


def plan_row_sums(graph: LossGraph, *, subgroup_size: int, row_tile: int | None) -> RowSumTiles:
    n = graph.rows
    if row_tile is None:
        row_tile = next(t for t in (16, 8, 4, 2, 1) if n % t == 0)
    if n % row_tile:
        raise NotLowerable(f"cross-entropy: dimension 0 ({n} rows) is not a multiple of the "
                           f"row tile of the reductions over the rows ({row_tile})")
    return RowSumTiles(n, row_tile, subgroup_size)
