"""XeGPU tail of row kernels (softmax, norms, row-wise elementwise chains).

A row kernel is a root linalg op (nothing else in the kernel set reads it) with its whole
producer chain; its outer parallel dims (all but the innermost loop dim) index independent
rows. Tiling (`tile_rows`): the root is tiled into an `scf.forall` of `rows` rows per
workgroup and the chain is fused in (`transform.structured.fuse`), so every reduction of a
row (max, sum) runs inside the workgroup that owns the row and no intermediate row is
written to memory. Decomposition: two rows per subgroup (sg_layout [rows / 2, 1], sg_data
[2, C]); the row reductions become cross-lane reductions of that subgroup.
Long rows (a subgroup's f32 row pieces beyond `ROW_BYTES` of registers) of a chain with a
row max (softmax, log-softmax) run in column tiles of `column_tile`: the max and the
reductions depending on it become one loop over column tiles with the online correction
(fuse_dependent_reduction_ops), then a second loop recomputes the elementwise chain per
column tile and writes the result; only per-row values are carried across tiles.
Layouts (`annotate_rows`): the anchor is the store of the result tile; the XeGPU layout
propagation carries it to the loads and reductions; loads in column loops are prefetched.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects.transform import structured, xegpu

from transform_ext.analysis.structure import loop_structure
from transform_ext.fuse_dependent_reduction_ops import fuse_dependent_reduction_ops
from transform_ext.match_column_sweep_ops import column_sweep_ops, match_column_sweep_ops
from transform_ext.match_row_kernel import (find_row_roots, match_row_kernel, next_row_kernel,
                                            producer_chain)
from transform_ext.match_row_max_reductions import match_row_max_reductions, row_foralls

from ..common import canonicalize, match
from ..script import StepRecorder
from .common import passes
from .contraction import block_mapping, func_named, split


@dataclass(frozen=True)
class RowTiles:
    """`rows` rows per workgroup, `rows_per_subgroup` of them per subgroup (>= 2: a lane then
    holds at least two elements of a block read; SPIR-V has no one-element vectors), the
    extents of the root's loops, the forall tile sizes, the grid over row tiles."""

    rows: int
    rows_per_subgroup: int
    row_shape: tuple[int, ...]      # extents of the root's loops
    tile_sizes: tuple[int, ...]     # forall tile sizes over the root's loops (0 = whole)
    grid: tuple[int, ...]
    subgroup_size: int = 16
    column_tile: int | None = None  # columns per step of the column loops (None: whole rows)

    @property
    def sg_layout(self) -> list[int]:
        return [self.rows // self.rows_per_subgroup, 1]

    @property
    def sg_data(self) -> tuple[int, int]:
        return (self.rows_per_subgroup, self.column_tile or self.row_shape[-1])

    @property
    def threads(self) -> int:
        return self.sg_layout[0] * self.subgroup_size


# Registers a subgroup may spend on the f32 pieces of its rows (a row tile and a working
# copy of it): half the register file, the rest is for the compiler.
ROW_BYTES = 8 * 1024


def plan_rows(root: ir.Operation, *, rows: int | None, subgroup_size: int, max_threads: int,
              min_workgroups: int = 1, column_tile: int | None = None) -> RowTiles:
    """Rows per subgroup: 2 (enough for >= 2 elements per lane, few registers for long
    rows). Rows per workgroup: `rows` if given, else the largest of 64 .. 2 dividing the row
    count that still leaves `min_workgroups` workgroups. Column tile (chains with a row max
    only): `column_tile` if given, else none when two f32 copies of a subgroup's rows fit in
    ROW_BYTES, else the largest multiple of the subgroup size dividing the row that fits.
    Raises ValueError naming the dimension when a tile does not divide it."""
    ls = loop_structure(root)
    where = f"{root.name} at {root.location}"
    if not ls.is_static:
        raise ValueError(f"{where}: dynamic shapes are not supported")
    if ls.num_loops < 2 or ls.iterators[0] != "parallel":
        raise ValueError(f"{where}: a row kernel needs an outer parallel row dim and a row "
                         f"(loops {ls.iterators})")
    outer = [d for d in range(ls.num_loops - 1) if ls.iterators[d] == "parallel"]
    row_dim = outer[-1]
    extent = ls.ranges[row_dim]
    per_subgroup = 2
    if extent % per_subgroup:
        raise ValueError(f"{where}: dimension {row_dim} ({extent} rows) is not a multiple of "
                         f"the rows per subgroup ({per_subgroup})")
    limit = (max_threads // subgroup_size) * per_subgroup
    others = 1
    for d in outer[:-1]:
        others *= ls.ranges[d]
    if rows is None:
        fitting = [r for r in (64, 32, 16, 8, 4, 2) if extent % r == 0 and r <= limit]
        rows = next((r for r in fitting if others * extent // r >= min_workgroups), fitting[-1])
    if extent % rows or rows % per_subgroup:
        raise ValueError(f"{where}: dimension {row_dim} ({extent} rows) is not a multiple of "
                         f"the rows per workgroup ({rows}), or those of {per_subgroup} per subgroup")
    if rows > limit:
        raise ValueError(f"{where}: {rows} rows per workgroup need more than {max_threads} threads")
    sizes = [0] * ls.num_loops
    for d in outer:
        sizes[d] = 1
    sizes[row_dim] = rows
    grid = tuple(ls.ranges[d] // sizes[d] for d in outer)
    width = ls.ranges[-1]
    if column_tile is None and _has_row_max(root) and 2 * per_subgroup * width * 4 > ROW_BYTES:
        fitting = [c for c in range(subgroup_size, width, subgroup_size)
                   if width % c == 0 and 2 * per_subgroup * c * 4 <= ROW_BYTES]
        if not fitting:
            raise ValueError(f"{where}: rows of {width} columns have no column tile (a multiple "
                             f"of {subgroup_size} dividing them) that fits the registers")
        column_tile = fitting[-1]
    if column_tile is not None and (width % column_tile or column_tile % subgroup_size):
        raise ValueError(f"{where}: dimension {ls.num_loops - 1} ({width} columns) is not a "
                         f"multiple of the column tile ({column_tile}), or that of the "
                         f"subgroup size ({subgroup_size})")
    if column_tile == width:
        column_tile = None
    return RowTiles(rows, per_subgroup, tuple(ls.ranges), tuple(sizes), grid, subgroup_size,
                    column_tile)


def _has_row_max(root: ir.Operation) -> bool:
    from transform_ext.analysis.classify import reduction_combiner

    return any(reduction_combiner(op) == "max" for op in [root] + producer_chain(root)
               if loop_structure(op).reduction_dims)


def tile_rows(rec: StepRecorder, root: ir.Operation, tiles: RowTiles) -> None:
    """The root tiled into a workgroup forall, its producer chain fused in (latest first):
    steps of `rec` (`root` an op of its trial)."""
    func = root.parent
    if next_row_kernel(func)[0] != root:
        raise ValueError(f"{root.name} at {root.location}: not the next row kernel of its function")
    count = len(producer_chain(root))
    tiled_dims = sum(1 for s in tiles.tile_sizes if s)
    func_name = ir.StringAttr(func.attributes["sym_name"]).value

    def body(r):
        root_op, chain = match_row_kernel(func_named(r, func_name))
        tiled = structured.TileUsingForallOp(root_op, tile_sizes=list(tiles.tile_sizes),
                                             mapping=block_mapping(tiled_dims))
        forall = tiled.results[1]
        for producer in split(chain, count):
            forall = structured.FuseIntoContainingOp(producer, forall).new_containing_op
        canonicalize(match(r, "func.func"))

    rec.step("tile_row_kernel", body)
    if tiles.column_tile:
        for _ in row_foralls(rec.trial):
            _column_loops(rec, tiles.column_tile)


def _column_loops(rec: StepRecorder, column_tile: int) -> None:
    """In the first row forall (match_row_max_reductions): the row max and its dependent
    reductions as one online loop over column tiles; then the root (and its elementwise
    producers, recomputed) in a second loop over column tiles (match_column_sweep_ops)."""
    (forall, *_) = row_foralls(rec.trial)

    def fuse(root):
        row_max, dependent, data = match_row_max_reductions(root)
        fuse_dependent_reduction_ops(row_max, dependent, column_tile, producers=[data],
                                     allow_remainder=False)

    rec.step("online_column_loop", fuse)
    rec.step("canonicalize", passes("canonicalize", "cse"))
    found = column_sweep_ops(rec.trial)
    if found is None or found[0].parent != forall:
        raise ValueError(f"row kernel at {forall.location}: no elementwise tail after its "
                         "column loop")
    root, chain = found
    sizes = [0] * (loop_structure(root).num_loops - 1) + [column_tile]
    count = len(chain)

    def sweep(r):
        root_op, producers = match_column_sweep_ops(r)
        loop = structured.TileUsingForOp(root_op, sizes=sizes).results[1]
        for producer in split(producers, count):
            loop = structured.FuseIntoContainingOp(producer, loop).new_containing_op

    rec.step("column_sweep", sweep)
    rec.step("canonicalize", passes("canonicalize", "cse"))


def annotate_rows(gpu_func: ir.Value, tiles: RowTiles) -> None:
    """Row tiles [rows_per_subgroup, C] (or [.., column_tile]) per subgroup on the loads and
    the store, in block instructions of [rows_per_subgroup, subgroup_size] (transform IR,
    handle input)."""
    layout = dict(sg_layout=tiles.sg_layout, sg_data=list(tiles.sg_data),
                  inst_data=[tiles.rows_per_subgroup, tiles.subgroup_size])
    xegpu.set_anchor_layout(match(gpu_func, "xegpu.store_nd"), **layout)
    xegpu.set_anchor_layout(match(gpu_func, "xegpu.load_nd"), **layout)
    canonicalize(gpu_func)
