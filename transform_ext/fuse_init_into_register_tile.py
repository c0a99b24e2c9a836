"""fuse_init_into_register_tile: a register tile of a contraction computes its own
accumulator's producer.

After `tile_using_for` over a contraction's m/n dims (or a convolution's output dims), the tile reads its accumulator as
`extract_slice %acc_iter[offsets][sizes]`, where %acc_iter is carried by the tile loops from
their initial value P(x...), the result of a producer P used by nothing else: a linalg.fill,
or an elementwise linalg.generic with an identity output map whose inputs are projected
permutations of its loops (a rescale). Tiles are disjoint and the loops write each tile
once, so when a tile is read, that tile of %acc_iter still holds P's value there:

    slice(P(x...), tile)  ==  P(slice(x..., tile), slice(dest(P), tile))

so P is cloned in front of the tile on slices of its inputs (input j sliced at the
offsets of the loop dims its map reads) with the accumulator slice as its init, and the
loops start from P's destination instead (P is erased). The accumulator producer is then
computed in registers, tile by tile, instead of in a pass over memory of its own.

Targets: tiled contractions or convolutions (one output; an edge tile's sizes may be
dynamic). Legality, checked on every target first: its
accumulator is a static-stride extract_slice of a value carried by enclosing scf.for loops
from such a single-use producer. Otherwise a silenceable failure naming the op, nothing
rewritten. The handle is only read: the contraction stays, with its accumulator replaced.
"""


from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .analysis.convolution import is_convolution
from .analysis.structure import dim_positions, is_linalg_op, loop_structure
from .analysis.tiles import per_tile_producer
from .common import Illegal, RewritesTargets, Success, defining_op, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.fuse_init_into_register_tile"
DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()
DYNAMIC_SIZE = ir.ShapedType.get_dynamic_size()


def _loop_init(value: ir.Value) -> ir.Value:
    """The value an scf.for iter_arg starts from, through every enclosing loop carrying it."""
    while isinstance(value, ir.BlockArgument) and value.owner.owner.name == "scf.for" \
            and value.arg_number > 0:
        loop = value.owner.owner
        value = loop.opview.initArgs[value.arg_number - 1]
    return value


def plan(tiled: ir.Operation) -> tuple[ir.Operation, ir.Operation]:
    """(accumulator slice, producer) of a legal target; Illegal otherwise."""
    if not is_linalg_op(tiled) or len(tiled.results) != 1:
        raise Illegal(tiled, "not a linalg op with one result")
    ls = loop_structure(tiled)
    if not ls.is_contraction and not is_convolution(tiled):
        raise Illegal(tiled, "not a contraction or a convolution")
    slice_op = defining_op(tiled.operands[ls.num_inputs])
    if slice_op is None or slice_op.name != "tensor.extract_slice":
        raise Illegal(tiled, "its accumulator is not a tensor.extract_slice")
    if DYNAMIC in list(slice_op.opview.static_strides):
        raise Illegal(tiled, "its accumulator slice has dynamic strides")
    init = _loop_init(slice_op.opview.source)
    producer = defining_op(init)
    if producer is None or not per_tile_producer(producer):
        raise Illegal(tiled, "its accumulator does not start from a fill or an elementwise "
                             "generic with an identity output map")
    if len(list(init.uses)) != 1:
        raise Illegal(tiled, "its accumulator's producer has other users")
    return slice_op, producer


def rewrite(tiled: ir.Operation, slice_op: ir.Operation, producer: ir.Operation,
            rewriter) -> None:
    ls = loop_structure(tiled)
    acc = tiled.operands[ls.num_inputs]
    view = slice_op.opview
    dynamic = iter(view.offsets)
    offsets = [next(dynamic) if o == DYNAMIC else o for o in view.static_offsets]
    dynamic_sizes = iter(view.sizes)
    sizes = [next(dynamic_sizes) if s == DYNAMIC_SIZE else s for s in view.static_sizes]
    strides = list(view.static_strides)
    pls = loop_structure(producer)
    with ir.InsertionPoint(tiled), tiled.location:
        slices = {}  # input index -> its slice under the tile, built before the clone reads it
        for j in range(pls.num_inputs):
            value = producer.operands[j]
            if not isinstance(value.type, ir.ShapedType):
                continue
            dims = dim_positions(pls.maps[j])
            offs = [offsets[d] for d in dims]
            szs = [sizes[d] for d in dims]
            static = [o if isinstance(o, int) else DYNAMIC for o in offs]
            dyn = [o for o in offs if not isinstance(o, int)]
            static_sizes = [z if isinstance(z, int) else DYNAMIC_SIZE for z in szs]
            dyn_sizes = [z for z in szs if not isinstance(z, int)]
            t = value.type
            slices[j] = tensor.ExtractSliceOp(
                ir.RankedTensorType.get(static_sizes, t.element_type, t.encoding), value, dyn,
                dyn_sizes, [], static, static_sizes, [strides[d] for d in dims]).result
        tile = producer.clone()
        for j, piece in slices.items():
            tile.operands[j] = piece
        tile.operands[pls.num_inputs] = acc
        tile.results[0].set_type(acc.type)
    tiled.operands[ls.num_inputs] = tile.results[0]
    rewriter.replace_op(producer, [producer.operands[pls.num_inputs]])


class FuseInitIntoRegisterTileOp(TransformExt.Operation, name="fuse_init_into_register_tile"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    plans = [(t, *plan(t)) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for tiled, slice_op, producer in plans:
                    rewrite(tiled, slice_op, producer, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fuse_init_into_register_tile(tiled: ir.Value) -> FuseInitIntoRegisterTileOp:
    """Compute the accumulator producer of the tiled contractions in `tiled` per tile."""
    return FuseInitIntoRegisterTileOp(tiled)


__all__ = ["FuseInitIntoRegisterTileOp", "fuse_init_into_register_tile"]
