"""torch-mlir's `tm_tensor.scatter` and `tm_tensor.sort` rewritten as scf loops and linalg,
so the import is pure linalg (the scans are in ingress.lower_scans).

Scatter (scatter_add, index_put, index_add, the backward of embedding, max(dim), max_pool).
TMTensor's semantics: `ins(updates, indices) outs(original)`, updates [N, u...] (k = rank - 1
update dims), indices [N, depth], `dimension_map` naming, for each index column c, the dim
of original it indexes; f the region with block args (update, current). For each update n
and each position p of the update slice, the element of original at
    starts[d] = (p[d - (rank(original) - k)] if d >= rank(original) - k else 0)
                + (indices[n, c] if dimension_map[c] == d else 0)
becomes f(updates[n, p], original[starts]). The rewrite is an scf.for over n (sequential,
so duplicate indices combine in update order, as torch's CPU kernels do; `unique_indices`
is not needed) carrying the result: the slice of the current value at the indexed starts
and the update row are combined by an elementwise linalg.generic and inserted back (a
scalar extract / f / insert when k = 0). f runs in the element type: a bf16 sum rounds at
each update, as torch's CPU kernels do. Updates without elements write nothing.

Out-of-range indices: TMTensor reads the index as is, but torch raises (scatter_add,
index_add, index_put, embedding: an IndexError or RuntimeError). The rewrite clamps each
index into [0, size - slice size] so no access leaves the tensor, and reports: a result-less
linalg.generic over the indices asserts every index is in range, which the CPU target turns
into the kernel-reported error (schedules/prepare.py checks_to_error_code: a KernelError,
the clamped results discarded). Negative indices are out of range here; index_put, where
torch wraps them, gets them wrapped before the import (prepare_index_puts).

Sort (torch.sort, argsort): `outs(values, others...)` sorted along `dimension` by the
region's comparator of the values (the others, e.g. the index iota, move with them). A
comparator that is one ordered compare of the values (<, <= ascending; >, >= descending)
is read as torch's order, a stable sort with NaN greater than every number (last
ascending, first descending). The rewrite is a bitonic sorting network over the sort dim
padded to a power of two, the elements' positions breaking ties (so the result is the
stable sort), one elementwise linalg.generic per compare-exchange stage: O(n log^2 n) per
row (the rank sort it replaced, O(n^2), ran torch.topk over 1024 values at 0.01x torch).
Over the innermost dim it runs per block of 16 rows, each transposed so that a stage
compares whole vectors (one key per row). When at most 64 leading elements are read
(torch.topk's small k), they are selected instead: one min-reduction per element over the
same packed keys, O(k n) per row, per block of rows in cache. A sort's index operand
(torch-mlir's iota) is never read: its result is the sorted positions themselves.
Any other comparator is left in place (the import then refuses with tm_tensor.sort).

Before the import, on the FX graph, torch's index rules the scatters cannot know:
prepare_index_puts wraps index_put's negative indices (and drops index_puts that write
nothing); index_decompositions lowers index_add / index_copy / index_fill to index_put
keeping each op's own rule for negative indices, sort(stable=True) to sort, and x[mask] = v
to a where; masked_sums_as_where sums x[mask] over its rows (v's gradient) as a where.
"""

from __future__ import annotations

import torch

_ELEMENTWISE_PREFIXES = ("arith.", "math.")


def lower_scatters(module) -> int:
    """Rewrite every tm_tensor.scatter (module docstring); returns the number rewritten.
    Left in place (the pure-linalg check reports them): dynamic shapes, a region with ops
    other than arith and math ones, a dim below the update slice that no index column
    addresses."""
    from transform_ext.common import ops_named

    with module.context:
        return sum(_lower_scatter(op) for op in ops_named(module.operation, "tm_tensor.scatter"))


def lower_sorts(module) -> int:
    """Rewrite every tm_tensor.sort with a comparator read as torch's order (module
    docstring); returns the number rewritten."""
    from transform_ext.common import ops_named

    with module.context:
        return sum(_lower_sort(op) for op in ops_named(module.operation, "tm_tensor.sort"))


# ----------------------------------------------------------------------------- FX graph


_INDEX_PUTS = ("index_put", "index_put_", "_unsafe_index_put", "_index_put_impl_")


def prepare_index_puts(gm: torch.fx.GraphModule) -> int:
    """Every integer index tensor i of an index_put (x[i] = v, x.index_put(..., accumulate))
    for a dim of size n becomes where(i < 0, i + n, i): torch wraps negative indices there,
    and torch-mlir's scatter reads them as they are (lower_scatters reports an index out of
    [0, n) as torch's IndexError). An index_put that writes nothing (an index or the values
    without elements) is its input: torch-mlir's lowering of it divides by the zero extent
    (SIGFPE). Exact; returns the number of index_puts changed."""
    aten = torch.ops.aten
    graph = gm.graph
    wrapped = 0
    for node in list(graph.nodes):
        target = getattr(node.target, "overloadpacket", None)
        if node.op != "call_function" or target is None or target.__name__ not in _INDEX_PUTS:
            continue
        written = [node.args[2]] + [i for i in node.args[1] if isinstance(i, torch.fx.Node)]
        if any(w.meta["val"].numel() == 0 for w in written):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            wrapped += 1
            continue
        size = node.args[0].meta["val"].shape
        new_indices, dim = [], 0
        for index in node.args[1]:
            value = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
            if value is None or value.dtype in (torch.bool, torch.uint8) \
                    or value.is_floating_point():
                new_indices.append(index)
                dim += value.dim() if value is not None else 1  # a mask covers its dims
                continue
            with graph.inserting_before(node):
                negative = _fx_call(graph, aten.lt.Scalar, index, 0)
                shifted = _fx_call(graph, aten.add.Scalar, index, size[dim])
                new_indices.append(_fx_call(graph, aten.where.self, negative, shifted, index))
            dim += 1
        wrapped += 1
        node.args = (node.args[0], new_indices, *node.args[2:])
    if wrapped:
        graph.eliminate_dead_code()
        gm.recompile()
    return wrapped


def masked_sums_as_where(gm: torch.fx.GraphModule) -> int:
    """Every sum over dim 0 of x[mask] (aten.index with one bool mask over x's leading dims,
    read only by such sums: the gradient of v in x[mask] = v) becomes the sum over the
    mask's dims of where(mask, x, 0). x[mask] has a shape that depends on the mask's values,
    which the traced graph fixed and torch-mlir could not lower. Exact up to the order of
    the sum; returns the number of sums rewritten."""
    aten = torch.ops.aten
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.index.Tensor \
                or len(node.args[1]) != 1 or not isinstance(node.args[1][0], torch.fx.Node):
            continue
        x, mask = node.args[0], node.args[1][0]
        xv, mv = x.meta.get("val"), mask.meta.get("val")
        if xv is None or mv is None or mv.dtype != torch.bool or mv.dim() == 0 \
                or list(mv.shape) != list(xv.shape[:mv.dim()]):
            continue
        sums = list(node.users)
        if not sums or any(u.target is not aten.sum.dim_IntList or list(u.args[1]) != [0]
                           for u in sums):
            continue
        for total in sums:
            shape = list(mv.shape) + [1] * (xv.dim() - mv.dim())
            with graph.inserting_before(total):
                kept = _fx_call(graph, aten.where.ScalarOther,
                                _fx_call(graph, aten.view.default, mask, shape), x, 0.0)
                summed = _fx_call(graph, aten.sum.dim_IntList, kept, list(range(mv.dim())))
                value = _fx_call(graph, aten.view.default, summed,
                                 list(total.meta["val"].shape))
            total.replace_all_uses_with(value)
            graph.erase_node(total)
            rewritten += 1
        graph.erase_node(node)
    if rewritten:
        graph.eliminate_dead_code()
        gm.recompile()
    return rewritten


def _fx_call(graph, target, *args):
    """A call_function node whose meta value is `target` run on its arguments' values: in
    their fake mode, or in a fresh one on fakes of their shapes when they come from several
    (a traced joint graph's values can), or on the meta device when none is fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    node = graph.call_function(target, args)
    values = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    modes = {id(v.fake_mode): v.fake_mode for v in values if hasattr(v, "fake_mode")}
    if len(modes) == 1:
        with next(iter(modes.values())):
            node.meta["val"] = target(*values)
    elif modes:
        with FakeTensorMode():
            node.meta["val"] = target(*[torch.empty(v.shape, dtype=v.dtype)
                                        if isinstance(v, torch.Tensor) else v for v in values])
    else:
        node.meta["val"] = target(*[v.to("meta") if isinstance(v, torch.Tensor) else v
                                    for v in values])
    return node


def index_decompositions() -> dict:
    """index_add, index_copy and index_fill as an index_put along `dim`, with torch's
    negative indices: index_fill wraps them (as index_put does: prepare_index_puts),
    index_add and index_copy raise, so theirs are moved out of range for the kernel to
    report (torch's own decompositions would have them wrapped). sort(stable=True) as
    sort, whose lowering is stable (torch-mlir has none for sort.stable). x[mask] = v (one bool
    mask over x's leading dims, v broadcast over the elements it selects: a number, or a
    tensor of x's trailing shape) as where(mask, v, x), x + where(mask, v, 0) accumulating:
    torch-mlir lowered it to a scatter at data-dependent positions that left tm_tensor ops."""
    aten = torch.ops.aten

    def stable_sort(x, *, stable=None, dim=-1, descending=False):
        return aten.sort.default(x, dim, descending)

    def put(x, dim, index, values, accumulate, negatives_raise):
        if x.dim() == 0 or index.dim() != 1:
            return NotImplemented
        dim = dim % x.dim()
        if negatives_raise:
            index = torch.where(index < 0, x.shape[dim], index)
        return aten.index_put(x, [None] * dim + [index], values, accumulate)

    def index_add(x, dim, index, source, *, alpha=1):
        return put(x, dim, index, source if alpha == 1 else source * alpha, True, True)

    def index_copy(x, dim, index, source):
        return put(x, dim, index, source, False, True)

    def index_fill(x, dim, index, value):
        return put(x, dim, index, torch.full((), value, dtype=x.dtype) if not isinstance(
            value, torch.Tensor) else value.to(x.dtype), False, False)

    def put_by_mask(x, indices, values, accumulate=False):
        if len(indices) != 1 or indices[0] is None or indices[0].dtype != torch.bool:
            return NotImplemented
        mask = indices[0]
        rest = x.dim() - mask.dim()
        if rest < 0 or list(mask.shape) != list(x.shape[:mask.dim()]) or \
                values.dim() > rest and values.numel() != 1:
            return NotImplemented
        values = values.reshape(()) if values.dim() > rest else values
        mask = mask.view(list(mask.shape) + [1] * rest)
        if accumulate:
            return x + torch.where(mask, values.to(x.dtype), 0)
        return torch.where(mask, values.to(x.dtype), x)

    return {aten.index_put.default: put_by_mask,
            aten.index_add.default: index_add, aten.index_copy.default: index_copy,
            aten.index_fill.int_Scalar: index_fill, aten.index_fill.int_Tensor: index_fill,
            aten.sort.stable: stable_sort}


# ----------------------------------------------------------------------------- MLIR


def _index_constant(value: int):
    from torch_mlir import ir
    from torch_mlir.dialects import arith

    idx = ir.IndexType.get()
    return arith.ConstantOp(idx, ir.IntegerAttr.get(idx, value)).result


def _lower_scatter(op) -> bool:
    from torch_mlir import ir
    from torch_mlir.dialects import arith, cf, linalg, scf, tensor

    from transform_ext.common import build_generic, clone_body

    if len(op.operands) != 3 or len(op.results) != 1:
        return False
    updates, indices, original = list(op.operands)
    types = [ir.RankedTensorType(v.type) for v in (updates, indices, original)]
    if not all(t.has_static_shape for t in types):
        return False
    update_type, index_type, original_type = types
    element = original_type.element_type
    body = op.regions[0].blocks[0]
    if update_type.element_type != element \
            or not isinstance(index_type.element_type, ir.IntegerType) \
            or not all(o.operation.name.startswith(_ELEMENTWISE_PREFIXES)
                       for o in list(body.operations)[:-1]):
        return False
    dimension_map = list(ir.DenseI64ArrayAttr(op.attributes["dimension_map"]))
    n, *slice_shape = update_type.shape
    shape = list(original_type.shape)
    rank, k = len(shape), len(slice_shape)
    offset = rank - k  # original dims [offset, rank) hold the update slice
    if offset < 0 or index_type.shape[1] != len(dimension_map) \
            or any(d not in dimension_map for d in range(offset)):
        return False
    sizes = [1 if d < offset else slice_shape[d - offset] for d in range(rank)]
    highest = {d: shape[d] - sizes[d] for d in dimension_map}  # the largest valid start
    slice_elements = 1
    for s in slice_shape:
        slice_elements *= s
    idx = ir.IndexType.get()

    with ir.InsertionPoint(op), op.location:
        if n == 0 or slice_elements == 0:
            op.results[0].replace_all_uses_with(original)
            op.erase()
            return True

        def check_body(args):
            value = arith.index_cast(idx, args[0])
            column = linalg.IndexOp(1).result if len(dimension_map) > 1 else None
            P = arith.CmpIPredicate
            for c, d in enumerate(dimension_map):
                ok = arith.andi(arith.cmpi(P.sge, value, _index_constant(0)),
                                arith.cmpi(P.sle, value, _index_constant(highest[d])))
                if column is not None:  # the check of column c holds in the other columns
                    ok = arith.ori(ok, arith.cmpi(P.ne, column, _index_constant(c)))
                dims = "x".join(map(str, shape))
                cf.AssertOp(ok, f"index out of range: dimension {d} of a {dims} tensor has "
                                f"size {shape[d]}")
            return []

        build_generic([indices], [], [ir.AffineMap.get_identity(2)], ["parallel"] * 2, check_body)
        if any(h < 0 for h in highest.values()):  # no index is valid: nothing is written
            op.results[0].replace_all_uses_with(original)
            op.erase()
            return True

        loop = scf.ForOp(_index_constant(0), _index_constant(n), _index_constant(1), [original])
        with ir.InsertionPoint(loop.body):
            i, current = loop.induction_variable, loop.inner_iter_args[0]
            starts = [None] * rank
            for c, d in enumerate(dimension_map):
                raw = tensor.extract(indices, [i, _index_constant(c)])
                value = arith.index_cast(idx, raw)
                starts[d] = arith.minsi(arith.maxsi(value, _index_constant(0)),
                                        _index_constant(highest[d]))
            dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
            static_starts = [dynamic if s is not None else 0 for s in starts]
            dynamic_starts = [s for s in starts if s is not None]
            region_args = body.arguments
            if k == 0:
                update = tensor.extract(updates, [i])
                old = tensor.extract(current, [s if s is not None else _index_constant(0)
                                               for s in starts])
                new = clone_body(op, {region_args[0]: update, region_args[1]: old})[0]
                result = tensor.insert(new, current, [s if s is not None else _index_constant(0)
                                                      for s in starts])
            else:
                slice_type = ir.RankedTensorType.get(slice_shape, element)
                row = tensor.ExtractSliceOp(slice_type, updates, [i], [], [], [dynamic] + [0] * k,
                                            [1] + slice_shape, [1] * (k + 1)).result
                old = tensor.ExtractSliceOp(slice_type, current, dynamic_starts, [], [],
                                            static_starts, sizes, [1] * rank).result
                identity = ir.AffineMap.get_identity(k)
                step = build_generic(
                    [row, old], [tensor.EmptyOp(slice_shape, element).result], [identity] * 3,
                    ["parallel"] * k,
                    lambda args: clone_body(op, {region_args[0]: args[0], region_args[1]: args[1]}))
                result = tensor.InsertSliceOp(step.result, current, dynamic_starts, [], [],
                                              static_starts, sizes, [1] * rank).result
            scf.YieldOp([result])
    op.results[0].replace_all_uses_with(loop.results[0])
    op.erase()
    return True


# arith.cmpf / arith.cmpi predicates: the ordered "less" and "greater" ones (strict or not)
_CMPF_LESS, _CMPF_GREATER = {4, 5, 11, 12}, {2, 3, 9, 10}
_CMPI_LESS = {2: "s", 3: "s", 6: "u", 7: "u"}  # the signedness of the compare
_CMPI_GREATER = {4: "s", 5: "s", 8: "u", 9: "u"}


def _sort_order(body):
    """(ascending, "s"/"u" for a signed/unsigned integer compare, None for floats) of a
    comparator that is one ordered compare of the values' pair (block args 0 and 1), else
    None."""
    from torch_mlir import ir

    ops = [o.operation for o in body.operations]
    if len(ops) != 2 or ops[0].name not in ("arith.cmpf", "arith.cmpi") \
            or ops[1].operands[0] != ops[0].results[0]:
        return None
    lhs, rhs = body.arguments[0], body.arguments[1]
    operands = list(ops[0].operands)
    if operands not in ([lhs, rhs], [rhs, lhs]):
        return None
    swapped = operands == [rhs, lhs]
    predicate = ir.IntegerAttr(ops[0].attributes["predicate"]).value
    if ops[0].name == "arith.cmpf":
        if predicate not in _CMPF_LESS | _CMPF_GREATER:
            return None
        return (predicate in _CMPF_LESS) != swapped, None
    if predicate in _CMPI_LESS:
        return not swapped, _CMPI_LESS[predicate]
    if predicate in _CMPI_GREATER:
        return swapped, _CMPI_GREATER[predicate]
    return None


def _strictly_before(x, y, ascending: bool, signedness):
    """x sorts strictly before y in torch's order: NaN above every number."""
    from torch_mlir.dialects import arith

    if signedness is not None:
        return arith.cmpi(getattr(arith.CmpIPredicate, signedness + ("lt" if ascending else "gt")),
                          x, y)
    F = arith.CmpFPredicate
    if ascending:  # x < y, or x a number and y NaN
        return arith.ori(arith.cmpf(F.OLT, x, y),
                         arith.andi(arith.cmpf(F.ORD, x, x), arith.cmpf(F.UNO, y, y)))
    return arith.ori(arith.cmpf(F.OGT, x, y),
                     arith.andi(arith.cmpf(F.UNO, x, x), arith.cmpf(F.ORD, y, y)))


def _lower_sort(op) -> bool:
    from torch_mlir import ir

    operands = list(op.operands)
    types = [ir.RankedTensorType(v.type) for v in operands]
    if not operands or not all(t.has_static_shape for t in types):
        return False
    order = _sort_order(op.regions[0].blocks[0])
    if order is None:
        return False
    ascending, signedness = order
    element = types[0].element_type
    if signedness is None and not isinstance(element, ir.FloatType):
        return False
    if element == ir.IntegerType.get_signless(1):
        signedness = "u"  # torch-mlir compares bools signed (true = -1 first); False < True
    dim = ir.IntegerAttr(op.attributes["dimension"]).value
    n = list(types[0].shape)[dim]
    if n <= 1:
        results = operands
    elif _key_bits(element) <= 32:
        keep = _leading_extent(op, dim)
        def selected(blocks, d, _blocked):
            return _selected_first(blocks, d, ascending, signedness, keep)

        def sorted_(blocks, d, blocked):
            if blocked:
                return _bitonic_sort_transposed(blocks, ascending, signedness, keep)
            return _bitonic_sort(blocks, d, ascending, signedness, keep)

        with ir.InsertionPoint(op), op.location:
            if keep <= SELECT_MAX and 2 * keep <= n:
                rows = max(1, SELECT_BLOCK_BYTES // (n * max(1, _key_bits(element) // 8)))
                results = _in_row_blocks(operands, dim, keep, rows, selected)
            else:
                results = _in_row_blocks(operands, dim, keep, SORT_BLOCK_ROWS, sorted_,
                                         SORT_MIN_ROWS)
        if keep < n:
            _replace_leading_slices(op, dim, results)
            op.erase()
            return True
    else:
        with ir.InsertionPoint(op), op.location:
            results = _rank_sort(operands, dim, ascending, signedness)
    for old, new in zip(op.results, results):
        old.replace_all_uses_with(new)
    op.erase()
    return True


# Rows of an innermost-dim sort per block (two 64-byte vectors of its i64 packed keys): the
# block is transposed, so that each compare-exchange stage runs across its rows (a sort of
# [512, 1024] went from 0.65x to 1.7x torch; 8 rows ran 7% slower).
SORT_BLOCK_ROWS = 16
# Fewer rows per block (their count has no divisor from this up to SORT_BLOCK_ROWS) sort
# the rows as they are: a compare-exchange across so few rows is a short vector.
SORT_MIN_ROWS = 4
# The most leading elements taken by selection (one reduction each) instead of a sort:
# topk of [1024, 1024] with k = 16 ran 1.9x faster by selection, with k = 64 as fast; of
# [64, 32000] with k = 50, 12x faster (the sort's halving steps over 32768 keys are slow).
SELECT_MAX = 64
# Bytes of operand 0 per block of rows taken by selection (their passes hit L1).
SELECT_BLOCK_BYTES = 32768


def _in_row_blocks(operands, dim: int, keep: int, block_rows: int, lower, min_rows: int = 1) -> list:
    """`lower(operands, dim, blocked)` (the first `keep` elements along `dim` of each
    operand) per block of at most `block_rows` rows when `dim` is the innermost of two or
    more (the other dims collapsed; `lower` gets [B, n] blocks, dim 1 and blocked True; the
    blocks in an scf.forall): the passes over a block stay in cache, and threads share the
    blocks. Else (and when the rows divide into no blocks of min_rows to block_rows) `lower`
    on the whole (blocked False)."""
    from torch_mlir import ir
    from torch_mlir.dialects import scf, tensor

    from transform_ext.common import largest_divisor_at_most, reassociation_attr

    shape = list(ir.RankedTensorType(operands[0].type).shape)
    rank, n = len(shape), shape[dim]
    rows = row_count(shape)
    block = largest_divisor_at_most(rows, block_rows)
    if dim != rank - 1 or rows == 1 or block < min_rows:
        return lower(operands, dim, False)
    elements = [ir.RankedTensorType(v.type).element_type for v in operands]
    flat = reassociation_attr([list(range(rank - 1)), [rank - 1]])
    if rank > 2:
        operands = [tensor.collapse_shape(ir.RankedTensorType.get([rows, n], e), v, flat)
                    for v, e in zip(operands, elements)]

    forall = scf.ForallOp([0], [rows], [block], shared_outs=[
        tensor.EmptyOp([rows, keep], e).result for e in elements])
    with ir.InsertionPoint(forall.body):
        r = forall.induction_variables[0]
        parts = lower([row_block(v, r, block) for v in operands], 1, True)
        parallel = scf.InParallelOp()
        with ir.InsertionPoint(parallel.block):
            for part, out in zip(parts, forall.inner_iter_args):
                row_block(out, r, block, part)
    results = list(forall.results)
    if rank > 2:
        results = [tensor.expand_shape(ir.RankedTensorType.get(shape[:-1] + [keep], e), v, flat,
                                       [], shape[:-1] + [keep])
                   for v, e in zip(results, elements)]
    return results


def row_block(t, r, count: int, part=None):
    """Rows [r, r + count) of `t` (dims after the first whole); with `part`, the
    parallel_insert_slice of `part` there instead."""
    from torch_mlir import ir
    from torch_mlir.dialects import tensor

    shape = list(ir.RankedTensorType(t.type).shape)
    dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
    offsets, sizes = [dynamic] + [0] * (len(shape) - 1), [count] + shape[1:]
    if part is not None:
        return tensor.ParallelInsertSliceOp(part, t, [r], [], [], offsets, sizes,
                                            [1] * len(shape))
    return tensor.ExtractSliceOp(ir.RankedTensorType.get(sizes, ir.RankedTensorType(t.type).element_type),
                                 t, [r], [], [], offsets, sizes, [1] * len(shape)).result


def transpose_2d(value, into=None):
    """The transpose of the 2-D tensor `value` (a linalg.transpose into `into`, else into a
    new tensor)."""
    from torch_mlir import ir
    from torch_mlir.dialects import linalg, tensor

    rows, cols = ir.RankedTensorType(value.type).shape
    if into is None:
        into = tensor.EmptyOp([cols, rows], ir.RankedTensorType(value.type).element_type).result
    result = linalg.transpose(value, outs=[into], permutation=[1, 0])
    return result if isinstance(result, ir.Value) else result.results[0]


def row_count(shape) -> int:
    """The product of all extents but the last."""
    rows = 1
    for extent in list(shape)[:-1]:
        rows *= extent
    return rows


def _bitonic_sort_transposed(blocks, ascending: bool, signedness, keep: int) -> list:
    """`_bitonic_sort` along dim 1 of the [B, n] `blocks` run on their transposes [n, B]
    along dim 0, so that every compare-exchange stage compares whole vectors of keys (one
    per row of the block) instead of pairs within a row; the kept [keep, B] transposed
    back. The same network, so the same result."""
    from torch_mlir import ir
    from torch_mlir.dialects import linalg, tensor

    def positions(value):  # the iota along dim 0 of the transpose, built as such
        from torch_mlir.dialects import arith

        from transform_ext.common import build_generic

        rows, cols = ir.RankedTensorType(value.type).shape
        element = ir.RankedTensorType(value.type).element_type
        return build_generic([], [tensor.EmptyOp([cols, rows], element).result],
                             [ir.AffineMap.get_identity(2)], ["parallel"] * 2,
                             lambda args: [arith.index_cast(element, linalg.IndexOp(0).result)]).result

    kept = _bitonic_sort([positions(b) if _is_positions(b, 1) else transpose_2d(b) for b in blocks],
                         0, ascending, signedness, keep)
    return [transpose_2d(k) for k in kept]


def _leading_slice_extent(user, dim: int) -> int | None:
    """The extent along `dim` of a tensor.extract_slice that takes the leading elements
    along `dim` and everything else (torch.topk's values and indices), else None."""
    from torch_mlir import ir

    if user.name != "tensor.extract_slice" or len(user.operands) != 1:
        return None
    offsets = list(ir.DenseI64ArrayAttr(user.attributes["static_offsets"]))
    sizes = list(ir.DenseI64ArrayAttr(user.attributes["static_sizes"]))
    strides = list(ir.DenseI64ArrayAttr(user.attributes["static_strides"]))
    full = list(ir.RankedTensorType(user.operands[0].type).shape)
    if any(offsets) or any(s != 1 for s in strides) or \
            any(a != b for d, (a, b) in enumerate(zip(sizes, full)) if d != dim):
        return None
    return sizes[dim]


def _leading_extent(op, dim: int) -> int:
    """How many leading elements along `dim` the sort's users read: the largest extent of
    their leading slices (`_leading_slice_extent`), or all n when another op reads it."""
    n = list(op.results[0].type.shape)[dim]
    keep = 1
    for result in op.results:
        for use in result.uses:
            extent = _leading_slice_extent(use.owner, dim)
            if extent is None:
                return n
            keep = max(keep, extent)
    return keep


def _replace_leading_slices(op, dim: int, results) -> None:
    """Each leading slice of a sort result replaced by the same slice of `results` (the
    sorted leading elements: `_bitonic_sort` with keep)."""
    from torch_mlir import ir
    from torch_mlir.dialects import tensor

    for result, kept in zip(op.results, results):
        keep = list(ir.RankedTensorType(kept.type).shape)[dim]
        for use in list(result.uses):
            user = use.owner
            extent = _leading_slice_extent(user, dim)
            value = kept
            if extent != keep:
                shape = list(ir.RankedTensorType(user.results[0].type).shape)
                with ir.InsertionPoint(user), user.location:
                    value = tensor.extract_slice(user.results[0].type, kept, [], [], [],
                                                 [0] * len(shape), shape, [1] * len(shape))
            user.results[0].replace_all_uses_with(value)
            user.erase()


def _key_bits(element) -> int:
    from torch_mlir import ir

    if isinstance(element, ir.FloatType):
        return element.width
    return ir.IntegerType(element).width


def _rank_sort(operands, dim: int, ascending: bool, signedness) -> list:
    """The operands sorted along `dim` by operand 0 (64-bit keys, which no 64-bit packed
    key holds with a position): a rank sort in two linalg reductions over [..., n, n],
    rank[i] = #{j : x[j] before x[i], or equal and j < i}, then out[r] = the x[i] with
    rank[i] = r. O(n^2) per row."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith, linalg, tensor

    from transform_ext.common import build_generic

    types = [ir.RankedTensorType(v.type) for v in operands]
    shape = list(types[0].shape)
    rank = len(shape)
    i64, i1 = ir.IntegerType.get_signless(64), ir.IntegerType.get_signless(1)
    outer = [ir.AffineDimExpr.get(d) for d in range(rank)]
    # loops: the operand's dims, then one more over the sort dim; `own` reads the sort
    # dim at loop `dim` (i in the ranks, r in the pick), `other` at the extra loop
    own = ir.AffineMap.get(rank + 1, 0, outer)
    other = ir.AffineMap.get(rank + 1, 0, outer[:dim] + [ir.AffineDimExpr.get(rank)]
                             + outer[dim + 1:])
    kinds = ["parallel"] * rank + ["reduction"]
    zeros = linalg.fill(arith.ConstantOp(i64, ir.IntegerAttr.get(i64, 0)).result,
                        outs=[tensor.EmptyOp(shape, i64).result])

    def rank_body(args):  # args: x[i], x[j], count; i = loop `dim`, j = loop `rank`
        x_i, x_j, count = args
        i, j = linalg.IndexOp(dim).result, linalg.IndexOp(rank).result
        true = arith.ConstantOp(i1, ir.IntegerAttr.get(i1, 1)).result
        tie_first = arith.andi(  # x[j] not after x[i], and j < i
            arith.xori(_strictly_before(x_i, x_j, ascending, signedness), true),
            arith.cmpi(arith.CmpIPredicate.ult, j, i))
        before = arith.ori(_strictly_before(x_j, x_i, ascending, signedness), tie_first)
        return [arith.addi(count, arith.extui(i64, before))]

    ranks = build_generic([operands[0], operands[0]], [zeros], [own, other, own], kinds,
                          rank_body).result
    m = len(operands)

    def pick_body(args):  # args: o_k[i]..., rank[i], out_k[r]...; r = loop `dim`
        r = arith.index_cast(i64, linalg.IndexOp(dim).result)
        hit = arith.cmpi(arith.CmpIPredicate.eq, args[m], r)
        return [arith.select(hit, args[q], args[m + 1 + q]) for q in range(m)]

    # the ranks are a permutation: every out[r] is picked once, the init never kept
    inits = [tensor.EmptyOp(shape, t.element_type).result for t in types]
    picked = build_generic(operands + [ranks], inits, [other] * (m + 1) + [own] * m,
                           kinds, pick_body)
    return list(picked.results)


def _bitonic_sort(operands, dim: int, ascending: bool, signedness, keep: int) -> list:
    """The first `keep` elements along `dim` of the operands sorted by operand 0 (keys of
    at most 32 bits) in torch's order, stable: each element becomes one i64, its
    order-preserving 32-bit key above its position (`_packed_keys`), so that the packed
    values' order is the stable sort's; a bitonic network sorts them over the sort dim
    padded to P = 2^p (padding after every element: the largest key, positions >= n), p (p
    + 1) / 2 stages (`_bitonic_stage`), O(n log^2 n) per row. When K = 2^q >= keep is at
    most P / 2 (torch.topk), only blocks of K are sorted, in alternating directions; then
    each pair of blocks keeps its K first elements (`_halve`: the elementwise minimum of an
    ascending and a descending block, a bitonic sequence) and is sorted again, until one
    block is left: O(n log^2 K). Every operand is then read at the sorted positions (a
    gather: the values as they were, -0.0 and NaN payloads included)."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith, linalg, tensor

    from transform_ext.common import build_generic

    shape = list(ir.RankedTensorType(operands[0].type).shape)
    rank, n = len(shape), shape[dim]
    size = 1 << (n - 1).bit_length()
    padded_shape = shape[:dim] + [size] + shape[dim + 1:]
    i64 = ir.IntegerType.get_signless(64)
    identity = ir.AffineMap.get_identity(rank)
    keys = _packed_keys(operands[0], dim, ascending, signedness)
    if size != n:
        def padding(args):  # the largest key above the position
            position = arith.index_cast(i64, linalg.IndexOp(dim).result)
            top = arith.ConstantOp(i64, ir.IntegerAttr.get(i64, 0x7FFFFFFF << 32)).result
            return [arith.ori(top, position)]

        pads = build_generic([], [tensor.EmptyOp(padded_shape, i64).result], [identity],
                             ["parallel"] * rank, padding).result
        keys = tensor.insert_slice(keys, pads, [], [], [], [0] * rank, shape, [1] * rank)
    block = max(2, 1 << (keep - 1).bit_length())
    if 2 * block > size:
        block = size
    k = 2
    while k <= block:
        j = k // 2
        while j >= 1:
            keys = _bitonic_stage(keys, dim, rank, padded_shape, size, k, j)
            j //= 2
        k *= 2
    length = size
    while length > block:
        keys = _halve(keys, dim, padded_shape[:dim] + [length] + padded_shape[dim + 1:], block)
        length //= 2
        j = block // 2
        while j >= 1:
            keys = _bitonic_stage(keys, dim, rank, padded_shape[:dim] + [length] + padded_shape[dim + 1:],
                                  length, block, j)
            j //= 2
    shape = shape[:dim] + [keep] + shape[dim + 1:]
    if length != keep:
        keys = tensor.extract_slice(ir.RankedTensorType.get(shape, i64), keys, [], [], [],
                                    [0] * rank, shape, [1] * rank)

    return _gathered_at_keys(keys, operands, dim, n)


def _is_positions(value, dim: int) -> bool:
    """Whether `value` is the iota of positions along `dim` (torch-mlir's index operand of
    a sort: a linalg.generic of no inputs yielding index_cast(linalg.index dim)), or a
    slice of one that keeps `dim` whole."""
    from torch_mlir import ir

    from transform_ext.common import defining_op

    op = defining_op(value)
    if op is not None and op.name == "tensor.extract_slice":
        shape = list(ir.RankedTensorType(value.type).shape)
        source = list(ir.RankedTensorType(op.operands[0].type).shape)
        offsets = list(ir.DenseI64ArrayAttr(op.attributes["static_offsets"]))
        if len(shape) != len(source) or shape[dim] != source[dim] or offsets[dim] != 0:
            return False
        op = defining_op(op.operands[0])
    if op is None or op.name != "linalg.generic" or len(op.operands) != 1:
        return False
    ops = [o.operation for o in op.regions[0].blocks[0].operations]
    return len(ops) == 3 and ops[0].name == "linalg.index" \
        and ir.IntegerAttr(ops[0].attributes["dim"]).value == dim \
        and ops[1].name == "arith.index_cast" and ops[1].operands[0] == ops[0].results[0] \
        and ops[2].operands[0] == ops[1].results[0]


def _gathered_at_keys(keys, operands, dim: int, n: int) -> list:
    """Each operand read along `dim` at the positions packed in `keys` (i64, the low 32
    bits; `_packed_keys`), keys' shape: a gather, the values as they were (-0.0 and NaN
    payloads included); the positions themselves for an iota of them (`_is_positions`)."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith, linalg, tensor

    from transform_ext.common import build_generic

    shape = list(ir.RankedTensorType(keys.type).shape)
    rank = len(shape)
    i64 = ir.IntegerType.get_signless(64)
    identity = ir.AffineMap.get_identity(rank)

    def gathered(value):
        def body(args):
            mask = arith.ConstantOp(i64, ir.IntegerAttr.get(i64, 0xFFFFFFFF)).result
            last = arith.ConstantOp(i64, ir.IntegerAttr.get(i64, n - 1)).result
            # below n already (padding sorts last): the bound tells clamp_gather_indices
            position = arith.index_cast(ir.IndexType.get(), arith.minui(arith.andi(args[0], mask), last))
            if positions:
                return [arith.index_cast(element, position)]
            indices = [linalg.IndexOp(d).result if d != dim else position for d in range(rank)]
            return [tensor.extract(value, indices)]

        element = ir.RankedTensorType(value.type).element_type
        positions = _is_positions(value, dim) and isinstance(element, ir.IntegerType)
        return build_generic([keys], [tensor.EmptyOp(shape, element).result], [identity] * 2,
                             ["parallel"] * rank, body).result

    return [gathered(v) for v in operands]


def _selected_first(operands, dim: int, ascending: bool, signedness, keep: int) -> list:
    """The first `keep` elements along `dim` of the operands sorted by operand 0, as
    `_bitonic_sort` gives them, by selection: with the packed keys (`_packed_keys`: distinct,
    their order the stable sort's), the t-th element in order has the smallest key above
    the (t-1)-th's, m_1 = min_i key[i], m_t = min_i {key[i] : key[i] > m_(t-1)}: one
    reduction over `dim` per kept element, O(keep n) per row (torch.topk's small k)."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith, linalg, tensor

    from transform_ext.common import build_generic

    shape = list(ir.RankedTensorType(operands[0].type).shape)
    rank, n = len(shape), shape[dim]
    i64 = ir.IntegerType.get_signless(64)
    keys = _packed_keys(operands[0], dim, ascending, signedness)
    reduced = shape[:dim] + shape[dim + 1:]
    loops = [ir.AffineDimExpr.get(d) for d in range(rank)]
    whole = ir.AffineMap.get_identity(rank)
    row = ir.AffineMap.get(rank, 0, loops[:dim] + loops[dim + 1:])
    kinds = ["parallel"] * rank
    kinds[dim] = "reduction"
    top = arith.ConstantOp(i64, ir.IntegerAttr.get(i64, (1 << 63) - 1)).result
    out = tensor.EmptyOp(shape[:dim] + [keep] + shape[dim + 1:], i64).result
    previous = None
    for t in range(keep):
        init = linalg.fill(top, outs=[tensor.EmptyOp(reduced, i64).result])
        if previous is None:
            smallest = build_generic([keys], [init], [whole, row], kinds,
                                     lambda args: [arith.minsi(args[0], args[1])]).result
        else:
            def body(args):
                key, before, best = args
                later = arith.cmpi(arith.CmpIPredicate.sgt, key, before)
                return [arith.minsi(arith.select(later, key, top), best)]

            smallest = build_generic([keys, previous], [init], [whole, row, row], kinds,
                                     body).result
        out = tensor.insert_slice(smallest, out, [], [], [],
                                  [t if d == dim else 0 for d in range(rank)],
                                  [1 if d == dim else e for d, e in enumerate(shape)],
                                  [1] * rank)
        previous = smallest
    return _gathered_at_keys(out, operands, dim, n)


def _packed_keys(values, dim: int, ascending: bool, signedness):
    """keys[i] = (key(x[i]) << 32) | i along `dim`, i64: key a signed 32-bit integer in
    torch's order of x (floats widened to f32: the sign-magnitude bits with the magnitude
    flipped below zero, +-0 one key, every NaN above +inf; integers as they are, unsigned
    ones with the sign bit flipped), inverted (~key) when descending. Positions below 2^31,
    so that signed i64 order is the order of (key, position)."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith, linalg, tensor

    from transform_ext.common import build_generic

    shape = list(ir.RankedTensorType(values.type).shape)
    rank = len(shape)
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    f32 = ir.F32Type.get()

    def c32(v):
        return arith.ConstantOp(i32, ir.IntegerAttr.get(i32, v)).result

    def body(args):
        x = args[0]
        if signedness is None:
            if x.type != f32:
                x = arith.extf(f32, x)
            bits = arith.bitcast(i32, x)
            negative = arith.cmpi(arith.CmpIPredicate.slt, bits, c32(0))
            key = arith.select(negative, arith.xori(bits, c32(0x7FFFFFFF)), bits)
            zero = arith.ConstantOp(f32, ir.FloatAttr.get(f32, 0.0)).result
            key = arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, x, zero), c32(0), key)
            key = arith.select(arith.cmpf(arith.CmpFPredicate.UNO, x, x), c32(0x7FC00000), key)
        else:
            width = ir.IntegerType(x.type).width
            if width < 32:
                x = (arith.extsi if signedness == "s" else arith.extui)(i32, x)
            key = arith.xori(x, c32(-0x80000000)) if signedness == "u" and width == 32 else x
        if not ascending:
            key = arith.xori(key, c32(-1))
        position = arith.index_cast(i64, linalg.IndexOp(dim).result)
        shifted = arith.shli(arith.extsi(i64, key), arith.ConstantOp(i64, ir.IntegerAttr.get(i64, 32)).result)
        return [arith.ori(shifted, position)]

    identity = ir.AffineMap.get_identity(rank)
    return build_generic([values], [tensor.EmptyOp(shape, i64).result], [identity] * 2,
                         ["parallel"] * rank, body).result


def _bitonic_stage(keys, dim, rank, padded_shape, size, k, j):
    """One compare-exchange stage (k, j) of `_bitonic_sort`: element i against i + j in
    blocks of 2j, the smaller first where i's bit k is 0, last elsewhere. Over the view
    [.., a, b, h, c, ..] of the sort dim ([P / k, k / 2j, 2, j]), element (a, b, h, c) is
    the min or max of the pair (a, b, :, c) by h xor a's parity (the block's direction)."""
    from torch_mlir.dialects import arith

    def later_of_pair(x, acc, bit):
        later = bit(dim + 2)
        if size > k:
            later = arith.xori(later, bit(dim))
        return arith.select(later, arith.maxsi(x, acc), arith.minsi(x, acc))

    return _pair_reduction(keys, dim, padded_shape, [size // k, k // (2 * j), 2, j], 2, True,
                           later_of_pair)


def _halve(keys, dim, shape, block):
    """Of each pair of consecutive blocks of `block` along `dim` (one ascending, one
    descending), the elementwise minimum: the pair's `block` first elements, in a bitonic
    sequence; the sort dim halves."""
    from torch_mlir.dialects import arith

    return _pair_reduction(keys, dim, shape, [shape[dim] // (2 * block), 2, block], 1, False,
                           lambda x, acc, bit: arith.minsi(x, acc))


def _pair_reduction(keys, dim, shape, split, pair, keep_pair, combine):
    """`keys` (i64) with its sort dim viewed as `split`, whose entry `pair` (extent 2)
    pairs elements: each result element a reduction over its pair, `combine(x1, x0, bit)`
    (bit(loop): the loop index's parity), over the view (`keep_pair`: each of the pair's
    positions its own result) or over it without the pair dim (the sort dim halved), then
    collapsed back. One read of one tensor: fusion clones a producer per read, which over
    the chain of stages is exponential."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith, linalg, tensor

    from transform_ext.common import build_generic, reassociation_attr

    rank = len(shape)
    view = shape[:dim] + split + shape[dim + 1:]
    written_view = view if keep_pair else view[:dim + pair] + view[dim + pair + 1:]
    inner = len(split) if keep_pair else len(split) - 1

    def grouped(width):
        return [[d] for d in range(dim)] + [list(range(dim, dim + width))] + \
            [[d + width - 1] for d in range(dim + 1, rank)]

    loops = len(written_view) + 1
    e = loops - 1  # the pair's element, a reduction loop
    dims = [ir.AffineDimExpr.get(d) for d in range(loops)]
    after = dim + pair + 1 if keep_pair else dim + pair
    read = ir.AffineMap.get(loops, 0, dims[:dim + pair] + [dims[e]] + dims[after:e])
    written = ir.AffineMap.get(loops, 0, dims[:e])
    i1, i64 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(64)
    viewed = tensor.expand_shape(ir.RankedTensorType.get(view, i64), keys,
                                 reassociation_attr(grouped(len(split))), [], view)

    def bit(loop):
        return arith.trunci(i1, arith.index_cast(i64, linalg.IndexOp(loop).result))

    def body(args):
        x, acc = args
        combined = combine(x, acc, bit)
        return [arith.select(bit(e), combined, x)]

    result = build_generic([viewed], [tensor.EmptyOp(written_view, i64).result], [read, written],
                           ["parallel"] * (loops - 1) + ["reduction"], body).result
    extent = 1
    for d in written_view[dim:dim + inner]:
        extent *= d
    collapsed = shape[:dim] + [extent] + shape[dim + 1:]
    return tensor.collapse_shape(ir.RankedTensorType.get(collapsed, i64), result,
                                 reassociation_attr(grouped(inner)))
