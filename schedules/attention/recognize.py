"""Recognizing a softmax attention in a payload and reading its causal mask.

`recognize` is the cheap test the family registry runs on an import; `find_attention` the
ops of the attention in a normalized payload (transform_ext/analysis/attention.py);
`causal_offset` reads, from the index computation that masks the scores, the delta with
every masked-in score at key <= query + delta (a causal mask; torch's is_causal: 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_mlir import ir

from transform_ext.analysis.attention import (AttentionOps, NotAttention, attention_in,
                                             elementwise_attention_in,
                                             elementwise_attention_pairs, is_index_computation,
                                             is_neg_inf, propagate_loop_dim)
from transform_ext.analysis.structure import dim_positions, is_linalg_op, loop_structure
from transform_ext.common import block_ops, defining_op, iterator_kinds, user_op, walk_ops

from ..generic import func_ops, single_func


def attention_func(payload: ir.Module) -> ir.Operation:
    return single_func(payload, NotAttention)


def find_attention(payload: ir.Module) -> AttentionOps:
    """The ops of the attention in a normalized payload (or NotAttention saying why not)."""
    return attention_in(attention_func(payload))


def recognize(payload: ir.Module) -> bool:
    """Cheap test: a max, an exp and two contractions (named matmuls, or linalg.generics
    whose innermost loop is a reduction: two contractions and the softmax's max), or an exp
    and five named matmuls (a backward given its lse: S, dP, dV, dQ, dK), or no exp and
    one attention without a softmax."""
    names = [op.name for op in walk_ops(payload.operation, lambda op: True)]
    matmuls = sum(n.startswith(("linalg.batch_matmul", "linalg.matmul")) for n in names)
    inner_reductions = len(walk_ops(payload.operation, lambda op: op.name == "linalg.generic"
                                    and iterator_kinds(op)[-1:] == ["reduction"]))
    return "math.exp" in names and (matmuls >= 5 or "arith.maximumf" in names and (
        matmuls >= 2 or inner_reductions >= 3)) or _has_elementwise_attention(payload)


def _has_elementwise_attention(payload: ir.Module) -> bool:
    """An attention without a softmax (elementwise_attention_in: f(Q K^T) V, e.g. ReLU
    attention), its contractions still between reshapes."""
    if "math.exp" in [op.name for op in walk_ops(payload.operation, lambda op: True)]:
        return False
    for func in func_ops(payload):
        ops = [op for op in block_ops(func) if is_linalg_op(op)]
        if len(elementwise_attention_pairs(ops, through_reshapes=True)) == 1:
            return True
    return False


def softmax_over_one_key(payload: ir.Module) -> bool:
    """Is there a max reduction over a dim of extent 1 (it folds away with the unit dim)?"""
    found = []

    def visit(op):
        if op.name == "linalg.generic" and any(o.operation.name == "arith.maximumf"
                                               for o in op.regions[0].blocks[0].operations):
            ls = loop_structure(op)
            if ls.reduction_dims and all(ls.ranges[d] == 1 for d in ls.reduction_dims):
                found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return bool(found)


def _is_cast(op: ir.Operation) -> bool:
    """An elementwise generic with identity maps yielding extf or truncf of its one input."""
    ls = loop_structure(op)
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    return ls.is_elementwise and ls.num_inputs == 1 and len(ops) == 2 and \
        ops[0].name in ("arith.extf", "arith.truncf") and ops[0].operands[0] == body.arguments[0] \
        and all(m == ls.maps[0] for m in ls.maps) and ls.maps[0].is_permutation


def index_masks(ops: AttentionOps) -> int:
    """The number of ops between the scores and the row max (without a softmax: P V)
    reading a mask computed from loop indices (a causal mask, a sliding window, ...)."""
    start = [ops.row_max.operands[0]] if ops.row_max is not None else \
        list(ops.values.operands)[:loop_structure(ops.values).num_inputs]
    count, seen, pending = 0, [], [defining_op(v) for v in start]
    while pending:
        op = pending.pop()
        if op is None or op is ops.scores or not is_linalg_op(op) or op in seen:
            continue
        seen.append(op)
        ls = loop_structure(op)
        if ls.reduction_dims:
            continue
        producers = [defining_op(v) for v in list(op.operands)[:ls.num_inputs]]
        if any(p is not None and is_index_computation(p) for p in producers):
            count += 1
        pending.extend(p for p in producers if p is not None and not is_index_computation(p))
    return count


@dataclass(frozen=True)
class _Lin:
    """a linear form sum_d coef[d] * loop_d + const over a generic's loop dims."""

    coef: tuple = ()
    const: int = 0

    def add(self, other: "_Lin", sign: int = 1) -> "_Lin":
        coef = dict(self.coef)
        for d, c in other.coef:
            coef[d] = coef.get(d, 0) + sign * c
        return _Lin(tuple(sorted((d, c) for d, c in coef.items() if c)), self.const + sign * other.const)

    def scale(self, k: int) -> "_Lin":
        return _Lin(tuple((d, c * k) for d, c in self.coef if c * k), self.const * k)


class _NotLinear(Exception):
    pass


_CMP = {"sle": "le", "slt": "lt", "sge": "ge", "sgt": "gt", "ule": "le", "ult": "lt",
        "uge": "ge", "ugt": "gt"}


def _form(value, op: ir.Operation):
    """The symbolic value of a scalar in `op`'s body: _Lin, ("pred", kind, _Lin) meaning
    lin <kind> 0, ("mask", pred) for select(pred, 0, -inf), ("bool", True), or a float."""
    if isinstance(value, ir.BlockArgument) and value.owner.owner == op:
        return _operand_form(op, value.arg_number)
    p = defining_op(value)
    if p is None:
        raise _NotLinear("value from outside the body")
    name = p.name
    if name == "linalg.index":
        return _Lin(((ir.IntegerAttr(p.attributes["dim"]).value, 1),), 0)
    if name == "arith.constant":
        attr = p.attributes["value"]
        if isinstance(attr, ir.IntegerAttr):
            return ("bool", bool(attr.value)) if str(attr.type) == "i1" else _Lin((), attr.value)
        if isinstance(attr, ir.FloatAttr):
            return attr.value
        raise _NotLinear(str(attr))
    args = [_form(v, op) for v in p.operands]
    if name in ("arith.index_cast", "arith.extsi", "arith.extui", "arith.trunci", "arith.index_castui"):
        return args[0]
    if name in ("arith.addi", "arith.subi") and all(isinstance(a, _Lin) for a in args):
        return args[0].add(args[1], 1 if name == "arith.addi" else -1)
    if name == "arith.muli" and all(isinstance(a, _Lin) for a in args):
        a, b = args
        if not a.coef:
            return b.scale(a.const)
        if not b.coef:
            return a.scale(b.const)
    if name == "arith.cmpi" and all(isinstance(a, _Lin) for a in args):
        pred_name = {2: "slt", 3: "sle", 4: "sgt", 5: "sge", 6: "ult", 7: "ule", 8: "ugt", 9: "uge"}.get(
            ir.IntegerAttr(p.attributes["predicate"]).value)
        kind = _CMP.get(pred_name)
        if kind is None:
            raise _NotLinear("cmpi predicate")
        return ("pred", kind, args[0].add(args[1], -1))
    if name == "arith.andi" and len(args) == 2:
        a, b = args
        if a == ("bool", True):
            return b
        if b == ("bool", True):
            return a
    if name == "arith.select":
        c, x, y = args
        if isinstance(c, tuple) and c[0] == "pred" and x == 0.0 and y == float("-inf"):
            return ("mask", c)
    raise _NotLinear(name)


def _operand_form(op: ir.Operation, index: int):
    """The form of `op`'s operand `index`, in `op`'s loop dims."""
    value = op.operands[index]
    producer = defining_op(value)
    amap = loop_structure(op).maps[index]
    if producer is None or not is_linalg_op(producer) or not loop_structure(producer).is_elementwise:
        raise _NotLinear("not computed from indices")
    body = producer.regions[0].blocks[0]
    inner = _form(body.operations[len(body.operations) - 1].operands[0], producer)
    # producer loop dim p is the consumer's loop dim at position p of the operand map
    out_positions = dim_positions(loop_structure(producer).output_map(0))
    outer = dim_positions(amap)
    rename = {pd: outer[pos] for pos, pd in enumerate(out_positions)}

    def relabel(lin: _Lin) -> _Lin:
        if any(rename.get(d) is None for d, _ in lin.coef):
            raise _NotLinear("composite map")
        return _Lin(tuple(sorted((rename[d], c) for d, c in lin.coef)), lin.const)

    if isinstance(inner, _Lin):
        return relabel(inner)
    if isinstance(inner, tuple) and inner[0] == "pred":
        return ("pred", inner[1], relabel(inner[2]))
    if isinstance(inner, tuple) and inner[0] == "mask":
        return ("mask", ("pred", inner[1][1], relabel(inner[1][2])))
    return inner


def causal_offset(payload: ir.Module, ops: AttentionOps) -> int | None:
    """delta such that every masked-in score has key <= query + delta (a causal mask, with
    torch's is_causal delta = 0), read from the index computation that masks the scores
    (added, S + M with M = select(pred, 0, -inf), or selected, select(pred, -inf, S));
    None when the scores carry no such mask. `ops.row_max` reads the masked scores row by
    row: their max over the keys, or (an attention backward given its lse) S - lse."""
    row_max = ops.row_max
    rls = loop_structure(row_max)
    if rls.reduction_dims:
        scores_index, key_dim = 0, rls.reduction_dims[0]
        m_dims = dim_positions(rls.output_map(0))
    else:  # S - lse: the scores read in full, lse along all but the key dim
        n = rls.num_loops
        scores_index = next((i for i in range(rls.num_inputs)
                             if rls.maps[i] == ir.AffineMap.get_identity(n)), None)
        if scores_index is None or rls.num_inputs != 2:
            return None
        key_dim = n - 1
        m_dims = [d for d in dim_positions(rls.maps[1 - scores_index]) if d is not None]
    producer = defining_op(row_max.operands[scores_index])
    while producer is not None and (producer.name in ("tensor.expand_shape", "tensor.collapse_shape")
                                    or producer.name == "linalg.generic" and _is_cast(producer)):
        # a bf16 softmax reads ext(masked S); grouped-query attention's heads are regrouped
        producer = defining_op(producer.operands[0])
    if producer is None or producer is ops.scores or not is_linalg_op(producer):
        return None
    ls = loop_structure(producer)
    if not ls.is_elementwise:
        return None
    allowed = _allowed_region(producer)
    if allowed is None:
        return None
    # in the scores (either layout) the key is the dim m reduces, the query the one m keeps last
    r_in = dim_positions(rls.maps[scores_index])
    if not m_dims or m_dims[-1] not in r_in:
        return None
    # positions from the end: a reshape between may merge or split the leading dims
    key_pos = r_in.index(key_dim) - len(r_in)
    query_pos = r_in.index(m_dims[-1]) - len(r_in)
    out = dim_positions(ls.output_map(0))
    if max(-key_pos, -query_pos) > len(out) or min(key_pos, query_pos) < -2:
        return None
    return _causal_delta(allowed, out[key_pos], out[query_pos])


def _causal_delta(allowed, key_loop: int, query_loop: int) -> int | None:
    """delta when the region ("pred", kind, lin) an op keeps is key <= query + delta in
    its loops `key_loop` and `query_loop`, else None."""
    _, kind, lin = allowed
    coef = dict(lin.coef)
    if set(coef) - {key_loop, query_loop}:
        return None
    a, b, c = coef.get(query_loop, 0), coef.get(key_loop, 0), lin.const
    # allowed iff a*i + b*j + c <kind> 0; accept the causal family j - i + c <= 0
    if kind in ("ge", "gt"):
        a, b, c = -a, -b, -c
        kind = "le" if kind == "ge" else "lt"
    if (a, b) != (-1, 1):
        return None
    return -c if kind == "le" else -c - 1


_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}


def _allowed_region(op: ir.Operation):
    """("pred", kind, lin) of the scores elementwise `op` keeps, when it masks the others
    to -inf by a predicate computed from loop indices: S + M (M = select(pred, 0, -inf))
    or select(pred, -inf, S) / select(pred, S, -inf). None otherwise."""
    body = op.regions[0].blocks[0]
    last = defining_op(body.operations[len(body.operations) - 1].operands[0])
    if last is None:
        return None
    if last.name == "arith.addf" and all(isinstance(v, ir.BlockArgument) for v in last.operands):
        for i in range(loop_structure(op).num_inputs):
            try:
                form = _operand_form(op, i)
            except _NotLinear:
                continue
            if isinstance(form, tuple) and form[0] == "mask":
                return form[1]
        return None
    if last.name == "arith.select":
        cond, on_true, on_false = last.operands
        try:
            pred = _form(cond, op)
        except _NotLinear:
            return None
        if not (isinstance(pred, tuple) and pred[0] == "pred"):
            return None
        if is_neg_inf(on_true) and isinstance(on_false, ir.BlockArgument):
            return ("pred", _NEGATED[pred[1]], pred[2])
        if is_neg_inf(on_false) and isinstance(on_true, ir.BlockArgument):
            return pred
    return None


def elementwise_causal_offset(ops: AttentionOps) -> int | None:
    """delta of the causal mask of an attention without a softmax (elementwise_attention_in:
    every masked-in score has key <= query + delta), when the map after the mask sends the
    masked scores (-inf) to exactly 0, so that the key tiles it masks add nothing to P V
    (ReLU, exp); None otherwise."""
    values = ops.values
    vls = loop_structure(values)
    along_keys = propagate_loop_dim(values, vls.reduction_dims[0])
    along_queries = propagate_loop_dim(values, dim_positions(vls.output_map(0))[-2])
    seen, pending = [], [defining_op(v) for v in list(values.operands)[:vls.num_inputs]]
    while pending:
        op = pending.pop()
        if op is None or op == ops.scores or op in seen or not is_linalg_op(op) \
                or loop_structure(op).is_contraction or op not in along_keys:
            continue
        seen.append(op)
        allowed = _allowed_region(op)
        keys, queries = along_keys.get(op, set()), along_queries.get(op, set())
        if allowed is not None and len(keys) == 1 and len(queries) == 1:
            delta = _causal_delta(allowed, next(iter(keys)), next(iter(queries)))
            masked = _map_of_masked(op, values)
            return delta if masked is not None and masked == 0.0 else None
        pending.extend(defining_op(v) for v in list(op.operands)[:loop_structure(op).num_inputs])
    return None


def _map_of_masked(mask: ir.Operation, values: ir.Operation) -> float | None:
    """The value P V reads where `mask` writes -inf: -inf carried through the chain of
    elementwise ops, each the one reader of the last, from `mask` to `values`; None when
    it cannot be told (another reader, an op or an operand this evaluator does not know)."""
    x, op = float("-inf"), mask
    while True:
        readers = [user_op(use) for use in op.results[0].uses]
        if len(op.results) != 1 or len(readers) != 1:
            return None
        reader = readers[0]
        if reader == values:
            return x
        ls = loop_structure(reader) if is_linalg_op(reader) else None
        if ls is None or not ls.is_elementwise or len(reader.results) != 1:
            return None
        index = [i for i, v in enumerate(list(reader.operands)[:ls.num_inputs])
                 if v == op.results[0]]
        if len(index) != 1:
            return None
        try:
            x = _evaluate(reader, index[0], x)
        except _NotLinear:
            return None
        op = reader


def _nan(a: float, b: float) -> bool:
    return a != a or b != b


_CMPF = {1: lambda a, b: a == b, 2: lambda a, b: a > b, 3: lambda a, b: a >= b,
         4: lambda a, b: a < b, 5: lambda a, b: a <= b, 6: lambda a, b: a != b and not _nan(a, b),
         7: lambda a, b: not _nan(a, b), 8: lambda a, b: _nan(a, b) or a == b,
         9: lambda a, b: _nan(a, b) or a > b, 10: lambda a, b: _nan(a, b) or a >= b,
         11: lambda a, b: _nan(a, b) or a < b, 12: lambda a, b: _nan(a, b) or a <= b,
         13: lambda a, b: _nan(a, b) or a != b, 14: _nan}
_FLOAT_OPS = {"arith.mulf": lambda a, b: a * b, "arith.addf": lambda a, b: a + b,
              "arith.subf": lambda a, b: a - b, "arith.maximumf": lambda a, b: max(a, b),
              "arith.minimumf": lambda a, b: min(a, b), "arith.negf": lambda a: -a,
              "arith.extf": lambda a: a, "arith.truncf": lambda a: a,
              "math.exp": lambda a: 0.0 if a == float("-inf") else math.exp(a),
              "arith.select": lambda c, a, b: a if c else b}


def _evaluate(op: ir.Operation, index: int, x: float) -> float:
    """The value `op`'s body yields when its input `index` holds x (its other inputs may
    not be read); _NotLinear when the body needs what it is not given."""
    body = op.regions[0].blocks[0]
    env = {body.arguments[index]: x}

    def value(v):
        if v in env:
            return env[v]
        p = defining_op(v)
        if p is not None and p.name == "arith.constant" \
                and isinstance(p.attributes["value"], ir.FloatAttr):
            return ir.FloatAttr(p.attributes["value"]).value
        raise _NotLinear("an operand that is not the masked scores or a constant")

    for o in body.operations:
        o = o.operation
        args = [value(v) for v in o.operands]
        if o.name == "linalg.yield":
            return args[0]
        if o.name == "arith.cmpf":
            compare = _CMPF.get(ir.IntegerAttr(o.attributes["predicate"]).value)
            if compare is None:
                raise _NotLinear("cmpf predicate")
            env[o.results[0]] = compare(*args)
        elif o.name in _FLOAT_OPS and len(o.results) == 1:
            env[o.results[0]] = _FLOAT_OPS[o.name](*args)
        else:
            raise _NotLinear(o.name)
    raise _NotLinear("no yield")
