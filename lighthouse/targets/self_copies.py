"""Copies of a buffer's region onto itself, dropped after bufferization.

A product computed in place into a slice of a loop-carried accumulator and inserted back at
the same offsets (the linear cross-entropy backward's dW class tile, read through column
panels: `insert_slice(collapse(product(expand(extract_slice(dW, c)))), dW, c)`) is
vectorized as a transfer_read of the product's result and a transfer_write into the
accumulator. Bufferized in place, the read is of `subview(B, o, s)` at zeros and the write
is into `B` at `o`: the same elements, copied onto themselves (256 KiB per class tile).

`drop_self_copies` erases each `vector.transfer_write(vector.transfer_read(A, 0...), B, o)`
where A is `memref.subview(B, o, s, 1...)` (the same offset values or constants), the
vector's shape is s, both maps are minor identities, neither takes a mask, the read has no
other user, and nothing between them in their block writes memory: the write stores what
the read loaded from the same addresses.
"""

from __future__ import annotations

from torch_mlir import ir

from transform_ext.common import constant_value, defining_op

_PURE_BETWEEN = ("arith.", "affine.apply", "memref.subview", "memref.expand_shape",
                 "memref.collapse_shape")


def _index(value: ir.Value) -> int | None:
    """The integer an index value holds when it is a constant, else None."""
    attr = constant_value(value)
    return ir.IntegerAttr(attr).value if isinstance(attr, ir.IntegerAttr) else None


def _same(a: ir.Value, b) -> bool:
    """Are `a` and `b` (a value, or a static int) the same index?"""
    if isinstance(b, int):
        return _index(a) == b
    return a == b or (_index(a) is not None and _index(a) == _index(b))


def _subview_region(view: ir.Value):
    """(source, offsets, sizes) of a unit-stride memref.subview with static sizes, each
    offset a value or an int; None otherwise."""
    op = defining_op(view)
    if op is None or op.name != "memref.subview":
        return None
    dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
    static_offsets = list(ir.DenseI64ArrayAttr(op.attributes["static_offsets"]))
    sizes = list(ir.DenseI64ArrayAttr(op.attributes["static_sizes"]))
    strides = list(ir.DenseI64ArrayAttr(op.attributes["static_strides"]))
    if any(s != 1 for s in strides) or any(s == dynamic for s in sizes) or \
            len(sizes) != ir.MemRefType(view.type).rank:
        return None
    values = iter(list(op.operands)[1:])
    offsets = [next(values) if o == dynamic else o for o in static_offsets]
    return op.operands[0], offsets, sizes


def _masked(op: ir.Operation) -> bool:
    """Does a transfer op take a mask (its last operand segment)?"""
    return list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))[-1] > 0


def _minor_identity(op: ir.Operation) -> bool:
    amap = ir.AffineMapAttr(op.attributes["permutation_map"]).value
    return amap == ir.AffineMap.get_minor_identity(amap.n_dims, len(amap.results))


def _nothing_written_between(read: ir.Operation, write: ir.Operation) -> bool:
    block = read.block
    if write.block != block:
        return False
    inside = False
    for op in block.operations:
        op = op.operation
        if op == read:
            inside = True
            continue
        if op == write:
            return inside
        if inside and not op.name.startswith(_PURE_BETWEEN):
            return False
    return False


def _is_self_copy(write: ir.Operation) -> bool:
    value, dest = write.operands[0], write.operands[1]
    read = defining_op(value)
    if read is None or read.name != "vector.transfer_read" or len(list(value.uses)) != 1 \
            or not isinstance(dest.type, ir.MemRefType) or _masked(read) or _masked(write):
        return False
    if not (_minor_identity(read) and _minor_identity(write)):
        return False
    region = _subview_region(read.operands[0])
    if region is None or region[0] != dest:
        return False
    _, offsets, sizes = region
    rank = ir.MemRefType(dest.type).rank
    read_at = list(read.operands)[1:1 + len(sizes)]
    write_at = list(write.operands)[2:2 + rank]
    shape = list(ir.VectorType(value.type).shape)
    if len(sizes) != rank or len(shape) != rank or shape != sizes:
        return False
    if not all(_same(i, 0) for i in read_at) or \
            not all(_same(w, o) for w, o in zip(write_at, offsets)):
        return False
    return _nothing_written_between(read, write)


def drop_self_copies(payload: ir.Module) -> int:
    """Erase the copies of a region onto itself (see the module docstring). Returns the
    number dropped."""
    writes = []

    def visit(op):
        if op.name == "vector.transfer_write" and _is_self_copy(op):
            writes.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    for write in writes:
        read = defining_op(write.operands[0])
        write.erase()
        read.erase()
    return len(writes)
