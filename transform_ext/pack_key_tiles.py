"""pack_key_tiles: key tiles of the scores contraction read from a tile-packed copy.

X [..., A, S] with the keys last (K^T) becomes P [..., S/T, A, T],

    P[..., t, a, j] = X[..., a, t T + j],

made once next to X; the slice X[..., a0:a0+n, k:k+T] of key tile k is then the contiguous
block P[..., k/T, a0:a0+n, :] instead of n rows S elements apart (rows 4 KiB apart share
cache sets).

Rewritten, in every top-level scf.forall (query block) nested in the target functions: each
tensor.extract_slice read by a contraction in a key loop (an scf.for directly in the forall
with a constant step T whose iterations all start on a tile, see `_starts_on_tile`) whose
last dim is (iv, T), over an X of static shape defined outside the query blocks (possibly
through one slice in the query block). Rank-reducing slices and a remainder S mod T (left to
the peeled last tile, which still reads X) are left as they are. A target that is not a
function is a silenceable failure naming it (nothing rewritten). The target handle stays
valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import (Illegal, RewritesTargets, Success, defining_op, fail, is_nested_in,
                     payload_ops, reassociation_attr, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.pack_key_tiles"
DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


def int_constant(value) -> int | None:
    """The value of an integer arith.constant, else None."""
    op = defining_op(value)
    if op is not None and op.name == "arith.constant" and isinstance(op.attributes["value"], ir.IntegerAttr):
        return ir.IntegerAttr(op.attributes["value"]).value
    return None


def top_level_foralls(root: ir.Operation) -> list[ir.Operation]:
    """The scf.forall ops under `root` not nested in another forall, except a kernel's
    already fused (marked `lh.fused_kernel`, see fuse_attention_backward)."""
    found = []

    def visit(op):
        if op.name == "scf.forall":
            if "lh.fused_kernel" not in op.attributes:
                found.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    root.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def pack(root: ir.Operation, rewriter) -> None:
    """The rewrite of the module docstring in the query blocks under `root`."""
    packed: dict = {}
    for forall in top_level_foralls(root):
        for loop in walk_ops(forall, lambda op: op.name == "scf.for"):
            step = int_constant(loop.operands[2])
            if step is None or loop.parent.operation != forall or \
                    not _starts_on_tile(loop.operands[0], loop.operands[1], step):
                continue
            iv = loop.regions[0].blocks[0].arguments[0]
            for op in list(loop.regions[0].blocks[0].operations):
                op = op.operation
                plan = _key_tile_slice(op, iv, step, forall) if op.name == "tensor.extract_slice" \
                    else None
                if plan is None:
                    continue
                x, offsets, sizes = plan
                key = (x, step)
                if key not in packed:
                    packed[key] = _packed_copy(x, step)
                with ir.InsertionPoint(op), op.location:
                    idx = ir.IndexType.get()
                    tile = arith.divui(iv, arith.ConstantOp(idx, ir.IntegerAttr.get(idx, step)))
                    rank = len(sizes)
                    offs = offsets[:rank - 2] + [tile] + [offsets[rank - 2], 0]
                    szs = sizes[:rank - 2] + [1] + [sizes[rank - 2], step]
                    static, dynamic = [], []
                    for o in offs:
                        if isinstance(o, int):
                            static.append(o)
                        else:
                            static.append(DYNAMIC)
                            dynamic.append(o)
                    new = tensor.ExtractSliceOp(op.results[0].type, packed[key], dynamic, [], [],
                                                static, szs, [1] * (rank + 1))
                rewriter.replace_op(op, [new.result])


def _starts_on_tile(lb: ir.Value, ub: ir.Value, step: int) -> bool:
    """Is every iteration of a loop from lb to ub a multiple of `step`? lb is a constant
    multiple, c * step, or min(such, ub) (when ub wins the loop is empty): the starts
    bound_causal_key_loops gives the key loops."""
    c = int_constant(lb)
    if c is not None:
        return c % step == 0
    op = defining_op(lb)
    if op is None:
        return False
    if op.name == "arith.muli":
        return any(int_constant(v) is not None and int_constant(v) % step == 0 for v in op.operands)
    if op.name == "arith.minsi":
        return all(v == ub or _starts_on_tile(v, ub, step) for v in op.operands)
    return False


def _slice_parts(op: ir.Operation):
    """(source, offsets, sizes) of a unit-stride extract_slice with static sizes; offsets are
    ints or index values. None otherwise."""
    view = op.opview
    if any(s != 1 for s in view.static_strides) or any(s == DYNAMIC for s in view.static_sizes):
        return None
    dynamic = iter(view.offsets)
    offsets = [next(dynamic) if o == DYNAMIC else o for o in view.static_offsets]
    return view.source, offsets, list(view.static_sizes)


def _key_tile_slice(op: ir.Operation, iv: ir.Value, step: int, forall: ir.Operation):
    """For a slice, read by a contraction, of X[..., a0:a0+n, iv:iv+step] (possibly through
    one slice in the query block): (X, offsets, sizes) in X's coordinates, else None."""
    if not any(is_linalg_op(u.owner) and loop_structure(u.owner).is_contraction
               for u in op.results[0].uses):
        return None
    parts = _slice_parts(op)
    if parts is None or parts[1][-1] != iv or parts[2][-1] != step:
        return None
    source, offsets, sizes = parts
    if len(sizes) != source.type.rank or len(sizes) < 2:
        return None  # rank-reducing slices are not rewritten
    outer = defining_op(source)
    if outer is not None and outer.name == "tensor.extract_slice" and \
            outer.parent.operation == forall:
        outer_parts = _slice_parts(outer)
        if outer_parts is None or outer_parts[1][-1] != 0 or \
                len(outer_parts[2]) != outer_parts[0].type.rank:
            return None
        source = outer_parts[0]
        combined = []
        with ir.InsertionPoint(op), op.location:
            for a, b in zip(outer_parts[1][:-1], offsets[:-1]):
                if isinstance(a, int) and isinstance(b, int):
                    combined.append(a + b)
                elif a == 0 or b == 0:
                    combined.append(b if a == 0 else a)
                else:
                    a = a if not isinstance(a, int) else arith.ConstantOp(
                        ir.IndexType.get(), ir.IntegerAttr.get(ir.IndexType.get(), a)).result
                    b = b if not isinstance(b, int) else arith.ConstantOp(
                        ir.IndexType.get(), ir.IntegerAttr.get(ir.IndexType.get(), b)).result
                    combined.append(arith.addi(a, b))
        offsets = combined + [iv]
    t = source.type
    if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape or t.shape[-1] < step:
        return None
    owner = defining_op(source)
    if owner is not None:
        if forall.parent is None or (owner == forall or is_nested_in(owner, forall)):
            return None
    return source, offsets, sizes


def _packed_copy(x: ir.Value, tile: int) -> ir.Value:
    """P [..., S/T, A, T] = X[..., A, :S - S mod T] with its key dim split into tiles, the
    tile index moved before A (see `pack_key_tiles`)."""
    t = x.type
    *lead, a, s = t.shape
    n = s // tile
    rank = t.rank
    producer = defining_op(x)
    ip = ir.InsertionPoint.at_block_begin(x.owner) if producer is None \
        else ir.InsertionPoint.after(producer)
    with ip, x.location:
        if s % tile:
            x = tensor.ExtractSliceOp(ir.RankedTensorType.get(lead + [a, n * tile], t.element_type),
                                      x, [], [], [], [0] * rank, lead + [a, n * tile],
                                      [1] * rank).result
        groups = [[i] for i in range(rank - 1)] + [[rank - 1, rank]]
        expanded = tensor.ExpandShapeOp(
            ir.RankedTensorType.get(lead + [a, n, tile], t.element_type), x, reassociation_attr(groups),
            [], lead + [a, n, tile]).result
        init = tensor.EmptyOp(lead + [n, a, tile], t.element_type).result
        perm = list(range(rank - 2)) + [rank - 1, rank - 2, rank]
        return linalg.transpose(expanded, outs=[init], permutation=perm).results[0]


class PackKeyTilesOp(TransformExt.Operation, name="pack_key_tiles"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                for target in targets:
                    if target.name != "func.func":
                        return fail(NAME, Illegal(target, "not a function"))
                for target in targets:
                    pack(target, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def pack_key_tiles(func: ir.Value) -> None:
    """Read the key tiles of the scores contractions in `func`'s query blocks from
    tile-packed copies (see the module docstring)."""
    PackKeyTilesOp(func)


__all__ = ["PackKeyTilesOp", "pack_key_tiles", "int_constant", "top_level_foralls"]
