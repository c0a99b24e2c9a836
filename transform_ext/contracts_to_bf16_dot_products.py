"""contracts_to_bf16_dot_products: a register tile's step over a pair of k, on bf16
operands with an f32 accumulator, as AVX512-BF16 dot products (vdpbf16ps).

    C[m, n] += A[m, 2k] B[2k, n] + A[m, 2k+1] B[2k+1, n]      (one step of the k loop)
      ->  per row m and per 16 columns n0..n0+15:
          C[m, n0:n0+16] = x86.avx512.dot(C[m, n0:n0+16], bcast(A[m, 2k:2k+2]), B_pairs)

`x86.avx512.dot %acc, %a, %b` adds to each f32 lane i the two products a[2i] b[2i] +
a[2i+1] b[2i+1] of its pair of bf16 lanes (each product exact in f32; the sum rounded to
nearest even, denormal inputs and results flushed to zero, as oneDNN's bf16 matmul that
torch calls). `bcast(A[m, 2k:2k+2])` repeats A's pair in the 16 lanes (one 32-bit
broadcast; A stored [2, M] is interleaved first); B_pairs interleaves B's two rows over 16 columns: B[2k, n0], B[2k+1, n0],
B[2k, n0+1], ... When B's vector is stored pair-innermost ([N, 2], the VNNI layout a
packed panel has) that is a slice of it; stored row by row ([2, N]) it is a shuffle of the
two rows.

Rewritten: every vector.contract nested in the targets that is not under a vector.mask,
with kind add, bf16 operands (or arith.extf of bf16 vectors) and an f32 accumulator
[M, N] (N a multiple of 16, its last dim), iterators m, n (parallel) and k (reduction,
extent 2) and any others of extent 1, A holding m and k, B holding k and n (the unit dims
dropped by shape casts around the rewrite); other contractions are left as they are (masked
edge tiles, odd k steps, f32 operands: they keep the outer-product lowering). Nothing is
illegal but a target that is not a func.func (a silenceable failure, nothing rewritten).
Needs a host with avx512_bf16 to run (the schedules apply it when the target description
says so). Result: none; the handle is only read.
"""


from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform, vector
from torch_mlir.dialects import x86

from .analysis.structure import dim_positions
from .common import (RewritesTargets, constant_value, defining_op, iterator_kinds,
                     reassociation_attr, rewrite_functions, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.contracts_to_bf16_dot_products"
LANES = 16  # f32 lanes of one vdpbf16ps (512 bits)


@dataclass
class _DotContract:
    """A contraction the rewrite takes: its bf16 operands A (rows m) and B (lanes n), and
    whether each is stored k-innermost ([M, 2] / [N, 2]) rather than k-outermost."""

    op: ir.Operation
    a: ir.Value
    b: ir.Value
    a_pairs_inner: bool
    b_pairs_inner: bool
    rows: int
    lanes: int


def _bf16_source(value: ir.Value):
    """`value` as a bf16 vector: itself, or the source of its arith.extf."""
    producer = defining_op(value)
    if producer is not None and producer.name == "arith.extf":
        value = producer.operands[0]
    vtype = value.type
    if isinstance(vtype, ir.VectorType) and isinstance(vtype.element_type, ir.BF16Type):
        return value
    return None


def dot_contract(op: ir.Operation):
    """The contraction in the form the module docstring names (unit dims aside), else None."""
    if op.name != "vector.contract" or (op.parent is not None and op.parent.name == "vector.mask"):
        return None
    acc_type = op.operands[2].type
    if "<add>" not in str(op.attributes["kind"]) or not isinstance(acc_type, ir.VectorType) or \
            not isinstance(acc_type.element_type, ir.F32Type):
        return None
    sources = [_bf16_source(op.operands[i]) for i in (0, 1)]
    if any(s is None for s in sources):
        return None
    maps = [dim_positions(ir.AffineMapAttr(m).value) for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
    if any(None in m for m in maps):
        return None
    extent = {}
    for value, dims in zip(list(op.operands[:3]), maps):
        extent.update(zip(dims, ir.VectorType(value.type).shape))
    kinds = iterator_kinds(op)
    wide = [d for d in range(len(kinds)) if extent.get(d, 1) != 1]
    n_dim = maps[2][-1]
    k_dims = [d for d in wide if kinds[d] == "reduction"]
    m_dims = [d for d in wide if kinds[d] == "parallel" and d != n_dim]
    if len(k_dims) != 1 or extent[k_dims[0]] != 2 or len(m_dims) > 1 or \
            extent.get(n_dim, 1) % LANES or kinds[n_dim] != "parallel":
        return None
    k_dim = k_dims[0]
    b_index = next((i for i in (0, 1) if n_dim in maps[i]), None)
    if b_index is None or n_dim in maps[1 - b_index] or k_dim not in maps[1 - b_index] or \
            k_dim not in maps[b_index] or any(m in maps[b_index] for m in m_dims):
        return None
    a_dims = [d for d in maps[1 - b_index] if d in wide]
    b_dims = [d for d in maps[b_index] if d in wide]
    return _DotContract(op, sources[1 - b_index], sources[b_index], a_dims[-1] == k_dim,
                        b_dims[-1] == k_dim, extent[m_dims[0]] if m_dims else 1, extent[n_dim])


def _contiguous_read(value: ir.Value, count: int):
    """An operand stored pair-innermost ([count / 2, 2], unit dims aside) read again as one
    vector<count x bf16> when it is (through shape casts) an unmasked, in-bounds
    vector.transfer_read of the whole trailing [count / 2, 2] of a tensor: from that tensor
    with the two dims collapsed, one contiguous load instead of a load per pair (what the
    transfer lowering makes of a [count / 2, 2] read). None when it is not such a read."""
    read = value
    while (producer := defining_op(read)) is not None and producer.name == "vector.shape_cast":
        read = producer.operands[0]
    producer = defining_op(read)
    if producer is None or producer.name != "vector.transfer_read":
        return None
    view = producer.opview
    source = view.base
    if view.mask is not None or not isinstance(source.type, ir.RankedTensorType):
        return None
    shape = list(ir.RankedTensorType(source.type).shape)
    rank, vector_rank = len(shape), ir.VectorType(read.type).rank
    indices = list(view.indices)
    whole = [d for d in ir.VectorType(read.type).shape if d != 1][-2:] == shape[-2:] and \
        all(isinstance(constant_value(i), ir.IntegerAttr) and constant_value(i).value == 0
            for i in indices[-2:])
    if rank < 2 or shape[-1] != 2 or 2 * shape[-2] != count or not whole or \
            not all(ir.BoolAttr(b).value for b in ir.ArrayAttr(view.in_bounds)) or \
            view.permutation_map.value != ir.AffineMap.get_minor_identity(rank, vector_rank):
        return None
    collapsed_t = ir.RankedTensorType.get(shape[:-2] + [count], ir.BF16Type.get())
    groups = [[d] for d in range(rank - 2)] + [[rank - 2, rank - 1]]
    collapsed = tensor.collapse_shape(collapsed_t, source, reassociation_attr(groups))
    return vector.transfer_read(ir.VectorType.get([count], ir.BF16Type.get()), collapsed,
                                indices[:-1], ir.AffineMap.get_minor_identity(rank - 1, 1),
                                view.padding, [True])


def _pair_broadcasts(c: _DotContract) -> list[ir.Value]:
    """Per row m of A: its pair (A[m, 0], A[m, 1]) repeated in 16 lanes, as vector<32xbf16>:
    one 32-bit word per row (of one contiguous read, or of the row itself, each row's own
    load; A stored [2, M]: its two rows interleaved first, one shuffle for all pairs),
    broadcast."""
    bf16, i32 = ir.BF16Type.get(), ir.IntegerType.get_signless(32)
    word_t = ir.VectorType.get([1], i32)
    flat = _contiguous_read(c.a, 2 * c.rows) if c.a_pairs_inner else None
    if flat is not None or not c.a_pairs_inner:
        if flat is None:
            a = vector.shape_cast(ir.VectorType.get([2, c.rows], bf16), c.a)
            row0, row1 = (vector.extract(a, [], [k]) for k in (0, 1))
            flat = vector.shuffle(row0, row1, [i for m in range(c.rows) for i in (m, c.rows + m)])
        words = vector.bitcast(ir.VectorType.get([c.rows], i32), flat)
        scalars = [vector.extract(words, [], [m]) for m in range(c.rows)]
    else:
        a = vector.shape_cast(ir.VectorType.get([c.rows, 2], bf16), c.a)
        scalars = [vector.extract(vector.bitcast(word_t, vector.extract(a, [], [m])), [], [0])
                   for m in range(c.rows)]
    return [vector.bitcast(ir.VectorType.get([2 * LANES], bf16),
                           vector.broadcast(ir.VectorType.get([LANES], i32), word))
            for word in scalars]


def _column_pairs(c: _DotContract) -> list[ir.Value]:
    """Per 16 columns of B: its two rows interleaved, as vector<32xbf16>."""
    bf16 = ir.BF16Type.get()
    chunk_t = ir.VectorType.get([2 * LANES], bf16)
    out = []
    if c.b_pairs_inner:
        flat = _contiguous_read(c.b, 2 * c.lanes)
        if flat is None:
            flat = vector.shape_cast(ir.VectorType.get([2 * c.lanes], bf16), c.b)
        for start in range(0, c.lanes, LANES):
            out.append(vector.extract_strided_slice(chunk_t, flat, [2 * start], [2 * LANES], [1]))
        return out
    b = vector.shape_cast(ir.VectorType.get([2, c.lanes], bf16), c.b)
    row0, row1 = (vector.extract(b, [], [k]) for k in (0, 1))
    for start in range(0, c.lanes, LANES):
        mask = [i for j in range(start, start + LANES) for i in (j, c.lanes + j)]
        out.append(vector.shuffle(row0, row1, mask))
    return out


def rewrite(c: _DotContract, rewriter) -> None:
    """Replace c's contraction by its dot products (the module docstring)."""
    op = c.op
    f32 = ir.F32Type.get()
    with ir.InsertionPoint(op), op.location:
        pairs = _pair_broadcasts(c)
        columns = _column_pairs(c)
        acc_type = op.operands[2].type
        acc = vector.shape_cast(ir.VectorType.get([c.rows, c.lanes], f32), op.operands[2])
        result = acc
        chunk_t = ir.VectorType.get([LANES], f32)
        for m, pair in enumerate(pairs):
            row = vector.extract(acc, [], [m])
            for j, column in enumerate(columns):
                start = j * LANES
                part = vector.extract_strided_slice(chunk_t, row, [start], [LANES], [1])
                part = x86.avx512_dot(part, pair, column)
                row = vector.insert_strided_slice(part, row, [start], [1])
            result = vector.insert(row, result, [], [m])
        result = vector.shape_cast(acc_type, result)
    rewriter.replace_op(op, [result])


def lower_in(root: ir.Operation, rewriter) -> int:
    """Rewrite the contractions under `root`; returns how many."""
    found = [c for c in map(dot_contract, walk_ops(root, lambda o: o.name == "vector.contract"))
             if c is not None]
    for c in found:
        rewrite(c, rewriter)
    return len(found)


class ContractsToBf16DotProductsOp(TransformExt.Operation, name="contracts_to_bf16_dot_products"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return rewrite_functions(NAME, op, rewriter, state, lower_in)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def contracts_to_bf16_dot_products(func: ir.Value) -> ContractsToBf16DotProductsOp:
    """Lower the bf16 k-pair contractions in the functions of `func` to vdpbf16ps."""
    return ContractsToBf16DotProductsOp(func)


__all__ = ["ContractsToBf16DotProductsOp", "contracts_to_bf16_dot_products", "dot_contract",
           "lower_in"]
