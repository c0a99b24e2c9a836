"""The loop structure of linalg ops, read from their indexing maps and operand shapes.

A loop dim is a reduction when no output map uses it (the definition linalg itself uses for
projected-permutation outputs); its extent comes from any operand dim indexed by that loop
alone. Works for named ops (matmul, transpose, fill, ...) and generics alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import linalg


@dataclass
class LoopStructure:
    op: ir.Operation
    maps: list            # ir.AffineMap per operand: inputs, then outputs
    num_inputs: int
    num_outputs: int
    iterators: list[str]  # "parallel" | "reduction" per loop dim
    ranges: list[int | None]

    @property
    def num_loops(self) -> int:
        return len(self.iterators)

    @property
    def parallel_dims(self) -> list[int]:
        return [d for d, it in enumerate(self.iterators) if it == "parallel"]

    @property
    def reduction_dims(self) -> list[int]:
        return [d for d, it in enumerate(self.iterators) if it == "reduction"]

    @property
    def is_static(self) -> bool:
        return all(r is not None for r in self.ranges)

    @property
    def is_elementwise(self) -> bool:
        return not self.reduction_dims and all(m.is_projected_permutation for m in self.maps)

    @property
    def is_contraction(self) -> bool:
        return linalg.isa_contraction_op(self.op)

    def contraction_dims(self) -> dict[str, list[int]]:
        d = linalg.infer_contraction_dimensions(self.op)
        return {"batch": list(d.batch), "m": list(d.m), "n": list(d.n), "k": list(d.k)}

    def fewest_rows(self) -> int:
        """Of a static contraction: the rows on its side with fewer (the product of its m
        dims' extents, or of its n dims'; 1 for a mat-vec)."""
        dims = self.contraction_dims()
        return min(math.prod(self.ranges[d] for d in dims[side]) for side in ("m", "n"))

    def output_map(self, i: int = 0):
        return self.maps[self.num_inputs + i]


def is_linalg_op(op) -> bool:
    op = getattr(op, "operation", op)
    return op.name.startswith("linalg.") and op.name not in ("linalg.yield", "linalg.index")


def dim_positions(amap) -> list[int | None]:
    """For each result of `amap`: the loop dim it is, or None for a non-dim expression."""
    out = []
    for expr in amap.results:
        out.append(expr.position if isinstance(expr, ir.AffineDimExpr) else None)
    return out


def loop_structure(op) -> LoopStructure:
    op = getattr(op, "operation", op)
    maps = [m.value if isinstance(m, ir.AffineMapAttr) else m for m in linalg.get_indexing_maps(op)]
    num_outputs = len(op.results)
    num_inputs = len(op.operands) - num_outputs
    num_loops = maps[0].n_dims if maps else 0
    used_by_outputs = set()
    for amap in maps[num_inputs:]:
        used_by_outputs.update(p for p in dim_positions(amap) if p is not None)
    iterators = ["parallel" if d in used_by_outputs else "reduction" for d in range(num_loops)]
    ranges: list[int | None] = [None] * num_loops
    for value, amap in zip(op.operands, maps):
        shaped = value.type
        if not isinstance(shaped, ir.ShapedType):
            continue
        for axis, pos in enumerate(dim_positions(amap)):
            if pos is None or ranges[pos] is not None:
                continue
            if not shaped.is_dynamic_dim(axis):
                ranges[pos] = shaped.get_dim_size(axis)
    return LoopStructure(op, maps, num_inputs, num_outputs, iterators, ranges)


def func_ops(payload: ir.Module):
    """The top-level func.func ops of a module."""
    for op in payload.body.operations:
        if op.operation.name == "func.func":
            yield op.operation


def single_func(payload: ir.Module, error: type[Exception] = ValueError) -> ir.Operation:
    """The payload's one function; `error` when there are none or several."""
    funcs = list(func_ops(payload))
    if len(funcs) != 1:
        raise error(f"expected one function, found {len(funcs)}")
    return funcs[0]


def top_level_linalg_ops(func: ir.Operation) -> list[ir.Operation]:
    """The linalg ops directly in a function's body, in order."""
    return [op.operation for op in func.regions[0].blocks[0].operations if is_linalg_op(op)]


def all_linalg_ops(root) -> list[ir.Operation]:
    """The linalg ops nested in `root` (root included), in pre-order, not looking inside
    linalg ops."""
    found = []

    def visit(op):
        if is_linalg_op(op):
            found.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    getattr(root, "operation", root).walk(visit, ir.WalkOrder.PRE_ORDER)
    return found
