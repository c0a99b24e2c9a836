"""fuse_elementwise_producers: merge single-use elementwise producers into elementwise
consumers, without recomputation.

For an elementwise linalg.generic C (all loops parallel) reading operand k from an
elementwise generic P whose result has no other user, and where C reads P's result through
a permutation of all of C's loops (so every element of P is used exactly once: no
broadcast, no recomputation),
    C(..., P(a, b, ...), ...)  ==  C'(..., a, b, ...)
with P's input maps composed into C's loop space and P's body inlined in front of C's (a P
that reads its init, out = max(out, x), passes the init in as one more input).
Repeated until no pair qualifies. Reductions and contractions are never consumers here (a
producer fused into a contraction would be recomputed per reduction step), and a producer
with several users stays (upstream's linalg-fuse-elementwise-ops duplicates it instead).
Nor is a widening (C = extf(x) of a bf16 x, nothing else) that a reduction or contraction
reads: it stays one, so that the contraction reads the rounded bf16 values as they are
(transform_ext.fold_casts_into_contractions; a bf16 MLP's second layer reading the first's
rounded GELU), not their f32 copy.

Targets: every linalg.generic nested in (or equal to) the target ops. Never fails; the result
handle holds the targets.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, transform

from .analysis.structure import loop_structure
from .common import (ReplacesTargets, Success, block_ops, build_generic, clone_body, defining_op,
                     is_linalg, payload_ops, users, walk_ops)
from .dialect import TransformExt


def _widening_read_by_a_reduction(op: ir.Operation) -> bool:
    """Is `op` a generic whose body only widens a bf16 input (extf), read by a structured
    linalg op with reduction loops?"""
    body = block_ops(op)
    if [o.name for o in body] != ["arith.extf", "linalg.yield"] or \
            not isinstance(body[0].operands[0].type, ir.BF16Type):
        return False
    return any(is_linalg(reader) and linalg.get_indexing_maps(reader) is not None
               and loop_structure(reader).reduction_dims for reader in users(op.results[0]))


def _fusable(consumer: ir.Operation, index: int):
    """The producer of consumer's input `index` when the pair qualifies, else None."""
    if _widening_read_by_a_reduction(consumer):
        return None
    producer = defining_op(consumer.operands[index])
    if producer is None or producer.name != "linalg.generic" or len(producer.results) != 1:
        return None
    if producer.block != consumer.block or len(list(producer.results[0].uses)) != 1:
        return None
    pls, cls = loop_structure(producer), loop_structure(consumer)
    if pls.reduction_dims or cls.reduction_dims:
        return None
    if not all(m.is_permutation for m in [pls.output_map(0), cls.maps[index]]):
        return None
    if pls.num_loops != cls.num_loops:
        return None
    if any(inner.operation.name == "linalg.index"
           for inner in producer.regions[0].blocks[0].operations):
        return None  # index ops would need re-mapping through the permutation
    return producer


def _compose(consumer_map: ir.AffineMap, producer_out: ir.AffineMap, producer_in: ir.AffineMap):
    """Producer input map expressed over the consumer's loops: the consumer's loop l reads
    P's element consumer_map(l), i.e. P's loop inverse(producer_out)(consumer_map(l))."""
    from .analysis.structure import dim_positions

    to_p_loop = {}
    for pos, p_loop in enumerate(dim_positions(producer_out)):
        to_p_loop[p_loop] = ir.AffineDimExpr.get(dim_positions(consumer_map)[pos])
    exprs = [to_p_loop[d] if d is not None else e for d, e in
             zip(dim_positions(producer_in), producer_in.results)]
    return ir.AffineMap.get(consumer_map.n_dims, 0, exprs)


def _fuse(consumer: ir.Operation, index: int, producer: ir.Operation, rewriter) -> ir.Operation:
    """The fused op; a producer whose body reads its init (out = max(out, x)) passes that
    init in as one more input, read through P's output map."""
    pls, cls = loop_structure(producer), loop_structure(consumer)
    p_block = producer.regions[0].blocks[0]
    reads_init = bool(list(p_block.arguments[pls.num_inputs].uses))
    n_read = pls.num_inputs + (1 if reads_init else 0)
    p_inputs = list(producer.operands)[:n_read]
    c_inputs = list(consumer.operands)[: cls.num_inputs]
    outputs = list(consumer.operands)[cls.num_inputs:]
    new_inputs = c_inputs[:index] + p_inputs + c_inputs[index + 1:]
    p_maps = [_compose(cls.maps[index], pls.output_map(0), m) for m in pls.maps[:n_read]]
    maps = cls.maps[:index] + p_maps + cls.maps[index + 1: cls.num_inputs] + cls.maps[cls.num_inputs:]
    n_p = len(p_inputs)

    def body(args):
        p_args = args[index: index + n_p]
        mapping = {p_block.arguments[i]: p_args[i] for i in range(n_p)}
        fused_value = clone_body(producer, mapping)[0]
        c_block = consumer.regions[0].blocks[0]
        c_args = args[:index] + [fused_value] + args[index + n_p:]
        mapping = {c_block.arguments[i]: c_args[i] for i in range(len(c_block.arguments))}
        return clone_body(consumer, mapping)

    with ir.InsertionPoint(consumer), consumer.location:
        new = build_generic(new_inputs, outputs, maps, ["parallel"] * cls.num_loops, body,
                            name_from=consumer)
    rewriter.replace_op(consumer, new.operation)
    rewriter.erase_op(producer)
    return new.operation


def _fusable_input(consumer: ir.Operation):
    """(input index, producer) of the first input of an elementwise consumer whose pair
    qualifies, else None."""
    ls = loop_structure(consumer)
    if ls.reduction_dims or len(consumer.results) != 1:
        return None
    for index in range(ls.num_inputs):
        producer = _fusable(consumer, index)
        if producer is not None:
            return index, producer
    return None


def _fuse_all(targets: list[ir.Operation], rewriter) -> list[ir.Operation]:
    """Fuse every qualifying pair under the targets, pass after pass until one fuses
    nothing; returns the targets, a fused one replaced by its fused op. (Restarting the walk
    after each fusion was quadratic: 8 s for a 6-layer LSTM of 16 steps.)"""
    fused = True
    while fused:
        targets, fused = _fuse_pass(targets, rewriter)
    return targets


def _fuse_pass(targets: list[ir.Operation], rewriter) -> tuple[list[ir.Operation], bool]:
    """One pass over the targets' generics in order, each consumer taking all its producers
    (a producer precedes its consumer: what a fusion erases was already visited); returns
    the targets and whether it fused. It ends at a fusion that replaces or erases a target
    op (the targets' walks would reach it)."""
    fused = False
    for target in targets:
        for consumer in walk_ops(target, lambda o: o.name == "linalg.generic"):
            while (hit := _fusable_input(consumer)) is not None:
                index, producer = hit
                replaced = [t == consumer for t in targets]
                dropped = [t == producer for t in targets]
                consumer = _fuse(consumer, index, producer, rewriter)
                fused = True
                if any(replaced) or any(dropped):
                    return [consumer if r else t for t, r, d in zip(targets, replaced, dropped)
                            if not d], True
    return targets, fused


class FuseElementwiseProducersOp(TransformExt.Operation, name="fuse_elementwise_producers"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = _fuse_all(payload_ops(state, op.target), rewriter)
                results.set_ops(op.result, targets)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def fuse_elementwise_producers(target: ir.Value) -> ir.Value:
    """Merge single-use, non-broadcast elementwise producers into elementwise consumers in
    `target`; returns the targets."""
    return FuseElementwiseProducersOp(target).result
