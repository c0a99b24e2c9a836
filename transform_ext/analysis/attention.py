"""The ops of a softmax attention, found by walking the IR:

    S = Q K^T [scaled, masked: elementwise ops],  m = max_j S,  E = exp(S - m),  l = sum_j E,
    O = (E V) / l  [then a head merge: transpose, reshape]

`attention_ops(block owner)`: the row max m (the one max reduction among the block's linalg
ops), the scores contraction S (the one contraction m reads through elementwise linalg ops)
and the P V contraction (the one other contraction that depends on m). `attention_in(func)`
adds the row sum, the op whose result is the attention output and its query and value loop
dims (AttentionOps). Shared by the transform_ext ops and the attention schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir

from .classify import reduction_combiner
from .structure import dim_positions, is_linalg_op, loop_structure
from ..common import block_ops, defining_op, depends_on, user_op


class NotAttention(Exception):
    """The ops are not one attention; the message is the reason."""


_RESHAPES = ("tensor.expand_shape", "tensor.collapse_shape")


def producing_contraction(value: ir.Value, through_reshapes: bool = False):
    """The one contraction `value` is computed from through elementwise linalg ops (a scale,
    an added or selected mask: S * c, S + M, select(M, -inf, S)) and, with
    `through_reshapes`, reshapes; None when there is none or more than one."""
    found, seen, pending = [], [], [defining_op(value)]
    while pending:
        op = pending.pop()
        if through_reshapes and op is not None and op.name in _RESHAPES:
            pending.append(defining_op(op.operands[0]))
            continue
        if op is None or not is_linalg_op(op) or op in seen:
            continue
        seen.append(op)
        ls = loop_structure(op)
        if ls.is_contraction:
            found.append(op)
        elif not ls.reduction_dims:
            pending.extend(defining_op(v) for v in list(op.operands)[:ls.num_inputs])
    return found[0] if len(found) == 1 else None



def attention_ops(block_owner) -> tuple[ir.Operation, ir.Operation, ir.Operation]:
    """(row max, scores contraction, P V contraction) among the linalg ops directly in the
    entry block of `block_owner`'s first region (a function, a query block's forall)."""
    return _attention_ops([op for op in block_ops(block_owner) if is_linalg_op(op)])


def _attention_ops(ops: list[ir.Operation]) -> tuple[ir.Operation, ir.Operation, ir.Operation]:
    maxes = [op for op in ops if reduction_combiner(op) == "max"]
    if len(maxes) != 1:
        raise NotAttention(f"expected one row max (softmax), found {len(maxes)}")
    row_max = maxes[0]
    if len(loop_structure(row_max).reduction_dims) != 1:
        raise NotAttention("the row max must reduce one dim (the keys)")
    scores = producing_contraction(row_max.operands[0])
    if scores is None:
        raise NotAttention("the row max does not read a contraction (S = Q K^T)")
    m = row_max.results[0]
    after = [op for op in ops if op is not scores and loop_structure(op).is_contraction
             and depends_on(op, m)]
    # P V reads the probabilities through elementwise ops; a projection of the attention
    # output (MinGPT's c_proj) reads P V
    values = [op for op in after if not any(depends_into(op, other) for other in after)]
    if len(values) != 1:
        raise NotAttention(f"expected one P V contraction after the softmax, found {len(values)}")
    return row_max, scores, values[0]


def is_index_computation(op: ir.Operation) -> bool:
    """An elementwise op whose value derives from loop indices and constants only (iotas and
    the comparisons, selects and casts of a mask computed from them)."""
    if not (is_linalg_op(op) and len(op.results) == 1 and loop_structure(op).is_elementwise):
        return False
    for v in list(op.operands)[: loop_structure(op).num_inputs]:
        p = defining_op(v)
        if p is None or not is_index_computation(p):
            return False
    return True


def is_neg_inf(value: ir.Value) -> bool:
    p = defining_op(value)
    return p is not None and p.name == "arith.constant" and \
        isinstance(p.attributes["value"], ir.FloatAttr) and \
        ir.FloatAttr(p.attributes["value"]).value == float("-inf")


def depends_into(consumer: ir.Operation, producer: ir.Operation) -> bool:
    """Does `consumer` (transitively, within the block) read `producer`'s results?"""
    return any(depends_on(consumer, r) for r in producer.results)


@dataclass
class AttentionOps:
    """The ops of one attention after normalization (payload ops)."""

    scores: ir.Operation       # S = Q K^T
    row_max: ir.Operation | None  # m (None: no softmax, elementwise_attention_in)
    row_sum: ir.Operation | None  # l
    values: ir.Operation       # E V
    output: ir.Operation       # the op whose result is the attention output
    query_dim: int             # loop dim of `output` running over query rows
    value_dim: int             # loop dim of `output` running over the value columns


def attention_in(func: ir.Operation) -> AttentionOps:
    """Locate S, m, l, P V and the output in a normalized function (or say why not)."""
    return _attention_in([op for op in block_ops(func) if is_linalg_op(op)], final_op(func))


def attention_of(value: ir.Value) -> AttentionOps:
    """The attention whose output is `value` (through reshapes), among the linalg ops it is
    computed from in its block (a joint graph's backward ops aside), or say why not."""
    output = defining_op(value)
    while output is not None and output.name in ("tensor.expand_shape", "tensor.collapse_shape"):
        output = defining_op(output.operands[0])
    if output is None or not is_linalg_op(output):
        raise NotAttention("the output is not computed by a linalg op")
    slice_ops, pending = [], [output]
    while pending:
        op = pending.pop()
        if op is None or op in slice_ops or op.block != output.block:
            continue
        slice_ops.append(op)
        pending.extend(defining_op(v) for v in op.operands)
    block = [op for op in block_ops(output.block) if op in slice_ops and is_linalg_op(op)]
    return _attention_in(block, output)


def elementwise_attention_in(func: ir.Operation) -> AttentionOps:
    """An attention without a softmax in a normalized function (or say why not):

        S = Q K^T,  P = f(S) elementwise (a scale, a mask, ReLU),  O = P V

    two batched contractions (a batch dim, the heads, in every operand of each), O reducing
    the keys of S, at least one elementwise op between, and no row max. row_max and
    row_sum are None."""
    ops = [op for op in block_ops(func) if is_linalg_op(op)]
    if any(reduction_combiner(op) == "max" for op in ops):
        raise NotAttention("the scores have a row max (a softmax) that is not an attention's")
    pairs = elementwise_attention_pairs(ops)
    if len(pairs) != 1:
        raise NotAttention(f"expected one contraction reading an elementwise map of another "
                           f"over its keys (S = Q K^T, f(S) V), found {len(pairs)}")
    scores, values = pairs[0]
    return AttentionOps(scores, None, None, values, *_output_of(values, final_op(func)))


def elementwise_attention_pairs(ops: list[ir.Operation], through_reshapes: bool = False
                                ) -> list[tuple[ir.Operation, ir.Operation]]:
    """(S, P V) for every batched contraction among `ops` reading, through at least one
    elementwise op (and, with `through_reshapes`, reshapes: before normalization), another
    batched contraction, with no reduction of S read on the way."""
    pairs = []
    for values in ops:
        ls = loop_structure(values)
        if not ls.is_contraction or len(ls.reduction_dims) != 1 \
                or not ls.contraction_dims()["batch"]:
            continue
        for operand in list(values.operands)[:ls.num_inputs]:
            first = defining_op(operand)
            while through_reshapes and first is not None and first.name in _RESHAPES:
                first = defining_op(first.operands[0])
            if first is None or not is_linalg_op(first) or loop_structure(first).is_contraction:
                continue
            scores = producing_contraction(operand, through_reshapes)
            if scores is None or not loop_structure(scores).contraction_dims()["batch"]:
                continue
            if _reduces_between(ops, scores, values):
                continue
            keys = propagate_loop_dim(values, ls.reduction_dims[0]).get(scores, set())
            if through_reshapes or keys & set(loop_structure(scores).contraction_dims()["n"]):
                pairs.append((scores, values))
    return pairs


def _reduces_between(ops: list[ir.Operation], scores: ir.Operation, values: ir.Operation) -> bool:
    """Is a reduction of the scores (a row max or min) read on the way to `values`? Then
    f is no elementwise map of S."""
    return any(op != values and op != scores and loop_structure(op).reduction_dims
               and depends_into(op, scores) and depends_into(values, op) for op in ops)


def _attention_in(ops: list[ir.Operation], final: ir.Operation) -> AttentionOps:
    row_max, scores, values = _attention_ops(ops)
    m = row_max.results[0]
    # the row sum reduces like the row max ([..., L]); a loss summing the output does not
    sums = [op for op in ops if reduction_combiner(op) == "add" and not
            loop_structure(op).is_contraction and depends_on(op, m)
            and list(ir.ShapedType(op.results[0].type).shape) == list(ir.ShapedType(m.type).shape)]
    if len(sums) != 1:
        raise NotAttention(f"expected one row sum of the softmax, found {len(sums)}")
    rounded = _narrowed_softmax_value(ops, row_max, values)
    if rounded is not None:
        raise NotAttention(f"torch rounds this softmax's probabilities to {rounded} (written "
                           f"by hand in {rounded}), which the fused loop never forms")
    return AttentionOps(scores, row_max, sums[0], values, *_output_of(values, final))


def _output_of(values: ir.Operation, final: ir.Operation) -> tuple[ir.Operation, int, int]:
    """(output op, its query dim, its value dim) of the attention whose P V is `values` in
    a function whose result op is `final`.

    P V is [..., L, Ev]: the output's query and value dims are the loop dims that run
    with P V's rows and columns (the output may permute them: the head merge
    o.transpose(1, 2) gives [B, L, H, Ev]). The output is the function's result op, or,
    when its dims do not follow P V's through linalg ops (a reshape between), the last
    op before it on the way back to P V whose dims do; the ops after it run after the
    fused loops."""
    pv_dims = dim_positions(loop_structure(values).output_map(0))
    if len(pv_dims) < 2 or None in pv_dims[-2:]:
        raise NotAttention("the P V contraction is not [..., queries, values]")
    output = final
    while True:
        found = None if _reads_a_projection(output, values) else \
            _query_and_value_dims(output, values, pv_dims[-2], pv_dims[-1])
        if found is not None or output is values:
            break
        output = _reshaped_source(output)
        if output is None:
            break
    if found is None:
        # a projection after the attention (MinGPT's c_proj) mixes the value columns: the
        # output is the last op of the elementwise chain after P V (the head merge)
        output = _last_elementwise_reader(values)
        found = _query_and_value_dims(output, values, pv_dims[-2], pv_dims[-1])
    if found is None:
        raise NotAttention("the output's query rows or value columns are not one loop dim each")
    return (output, *found)


def _reads_a_projection(output: ir.Operation, values: ir.Operation) -> bool:
    """Does `output` read a contraction computed from `values` (a projection of the
    attention output, `c_proj(y) + y`)? Its query blocks would hold the attention twice."""
    seen, pending = [], [output]
    while pending:
        op = pending.pop()
        if op is None or op in seen or op == values or op.block != values.block:
            continue
        seen.append(op)
        if op != output and is_linalg_op(op) and loop_structure(op).is_contraction \
                and depends_into(op, values):
            return True
        pending.extend(defining_op(v) for v in op.operands)
    return False


def _last_elementwise_reader(values: ir.Operation) -> ir.Operation:
    """The last op of the chain from `values` through reshapes and the linalg ops without
    reductions that are its one reader each (a head merge's transpose), or `values`."""
    op = values
    while len(op.results) == 1:
        readers = [user_op(use) for use in op.results[0].uses]
        while len(readers) == 1 and readers[0].name in ("tensor.expand_shape",
                                                         "tensor.collapse_shape"):
            readers = [user_op(use) for use in readers[0].results[0].uses]
        if len(readers) != 1 or not is_linalg_op(readers[0]) \
                or loop_structure(readers[0]).reduction_dims:
            break
        op = readers[0]
    return op


def _query_and_value_dims(output: ir.Operation, values: ir.Operation, row: int, col: int):
    """`output`'s loop dims running with P V's loop dims `row` and `col`, or None."""
    ls = loop_structure(output)
    rows = [d for d in ls.parallel_dims if row in propagate_loop_dim(output, d).get(values, ())]
    cols = [d for d in ls.parallel_dims if col in propagate_loop_dim(output, d).get(values, ())]
    return (rows[0], cols[0]) if len(rows) == 1 and len(cols) == 1 else None


def _reshaped_source(op: ir.Operation):
    """The linalg op producing `op`'s only tensor input, through reshapes, or None."""
    n_in = loop_structure(op).num_inputs
    inputs = [v for v in list(op.operands)[:n_in] if isinstance(v.type, ir.ShapedType)
              and ir.ShapedType(v.type).rank > 0]
    if len(inputs) != 1:
        return None
    source = defining_op(inputs[0])
    while source is not None and source.name in ("tensor.expand_shape", "tensor.collapse_shape"):
        source = defining_op(source.operands[0])
    return source if source is not None and is_linalg_op(source) else None


def _narrowed_softmax_value(ops, row_max: ir.Operation, values: ir.Operation) -> str | None:
    """The element type (f16, bf16) of a value computed from the row max and read by the
    P V contraction when it is narrower than f32 (torch rounds the probabilities of a
    hand-written f16/bf16 softmax; _widen_softmax keeps them in f32 where it can); None when
    there is none."""
    for op in ops:
        if op is row_max or op is values or not op.results or not depends_into(op, row_max) \
                or not depends_into(values, op):
            continue
        etype = op.results[0].type.element_type
        if isinstance(etype, ir.FloatType) and etype.width < 32:
            return str(etype)
    return None


def final_op(func: ir.Operation) -> ir.Operation:
    """The linalg op whose result the function returns (through reshapes)."""
    ret = block_ops(func)[-1]
    if len(ret.operands) < 1:
        raise NotAttention("the function returns nothing")
    op = defining_op(ret.operands[0])
    while op is not None and op.name in ("tensor.expand_shape", "tensor.collapse_shape"):
        op = defining_op(op.operands[0])
    if op is None or not is_linalg_op(op):
        raise NotAttention("the result is not computed by a linalg op")
    return op


def propagate_loop_dim(output: ir.Operation, query_dim: int) -> dict:
    """Loop dims running with `output`'s loop dim `query_dim`, per op, propagated to its
    producers through operand maps (top-down, so a shared input such as one iota read as
    both the query and the key index cannot tie unrelated dims together)."""
    found = {output: {query_dim}}
    pending = [output]
    while pending:
        op = pending.pop()
        ls = loop_structure(op)
        for value, amap in zip(op.operands, ls.maps):
            producer = defining_op(value)
            if producer is None or not is_linalg_op(producer) or producer.block != op.block:
                continue
            positions = [p for p, d in enumerate(dim_positions(amap)) if d in found[op]]
            if not positions:
                continue
            pls = loop_structure(producer)
            index = list(producer.results).index(value) if value in list(producer.results) else 0
            out_map = pls.output_map(index)
            dims = {d for p, d in enumerate(dim_positions(out_map)) if p in positions and d is not None}
            if dims - found.get(producer, set()):
                found.setdefault(producer, set()).update(dims)
                pending.append(producer)
    return found
