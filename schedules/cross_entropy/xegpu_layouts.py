"""Layouts of the kernels of a cross-entropy loss (xegpu.py) after
convert-vector-to-xegpu: the anchor layouts of each kernel's tile loads and stores and
scattered loads (`kernel_anchors`, set by `annotate_loss_kernel`) and what its loop
prefetches are spread over (`prefetch_shape`), from the kernel's tiles (xegpu_plan.py).
"""

from __future__ import annotations

from torch_mlir import ir

from transform_ext.common import ops_named

from ..common import canonicalize, match
from .fuse import split_handle
from .xegpu_plan import LossRowTiles

ANCHOR_OPS = ("xegpu.load_nd", "xegpu.store_nd", "xegpu.load")   # ops given anchor layouts


def kernel_anchors(gpu_func: ir.Operation, tiles) -> list[tuple[str, dict]]:
    """The anchor layouts of one outlined loss kernel after convert-vector-to-xegpu: (op
    name, layout) for its tile loads/stores and scattered loads, by ANCHOR_OPS then walk
    order (as `annotate_loss_kernel` matches them). Row kernel: [rows, w] tiles split over
    the subgroups by rows (`rows_per_subgroup` each), 2-D block instructions
    [rows_per_subgroup, 16]; the lane-form gathers one row per instruction. Reduction
    kernels: one subgroup holding [row_tile, 16]."""
    anchors = []
    for name in ANCHOR_OPS:
        for op in ops_named(gpu_func, name):
            value = op.results[0] if op.name != "xegpu.store_nd" else op.operands[0]
            shape = list(ir.VectorType(value.type).shape)
            if len(shape) == 1 and isinstance(tiles, LossRowTiles) and op.name == "xegpu.load":
                # a class vector (weights w_c) broadcast over the rows: the tile layout, sliced
                anchors.append((name, dict(sg_layout=tiles.sg_layout,
                                           sg_data=[tiles.rows_per_subgroup, shape[0]],
                                           inst_data=[tiles.rows_per_subgroup,
                                                      tiles.subgroup_size], slice_dims=[0])))
                continue
            if len(shape) != 2:
                raise ValueError(f"{op.location}: a {len(shape)}-D {op.name} has no layout in a "
                                 "cross-entropy kernel")
            rows, width = shape
            if isinstance(tiles, LossRowTiles):
                sg_layout, sg_data = tiles.sg_layout, [tiles.rows_per_subgroup, width]
                inst = [1 if op.name == "xegpu.load" else tiles.rows_per_subgroup,
                        tiles.subgroup_size]
            else:
                sg_layout, sg_data = [1, 1], [rows, width]
                inst = [1 if op.name == "xegpu.load" else min(rows, 8), tiles.subgroup_size]
            anchors.append((name, dict(sg_layout=list(sg_layout), sg_data=list(sg_data),
                                       inst_data=inst)))
    return anchors


def prefetch_shape(tiles) -> tuple[int, tuple[int, int]]:
    """(subgroups, instruction tile) the loop prefetches of a loss kernel are spread over."""
    if isinstance(tiles, LossRowTiles):
        return tiles.subgroups, (tiles.rows_per_subgroup, tiles.subgroup_size)
    return 1, (min(tiles.row_tile, 8), tiles.subgroup_size)


def annotate_loss_kernel(gpu_func: ir.Value, anchors: list[tuple[str, dict]]) -> None:
    """Transform IR: the anchor layouts of `kernel_anchors` (gpu_func a handle), each op
    taken by its place among the ops of its name that structured.match finds."""
    from torch_mlir.dialects.transform import xegpu

    for name in ANCHOR_OPS:
        layouts = [layout for n, layout in anchors if n == name]
        for handle, layout in zip(split_handle(match(gpu_func, name), len(layouts)), layouts):
            xegpu.set_anchor_layout(handle, **layout)
    canonicalize(gpu_func)
