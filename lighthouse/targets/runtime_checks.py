"""Run-time bounds checks of the CPU kernels (`--runtime-checks`).

MLIR's `generate-runtime-verification` checks memref loads, stores, subviews, casts and
reshapes; the vector accesses a vectorized kernel is made of have no such checks. Here each
vector access to a memref gets a `cf.assert` before it, with the same message format:
  vector.load / vector.store at indices i into sizes s, vector shape v (trailing dims):
      0 <= i_d and i_d + v_d <= s_d for every dim d (v_d = 1 for the leading dims); a 1-D
      vector of k whole rows at [i, 0, ..., 0] of a static row-major buffer: 0 <= i and
      i + k <= s_0 (upstream folds a gather of consecutive indices, which the vectorizer
      linearizes over the whole buffer, into such a load);
  vector.maskedload / vector.maskedstore: the same for the lanes the mask keeps;
  vector.transfer_read / transfer_write: for each vector dim marked in_bounds and mapped to
      memref dim d, 0 <= i_d and i_d + v_k <= s_d; other dims not covered by the vector:
      0 <= i_d < s_d (dims the transfer masks itself are not checked);
  vector.gather / vector.scatter (element k at linear position o + sum_d i_d t_d + idx_k,
      offset o, strides t): o <= position <= o + sum_d (s_d - 1) t_d for the kept lanes.
A failed check prints the op and its location and aborts, before the access.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, cf, memref, vector

from transform_ext.common import is_row_major, is_zero

_CHECKED = ("vector.load", "vector.store", "vector.maskedload", "vector.maskedstore",
            "vector.transfer_read", "vector.transfer_write", "vector.gather", "vector.scatter")


def add_vector_bounds_checks(payload: ir.Module) -> int:
    """Insert the checks of the module docstring; returns the number of accesses checked."""
    ops = []

    def visit(op):
        if op.name in _CHECKED:
            ops.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    checked = 0
    with payload.context:
        for op in ops:
            with ir.InsertionPoint(op), op.location:
                ok = _condition(op)
                if ok is not None:
                    cf.AssertOp(ok, _message(op))
                    checked += 1
    return checked


def _message(op: ir.Operation) -> str:
    text = str(op).strip().splitlines()[0]
    if len(text) > 240:
        text = text[:240] + " ..."
    return (f"ERROR: Runtime op verification failed\n{text}\n^ out-of-bounds access\n"
            f"Location: {op.location}")


class _Builder:
    """Index arithmetic on scalars, folded where the values are constants."""

    def __init__(self):
        self.index = ir.IndexType.get()
        self.i1 = ir.IntegerType.get_signless(1)

    def const(self, value: int) -> ir.Value:
        return arith.constant(self.index, value)

    def add(self, a, b):
        return arith.addi(a, b)

    def mul(self, a, b):
        return arith.muli(a, b)

    def le(self, a, b):
        return arith.cmpi(arith.CmpIPredicate.sle, a, b)

    def lt(self, a, b):
        return arith.cmpi(arith.CmpIPredicate.slt, a, b)

    def all(self, conditions):
        result = arith.constant(self.i1, 1)
        for c in conditions:
            result = arith.andi(result, c)
        return result


def _metadata(base: ir.Value):
    """(offset, sizes, strides) of a memref as index values."""
    mtype = ir.MemRefType(base.type)
    rank = mtype.rank
    index = ir.IndexType.get()
    base_type = ir.MemRefType.get([], mtype.element_type, memory_space=mtype.memory_space)
    meta = memref.ExtractStridedMetadataOp(
        base, results=[base_type, index] + [index] * rank + [index] * rank)
    values = list(meta.results)
    return values[1], values[2:2 + rank], values[2 + rank:]


def _box(b: _Builder, indices, sizes, extents) -> list:
    """0 <= i_d and i_d + e_d <= s_d for every dim with an extent (None: unchecked)."""
    conditions = []
    zero = b.const(0)
    for i, s, e in zip(indices, sizes, extents):
        if e is None:
            continue
        conditions.append(b.le(zero, i))
        conditions.append(b.le(b.add(i, b.const(e)), s))
    return conditions


def _whole_rows(mtype: ir.MemRefType, indices, vtype: ir.VectorType) -> int:
    """How many whole rows (of the dims after the first) a 1-D vector access at [i, 0, ..., 0]
    of a static row-major buffer covers; 0 when it is not such an access."""
    if vtype.rank != 1 or mtype.rank < 2 or not is_row_major(mtype) \
            or not all(is_zero(i) for i in indices[1:]):
        return 0
    strides, _ = mtype.get_strides_and_offset()
    row = strides[0]
    if row == 0 or vtype.shape[0] % row:
        return 0
    return vtype.shape[0] // row


def _lanes_ok(b: _Builder, ok_lanes: ir.Value, mask: ir.Value | None) -> ir.Value:
    """All lanes in bounds, or masked off: reduce_and(!mask | ok)."""
    vtype = ir.VectorType(ok_lanes.type)
    if mask is not None:
        ones = arith.constant(vtype, ir.DenseElementsAttr.get_splat(vtype, ir.BoolAttr.get(True)))
        ok_lanes = arith.ori(arith.xori(mask, ones), ok_lanes)
    return vector.reduction(b.i1, vector.CombiningKind.AND, ok_lanes)


def _flat(value: ir.Value) -> ir.Value:
    vtype = ir.VectorType(value.type)
    if vtype.rank == 1:
        return value
    n = 1
    for d in vtype.shape:
        n *= d
    return vector.shape_cast(ir.VectorType.get([n], vtype.element_type), value)


def _condition(op: ir.Operation) -> ir.Value | None:
    b = _Builder()
    name = op.name
    if name in ("vector.load", "vector.store"):
        base_pos, value_pos = (0, None) if name == "vector.load" else (1, 0)
        base = op.operands[base_pos]
        indices = list(op.operands[base_pos + 1:])
        vtype = ir.VectorType(op.results[0].type if value_pos is None else op.operands[0].type)
        _, sizes, _ = _metadata(base)
        r, v = len(indices), vtype.rank
        rows = _whole_rows(ir.MemRefType(base.type), indices, vtype)
        if rows:
            return b.all(_box(b, indices[:1], sizes[:1], [rows]))
        extents = [1] * (r - v) + list(vtype.shape)
        return b.all(_box(b, indices, sizes, extents))
    if name in ("vector.maskedload", "vector.maskedstore"):
        base = op.operands[0]
        rank = ir.MemRefType(base.type).rank
        indices = list(op.operands[1:1 + rank])
        mask = op.operands[1 + rank]
        lanes = ir.VectorType(mask.type).shape[0]
        _, sizes, _ = _metadata(base)
        outer = b.all(_box(b, indices[:-1], sizes[:-1], [1] * (rank - 1)))
        ivec = ir.VectorType.get([lanes], b.index)
        last = vector.broadcast(ivec, indices[-1])
        pos = arith.addi(last, vector.step(ivec))
        zero = vector.broadcast(ivec, b.const(0))
        size = vector.broadcast(ivec, sizes[-1])
        ok_lanes = arith.andi(arith.cmpi(arith.CmpIPredicate.sle, zero, pos),
                              arith.cmpi(arith.CmpIPredicate.slt, pos, size))
        any_kept = vector.reduction(b.i1, vector.CombiningKind.OR, mask)
        ones = arith.constant(b.i1, 1)
        return arith.andi(_lanes_ok(b, ok_lanes, mask),
                          arith.ori(outer, arith.xori(any_kept, ones)))
    if name in ("vector.transfer_read", "vector.transfer_write"):
        return _transfer_condition(b, op)
    if name in ("vector.gather", "vector.scatter"):
        return _gather_condition(b, op)
    return None


def _transfer_condition(b: _Builder, op: ir.Operation) -> ir.Value | None:
    is_read = op.name == "vector.transfer_read"
    base = op.operands[0] if is_read else op.operands[1]
    if not isinstance(base.type, ir.MemRefType):
        return None
    rank = ir.MemRefType(base.type).rank
    first = 1 if is_read else 2
    indices = list(op.operands[first:first + rank])
    vtype = ir.VectorType(op.results[0].type if is_read else op.operands[0].type)
    # a mask operand follows the indices (and the padding of a read): lanes it drops may lie
    # outside; such transfers are left unchecked rather than reported falsely
    extra = len(op.operands) - first - rank - (1 if is_read else 0)
    if extra:
        return None
    amap = ir.AffineMapAttr(op.attributes["permutation_map"]).value
    in_bounds = [ir.BoolAttr(a).value for a in ir.ArrayAttr(op.attributes["in_bounds"])]
    extents: list[int | None] = [1] * rank
    for k, expr in enumerate(amap.results):
        if not isinstance(expr, ir.AffineDimExpr):
            continue  # a broadcast dim reads nothing along the vector
        d = expr.position
        extents[d] = vtype.shape[k] if in_bounds[k] else None
    _, sizes, _ = _metadata(base)
    return b.all(_box(b, indices, sizes, extents))


def _gather_condition(b: _Builder, op: ir.Operation) -> ir.Value | None:
    base = op.operands[0]  # gather and scatter: base, offsets, index vector, mask, ...
    if not isinstance(base.type, ir.MemRefType):
        return None
    rank = ir.MemRefType(base.type).rank
    offsets = list(op.operands[1:1 + rank])
    index_vec, mask = op.operands[1 + rank], op.operands[2 + rank]
    offset, sizes, strides = _metadata(base)
    position = offset
    last = offset
    for o, s, t in zip(offsets, sizes, strides):
        position = b.add(position, b.mul(o, t))
        last = b.add(last, b.mul(b.add(s, b.const(-1)), t))
    index_vec, mask = _flat(index_vec), _flat(mask)
    itype = ir.VectorType(index_vec.type)
    ivec = ir.VectorType.get(itype.shape, b.index)
    if itype.element_type != b.index:
        index_vec = arith.index_cast(ivec, index_vec)
    pos = arith.addi(vector.broadcast(ivec, position), index_vec)
    ok_lanes = arith.andi(
        arith.cmpi(arith.CmpIPredicate.sle, vector.broadcast(ivec, offset), pos),
        arith.cmpi(arith.CmpIPredicate.sle, pos, vector.broadcast(ivec, last)))
    return _lanes_ok(b, ok_lanes, mask)
