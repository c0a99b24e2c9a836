"""bound_causal_key_loops: causal tile skipping in the fused key loop of each query block.

Each target is a query block's scf.forall whose body holds one scf.for over key tiles
[j0, j0 + T). With a causal mask (every masked-in score has key j <= query i + delta; torch's
is_causal: delta = 0) and query rows [i0, i0 + query_tile), i0 = query_tile * iv (the forall
induction variable number `query_iv`; i0 = 0 when query_iv < 0, a single query block):

  bound:  every key j > i0 + query_tile - 1 + delta is masked for every row of the block, so
          the loop stops at  ub' = min(ub, max(0, i0 + query_tile + delta)):  those tiles are
          not computed (a remainder tile after the loop still runs; its masked keys
          contribute exp(-inf) = 0).
  split:  a tile is wholly allowed for every row when j0 + T - 1 <= i0 + delta. With `split`,
          a first copy of the loop runs [lb, s),
              s = min(ub', T ceil(max(0, i0 + delta - T + 2) / T)),
          with the mask removed from its body; the original loop continues from s with the
          first copy's results as its initial values. Removing the mask: in the body of the
          linalg.generic reading the one mask computed from indices only (iotas, comparisons),
          x + mask and select(c(mask), -inf, x) / select(c(mask), x, -inf) become x (c: the
          mask or an integer cast of it), and the mask input goes when nothing reads it.
          Exact: on those tiles the mask is 0 / true everywhere.

Preconditions (checked on every target first; a violation is a silenceable failure naming
the op): the target is an scf.forall whose body holds exactly one scf.for, with `query_iv`
one of its induction variables, every result slice inserted at an offset computed from it
starting at query_tile * iv (so the block's rows are those the bound assumes), and (with
`split`) a constant step. The targets and the
loops stay in place: the target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .analysis.attention import is_index_computation, is_neg_inf
from .analysis.structure import loop_structure
from .common import (Illegal, RewritesTargets, Success, build_generic, clone_body, defining_op,
                     erase_dead_body_ops, fail, iterator_kinds, payload_ops)
from .dialect import TransformExt

NAME = "transform_ext.bound_causal_key_loops"


def _index(v: int) -> ir.Value:
    idx = ir.IndexType.get()
    return arith.ConstantOp(idx, ir.IntegerAttr.get(idx, v)).result


def key_loop(forall: ir.Operation, query_iv: int, query_tile: int, split: bool) -> ir.Operation:
    """The one key loop of a query block (raises Illegal when the preconditions fail)."""
    if forall.name != "scf.forall":
        raise Illegal(forall, "not an scf.forall (a query block)")
    body = forall.regions[0].blocks[0]
    loops = [o.operation for o in body.operations if o.operation.name == "scf.for"]
    if len(loops) != 1:
        raise Illegal(forall, f"the query block holds {len(loops)} key loops, not one")
    if query_iv >= 0 and query_iv >= len(body.arguments):
        raise Illegal(forall, f"has no induction variable {query_iv}")
    if query_iv >= 0:
        _check_query_rows(forall, body.arguments[query_iv], query_iv, query_tile)
    step = defining_op(loops[0].operands[2])
    if split and (step is None or step.name != "arith.constant"):
        raise Illegal(loops[0], "the key loop's step is not a constant")
    return loops[0]


def _iv_multiple(value: ir.Value, iv: ir.Value) -> int | None:
    """k when `value` is iv * k (iv itself, arith.muli by a constant, or affine.apply of
    (d0) -> (d0 * k)), else None."""
    if value == iv:
        return 1
    op = defining_op(value)
    if op is None:
        return None
    if op.name == "arith.muli":
        a, b = op.operands
        other = b if a == iv else a if b == iv else None
        const = defining_op(other) if other is not None else None
        if const is not None and const.name == "arith.constant":
            return ir.IntegerAttr(const.attributes["value"]).value
    if op.name == "affine.apply" and list(op.operands) == [iv]:
        amap = ir.AffineMapAttr(op.attributes["map"]).value
        if amap.n_dims == 1 and len(amap.results) == 1:
            for k in (str(amap.results[0]).replace(" ", ""),):
                if k == "d0":
                    return 1
                if k.startswith("d0*") and k[3:].isdigit():
                    return int(k[3:])
    return None


def _check_query_rows(forall: ir.Operation, iv: ir.Value, query_iv: int, query_tile: int) -> None:
    """The block's rows are [iv * query_tile, ...): every result slice the forall inserts at
    an offset computed from `iv` starts at iv * query_tile (an edited tile size without the
    matching query_tile would bound the loop at the wrong rows)."""
    body = forall.regions[0].blocks[0]
    terminator = body.operations[len(body.operations) - 1].operation
    multiples = []
    for insert in terminator.regions[0].blocks[0].operations:
        if insert.operation.name != "tensor.parallel_insert_slice":
            continue
        for offset in insert.opview.offsets:
            k = _iv_multiple(offset, iv)
            reads_iv = k is not None or iv in list(getattr(defining_op(offset), "operands", []))
            if reads_iv:
                multiples.append(k)
    if not multiples or any(k != query_tile for k in multiples):
        found = ", ".join("?" if k is None else str(k) for k in multiples) or "none"
        raise Illegal(forall, f"induction variable {query_iv} does not index blocks of "
                              f"{query_tile} query rows (its result offsets step by {found})")


def bound(forall: ir.Operation, loop: ir.Operation, delta: int, query_tile: int,
          query_iv: int, split: bool, rewriter) -> None:
    body = forall.regions[0].blocks[0]
    with ir.InsertionPoint(loop), loop.location:
        i0 = _index(0) if query_iv < 0 else arith.muli(body.arguments[query_iv], _index(query_tile))
        upper = arith.maxsi(arith.addi(i0, _index(query_tile + delta)), _index(0))
        loop.operands[1] = arith.minsi(upper, loop.operands[1])
        if split:
            _split_unmasked_tiles(loop, i0, delta, rewriter)


def _split_unmasked_tiles(loop: ir.Operation, i0: ir.Value, delta: int, rewriter) -> None:
    """The first copy of the key loop over the wholly allowed tiles, without the mask (see
    the module docstring); built at the current insertion point."""
    ub, step = loop.operands[1], loop.operands[2]
    tile = ir.IntegerAttr(defining_op(step).attributes["value"]).value
    # tiles j0 < i0 + delta - T + 2 are unmasked; the masked loop starts at the next multiple
    split = arith.maxsi(arith.addi(i0, _index(delta - tile + 2)), _index(0))
    split = arith.muli(arith.ceildivsi(split, step), step)
    split = arith.minsi(split, ub)
    unmasked = loop.clone()
    unmasked.operands[1] = split
    for k in range(len(loop.results)):
        loop.operands[3 + k] = unmasked.results[k]
    loop.operands[0] = split
    _drop_mask(unmasked, rewriter)


def _drop_mask(loop: ir.Operation, rewriter) -> None:
    body = loop.regions[0].blocks[0]
    for op in list(body.operations):
        op = op.operation
        if op.name != "linalg.generic" or len(op.results) != 1:
            continue
        n_in = loop_structure(op).num_inputs
        masks = [i for i in range(n_in) if defining_op(op.operands[i]) is not None
                 and is_index_computation(defining_op(op.operands[i]))]
        if len(masks) != 1:
            continue
        inner = op.regions[0].blocks[0]
        mask = inner.arguments[masks[0]]
        for inner_op in list(inner.operations):
            inner_op = inner_op.operation
            unmasked = _unmasked_operand(inner_op, mask)
            if unmasked is not None:
                rewriter.replace_op(inner_op, [unmasked])
        erase_dead_body_ops(inner)
        if not list(mask.uses):
            _drop_input(op, masks[0], rewriter)


def _drop_input(op: ir.Operation, index: int, rewriter) -> None:
    """Rebuild linalg.generic `op` without input `index`, which its body does not read."""
    ls = loop_structure(op)
    operands = list(op.operands)
    keep = [i for i in range(len(operands)) if i != index]
    old_args = list(op.regions[0].blocks[0].arguments)
    with ir.InsertionPoint(op), op.location:
        new = build_generic(operands[:index] + operands[index + 1:ls.num_inputs],
                            operands[ls.num_inputs:], [ls.maps[i] for i in keep],
                            iterator_kinds(op), lambda args: clone_body(
                                op, {old_args[i]: a for i, a in zip(keep, args)}), name_from=op)
    rewriter.replace_op(op, list(new.results))


def _unmasked_operand(op: ir.Operation, mask: ir.Value):
    """x for op = x + mask or op = select(c(mask), -inf, x) / select(c(mask), x, -inf) with
    c(mask) the mask itself or a cast of it; None otherwise."""
    if op.name == "arith.addf" and mask in list(op.operands):
        others = [v for v in op.operands if v != mask]
        return others[0] if len(others) == 1 else None
    if op.name != "arith.select":
        return None
    cond, on_true, on_false = op.operands
    while cond != mask:
        p = defining_op(cond)
        if p is None or p.name not in ("arith.trunci", "arith.extui") or p.block != op.block:
            return None
        cond = p.operands[0]
    if is_neg_inf(on_true):
        return on_false
    if is_neg_inf(on_false):
        return on_true
    return None


class BoundCausalKeyLoopsOp(TransformExt.Operation, name="bound_causal_key_loops"):
    target: ext.Operand[transform.AnyOpType]
    delta: ir.IntegerAttr
    query_tile: ir.IntegerAttr
    query_iv: ir.IntegerAttr
    split: ir.IntegerAttr  # i1

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                delta = ir.IntegerAttr(op.delta).value
                query_tile = ir.IntegerAttr(op.query_tile).value
                query_iv = ir.IntegerAttr(op.query_iv).value
                split = bool(ir.IntegerAttr(op.split).value)
                targets = payload_ops(state, op.target)
                try:
                    loops = [key_loop(t, query_iv, query_tile, split) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for forall, loop in zip(targets, loops):
                    bound(forall, loop, delta, query_tile, query_iv, split, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def bound_causal_key_loops(query_blocks: ir.Value, *, delta: int, query_tile: int,
                           query_iv: int | None, split: bool) -> None:
    """Skip the key tiles above the causal diagonal key <= query + `delta` in each query
    block (and with `split` run those below it without the mask); see the module docstring.
    `query_iv`: the forall induction variable of the query blocks, None for one block."""
    if query_tile < 1:
        raise ValueError(f"query_tile must be >= 1, got {query_tile}")
    i64 = ir.IntegerType.get_signless(64)
    BoundCausalKeyLoopsOp(query_blocks, ir.IntegerAttr.get(i64, delta),
                          ir.IntegerAttr.get(i64, query_tile),
                          ir.IntegerAttr.get(i64, -1 if query_iv is None else query_iv),
                          ir.IntegerAttr.get(ir.IntegerType.get_signless(1), int(split)))


__all__ = ["BoundCausalKeyLoopsOp", "bound_causal_key_loops"]
