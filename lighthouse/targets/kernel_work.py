"""The work of one XeGPU kernel, counted on its workgroup-level IR (the xegpu-layouts stage):
DPAS FLOPs and the bytes its 2-D block loads and stores move, with every loop's trip count
evaluated per workgroup from the kernel's own bound computations (so the loops a causal
mask bounds by the block id count right), summed over the grid.

  flops        sum over xegpu.dpas ops of 2 m n k x trips, over all workgroups
  block_bytes  sum over xegpu.load_nd / store_nd of the tile's bytes x trips x the subgroups
               that each read it (a tile whose layout covers fewer subgroups than the
               workgroup has is read by each of them: sg_layout [1, 1] = every subgroup)
  io_bytes     the kernel's memref arguments, each once (what must cross DRAM at least)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_mlir import ir

from transform_ext.common import ops_named

# what an index computation of a kernel may consist of: binary arith ops and their meaning
_ARITH = {"arith.addi": lambda a, b: a + b, "arith.subi": lambda a, b: a - b,
          "arith.muli": lambda a, b: a * b, "arith.maxsi": max, "arith.minsi": min,
          "arith.ceildivsi": lambda a, b: -(-a // b), "arith.divsi": lambda a, b: int(a / b),
          "arith.floordivsi": lambda a, b: a // b, "arith.divui": lambda a, b: a // b,
          "arith.remsi": lambda a, b: int(math.fmod(a, b)), "arith.remui": lambda a, b: a % b}


class NotEvaluable(ValueError):
    """An index computation that is not made of constants, block ids and integer arith."""


def evaluate(value: ir.Value, block_id: dict) -> int:
    """The integer an index computation of a kernel yields in the workgroup `block_id`
    ({'x': .., 'y': .., 'z': ..}): constants, block ids and the integer arith ops only."""
    owner = value.owner
    owner = getattr(owner, "operation", owner)
    if not isinstance(owner, ir.Operation):
        raise NotEvaluable(f"{value} is not computed from constants and block ids")
    name = owner.name
    if name == "arith.constant":
        return ir.IntegerAttr(owner.attributes["value"]).value
    if name == "gpu.block_id":
        return block_id[str(owner.attributes["dimension"]).rstrip(">").split()[-1]]
    if name == "arith.index_cast":
        return evaluate(owner.operands[0], block_id)
    if name not in _ARITH:
        raise NotEvaluable(f"cannot evaluate {name}")
    a, b = (evaluate(v, block_id) for v in owner.operands)
    return _ARITH[name](a, b)


def trips(op: ir.Operation, block_id: dict) -> int:
    """Product of the trip counts of the scf.for loops around `op` in one workgroup."""
    count, parent = 1, op.parent
    while parent is not None and parent.name != "gpu.func":
        if parent.name == "scf.for":
            lb, ub, step = (evaluate(v, block_id) for v in list(parent.operands)[:3])
            count *= max(0, -(-(ub - lb) // step))
        parent = parent.parent
    return count


def workgroups(gpu_func: ir.Operation) -> list[dict]:
    """The block ids of every workgroup of the kernel's known grid."""
    gx, gy, gz = ir.DenseI32ArrayAttr(gpu_func.attributes["known_grid_size"])
    return [{"x": x, "y": y, "z": z} for z in range(gz) for y in range(gy) for x in range(gx)]


@dataclass(frozen=True)
class KernelWork:
    workgroups: int
    subgroups: int              # per workgroup
    flops: int                  # DPAS FLOPs of the whole grid
    max_workgroup_flops: int    # of the busiest workgroup
    block_bytes: int            # moved by the 2-D block loads and stores of every subgroup
    io_bytes: int               # the kernel's arguments, each once

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _bytes(t: ir.Type) -> int:
    shaped = ir.ShapedType(t)
    return math.prod(shaped.shape) * max(1, ir.ShapedType(t).element_type.width // 8)


def _readers(op: ir.Operation, subgroups: int) -> int:
    """How many subgroups of the workgroup move this tile whole: the workgroup's subgroups
    over those its layout spreads it across (1 without a layout)."""
    if "layout" not in op.attributes:
        return 1
    text = str(op.attributes["layout"])
    if "sg_layout" not in text:
        return 1
    layout = [int(n) for n in text.split("sg_layout = [", 1)[1].split("]", 1)[0].split(",")]
    return max(1, subgroups // math.prod(layout))


def kernel_work(gpu_func: ir.Operation, subgroup_size: int) -> KernelWork:
    """The work of one gpu.func at the xegpu-layouts stage (see the module docstring);
    NotEvaluable when a loop bound is not computed from constants and block ids."""
    threads = ir.DenseI32ArrayAttr(gpu_func.attributes["known_block_size"])[0]
    subgroups = max(1, threads // subgroup_size)
    groups = workgroups(gpu_func)
    per_group = [0] * len(groups)
    for op in ops_named(gpu_func, "xegpu.dpas"):
        (m, k), (_, n) = (ir.VectorType(v.type).shape for v in list(op.operands)[:2])
        for i, block in enumerate(groups):
            per_group[i] += 2 * m * n * k * trips(op, block)
    moved = 0
    for op in ops_named(gpu_func, "xegpu.load_nd") + ops_named(gpu_func, "xegpu.store_nd"):
        tile = op.results[0].type if op.name == "xegpu.load_nd" else op.operands[0].type
        size = _bytes(tile) * _readers(op, subgroups)
        moved += size * sum(trips(op, block) for block in groups)
    arguments = gpu_func.regions[0].blocks[0].arguments
    io = sum(_bytes(a.type) for a in arguments if isinstance(a.type, ir.MemRefType))
    return KernelWork(len(groups), subgroups, sum(per_group), max(per_group, default=0),
                      moved, io)
