"""tile_insert_slices: rewrite large or strided tensor.insert_slice ops as loops of tiles.

    insert_slice %src into %dst[o_0..o_R-1] [n_0..n_R-1] [s_0..s_R-1]
      ==  for every tile t of the slice (1 x ... x 1 x w along the lane dim L, the innermost
          dim with n_L > 1; w = 1 when s_L != 1):
            dst[o_d + s_d * t_d + k_d] = src'[t_d + k_d]   (k_L < w, k_d = 0 elsewhere)

where src' is %src expanded (tensor.expand_shape) to the slice's rank when the insert is
rank-reducing, so every tile insert has the destination's rank, size 1 in every dim but L
and stride 1 in every dim (a stride of a unit dim is irrelevant). The loops are `scf.for`
nests carrying the destination; w is the largest divisor of n_L not above `lane_tile`.

Why: the linalg vectorizer (vectorize_children_and_apply_patterns) turns a whole
insert_slice into one transfer_read of the source and a minor-identity transfer_write at
the offsets. That drops the strides (a stride-2 insert becomes a contiguous write: the
zero-stuffed input of a transposed convolution), misplaces a rank-reducing insert whose
dropped dims are not the leading ones (a [8] column into [8, 4] is written along a row),
and builds one vector as large as the source (a padded activation of millions of
elements: LLVM IR of megabytes that never finishes compiling). After this rewrite each
tile insert vectorizes to a read and a write of at most `lane_tile` elements that land
where the insert_slice put them.

Rewritten: every insert_slice nested in (or equal to) the targets that has a stride other
than 1 on a dim of size > 1, or is rank-reducing, or whose source holds more than
`max_elements` elements; the others (the tiles of tiled linalg ops) are left alone, and so
is an update in place: a source computed (through the inits of destination-style ops and
loops) into a slice of the destination at the same offsets, sizes and strides, which
bufferization writes where it is (a class tile of dW accumulated in a loop; tiled into
copies, it was copied out and back per tile). Precondition: static sizes, strides and source shape (offsets may be dynamic). A target
that is itself an insert_slice without them is a silenceable failure (nothing rewritten);
nested ones are left alone, as the vectorizer leaves them.
"""


import math

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, scf, tensor, transform

from .common import (Illegal, RewritesTargets, Success, defining_op, fail, largest_divisor_at_most, payload_ops,
                     reassociation_attr, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.tile_insert_slices"
DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


def is_static(op: ir.Operation) -> bool:
    """Static sizes, strides and source shape (offsets may be dynamic)."""
    view = op.opview
    return DYNAMIC not in list(view.static_sizes) + list(view.static_strides) and \
        ir.RankedTensorType(view.source.type).has_static_shape


def updates_in_place(op: ir.Operation) -> bool:
    """The source is computed into a slice of the destination taken at the same offsets,
    sizes and strides (through the inits of destination-style ops and loops, and reshapes,
    which keep the elements in their row-major order): after bufferization the insert
    writes nothing."""
    view = op.opview
    value = view.source
    for _ in range(64):
        producer = defining_op(value)
        if producer is None:
            return False
        if producer.name == "tensor.extract_slice":
            src = producer.opview
            return src.source == view.dest and \
                list(src.static_offsets) == list(view.static_offsets) and \
                list(src.offsets) == list(view.offsets) and \
                list(src.static_sizes) == list(view.static_sizes) and \
                list(src.static_strides) == list(view.static_strides)
        if producer.name == "scf.for":
            index = list(producer.results).index(value)
            value = producer.operands[3 + index]
            continue
        if producer.name in ("tensor.expand_shape", "tensor.collapse_shape"):
            value = producer.operands[0]  # the same elements in the same order
            continue
        inits = _destination_of(producer, value)
        if inits is None:
            return False
        value = inits
    return False


def _destination_of(producer: ir.Operation, result: ir.Value):
    """The init a destination-style op writes `result` into, else None."""
    if producer.name in ("vector.transfer_write",):
        return producer.operands[1]
    if producer.name.startswith("linalg.") and "operandSegmentSizes" in producer.attributes:
        sizes = list(ir.DenseI32ArrayAttr(producer.attributes["operandSegmentSizes"]))
        index = list(producer.results).index(result)
        return producer.operands[sizes[0] + index]
    return None


def needs_tiling(op: ir.Operation, max_elements: int) -> bool:
    """A static insert_slice the vectorizer would get wrong or make too large a vector of."""
    view = op.opview
    if updates_in_place(op):
        return False
    sizes, strides = list(view.static_sizes), list(view.static_strides)
    source = ir.RankedTensorType(view.source.type)
    if any(st != 1 and n > 1 for n, st in zip(sizes, strides)):
        return True
    return source.rank != len(sizes) or math.prod(source.shape) > max_elements


def dropped_dims(sizes: list[int], source_shape: list[int]) -> list[int]:
    """The slice dims a rank-reducing insert drops (unit dims), matched from the innermost
    dim outwards as MLIR does; any choice among unit dims places the same elements."""
    dropped, j = [], len(source_shape) - 1
    for d in range(len(sizes) - 1, -1, -1):
        if j >= 0 and sizes[d] == source_shape[j]:
            j -= 1
        else:
            dropped.append(d)
    return sorted(dropped)


def _expansion_groups(rank: int, dropped: list[int]) -> list[list[int]]:
    """Reassociation of an expand_shape inserting the unit dims `dropped` into a source of
    `rank - len(dropped)` dims: each dropped dim joins the next kept dim (the last group
    when none follows)."""
    kept = [d for d in range(rank) if d not in dropped]
    groups, pending = [], []
    for d in range(rank):
        pending.append(d)
        if d in kept:
            groups.append(pending)
            pending = []
    if pending and groups:  # (a 0-d source has no groups at all)
        groups[-1].extend(pending)
    return groups


def _index(value: int) -> ir.Value:
    idx = ir.IndexType.get()
    return arith.ConstantOp(idx, ir.IntegerAttr.get(idx, value)).result


def _offset(base, stride: int, iv: ir.Value) -> ir.Value:
    """base + stride * iv as an index value (base: an int or an index value)."""
    step = iv if stride == 1 else arith.MulIOp(iv, _index(stride)).result
    if isinstance(base, int) and base == 0:
        return step
    return arith.AddIOp(base if isinstance(base, ir.Value) else _index(base), step).result


def rewrite(op: ir.Operation, lane_tile: int, rewriter) -> None:
    view = op.opview
    sizes, strides = list(view.static_sizes), list(view.static_strides)
    dynamic = iter(view.offsets)
    offsets = [next(dynamic) if o == DYNAMIC else o for o in view.static_offsets]
    rank = len(sizes)
    source_type = ir.RankedTensorType(view.source.type)
    element = source_type.element_type
    looped = [d for d in range(rank) if sizes[d] > 1]
    lane = looped[-1] if looped else None
    tile = [1] * rank
    if lane is not None and strides[lane] == 1:
        tile[lane] = largest_divisor_at_most(sizes[lane], lane_tile)
    with ir.InsertionPoint(op), op.location:
        source = view.source
        if source_type.rank != rank:
            dropped = dropped_dims(sizes, list(source_type.shape))
            source = tensor.ExpandShapeOp(
                ir.RankedTensorType.get(sizes, element), source,
                reassociation_attr(_expansion_groups(rank, dropped)), [], sizes).result
        ivs: dict[int, ir.Value] = {}

        def insert_tile(dest: ir.Value) -> ir.Value:
            src_offsets = [ivs.get(d, 0) for d in range(rank)]
            piece = tensor.ExtractSliceOp(
                ir.RankedTensorType.get(tile, element), source,
                [v for v in src_offsets if isinstance(v, ir.Value)], [], [],
                [DYNAMIC if isinstance(v, ir.Value) else v for v in src_offsets], tile,
                [1] * rank).result
            dst_offsets = [_offset(offsets[d], strides[d], ivs[d]) if d in ivs else offsets[d]
                           for d in range(rank)]
            return tensor.InsertSliceOp(
                piece, dest, [v for v in dst_offsets if isinstance(v, ir.Value)], [], [],
                [DYNAMIC if isinstance(v, ir.Value) else v for v in dst_offsets], tile,
                [1] * rank).result

        def nest(dims: list[int], dest: ir.Value) -> ir.Value:
            if not dims:
                return insert_tile(dest)
            d = dims[0]
            loop = scf.ForOp(_index(0), _index(sizes[d]), _index(tile[d]), [dest])
            with ir.InsertionPoint(loop.body):
                ivs[d] = loop.induction_variable
                scf.YieldOp([nest(dims[1:], loop.inner_iter_args[0])])
            return loop.results[0]

        inserted = nest(looped, view.dest)
    rewriter.replace_op(op, [inserted])


def _is_insert_slice(op: ir.Operation) -> bool:
    return op.name == "tensor.insert_slice"


class TileInsertSlicesOp(TransformExt.Operation, name="tile_insert_slices"):
    target: ext.Operand[transform.AnyOpType]
    lane_tile: ir.IntegerAttr
    max_elements: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                lane_tile = ir.IntegerAttr(op.lane_tile).value
                max_elements = ir.IntegerAttr(op.max_elements).value
                targets = payload_ops(state, op.target)
                plan = []
                try:
                    for target in targets:
                        if target.name == "tensor.insert_slice" and not is_static(target):
                            raise Illegal(target, "dynamic sizes, strides or source shape")
                        plan += [found for found in walk_ops(target, _is_insert_slice)
                                 if is_static(found) and needs_tiling(found, max_elements)]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for found in plan:
                    rewrite(found, lane_tile, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def tile_insert_slices(target: ir.Value, lane_tile: int, max_elements: int) -> None:
    """Rewrite the large, strided or rank-reducing insert_slices nested in `target` as loops
    of tiles of at most `lane_tile` elements (see the module docstring)."""
    i64 = ir.IntegerType.get_signless(64)
    TileInsertSlicesOp(target, ir.IntegerAttr.get(i64, lane_tile), ir.IntegerAttr.get(i64, max_elements))


__all__ = ["TileInsertSlicesOp", "tile_insert_slices", "dropped_dims"]
