"""store_scores_keys_major: the attention scores stored [..., keys, queries].

With S = Q K^T stored [..., queries, keys], a CPU vector register tile of S holds keys in its
lanes: the row max and the row sum over the keys are then reductions across lanes (shuffle
trees per row). Stored transposed,

    S^T[..., j, i] = sum_d K^T[..., d, j] Q^T[..., d, i]

the lanes run along the queries and max_j / sum_j become elementwise max / add of rows. The
values are the same (only their layout changes), so every consumer reads them with its
indexing map's last two results swapped and computes exactly what it did.

Rewritten, for each target S (a linalg.generic contraction): S and every elementwise
linalg.generic computing a value of S's shape and layout from it (masked scores,
E = exp(S - m)) write the transposed layout into a fresh tensor.empty (or a fill of one, the
same constant); their readers' maps are permuted; Q is read as Q^T, which its producer
writes directly when it is a single-use elementwise generic into an empty tensor, else a
linalg.transpose makes it.

Preconditions (checked on every target before anything changes; a violation is a
silenceable failure naming the op): S is a linalg.generic contraction with one query, one
key and one depth dim whose output map ends (queries, keys); Q's map ends (queries, d);
every reader of an S-like value is a linalg.generic reading it as an input; S-like values
are computed into tensor.empty or fills of one. In-place: the target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, tensor, transform

from .analysis.structure import dim_positions, is_linalg_op, loop_structure
from .common import Illegal, RewritesTargets, Success, defining_op, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.store_scores_keys_major"


def swap_last_two(amap: ir.AffineMap) -> ir.AffineMap:
    results = list(amap.results)
    results[-2], results[-1] = results[-1], results[-2]
    return ir.AffineMap.get(amap.n_dims, amap.n_symbols, results)


def set_map(op: ir.Operation, index: int, amap: ir.AffineMap) -> None:
    maps = [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]
    maps[index] = amap
    op.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])


def transposed_type(t: ir.RankedTensorType) -> ir.RankedTensorType:
    shape = list(t.shape)
    shape[-2], shape[-1] = shape[-1], shape[-2]
    return ir.RankedTensorType.get(shape, t.element_type, t.encoding)


def is_generic(op) -> bool:
    return op is not None and op.name == "linalg.generic"


def uses(value: ir.Value) -> list[tuple[ir.Operation, int]]:
    return [(u.owner, u.operand_number) for u in value.uses]


def _is_empty(op) -> bool:
    return op is not None and op.name == "tensor.empty"


def _holds_no_data(init: ir.Value) -> bool:
    """Is `init` a tensor.empty or a linalg.fill of one?"""
    producer = defining_op(init)
    if producer is None:
        return False
    return _is_empty(producer) or (producer.name == "linalg.fill"
                                   and _is_empty(defining_op(producer.operands[1])))


def _fresh_init(init: ir.Value, before: ir.Operation) -> ir.Value:
    """A transposed-shape copy of an init that holds no data (see _holds_no_data)."""
    producer = defining_op(init)
    shape = list(transposed_type(init.type).shape)
    etype = init.type.element_type
    with ir.InsertionPoint(before), before.location:
        if producer.name == "tensor.empty":
            return tensor.EmptyOp(shape, etype).result
        empty = tensor.EmptyOp(shape, etype).result
        return linalg.fill(producer.operands[0], outs=[empty])


def _scores_like(scores: ir.Operation) -> list[ir.Operation]:
    """S and the elementwise generics computing values of S's shape and layout from it."""
    found = [scores]
    shape = list(scores.results[0].type.shape)
    work = [scores]
    while work:
        op = work.pop()
        for user, index in uses(op.results[0]):
            if not is_generic(user) or not is_linalg_op(user):
                raise Illegal(scores, f"{user.name} reads the scores")
            ls = loop_structure(user)
            if index >= ls.num_inputs:
                raise Illegal(scores, "the scores are an accumulator")
            if any(user == f for f in found):
                continue
            if ls.is_elementwise and len(user.results) == 1 and \
                    list(user.results[0].type.shape) == shape and \
                    ls.output_map(0) == ls.maps[index]:
                found.append(user)
                work.append(user)
    return found


def plan(scores: ir.Operation) -> tuple[int, list[ir.Operation]]:
    """(Q's operand index, the S-like ops) of a target meeting the preconditions; raises
    Illegal otherwise."""
    if not is_generic(scores) or not loop_structure(scores).is_contraction:
        raise Illegal(scores, "not a linalg.generic contraction")
    ls = loop_structure(scores)
    dims = ls.contraction_dims()
    out = dim_positions(ls.output_map(0))
    if len(out) < 2 or len(dims["m"]) != 1 or len(dims["n"]) != 1 or len(dims["k"]) != 1 \
            or out[-2:] != [dims["m"][0], dims["n"][0]]:
        raise Illegal(scores, "the scores are not [..., queries, keys]")
    query, depth = dims["m"][0], dims["k"][0]
    q_index = next((i for i in range(ls.num_inputs)
                    if dim_positions(ls.maps[i])[-2:] == [query, depth]), None)
    if q_index is None:
        raise Illegal(scores, "Q is not read as [..., queries, d]")
    values = _scores_like(scores)
    for op in values:
        if not _holds_no_data(op.operands[loop_structure(op).num_inputs]):
            raise Illegal(op, "computes scores into a tensor with data")
        for user, _ in uses(op.results[0]):
            if not is_generic(user):
                raise Illegal(scores, f"{user.name} reads the scores")
    return q_index, values


def rewrite(scores: ir.Operation, q_index: int, values: list[ir.Operation]) -> None:
    for op in values:
        ols = loop_structure(op)
        init = _fresh_init(op.operands[ols.num_inputs], op)
        readers = uses(op.results[0])
        op.operands[ols.num_inputs] = init
        set_map(op, ols.num_inputs, swap_last_two(ols.output_map(0)))
        op.results[0].set_type(transposed_type(op.results[0].type))
        for user, index in readers:
            set_map(user, index, swap_last_two(loop_structure(user).maps[index]))
    _read_transposed(scores, q_index)


def _read_transposed(op: ir.Operation, index: int) -> None:
    """Operand `index` of `op` is read as its transpose (last two dims swapped), materialized
    once: by its producer when that is a single-use elementwise generic into an empty tensor
    (it writes the transposed layout directly), else by a linalg.transpose."""
    value = op.operands[index]
    producer = defining_op(value)
    if is_generic(producer) and len(list(value.uses)) == 1 and \
            loop_structure(producer).is_elementwise and len(producer.results) == 1 and \
            _holds_no_data(producer.operands[loop_structure(producer).num_inputs]):
        pls = loop_structure(producer)
        producer.operands[pls.num_inputs] = _fresh_init(producer.operands[pls.num_inputs], producer)
        set_map(producer, pls.num_inputs, swap_last_two(pls.output_map(0)))
        producer.results[0].set_type(transposed_type(value.type))
    else:
        rank = value.type.rank
        with ir.InsertionPoint(op), op.location:
            empty = tensor.EmptyOp(list(transposed_type(value.type).shape),
                                   value.type.element_type).result
            perm = list(range(rank - 2)) + [rank - 1, rank - 2]
            op.operands[index] = linalg.transpose(value, outs=[empty], permutation=perm).results[0]
    set_map(op, index, swap_last_two(loop_structure(op).maps[index]))


class StoreScoresKeysMajorOp(TransformExt.Operation, name="store_scores_keys_major"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    plans = [plan(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target, (q_index, values) in zip(targets, plans):
                    rewrite(target, q_index, values)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def store_scores_keys_major(scores: ir.Value) -> None:
    """Store each scores contraction of `scores`, and the values computed from it, as
    [..., keys, queries] (see the module docstring)."""
    StoreScoresKeysMajorOp(scores)


__all__ = ["StoreScoresKeysMajorOp", "store_scores_keys_major", "swap_last_two", "set_map",
           "transposed_type", "is_generic", "uses"]
