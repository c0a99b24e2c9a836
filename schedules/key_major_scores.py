"""Attention scores stored keys-major, for register tiles with lanes along the queries.

With S = Q K^T stored [..., queries, keys], a vector register tile of S holds keys in its
lanes: the row max and the row sum over the keys are then reductions across lanes (shuffle
trees per row), and K has to be transposed into K^T rows. Stored [..., keys, queries]:

    S^T[j, i] = sum_d K[j, d] Q^T[d, i]

the lanes run along the queries, K is read as broadcast scalars in its own layout, Q^T is one
small transpose per query block, and max_j / sum_j become elementwise max / add of rows. The
values are the same (only their layout changes), so every consumer reads them with its
indexing map permuted and computes exactly what it did.

`store_scores_keys_major(S)` relays out S and every elementwise value computed from it of its
shape (masked scores, E = exp(S - m)), and reads Q transposed; `fold_key_transpose(S)` then
reads K in place of K^T when K^T is `transpose(K)`, possibly scaled by a constant c, and
moves c and a constant scale of S itself (a hand-written `q @ k^T / sqrt(d)`) to Q^T (exact
when the product of the scales is a power of two, as for head dims 4^n).
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, linalg, tensor

from transform_ext.analysis.structure import dim_positions, is_linalg_op, loop_structure
from transform_ext.common import defining_op


class CannotRelayout(Exception):
    """The payload does not have the shape this rewrite needs; nothing was changed."""


def _swap_last_two(amap: ir.AffineMap) -> ir.AffineMap:
    results = list(amap.results)
    results[-2], results[-1] = results[-1], results[-2]
    return ir.AffineMap.get(amap.n_dims, amap.n_symbols, results)


def _set_map(op: ir.Operation, index: int, amap: ir.AffineMap) -> None:
    maps = [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]
    maps[index] = amap
    op.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])


def _transposed_type(t: ir.RankedTensorType) -> ir.RankedTensorType:
    shape = list(t.shape)
    shape[-2], shape[-1] = shape[-1], shape[-2]
    return ir.RankedTensorType.get(shape, t.element_type, t.encoding)


def _fresh_init(init: ir.Value, before: ir.Operation) -> ir.Value | None:
    """A transposed-shape copy of an init that holds no data (tensor.empty) or a constant
    (linalg.fill of one); None for anything else."""
    producer = defining_op(init)
    if producer is None:
        return None
    shape = list(_transposed_type(init.type).shape)
    etype = init.type.element_type
    with ir.InsertionPoint(before), before.location:
        if producer.name == "tensor.empty":
            return tensor.EmptyOp(shape, etype).result
        if producer.name == "linalg.fill" and defining_op(producer.operands[1]) is not None \
                and defining_op(producer.operands[1]).name == "tensor.empty":
            empty = tensor.EmptyOp(shape, etype).result
            return linalg.fill(producer.operands[0], outs=[empty])
    return None


def _holds_no_data(init: ir.Value) -> bool:
    producer = defining_op(init)
    if producer is None:
        return False
    if producer.name == "tensor.empty":
        return True
    return producer.name == "linalg.fill" and defining_op(producer.operands[1]) is not None \
        and defining_op(producer.operands[1]).name == "tensor.empty"


def _is_generic(op) -> bool:
    return op is not None and op.name == "linalg.generic"


def _uses(value: ir.Value) -> list[tuple[ir.Operation, int]]:
    return [(u.owner, u.operand_number) for u in value.uses]


def _scores_like(scores: ir.Operation) -> list[ir.Operation]:
    """S and the elementwise generics computing values of S's shape and layout from it."""
    found = [scores]
    shape = list(scores.results[0].type.shape)
    work = [scores]
    while work:
        op = work.pop()
        for user, index in _uses(op.results[0]):
            if not _is_generic(user) or not is_linalg_op(user):
                raise CannotRelayout(f"{user.name} reads the scores")
            ls = loop_structure(user)
            if index >= ls.num_inputs:
                raise CannotRelayout("the scores are an accumulator")
            if any(user == f for f in found):
                continue
            if ls.is_elementwise and len(user.results) == 1 and \
                    list(user.results[0].type.shape) == shape and \
                    ls.output_map(0) == ls.maps[index]:
                found.append(user)
                work.append(user)
    return found


def store_scores_keys_major(scores: ir.Operation) -> None:
    """See the module docstring. Preconditions (checked before anything changes): S is a
    linalg.generic contraction whose output map ends (queries, keys), every reader of an S-like
    value is a linalg.generic reading it as an input, S-like results are computed into
    tensor.empty / fills of one, and Q's map ends (queries, d)."""
    if not _is_generic(scores) or not loop_structure(scores).is_contraction:
        raise CannotRelayout("S is not a linalg.generic contraction")
    ls = loop_structure(scores)
    dims = ls.contraction_dims()
    out = dim_positions(ls.output_map(0))
    if len(out) < 2 or len(dims["m"]) != 1 or len(dims["n"]) != 1 or len(dims["k"]) != 1 \
            or out[-2:] != [dims["m"][0], dims["n"][0]]:
        raise CannotRelayout("S is not [..., queries, keys]")
    query, depth = dims["m"][0], dims["k"][0]
    q_index = next((i for i in range(ls.num_inputs)
                    if dim_positions(ls.maps[i])[-2:] == [query, depth]), None)
    if q_index is None:
        raise CannotRelayout("Q is not read as [..., queries, d]")
    values = _scores_like(scores)
    for op in values:
        ols = loop_structure(op)
        if not _holds_no_data(op.operands[ols.num_inputs]):
            raise CannotRelayout(f"{op.name} computes scores into a tensor with data")
        for user, index in _uses(op.results[0]):
            if not _is_generic(user):
                raise CannotRelayout(f"{user.name} reads the scores")

    for op in values:
        ols = loop_structure(op)
        init = _fresh_init(op.operands[ols.num_inputs], op)
        readers = _uses(op.results[0])
        op.operands[ols.num_inputs] = init
        _set_map(op, ols.num_inputs, _swap_last_two(ols.output_map(0)))
        op.results[0].set_type(_transposed_type(op.results[0].type))
        for user, index in readers:
            _set_map(user, index, _swap_last_two(loop_structure(user).maps[index]))
    _read_transposed(scores, q_index)


def _read_transposed(op: ir.Operation, index: int) -> None:
    """Operand `index` of `op` is read as its transpose (last two dims swapped), materialized
    once: by its producer when that is a single-use elementwise generic into an empty tensor
    (it writes the transposed layout directly), else by a linalg.transpose."""
    value = op.operands[index]
    producer = defining_op(value)
    if _is_generic(producer) and len(list(value.uses)) == 1 and \
            loop_structure(producer).is_elementwise and len(producer.results) == 1 and \
            _holds_no_data(producer.operands[loop_structure(producer).num_inputs]):
        pls = loop_structure(producer)
        producer.operands[pls.num_inputs] = _fresh_init(producer.operands[pls.num_inputs], producer)
        _set_map(producer, pls.num_inputs, _swap_last_two(pls.output_map(0)))
        producer.results[0].set_type(_transposed_type(value.type))
    else:
        rank = value.type.rank
        with ir.InsertionPoint(op), op.location:
            empty = tensor.EmptyOp(list(_transposed_type(value.type).shape),
                                   value.type.element_type).result
            perm = list(range(rank - 2)) + [rank - 1, rank - 2]
            op.operands[index] = linalg.transpose(value, outs=[empty], permutation=perm).results[0]
    _set_map(op, index, _swap_last_two(loop_structure(op).maps[index]))


def _scale_constant(op) -> tuple[ir.Operation, int, str] | None:
    """For an elementwise generic whose body is `in * c`, `c * in` or `in / c` with c a
    float constant of the argument's type: (the mulf/divf, the operand position of c,
    "mul" or "div"); None otherwise."""
    if not _is_generic(op) or len(op.results) != 1 or not loop_structure(op).is_elementwise \
            or loop_structure(op).num_inputs != 1:
        return None
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    if len(ops) != 2 or ops[0].name not in ("arith.mulf", "arith.divf") or \
            ops[1].operands[0] != ops[0].results[0]:
        return None
    scale = ops[0]
    positions = (0, 1) if scale.name == "arith.mulf" else (1,)
    for pos in positions:
        c = defining_op(scale.operands[pos])
        if c is not None and c.name == "arith.constant" and \
                scale.operands[1 - pos] == body.arguments[0]:
            return scale, pos, "mul" if scale.name == "arith.mulf" else "div"
    return None


def _factor_of(found) -> float:
    """The multiplier a _scale_constant applies: c, or 1 / c for a division."""
    scale, pos, kind = found
    c = ir.FloatAttr(defining_op(scale.operands[pos]).attributes["value"]).value
    return c if kind == "mul" else 1.0 / c


def _key_source(value: ir.Value):
    """(K, reassociation groups or None, the scale of K^T) when `value` is
    [c *] [collapse_shape] transpose(K) with the last two dims swapped; None otherwise."""
    factor = 1.0
    scale = defining_op(value)
    found = _scale_constant(scale) if scale is not None else None
    if found is not None:
        factor = _factor_of(found)
        value = scale.operands[0]
    groups = None
    reshape = defining_op(value)
    if reshape is not None and reshape.name == "tensor.collapse_shape":
        groups = [[ir.IntegerAttr(i).value for i in g] for g in reshape.attributes["reassociation"]]
        value = reshape.operands[0]
        if groups[-2:] != [[value.type.rank - 2], [value.type.rank - 1]]:
            return None
    transpose = defining_op(value)
    if transpose is None or transpose.name != "linalg.transpose":
        return None
    perm = list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"]))
    rank = len(perm)
    if perm != list(range(rank - 2)) + [rank - 1, rank - 2]:
        return None
    return transpose.operands[0], groups, factor


def fold_key_transpose(scores: ir.Operation) -> bool:
    """S^T = K Q^T reading K^T = c_k transpose(K) (through a collapse_shape; c_k a constant
    or absent) reads K itself, its map's last two dims swapped; c_k and a constant scale of
    the scores themselves (c_s S or S / c_s, when that is S's only reader, which then goes)
    move to Q^T: Q^T becomes (c_k c_s) Q^T, by Q^T's own scale constant when it has an f32
    one, else by a multiply after it (in f32). Exact up to the rounding of the products
    (exact when the scales are powers of two). Returns whether it applied."""
    ls = loop_structure(scores)
    dims = ls.contraction_dims()
    key, depth = dims["n"][0], dims["k"][0]
    k_index = next((i for i in range(ls.num_inputs)
                    if dim_positions(ls.maps[i])[-2:] == [depth, key]), None)
    q_index = next((i for i in range(ls.num_inputs) if i != k_index), None)
    if k_index is None or q_index is None or len(list(scores.operands[k_index].uses)) != 1:
        return False
    source = _key_source(scores.operands[k_index])
    if source is None:
        return False
    k, groups, factor = source
    score_scale = None
    readers = _uses(scores.results[0])
    if len(readers) == 1:
        reader = readers[0][0]
        found = _scale_constant(reader)
        if found is not None and loop_structure(reader).maps[0] == \
                loop_structure(reader).output_map(0) and reader.results[0].type == scores.results[0].type:
            score_scale = reader
            factor *= _factor_of(found)
    with ir.InsertionPoint(scores), scores.location:
        if groups is not None:
            from transform_ext.common import reassociation_attr

            shape = list(_transposed_type(scores.operands[k_index].type).shape)
            k = tensor.CollapseShapeOp(ir.RankedTensorType.get(shape, k.type.element_type), k,
                                       reassociation_attr(groups)).result
    scores.operands[k_index] = k
    _set_map(scores, k_index, _swap_last_two(ls.maps[k_index]))
    if score_scale is not None:
        score_scale.results[0].replace_all_uses_with(scores.results[0])
        score_scale.erase()
    if factor != 1.0:
        _scale_operand(scores, q_index, factor)
    return True


def _scale_operand(op: ir.Operation, index: int, factor: float) -> None:
    """Operand `index` of `op` (read by `op` only) multiplied by `factor`: in its producer's
    f32 scale constant when it has one, else by an elementwise generic computing
    x * factor in f32 (rounded back to x's type)."""
    value = op.operands[index]
    producer = defining_op(value)
    found = _scale_constant(producer) if producer is not None else None
    f32 = ir.F32Type.get()
    if found is not None and found[0].results[0].type == f32:
        scale, pos, kind = found
        new = _factor_of(found) * factor
        with ir.InsertionPoint(scale), scale.location:
            scale.operands[pos] = arith.ConstantOp(f32, ir.FloatAttr.get(
                f32, new if kind == "mul" else 1.0 / new)).result
        return
    from transform_ext.common import build_generic

    t = value.type
    etype = t.element_type
    identity = ir.AffineMap.get_identity(t.rank)

    def body(args):
        x = args[0] if etype == f32 else arith.extf(f32, args[0])
        y = arith.mulf(x, arith.ConstantOp(f32, ir.FloatAttr.get(f32, factor)).result)
        return [y if etype == f32 else arith.truncf(etype, y)]

    with ir.InsertionPoint(op), op.location:
        empty = tensor.EmptyOp(list(t.shape), etype).result
        scaled = build_generic([value], [empty], [identity, identity], ["parallel"] * t.rank, body)
    op.operands[index] = scaled.results[0]
