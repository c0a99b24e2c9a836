"""When a kernel is too small to share between threads.

Each parallel region forks and joins the OpenMP workers. A worker that slept since the last
region costs a wake-up (on the VMs this project is measured on, 50-100 us each way, more
than a small kernel's whole work), and even spinning workers cost a few microseconds per
region. torch does the same (ATen runs a loop on one thread below its grain size).

  estimated_cycles(payload, lanes)
      sum over the payload's linalg ops of their iteration points / lanes, times the ops of
      their body (MATH_OPS for a math op) or halved for contractions and convolutions (an
      FMA per point on two ports); plus a tensor.pad's result elements / lanes; each op
      times the trip counts of the scf.for loops around it. None when some extent or trip
      count is not static, or the payload holds an op whose work is not counted (a
      tm_tensor op, an op with regions other than these).
  on_one_thread_when_small(payload, target, notes)
      the CPU target on one thread for a payload whose estimate is below its description's
      parallel_cycles (lighthouse.targets.description.PARALLEL_CYCLES), with a note.
"""

from __future__ import annotations

import dataclasses
import math

from torch_mlir import ir
from torch_mlir.dialects import linalg

from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import constant_value

MATH_OPS = 10  # about the vector ops of an exp, log or tanh once expanded to polynomials

# ops with regions whose work is counted (besides linalg ops): scf.for as its trip count
# times its body's work, a function or module as their body's
_COUNTED_REGIONS = ("builtin.module", "func.func", "scf.for")


class _Uncounted(Exception):
    """The payload holds work estimated_cycles does not count."""


def estimated_cycles(payload: ir.Module, lanes: int) -> float | None:
    """The vector cycles of the payload's linalg ops (see the module docstring), or None."""
    try:
        return _block_cycles(payload.body, lanes)
    except _Uncounted:
        return None


def _block_cycles(block: ir.Block, lanes: int) -> float:
    total = 0.0
    for op in block.operations:
        total += _op_cycles(op.operation, lanes)
    return total


def _op_cycles(op: ir.Operation, lanes: int) -> float:
    if is_linalg_op(op):
        shape = loop_structure(op)
        if not shape.is_static:
            raise _Uncounted(op.name)
        if shape.is_contraction or linalg.isa_convolution_op(op):
            return math.prod(shape.ranges) / lanes / 2
        return math.prod(shape.ranges) / lanes * _body_ops(op)
    if op.name == "tensor.pad":  # a copy into the padded result
        return math.prod(ir.ShapedType(op.results[0].type).shape) / lanes
    if not op.regions:
        if op.name.startswith("tm_tensor."):
            raise _Uncounted(op.name)
        return 0.0
    if op.name not in _COUNTED_REGIONS:
        raise _Uncounted(op.name)
    body = sum(_block_cycles(block, lanes) for region in op.regions for block in region.blocks)
    return body * (_trip_count(op) if op.name == "scf.for" else 1)


def _body_ops(op: ir.Operation) -> int:
    """Vector ops per iteration point of a linalg op's body: MATH_OPS for each math op (its
    polynomial), one for any other; one at least (a copy)."""
    count = 0
    for inner in op.regions[0].blocks[0].operations:
        name = inner.operation.name
        if name != "linalg.yield":
            count += MATH_OPS if name.startswith("math.") else 1
    return max(1, count)


def _trip_count(loop: ir.Operation) -> int:
    bounds = [constant_value(v) for v in list(loop.operands)[:3]]
    if not all(isinstance(b, ir.IntegerAttr) for b in bounds):
        raise _Uncounted("scf.for with a bound that is not a constant")
    lower, upper, step = (b.value for b in bounds)
    return max(0, -(-(upper - lower) // step))


def on_one_thread_when_small(payload: ir.Module, target, notes: list[str]):
    """`target`, on one thread when it is a CPU target of several threads and the payload
    is small (a note says so); else `target` itself."""
    from .cpu import CpuTarget

    if not isinstance(target, CpuTarget) or target.threads == 1:
        return target
    bound = target.cpu.parallel_cycles
    cycles = estimated_cycles(payload, target.cpu.f32_lanes)
    if cycles is None or cycles >= bound:
        return target
    notes.append(f"runs on one thread: about {cycles:.0f} vector cycles of work, under the "
                 f"{bound} that pay for waking {target.threads - 1} more")
    return dataclasses.replace(target, threads=1)
