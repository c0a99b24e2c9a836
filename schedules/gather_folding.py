"""Gathers (`tensor.extract` in linalg bodies) rewritten to read what their source is made of.

fold_gathers_through_elementwise: a body reads one element T[idx] of a tensor T produced by
an elementwise linalg.generic P(a_1, ..., a_n) (all loops parallel, output through a
permutation). Since T[idx] = body_P(a_1[M_1(l)], ..., a_n[M_n(l)]) with l the loop point of
P that writes idx, the extract becomes P's body applied to extracts of P's inputs. Exact (the
same scalar ops on the same values); repeated to a fixed point (and through
tensor.expand_shape, whose indices are linearized per reassociation group), a gather from
log_softmax(x) = x - m - log(l) becomes x[i, y] - m[i] - log(l[i]): the [N, C] tensor is no
longer read and dies.

promote_indexed_extracts: an extract whose indices are the reading op's own loop indices
(`linalg.index d`, or constants) is an ordinary operand read: T becomes an input operand
with the map those indices spell, so tiling slices it and fusion sees the dependence.
Extracts at data-dependent indices (x[i, y_i]) stay gathers.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, linalg, tensor

from transform_ext.analysis.maps import Const, make_map, terms
from transform_ext.common import body_of, build_generic, clone_op, defining_op, iterator_kinds, terminator


def _elementwise_source(value: ir.Value):
    """The generic producing `value` when it is elementwise with a permutation output map and
    simple input maps (plain dims and constants), else None."""
    op = defining_op(value)
    if op is None or op.name != "linalg.generic" or len(op.results) != 1:
        return None
    if any(k != "parallel" for k in iterator_kinds(op)):
        return None
    maps = [terms(m) for m in linalg.get_indexing_maps(op)]
    if any(t is None for t in maps):
        return None
    out = maps[-1]
    if sorted(t for t in out if not isinstance(t, Const)) != list(range(len(out))) or \
            any(isinstance(t, Const) for t in out):
        return None
    for inner in body_of(op).operations:
        if inner.operation.name == "cf.assert" or len(inner.operation.regions):
            return None
    return op


def _index_constant(n: int) -> ir.Value:
    return arith.ConstantOp(ir.IndexType.get(), ir.IntegerAttr.get(ir.IndexType.get(), n)).result


def _fold_one(extract: ir.Operation, producer: ir.Operation) -> None:
    """Replace `extract` (of producer's result) with producer's body on extracted inputs."""
    maps = [terms(m) for m in linalg.get_indexing_maps(producer)]
    out_terms = maps[-1]
    indices = list(extract.operands)[1:]
    loop_index = {d: indices[pos] for pos, d in enumerate(out_terms)}
    n_in = len(producer.operands) - 1
    body = body_of(producer)
    mapping: dict = {}
    with ir.InsertionPoint(extract), extract.location:
        for k in range(n_in + 1):
            operand = producer.operands[k]
            arg = body.arguments[k]
            if not list(arg.uses):
                continue
            if not isinstance(operand.type, ir.RankedTensorType):
                mapping[arg] = operand
                continue
            idx = [_index_constant(t.value) if isinstance(t, Const) else loop_index[t]
                   for t in maps[k]]
            mapping[arg] = tensor.ExtractOp(operand, idx).result
        for inner in body.operations:
            if inner.operation.name == "linalg.index":
                d = ir.IntegerAttr(inner.operation.attributes["dim"]).value
                mapping[inner.operation.results[0]] = loop_index[d]
        for inner in list(body.operations)[:-1]:
            inner = inner.operation
            if inner.name == "linalg.index":
                continue
            clone_op(inner, mapping)
        yielded = terminator(body).operands[0]
        value = mapping.get(yielded, yielded)
    extract.results[0].replace_all_uses_with(value)
    extract.erase()


def _fold_expand(extract: ir.Operation, expand: ir.Operation) -> None:
    """extract(expand_shape(T), idx) -> extract(T, idx linearized per reassociation group)."""
    groups = [[ir.IntegerAttr(i).value for i in g] for g in expand.opview.reassociation]
    shape = list(expand.results[0].type.shape)
    indices = list(extract.operands)[1:]
    with ir.InsertionPoint(extract), extract.location:
        new_indices = []
        for g in groups:
            value = None
            for d in g:
                if shape[d] == 1:
                    continue  # the index of a unit dim is 0
                value = indices[d] if value is None else arith.addi(
                    arith.muli(value, _index_constant(shape[d])), indices[d])
            new_indices.append(value if value is not None else _index_constant(0))
        new = tensor.ExtractOp(expand.operands[0], new_indices).result
    extract.results[0].replace_all_uses_with(new)
    extract.erase()


def _extracts_in(op: ir.Operation) -> list[ir.Operation]:
    return [o.operation for o in body_of(op).operations if o.operation.name == "tensor.extract"]


def _linalg_ops(func: ir.Operation) -> list[ir.Operation]:
    return [o.operation for o in func.regions[0].blocks[0].operations
            if o.operation.name.startswith("linalg.") and o.operation.regions]


def fold_gathers_through_elementwise(func: ir.Operation) -> int:
    """Fold every gather from an elementwise producer (to a fixed point); returns the count."""
    count = 0
    changed = True
    while changed:
        changed = False
        for op in _linalg_ops(func):
            for extract in _extracts_in(op):
                source = defining_op(extract.operands[0])
                if source is not None and source.name == "tensor.expand_shape":
                    with op.context:
                        _fold_expand(extract, source)
                    count += 1
                    changed = True
                    continue
                producer = _elementwise_source(extract.operands[0])
                if producer is None:
                    continue
                with op.context:
                    _fold_one(extract, producer)
                count += 1
                changed = True
    return count


def _loop_dim_of(value: ir.Value, block: ir.Block):
    """The loop dim d when `value` is `linalg.index d` of the op owning `block` (possibly
    through index_cast), a Const for an index constant, else None."""
    op = defining_op(value)
    if op is None:
        return None
    if op.name == "arith.constant" and isinstance(value.type, ir.IndexType):
        return Const(ir.IntegerAttr(op.attributes["value"]).value)
    if op.name == "linalg.index" and op.block == block:
        return ir.IntegerAttr(op.attributes["dim"]).value
    return None


def promote_indexed_extracts(func: ir.Operation) -> int:
    """Turn extracts at the op's own loop indices into input operands; returns the count."""
    count = 0
    for op in _linalg_ops(func):
        if op.name != "linalg.generic":
            continue
        block = body_of(op)
        promotable = []
        for extract in _extracts_in(op):
            source = extract.operands[0]
            if isinstance(source, ir.BlockArgument) and source.owner == block:
                continue
            ts = [_loop_dim_of(v, block) for v in list(extract.operands)[1:]]
            if any(t is None for t in ts):
                continue
            dims = [t for t in ts if not isinstance(t, Const)]
            if len(set(dims)) != len(dims):
                continue
            promotable.append((extract, ts))
        if promotable:
            with op.context, op.location:
                _add_inputs(op, promotable)
            count += len(promotable)
    return count


def _add_inputs(op: ir.Operation, promotable: list) -> None:
    view = op.opview
    inputs = list(view.inputs)
    outputs = list(view.outputs)
    maps = [m.value for m in view.indexing_maps]
    n_loops = maps[0].n_dims if maps else len(iterator_kinds(op))
    new_inputs = [e.operands[0] for e, _ in promotable]
    new_maps = [make_map(n_loops, ts) for _, ts in promotable]
    block = body_of(op)
    extract_index = {e: len(inputs) + i for i, (e, _) in enumerate(promotable)}

    def body(args):
        mapping = {block.arguments[i]: args[i] for i in range(len(inputs))}
        for j in range(len(outputs)):
            mapping[block.arguments[len(inputs) + j]] = args[len(inputs) + len(new_inputs) + j]
        for e, pos in extract_index.items():
            mapping[e.results[0]] = args[pos]
        values = []
        for inner in list(block.operations)[:-1]:
            inner = inner.operation
            if inner in extract_index:
                continue
            clone = inner.clone()
            _remap(clone, mapping)
            for old, new in zip(inner.results, clone.results):
                mapping[old] = new
        for v in terminator(block).operands:
            values.append(mapping.get(v, v))
        return values

    with ir.InsertionPoint(op):
        new = build_generic(inputs + new_inputs, outputs,
                            maps[:len(inputs)] + new_maps + maps[len(inputs):],
                            iterator_kinds(op), body, name_from=op)
    for old, new_result in zip(op.results, new.results):
        old.replace_all_uses_with(new_result)
    op.erase()


def append_input(op: ir.Operation, value: ir.Value, amap: ir.AffineMap) -> ir.Operation:
    """Rebuild linalg.generic `op` with one more input (`value` through `amap`) that its body
    does not read; returns the new op."""
    view = op.opview
    inputs = list(view.inputs)
    outputs = list(view.outputs)
    maps = [m.value for m in view.indexing_maps]
    block = body_of(op)

    def body(args):
        mapping = {block.arguments[i]: args[i] for i in range(len(inputs))}
        for j in range(len(outputs)):
            mapping[block.arguments[len(inputs) + j]] = args[len(inputs) + 1 + j]
        for inner in list(block.operations)[:-1]:
            inner = inner.operation
            clone = inner.clone()
            _remap(clone, mapping)
            for old, new in zip(inner.results, clone.results):
                mapping[old] = new
        return [mapping.get(v, v) for v in terminator(block).operands]

    with op.context, op.location, ir.InsertionPoint(op):
        new = build_generic(inputs + [value], outputs, maps[:len(inputs)] + [amap] + maps[len(inputs):],
                            iterator_kinds(op), body, name_from=op)
    attrs = op.attributes
    for i in range(len(attrs)):
        if attrs[i].name not in ("indexing_maps", "iterator_types", "operandSegmentSizes"):
            new.attributes[attrs[i].name] = attrs[i].attr
    for old, res in zip(op.results, new.results):
        old.replace_all_uses_with(res)
    op.erase()
    return new.operation


def _remap(op: ir.Operation, mapping: dict) -> None:
    def visit(inner):
        for i, v in enumerate(inner.operands):
            if v in mapping:
                inner.operands[i] = mapping[v]
        return ir.WalkResult.ADVANCE

    op.walk(visit)

