"""inline_elementwise_producers: elementwise producers computed in the bodies of the linalg
ops that read them.

A consumer C reads tensor T = P(a_1, ..., a_n), P an elementwise linalg.generic in C's block
(all loops parallel, output through a permutation, no cf.assert or region in its body),
through an indexing map that is a permutation (C visits each element of T once: no
broadcast, so nothing is recomputed), or through any projected permutation when P reads no
tensor at all (an iota of linalg.index values). C is rebuilt to read P's inputs instead,
through the composed maps, with P's body computed in its own body:
    C(.., T[M(i)], ..) = C(.., body_P(a_1[M_1(P^-1(M(i)))], ...), ..)
The same scalar operations run on the same values: the rewrite is exact. Unlike upstream
elementwise fusion it also inlines producers with several readers (each reader computes the
element itself, and P is erased once every reader has inlined it), which removes [N, C]
intermediates read by two ops (x - m feeding both the exp-sum and the gradient). When a
loop of C was bounded only by T, an unread input keeps its bounds: the `witness`, else a
new tensor.empty of T's shape.

Each consumer (in handle order) inlines its first inlinable input, is rebuilt, and repeats
until none is left. With `whole`, only producers whose every reader is one of the consumers
are inlined (so none is left stored: a reduction's producer that an elementwise op also
reads stays whole and is not computed twice). With a `witness` (one value, e.g. the logits from trace_to_argument),
only producers of tensors shaped like it are inlined. Legality first: every consumer must be
a linalg.generic on tensors, and the witness one ranked tensor; else a silenceable failure
(nothing rewritten). The consumers' handle is consumed (match the rebuilt ops again).
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, tensor, transform

from .analysis.maps import Const, make_map, terms
from .common import (Illegal, Success, body_of, build_generic, clone_op, defining_op, fail,
                     iterator_kinds, payload_ops, terminator)
from .dialect import TransformExt

NAME = "transform_ext.inline_elementwise_producers"
STRUCTURAL_ATTRS = ("indexing_maps", "iterator_types", "operandSegmentSizes")


def is_elementwise_producer(op: ir.Operation | None) -> bool:
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
    if producer is None or producer.block != consumer.block or not is_elementwise_producer(producer):
        return None
    maps = [terms(m) for m in linalg.get_indexing_maps(consumer)]
    if any(m is None for m in maps):  # a map beyond dims and constants (a convolution's)
        return None
    cmap = maps[k]
    n_loops = len(iterator_kinds(consumer))
    if any(isinstance(t, Const) for t in cmap):
        return None
    if len(producer.operands) == 1:
        return producer  # only loop indices (an iota): free to recompute under a broadcast
    if len(cmap) != n_loops or not _is_permutation(cmap, n_loops):
        return None
    return producer


def _clone_ops(block: ir.Block, mapping: dict, index_map: dict | None = None) -> list[ir.Value]:
    """Clone `block`'s ops at the insertion point; linalg.index d becomes index_map[d]."""
    for inner in list(block.operations)[:-1]:
        inner = inner.operation
        clone = clone_op(inner, mapping)
        if index_map is not None and inner.name == "linalg.index":
            d = ir.IntegerAttr(inner.attributes["dim"]).value
            clone.attributes["dim"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), index_map[d])
    return [mapping.get(v, v) for v in terminator(block).operands]


def inline_producer(consumer: ir.Operation, k: int, witness: ir.Value | None = None,
                    rewriter=None) -> ir.Operation:
    """Inline the producer of input k into `consumer` (see the module docstring); the new
    consumer replaces the old, the producer is erased when nothing reads it any more.
    Without a `rewriter` (outside a transform op) the payload is edited directly."""
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
        shape_witness = witness
        if shape_witness is None or list(shape_witness.type.shape) != list(t.shape):
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
        if attrs[i].name not in STRUCTURAL_ATTRS:
            new.attributes[attrs[i].name] = attrs[i].attr
    if rewriter is not None:
        rewriter.replace_op(consumer, list(new.results))
    else:
        for old, res in zip(consumer.results, new.results):
            old.replace_all_uses_with(res)
        consumer.erase()
    if not any(list(r.uses) for r in producer.results):
        if rewriter is not None:
            rewriter.erase_op(producer)
        else:
            producer.erase()
    return new.operation


def inline_all(consumer: ir.Operation, producer=lambda op: True, witness=None,
               rewriter=None) -> ir.Operation:
    """Inline into `consumer` its inlinable producers satisfying `producer(op)`, first input
    first, to a fixed point; returns the rebuilt consumer."""
    while True:
        for k in range(len(consumer.operands) - len(consumer.results)):
            p = inlinable_operand(consumer, k)
            if p is not None and producer(p):
                consumer = inline_producer(consumer, k, witness, rewriter)
                break
        else:
            return consumer


def _check_consumer(op: ir.Operation) -> None:
    if op.name != "linalg.generic":
        raise Illegal(op, "not a linalg.generic")
    if any(isinstance(v.type, ir.ShapedType) and not isinstance(v.type, ir.RankedTensorType)
           for v in op.operands):
        raise Illegal(op, "it works on buffers")


READER = "lh.inline_reader"  # marks the consumers while `whole` looks at a producer's readers


def _read_only_by_consumers(producer: ir.Operation) -> bool:
    return all(READER in use.owner.attributes for r in producer.results for use in r.uses)


class InlineElementwiseProducersOp(TransformExt.Operation, name="inline_elementwise_producers"):
    consumers: ext.Operand[transform.AnyOpType]
    whole: ir.IntegerAttr  # i1
    witness: ext.Operand[transform.AnyValueType] | None = None

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                consumers = payload_ops(state, op.consumers)
                witness = None
                try:
                    if op.witness is not None:
                        values = list(state.get_payload_values(op.witness))
                        if len(values) != 1 or not isinstance(values[0].type, ir.RankedTensorType):
                            raise Illegal(consumers[0] if consumers else op.operation,
                                          f"the witness must be one ranked tensor, got "
                                          f"{[str(v.type) for v in values]}")
                        witness = values[0]
                    for c in consumers:
                        _check_consumer(c)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                whole = bool(ir.IntegerAttr(op.whole).value)
                shape = None if witness is None else list(witness.type.shape)

                def wanted(p):
                    return (shape is None or list(p.results[0].type.shape) == shape) and \
                        (not whole or _read_only_by_consumers(p))

                if whole:
                    for c in consumers:
                        c.attributes[READER] = ir.UnitAttr.get()
                rebuilt = [inline_all(c, wanted, witness, rewriter) for c in consumers]
                if whole:
                    for c in rebuilt:
                        if READER in c.attributes:
                            del c.attributes[READER]
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    class Effects(ir.MemoryEffectsOpInterface):
        @staticmethod
        def get_effects(op, effects):
            transform.consumes_handle(op.op_operands[:1], effects)
            if len(op.op_operands) > 1:
                transform.only_reads_handle(op.op_operands[1:], effects)
            transform.modifies_payload(effects)


def inline_elementwise_producers(consumers: ir.Value, witness: ir.Value | None = None, *,
                                 whole: bool = False):
    """Inline the elementwise producers of the ops in `consumers` into them (see the module
    docstring)."""
    return InlineElementwiseProducersOp(
        consumers, ir.IntegerAttr.get(ir.IntegerType.get_signless(1), int(whole)),
        witness=witness)


__all__ = ["InlineElementwiseProducersOp", "inline_elementwise_producers", "inline_producer",
           "inline_all", "inlinable_operand", "is_elementwise_producer"]
