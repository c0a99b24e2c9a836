"""contraction_loops_to_amx_tiles: a bufferized register tile's loop over k, whose step is a
bf16 contraction in VNNI pairs accumulating into an f32 tile of C, run on AMX tiles.

    scf.for %k = lb to ub step s {                     C: [M, N] f32 (loop-invariant view)
      linalg.generic: C[m, n] += A[m, k, v] B[k, n, v]    A: [M, K, 2], B: [K, N, 2] bf16
    }                                                  (any further dims of extent 1)
      ->  c_ij = tile_load C[16i:16i+16, 16j:16j+16]       (for i < M/16, j < N/16)
          scf.for %k iter_args(c_ij) {
            a_i = tile_load A[16i:16i+16, 16p:16p+16, :]     (as [16, 32] bf16)
            b_j = tile_load B[16p:16p+16, 16j:16j+16, :]     (as [16, 32] bf16, VNNI)
            c_ij = tdpbf16ps(a_i, b_j, c_ij)                  (for each 16 k pairs p)
          }
          tile_store C[16i:16i+16, 16j:16j+16] = c_ij

`x86.amx.tile_mulf` (tdpbf16ps) adds to C[m, n] the products A[m, 2q] B[q, 2n] + A[m, 2q+1]
B[q, 2n+1] over its 16 pairs q, each exact in f32, the sum rounded to nearest even (denormal
inputs flushed), as oneDNN's AMX bf16 matmul torch calls. The accumulators stay in tile
registers across the loop: C is read once before it and written once after it. A step that
is not the body of such a loop (a loop of one step folded away, or a loop that does more)
is rewritten where it is: C's tiles loaded, the products, C's tiles stored.

Rewritten: every linalg.generic nested in the targets, on memrefs, where
  - the body is C + extf(A) * extf(B) (f32 C, bf16 A and B), maps projected permutations,
    static extents: m and n multiples of 16 whose tiles fit AMX's 8 tile registers (the
    (M/16)(N/16) accumulators, M/16 tiles of A, N/16 of B), k a multiple of 16, v = 2;
  - each operand holds its two or three dims in the order above as its only dims of extent
    > 1, the trailing ones contiguous (A's k, v and B's n, v dense rows of 64 bytes; C's n
    of stride 1);
and its loop, when it is the body of an scf.for without iter_args holding nothing else but
ops without memory effects (views, index arithmetic) and C's view is defined outside the
loop (or by view ops of values defined outside it, which are moved before the loop).
Other ops are left as they are. Nothing is illegal but a target that is not a func.func (a
silenceable failure, nothing rewritten). Needs a host with amx_tile and amx_bf16 and the
process's permission to use the tile registers (lighthouse.runtime). Result: none.
"""

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, memref, scf, transform, x86

from .analysis.structure import dim_positions
from .common import (RewritesTargets, block_ops, defining_op, is_nested_in, reassociation_attr,
                     rewrite_functions, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.contraction_loops_to_amx_tiles"
ROWS = 16          # rows of an AMX tile
PAIRS = 16         # bf16 pairs in a row of 64 bytes
TILE_REGISTERS = 8
VIEW_OPS = ("memref.subview", "memref.collapse_shape", "memref.expand_shape",
            "memref.reinterpret_cast", "affine.apply", "affine.min", "affine.max")


@dataclass
class _AmxLoop:
    """A contraction the rewrite takes: its loop (None: rewritten where it is), its
    generic, A, B and C (operand dims (m, k, v), (k, n, v), (m, n)) and their extents."""

    loop: ir.Operation | None
    generic: ir.Operation
    a: ir.Value
    b: ir.Value
    c: ir.Value
    m: int
    n: int
    k: int


def is_multiply_add(generic: ir.Operation) -> bool:
    """Is the generic's body yield(C + extf(A) * extf(B)) in f32 (in either order)?"""
    args = list(generic.regions[0].blocks[0].arguments)
    ops = block_ops(generic)
    if len(args) != 3 or len(ops) != 5 or ops[-1].name != "linalg.yield":
        return False
    names = sorted(op.name for op in ops[:-1])
    if names != ["arith.addf", "arith.extf", "arith.extf", "arith.mulf"]:
        return False
    add = ops[-1].operands[0].owner
    if getattr(add, "name", None) != "arith.addf":
        return False
    terms = list(add.operands)
    if args[2] not in terms:
        return False
    product = terms[1 - terms.index(args[2])].owner
    if getattr(product, "name", None) != "arith.mulf":
        return False
    sources = []
    for factor in product.operands:
        ext_op = factor.owner
        if getattr(ext_op, "name", None) != "arith.extf":
            return False
        sources.append(ext_op.operands[0])
    return sorted(s.arg_number for s in sources if isinstance(s, ir.BlockArgument)) == [0, 1]


def _strides(t: ir.MemRefType) -> list[int | None]:
    strides, _ = t.get_strides_and_offset()
    dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
    return [None if s == dynamic else s for s in strides]


def _wide_dims(value: ir.Value, dims: list[int]) -> list[tuple[int, int]]:
    """(axis, loop dim) of the operand's axes of extent > 1."""
    shape = ir.MemRefType(value.type).shape
    return [(axis, d) for axis, d in enumerate(dims) if shape[axis] != 1]


def _invariant(value: ir.Value, loop: ir.Operation) -> bool:
    """Is `value` defined outside `loop`, or by view ops inside it whose operands are?"""
    producer = defining_op(value)
    if producer is None:
        block_owner = value.owner.owner if isinstance(value, ir.BlockArgument) else None
        return block_owner is None or block_owner != loop
    if not is_nested_in(producer, loop):
        return True
    return producer.name in VIEW_OPS + ("arith.constant",) and all(
        _invariant(v, loop) for v in producer.operands)


def _hoist(value: ir.Value, loop: ir.Operation) -> None:
    """Move the view ops defining `value` inside `loop` before it (`_invariant` holds)."""
    producer = defining_op(value)
    if producer is None or not is_nested_in(producer, loop):
        return
    for v in producer.operands:
        _hoist(v, loop)
    producer.move_before(loop)


def amx_contraction(generic: ir.Operation):
    """The generic in the form the module docstring names (its loop aside), else None."""
    if generic.name != "linalg.generic":
        return None
    view = generic.opview
    inputs, outputs = list(view.inputs), list(view.outputs)
    if len(inputs) != 2 or len(outputs) != 1 or not all(
            isinstance(v.type, ir.MemRefType) for v in inputs + outputs):
        return None
    types = [ir.MemRefType(v.type).element_type for v in inputs + outputs]
    if not (isinstance(types[0], ir.BF16Type) and isinstance(types[1], ir.BF16Type)
            and isinstance(types[2], ir.F32Type)) or not is_multiply_add(generic):
        return None
    if any(not ir.MemRefType(v.type).has_static_shape for v in inputs + outputs):
        return None
    maps = [dim_positions(ir.AffineMapAttr(m).value) for m in ir.ArrayAttr(generic.attributes["indexing_maps"])]
    if any(None in m for m in maps):
        return None
    c_wide = _wide_dims(outputs[0], maps[2])
    if len(c_wide) != 2:
        return None
    (_, m_dim), (_, n_dim) = c_wide
    a_index = next((i for i in (0, 1) if m_dim in maps[i]), None)
    if a_index is None:
        return None
    a, b = inputs[a_index], inputs[1 - a_index]
    a_wide = _wide_dims(a, maps[a_index])
    b_wide = _wide_dims(b, maps[1 - a_index])
    if len(a_wide) != 3 or len(b_wide) != 3:
        return None
    if a_wide[0][1] != m_dim or b_wide[1][1] != n_dim:
        return None
    k_dim, v_dim = a_wide[1][1], a_wide[2][1]
    if (b_wide[0][1], b_wide[2][1]) != (k_dim, v_dim):
        return None
    shape = {}
    for value, wide in ((a, a_wide), (b, b_wide), (outputs[0], c_wide)):
        for axis, d in wide:
            shape[d] = ir.MemRefType(value.type).shape[axis]
    m, n, k, v = (shape[d] for d in (m_dim, n_dim, k_dim, v_dim))
    tiles_m, tiles_n = m // ROWS, n // ROWS
    if v != 2 or m % ROWS or n % ROWS or k % PAIRS or \
            tiles_m + tiles_n + tiles_m * tiles_n > TILE_REGISTERS:
        return None
    a_strides, b_strides, c_strides = (_strides(ir.MemRefType(x.type)) for x in (a, b, outputs[0]))
    if a_strides[a_wide[2][0]] != 1 or a_strides[a_wide[1][0]] != 2 or \
            b_strides[b_wide[2][0]] != 1 or b_strides[b_wide[1][0]] != 2 or \
            c_strides[c_wide[1][0]] != 1:
        return None
    return _AmxLoop(None, generic, a, b, outputs[0], m, n, k)


def amx_loop(generic: ir.Operation):
    """The contraction (`amx_contraction`) and, when it is the step of a loop of the form
    the module docstring names, that loop; else None."""
    found = amx_contraction(generic)
    if found is None:
        return None
    loop = generic.parent
    if loop is None or loop.name != "scf.for":
        return found
    body = block_ops(loop)
    if len(loop.results) == 0 and not any(
            op.name not in VIEW_OPS + ("arith.constant", "arith.addi", "arith.muli", "scf.yield")
            for op in body if op != generic) and _invariant(found.c, loop):
        found.loop = loop
    return found


def _as_rows(value: ir.Value, split_after: int) -> ir.Value:
    """The memref `value` collapsed to 2-D: its axes up to `split_after` as rows, the rest
    as columns (unit axes and one contiguous run: the checks of `amx_contraction`)."""
    t = ir.MemRefType(value.type)
    groups = [list(range(split_after + 1)), list(range(split_after + 1, t.rank))]
    shape, strides = t.shape, _strides(t)
    rows = 1
    for axis in groups[0]:
        rows *= shape[axis]
    cols = 1
    for axis in groups[1]:
        cols *= shape[axis]
    if isinstance(t.layout, ir.StridedLayoutAttr):
        wide_rows = [axis for axis in groups[0] if shape[axis] != 1]
        row_stride = strides[wide_rows[0]] if wide_rows else cols
        dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
        _, offset = t.get_strides_and_offset()
        layout = ir.StridedLayoutAttr.get(offset, [dynamic if row_stride is None else row_stride, 1])
        result = ir.MemRefType.get([rows, cols], t.element_type, layout)
    else:  # an identity layout collapses to one
        result = ir.MemRefType.get([rows, cols], t.element_type)
    return memref.collapse_shape(result, value, reassociation_attr(groups))


def rewrite(found: _AmxLoop, rewriter) -> None:
    """Replace the loop (or the lone step) by its AMX form (the module docstring)."""
    loop, generic = found.loop, found.generic
    at = loop if loop is not None else generic
    acc_t = ir.Type.parse("!x86.amx.tile<16x16xf32>")
    in_t = ir.Type.parse("!x86.amx.tile<16x32xbf16>")
    if loop is not None:
        _hoist(found.c, loop)

    def first_wide_axis(value):
        return next(axis for axis, s in enumerate(ir.MemRefType(value.type).shape) if s != 1)

    tiles_m, tiles_n, steps = found.m // ROWS, found.n // ROWS, found.k // PAIRS
    with ir.InsertionPoint(at), at.location:  # the tile offsets, once before the loop
        offsets = sorted({ROWS * i for i in range(max(tiles_m, tiles_n, steps))}
                         | {2 * PAIRS * p for p in range(steps)} | {2 * ROWS * j for j in range(tiles_n)})
        index = {o: arith.constant(ir.IndexType.get(), o) for o in offsets}
        c2 = _as_rows(found.c, first_wide_axis(found.c))
        accs = [x86.TileLoadOp(acc_t, c2, [index[ROWS * i], index[ROWS * j]]).result
                for i in range(tiles_m) for j in range(tiles_n)]

    def steps_of(a, b, accs):
        """The step's tile loads and products on the accumulators; returns them."""
        a2 = _as_rows(a, first_wide_axis(a))
        b2 = _as_rows(b, first_wide_axis(b))
        for p in range(steps):
            a_tiles = [x86.TileLoadOp(in_t, a2, [index[ROWS * i], index[2 * PAIRS * p]]).result
                       for i in range(tiles_m)]
            b_tiles = [x86.TileLoadOp(in_t, b2, [index[PAIRS * p], index[2 * ROWS * j]]).result
                       for j in range(tiles_n)]
            accs = [x86.TileMulFOp(a_tiles[i], b_tiles[j], accs[i * tiles_n + j]).result
                    for i in range(tiles_m) for j in range(tiles_n)]
        return accs

    if loop is None:
        with ir.InsertionPoint(generic), generic.location:
            results = steps_of(found.a, found.b, accs)
    else:
        view = loop.opview
        with ir.InsertionPoint(loop), loop.location:
            new = scf.ForOp(view.lowerBound, view.upperBound, view.step, accs)
        old_block = loop.regions[0].blocks[0]
        with ir.InsertionPoint(new.body), loop.location:
            yield_op = scf.YieldOp([])
        for op in block_ops(old_block):
            if op.name not in ("scf.yield", "linalg.generic"):
                op.move_before(yield_op.operation)
        old_block.arguments[0].replace_all_uses_with(new.induction_variable)
        with ir.InsertionPoint(yield_op), loop.location:
            scf.YieldOp(steps_of(found.a, found.b, list(new.inner_iter_args)))
        yield_op.operation.erase()
        results = list(new.results)
    with ir.InsertionPoint(at), at.location:  # after the new loop, or the products
        for i in range(tiles_m):
            for j in range(tiles_n):
                x86.TileStoreOp(c2, [index[ROWS * i], index[ROWS * j]], results[i * tiles_n + j])
    rewriter.erase_op(generic)
    if loop is not None:
        rewriter.erase_op(loop)


def lower_in(root: ir.Operation, rewriter) -> int:
    """Rewrite the loops under `root`; returns how many."""
    found = [f for f in map(amx_loop, walk_ops(root, lambda o: o.name == "linalg.generic"))
             if f is not None]
    for f in found:
        rewrite(f, rewriter)
    return len(found)


class ContractionLoopsToAmxTilesOp(TransformExt.Operation, name="contraction_loops_to_amx_tiles"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return rewrite_functions(NAME, op, rewriter, state, lower_in)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def contraction_loops_to_amx_tiles(func: ir.Value) -> ContractionLoopsToAmxTilesOp:
    """Run the bf16 pair contraction loops of the functions of `func` on AMX tiles."""
    return ContractionLoopsToAmxTilesOp(func)


__all__ = ["ContractionLoopsToAmxTilesOp", "amx_loop", "contraction_loops_to_amx_tiles",
           "is_multiply_add", "lower_in"]
