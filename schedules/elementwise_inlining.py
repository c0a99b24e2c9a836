"""Inline elementwise producers into the linalg ops that read them.

A consumer C reads tensor T = P(a_1, ..., a_n), P an elementwise linalg.generic (all loops
parallel, output through a permutation), through an indexing map that is a permutation (C
visits each element of T once: no broadcast, so nothing is recomputed), or through any
projected permutation when P reads no tensor at all (an iota of linalg.index values). C is rebuilt to read
P's inputs instead, through the composed maps, with P's body computed in its own body:
    C(.., T[M(i)], ..) = C(.., body_P(a_1[M_1(P^-1(M(i)))], ...), ..)
The same scalar operations run on the same values: the rewrite is exact. Unlike upstream
elementwise fusion it also inlines producers with several readers (each reader computes the
element itself, and P dies once every reader has inlined it), which removes [N, C]
intermediates read by two ops (x - m feeding both the exp-sum and the gradient).
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import linalg, tensor

from transform_ext.analysis.maps import Const, make_map, terms
from transform_ext.common import body_of, build_generic, defining_op, iterator_kinds, terminator


_STRUCTURAL = ("indexing_maps", "iterator_types", "operandSegmentSizes")


def _is_elementwise(op: ir.Operation) -> bool:
    if op is None or op.name != "linalg.generic" or len(op.results) != 1:
        return False
    if any(k != "parallel" for k in iterator_kinds(op)):
        return False
    maps = [terms(m) for m in linalg.get_indexing_maps(op)]
    if any(t is None for t in maps):
        return False
    out = maps[-1]
    if any(isinstance(t, Const) for t in out) or sorted(out) != list(range(len(out))):
        return False
    return not any(inner.operation.name == "cf.assert" or len(inner.operation.regions)
                   for inner in body_of(op).operations)


def _is_permutation(ts, n: int) -> bool:
    return ts is not None and not any(isinstance(t, Const) for t in ts) and sorted(ts) == list(range(n))


def inlinable_operand(consumer: ir.Operation, k: int) -> ir.Operation | None:
    """The producer of input k of `consumer` when it can be inlined, else None."""
    if consumer.name != "linalg.generic":
        return None
    n_in = len(consumer.operands) - len(consumer.results)
    if k >= n_in:
        return None
    producer = defining_op(consumer.operands[k])
    if producer is None or producer.block != consumer.block or not _is_elementwise(producer):
        return None
    cmap = terms(linalg.get_indexing_maps(consumer)[k])
    n_loops = len(iterator_kinds(consumer))
    if cmap is None or any(isinstance(t, Const) for t in cmap):
        return None
    if len(producer.operands) == 1:
        return producer  # only loop indices (an iota): free to recompute under a broadcast
    if len(cmap) != n_loops or not _is_permutation(cmap, n_loops):
        return None
    return producer


def inline_producer(consumer: ir.Operation, k: int, witness=None) -> tuple[ir.Operation, bool]:
    """Inline the producer of input k into `consumer`; returns the new consumer and whether
    the producer died (and was erased). When a loop of `consumer` was bounded only by T's
    shape, an unread input of that shape keeps its bounds: `witness(shape)` (a tensor that
    exists anyway, e.g. a function argument), else a new tensor.empty."""
    producer = defining_op(consumer.operands[k])
    cview = consumer.opview
    c_inputs = list(cview.inputs)
    c_outputs = list(cview.outputs)
    c_maps = [terms(m.value) for m in cview.indexing_maps]
    n_loops = len(iterator_kinds(consumer))
    p_maps = [terms(m) for m in linalg.get_indexing_maps(producer)]
    p_out = p_maps[-1]
    # P's loop p_out[j] runs over T's dim j, which C reads with its loop c_maps[k][j].
    p_loop_to_c = {p_out[j]: c_maps[k][j] for j in range(len(p_out))}
    p_operands = list(producer.operands)
    p_body = body_of(producer)
    used = [j for j in range(len(p_operands)) if list(p_body.arguments[j].uses)]
    new_inputs = c_inputs[:k] + c_inputs[k + 1:]
    new_maps = [make_map(n_loops, t) for t in c_maps[:k] + c_maps[k + 1:len(c_inputs)]]
    extra = {}
    for j in used:
        extra[j] = len(new_inputs)
        new_inputs.append(p_operands[j])
        new_maps.append(make_map(n_loops, [t if isinstance(t, Const) else p_loop_to_c[t]
                                           for t in p_maps[j]]))
    new_maps += [make_map(n_loops, t) for t in c_maps[len(c_inputs):]]
    covered = {t for m in [c_maps[i] for i in range(len(c_maps)) if i != k] for t in m
               if not isinstance(t, Const)}
    covered |= {p_loop_to_c[t] for j in used for t in p_maps[j] if not isinstance(t, Const)}
    if len(covered) < n_loops:
        t = consumer.operands[k].type
        shape_witness = witness(list(t.shape)) if witness is not None else None
        if shape_witness is None:
            with ir.InsertionPoint(consumer), consumer.location:
                shape_witness = tensor.EmptyOp(list(t.shape), t.element_type).result
        new_inputs.append(shape_witness)
        new_maps.insert(len(new_inputs) - 1, make_map(n_loops, c_maps[k]))
    c_body = body_of(consumer)

    def body(args):
        mapping = {}
        for j in used:
            mapping[p_body.arguments[j]] = args[extra[j]]
        p_values = _clone_ops(p_body, mapping, index_map=p_loop_to_c)
        cmapping = {}
        pos = 0
        for i in range(len(c_inputs)):
            if i == k:
                cmapping[c_body.arguments[i]] = p_values[0]
            else:
                cmapping[c_body.arguments[i]] = args[pos]
                pos += 1
        for j in range(len(c_outputs)):
            cmapping[c_body.arguments[len(c_inputs) + j]] = args[len(new_inputs) + j]
        return _clone_ops(c_body, cmapping)

    with ir.InsertionPoint(consumer), consumer.location:
        new = build_generic(new_inputs, c_outputs, new_maps, iterator_kinds(consumer), body,
                            name_from=consumer)
    attrs = consumer.attributes
    for i in range(len(attrs)):
        if attrs[i].name not in _STRUCTURAL:
            new.attributes[attrs[i].name] = attrs[i].attr
    for old, res in zip(consumer.results, new.results):
        old.replace_all_uses_with(res)
    consumer.erase()
    if not any(list(r.uses) for r in producer.results):
        producer.erase()
        return new.operation, True
    return new.operation, False


def _clone_ops(block: ir.Block, mapping: dict, index_map: dict | None = None) -> list[ir.Value]:
    """Clone `block`'s ops at the insertion point; linalg.index d becomes index_map[d]."""
    for inner in list(block.operations)[:-1]:
        inner = inner.operation
        clone = inner.clone()
        if index_map is not None and inner.name == "linalg.index":
            d = ir.IntegerAttr(inner.attributes["dim"]).value
            target = index_map[d]
            clone.attributes["dim"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), target)
        _remap(clone, mapping)
        for old, new in zip(inner.results, clone.results):
            mapping[old] = new
    return [mapping.get(v, v) for v in terminator(block).operands]


def _remap(op: ir.Operation, mapping: dict) -> None:
    def visit(inner):
        for i, v in enumerate(inner.operands):
            if v in mapping:
                inner.operands[i] = mapping[v]
        return ir.WalkResult.ADVANCE

    op.walk(visit)


def inline_elementwise_producers(blocks, consumer=lambda op: True,
                                 producer=lambda op: True, witness=None) -> int:
    """Inline, to a fixed point, every inlinable producer satisfying `producer(op)` into the
    linalg ops of `blocks` that satisfy `consumer(op)`; returns the count. The blocks are rescanned after each
    rewrite (ops are replaced and erased as it goes)."""
    count = 0
    for block in blocks:
        while True:
            found = None
            for op in block.operations:
                op = op.operation
                if op.name != "linalg.generic" or not consumer(op):
                    continue
                for k in range(len(op.operands) - len(op.results)):
                    p = inlinable_operand(op, k)
                    if p is not None and producer(p):
                        found = (op, k)
                        break
                if found:
                    break
            if found is None:
                break
            with found[0].context:
                inline_producer(*found, witness=witness)
            count += 1
    return count


def merge_elementwise(ops: list[ir.Operation]) -> ir.Operation:
    """One linalg.generic computing every op of `ops` (elementwise ops with equal loop ranges
    and identity output maps, in one block): its inputs are theirs (each value once), its
    results theirs in order, its body their bodies side by side. The new op is inserted at
    the last op's place and replaces them all."""
    first = ops[0]
    n_loops = len(iterator_kinds(first))
    identity = ir.AffineMap.get_identity(n_loops)
    inputs, in_maps, outputs = [], [], []
    index = {}
    for op in ops:
        view = op.opview
        for v, m in zip(view.inputs, list(view.indexing_maps)[:len(view.inputs)]):
            key = (v, str(m.value))
            if key not in index:
                index[key] = len(inputs)
                inputs.append(v)
                in_maps.append(m.value)
        outputs.extend(view.outputs)
    last = ops[0]
    for op in ops[1:]:
        if last.is_before_in_block(op):
            last = op

    def body(args):
        results = []
        out_pos = len(inputs)
        for op in ops:
            view = op.opview
            block = body_of(op)
            mapping = {}
            for i, (v, m) in enumerate(zip(view.inputs, list(view.indexing_maps))):
                mapping[block.arguments[i]] = args[index[(v, str(m.value))]]
            for j in range(len(view.outputs)):
                mapping[block.arguments[len(view.inputs) + j]] = args[out_pos]
                out_pos += 1
            results.extend(_clone_ops(block, mapping))
        return results

    with ir.InsertionPoint(last), last.location:
        new = build_generic(inputs, outputs, in_maps + [identity] * len(outputs),
                            ["parallel"] * n_loops, body)
    position = 0
    for op in ops:
        for r in op.results:
            r.replace_all_uses_with(new.results[position])
            position += 1
    for op in ops:
        op.erase()
    return new.operation
