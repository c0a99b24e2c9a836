"""flatten_contiguous_writes: a vector.transfer_write whose vector covers a contiguous run of
its destination tensor is one 1-D write of that run.

    %r = vector.transfer_write %v, %dest[i_0, .., i_{n-c}, 0, .., 0]
           : vector<s_0 x .. x s_{r-c} x d_{n-c+1} x .. x d_{n-1}>, tensor<d_0 x .. x d_{n-1}>
  ->  %flat = tensor.collapse_shape %dest  (its last c dims merged into one of D = d_{n-c} .. d_{n-1})
      %w = vector.transfer_write shape_cast(%v) : vector<s_0 x .. x (s_{r-c} d_{n-c+1} .. d_{n-1})>,
             %flat[i_0, .., i_{n-c} * d_{n-c+1} .. d_{n-1}]
      %r = tensor.expand_shape %w  (back to the destination's shape)

Exact: the same elements land at the same places; the c trailing dims of the vector (c >= 2,
the largest that fits) are whole trailing dims of the destination except the outermost of
them, written from index 0, so in row-major order they form one run. Legal for a write that
is unmasked, in bounds in every dim, with a minor identity permutation map and a ranked
tensor destination of static shape whose buffer keeps those dims contiguous: traced through
slices that take them whole, loop-carried tensors and in-place results to a tensor.empty
or a function argument (identity layout); a slice of a wider row is not flattened (its
collapse would need a copy). (The transfer lowering otherwise stores each innermost
row on its own: the [NR, 2] bf16 pairs a packing step writes became NR stores of 4 bytes.
MLIR's flattening patterns take memrefs only.)

Rewritten: every legal vector.transfer_write nested in the targets (the others are left as
they are); nothing is illegal but a target that is not a func.func (a silenceable failure,
nothing rewritten). The writes are replaced; the handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, tensor, transform, vector

from .common import (RewritesTargets, constant_value, ops_named, reassociation_attr,
                     rewrite_functions)
from .dialect import TransformExt

NAME = "transform_ext.flatten_contiguous_writes"


def _is_zero_index(value: ir.Value) -> bool:
    attr = constant_value(value)
    return isinstance(attr, ir.IntegerAttr) and attr.value == 0


def _contiguous(value: ir.Value, c: int, depth: int = 64) -> bool:
    """Are the trailing c dims of tensor `value` contiguous in its buffer (as far as the
    chain of ops the module docstring names shows)?"""
    if depth == 0:
        return False
    if isinstance(value, ir.BlockArgument):
        owner = value.owner.owner
        if owner.name == "func.func":
            return True
        if owner.name == "scf.for":  # block args: iv, then the iter_args after the 3 bounds
            index = value.arg_number - 1
            return index >= 0 and _contiguous(owner.operands[3 + index], c, depth - 1)
        return False
    op = value.owner
    name = op.name
    if name == "tensor.empty":
        return True
    if name == "tensor.extract_slice":
        source_t = ir.RankedTensorType(op.operands[0].type)
        view = op.opview
        sizes, offsets = list(view.static_sizes), list(view.static_offsets)
        if source_t.rank != ir.RankedTensorType(value.type).rank or \
                any(s != 1 for s in view.static_strides):
            return False
        inner = range(source_t.rank - c + 1, source_t.rank)
        return all(sizes[d] == source_t.shape[d] and offsets[d] == 0 for d in inner) and \
            _contiguous(op.operands[0], c, depth - 1)
    if name == "scf.for":
        return _contiguous(op.operands[3 + value.result_number], c, depth - 1)
    if name in ("tensor.insert_slice", "vector.transfer_write"):
        return _contiguous(op.operands[1], c, depth - 1)
    return False


def merged_dims(write: ir.Operation) -> int:
    """How many trailing dims of `write`'s destination its vector covers as one run (the
    module docstring's c), 0 when fewer than 2 or the write is not legal."""
    view = write.opview
    dest_t = view.base.type
    if not isinstance(dest_t, ir.RankedTensorType) or not dest_t.has_static_shape or \
            view.mask is not None or not all(ir.BoolAttr(b).value for b in ir.ArrayAttr(view.in_bounds)):
        return 0
    shape, vshape = list(dest_t.shape), list(ir.VectorType(view.valueToStore.type).shape)
    n, r = len(shape), len(vshape)
    if view.permutation_map.value != ir.AffineMap.get_minor_identity(n, r):
        return 0
    indices = list(view.indices)
    c = 1
    while c < r and vshape[-c] == shape[-c] and _is_zero_index(indices[-c]):
        c += 1
    return c if c >= 2 and _contiguous(view.base, c) else 0


def flatten(write: ir.Operation, c: int, rewriter) -> None:
    """Replace `write` by the 1-D write of its last c dims (the module docstring)."""
    view = write.opview
    dest_t = ir.RankedTensorType(view.base.type)
    shape, vshape = list(dest_t.shape), list(ir.VectorType(view.valueToStore.type).shape)
    n, r = len(shape), len(vshape)
    inner = 1
    for d in shape[n - c + 1:]:
        inner *= d
    element = dest_t.element_type
    with ir.InsertionPoint(write), write.location:
        groups = [[d] for d in range(n - c)] + [list(range(n - c, n))]
        flat_t = ir.RankedTensorType.get(shape[:n - c] + [shape[n - c] * inner], element)
        flat = tensor.collapse_shape(flat_t, view.base, reassociation_attr(groups))
        vector_t = ir.VectorType.get(vshape[:r - c] + [vshape[r - c] * inner], element)
        indices = list(view.indices)
        index_t = ir.IndexType.get()
        outer = indices[n - c]
        if not _is_zero_index(outer):
            outer = arith.muli(outer, arith.constant(index_t, inner))
        written = vector.transfer_write(flat_t, vector.shape_cast(vector_t, view.valueToStore), flat,
                                        indices[:n - c] + [outer],
                                        ir.AffineMap.get_minor_identity(n - c + 1, r - c + 1),
                                        in_bounds=[True] * (r - c + 1))
        result = tensor.expand_shape(dest_t, written, reassociation_attr(groups), [],
                                     ir.DenseI64ArrayAttr.get(shape))
    rewriter.replace_op(write, [result])


def flatten_in(root: ir.Operation, rewriter) -> int:
    """Flatten the legal writes under `root`; returns how many."""
    found = [(w, c) for w in ops_named(root, "vector.transfer_write") if (c := merged_dims(w))]
    for w, c in found:
        flatten(w, c, rewriter)
    return len(found)


class FlattenContiguousWritesOp(TransformExt.Operation, name="flatten_contiguous_writes"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return rewrite_functions(NAME, op, rewriter, state, flatten_in)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def flatten_contiguous_writes(func: ir.Value) -> FlattenContiguousWritesOp:
    """Write the contiguous runs of the transfer_writes in the functions of `func` in one 1-D
    write each."""
    return FlattenContiguousWritesOp(func)


__all__ = ["FlattenContiguousWritesOp", "flatten_contiguous_writes", "flatten_in", "merged_dims"]
