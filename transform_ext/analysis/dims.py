"""Which loop dims of linalg ops and which dims of tensors run together.

`DimClasses` is a union-find over keys `(op, loop_dim)` and `(value, tensor_dim)`: each
operand or result indexed by a plain loop dim joins that loop dim's class. Two dims in one
class iterate over the same index (e.g. the key axis of S, of P and of P @ V's reduction).
"""

from __future__ import annotations

from torch_mlir import ir

from .structure import dim_positions, loop_structure


class DimClasses:
    def __init__(self, ops=()):
        self.parent: dict = {}
        for op in ops:
            self.add_op(op)

    def find(self, key):
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb

    def same(self, a, b) -> bool:
        return self.find(a) == self.find(b)

    def add_op(self, op: ir.Operation) -> None:
        ls = loop_structure(op)
        values = list(op.operands) + list(op.results)
        maps = ls.maps + ls.maps[ls.num_inputs:]
        for v, amap in zip(values, maps):
            for pos, d in enumerate(dim_positions(amap)):
                if d is not None:
                    self.union((op, d), (v, pos))

    def value_dim_like(self, value: ir.Value, key) -> int | None:
        """The dim of `value` in `key`'s class, if any."""
        if not isinstance(value.type, ir.ShapedType):
            return None
        for p in range(value.type.rank):
            if self.same((value, p), key):
                return p
        return None
