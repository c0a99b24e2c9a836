"""version_full_tiles: a tile with dynamic sizes runs on static shapes when it is full.

    y = op(x: tensor<?x?>, ...)   ->   y = scf.if (every dynamic size == its bound)
                                              { op(cast x: tensor<B0xB1>, ...) }
                                              else { op(x, ...) }

A tile of a loop whose last iteration is partial has sizes `affine.min(c, ...)` (the bound
c a constant of the min's map): every iteration but the last is full. Vectorized at its
nominal sizes, such a tile gets masked reads and writes in every iteration (AMD's
vmaskmovps stores are microcoded). The full version is the same op on tensor.casts of
its operands to the bounds (its results cast back): it vectorizes without masks; the
partial version is the original op, moved into the else branch.

The linalg ops of the target's block whose results only the target (or such an op) reads
- its producers fused into the same tile - are versioned with it, and so are the
tensor.insert_slice ops writing the target's results back (both branches then write the
same tensor in place; a slice yielded alone would be copied by bufferization).

Targets: linalg ops on tensors (linalg.pack and linalg.unpack: their dest is operand 1;
other linalg ops: their outs); anything else is a silenceable failure naming the op
(nothing rewritten). A target is left alone when nothing is dynamic or when a dynamic
operand dim has no bound: a bound is a size of the tensor.extract_slice producing the
operand, computed by an affine.min one of whose results is a constant (or, in turn, such
a min or a constant). The target handles stay valid (they map to the partial versions);
the result maps to the full versions.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, scf, tensor, transform

from .common import Illegal, RewritesTargets, Success, defining_op, fail, payload_ops
from .dialect import TransformExt

NAME = "version_full_tiles"
DYNAMIC = ir.ShapedType.get_dynamic_size()


def _bound(size: ir.Value, depth: int = 4) -> int | None:
    """An upper bound of `size`: a constant, or the least bound of the results of the
    affine.min computing it (a result's bound: its constant, or the bound of the operand
    a dim or symbol result names)."""
    producer = defining_op(size)
    if producer is None or depth == 0:
        return None
    if producer.name == "arith.constant":
        return ir.IntegerAttr(producer.attributes["value"]).value
    if producer.name != "affine.min":
        return None
    amap = ir.AffineMapAttr(producer.attributes["map"]).value
    bounds = []
    for e in amap.results:
        if isinstance(e, ir.AffineConstantExpr):
            bounds.append(e.value)
        elif isinstance(e, ir.AffineDimExpr):
            bounds.append(_bound(producer.operands[e.position], depth - 1))
        elif isinstance(e, ir.AffineSymbolExpr):
            bounds.append(_bound(producer.operands[amap.n_dims + e.position], depth - 1))
    bounds = [b for b in bounds if b is not None]
    return min(bounds) if bounds else None


def _dynamic_sizes(value: ir.Value) -> dict[int, ir.Value]:
    """The SSA size of each dynamic dim of `value`, from the extract_slice producing it
    (Unbounded if it has dynamic dims and is no such slice)."""
    t = value.type
    if all(d != DYNAMIC for d in t.shape):
        return {}
    producer = defining_op(value)
    if producer is None or producer.name != "tensor.extract_slice":
        raise Unbounded("a dynamic operand is not a tensor.extract_slice")
    view = producer.opview
    static = list(view.static_sizes)
    if len(static) != t.rank:
        raise Unbounded("a dynamic operand is a rank-reducing slice")
    dynamic = iter(view.sizes)
    return {dim: next(dynamic) for dim, s in enumerate(static) if s == DYNAMIC}


def _is_linalg(op: ir.Operation) -> bool:
    return op.name.startswith("linalg.") and op.name not in ("linalg.yield", "linalg.index")


def _inits(op: ir.Operation) -> list[int]:
    """Operand indices of the op's inits (the destination of each result)."""
    if op.name in ("linalg.pack", "linalg.unpack"):
        return [1]
    count = len(op.results)  # on tensors: one init per result (linalg.transpose has no `outputs`)
    tensors = [i for i, v in enumerate(op.operands) if isinstance(v.type, ir.RankedTensorType)]
    return tensors[-count:] if count else []


def _chain(op: ir.Operation) -> list[ir.Operation]:
    """`op` and the linalg ops of its block feeding it whose results only it (or another op
    of the chain) reads (a tile's producers fused into its loop: versioned together), in
    block order."""
    chain = [op]
    frontier = [op]
    while frontier:
        for value in frontier.pop().operands:
            producer = defining_op(value)
            if producer is None or producer.block != op.block or producer in chain \
                    or not _is_linalg(producer):
                continue
            if all(use.owner.operation in chain for r in producer.results for use in r.uses):
                chain.append(producer)
                frontier.append(producer)
    return sorted(chain, key=_position)


class Unbounded(Exception):
    """A dynamic operand size without a constant bound: the op is not versioned."""


def _check(chain: list[ir.Operation]) -> None:
    """Raise Illegal unless every op of the chain is a linalg op with one init per result."""
    for op in chain:
        if not _is_linalg(op):
            raise Illegal(op, "not a linalg op")
        if len(_inits(op)) != len(op.results) or not op.results:
            raise Illegal(op, "its results are not one per init")


def _plan(chain: list[ir.Operation]) -> dict:
    """For each op of the chain and each of its tensor operands with dynamic dims that no
    chain op produces: dim -> (its SSA size, its bound); Unbounded if a size has none."""
    plan = {}
    for op in chain:
        for index, value in enumerate(op.operands):
            producer = defining_op(value)
            if not isinstance(value.type, ir.RankedTensorType) \
                    or producer is not None and producer in chain:
                continue
            bounded = {}
            for dim, size in _dynamic_sizes(value).items():
                bound = _bound(size)
                if bound is None:
                    raise Unbounded(f"operand #{index} of {op.name}: dim {dim} has no constant bound")
                bounded[dim] = (size, bound)
            if bounded:
                plan[(op, index)] = bounded
    return plan


def _static_type(t: ir.RankedTensorType, bounds: dict[int, tuple[ir.Value, int]]) -> ir.RankedTensorType:
    shape = [bounds[d][1] if d in bounds else s for d, s in enumerate(t.shape)]
    return ir.RankedTensorType.get(shape, t.element_type, t.encoding)


def _position(op: ir.Operation) -> int:
    """The index of `op` in its block."""
    for i, other in enumerate(op.block.operations):
        if other == op:
            return i
    raise ValueError("op not in its block")


def _before(value: ir.Value, op: ir.Operation) -> bool:
    """Is `value` defined before `op` (an argument of an enclosing block or of op's block,
    or a result of an op earlier in op's block or outside it)?"""
    producer = defining_op(value)
    if producer is None or producer.block != op.block:
        return True
    return _position(producer) < _position(op)


def _inserts(op: ir.Operation) -> list[ir.Operation]:
    """The tensor.insert_slice ops in op's block writing a result of `op` into a tensor
    defined before it (versioned with it: both branches then yield that tensor, written in
    place; a slice yielded alone would be copied by bufferization)."""
    found = []
    for result in op.results:
        for use in result.uses:
            user = use.owner.operation
            if user.name == "tensor.insert_slice" and use.operand_number == 0 \
                    and user.block == op.block \
                    and all(_before(v, op) for v in list(user.operands)[1:]):
                found.append(user)
    return sorted(found, key=_position)


def _full(plan: dict) -> ir.Value:
    """i1: every planned size equals its bound."""
    full, seen = None, set()
    for bounds in plan.values():
        for size, bound in bounds.values():
            if (size, bound) in seen:
                continue
            seen.add((size, bound))
            c = arith.ConstantOp(ir.IndexType.get(), bound).result
            eq = arith.CmpIOp(arith.CmpIPredicate.eq, size, c).result
            full = eq if full is None else arith.AndIOp(full, eq).result
    return full


def version(op: ir.Operation) -> ir.Operation | None:
    """Build the scf.if of the module docstring before `op`, for `op` with its chain
    (`_chain`) and the insert_slice ops writing its results back; returns the full version
    of `op` (None: nothing dynamic)."""
    chain = _chain(op)
    try:
        plan = _plan(chain)
    except Unbounded:
        return None
    if not plan:
        return None
    inserts = _inserts(op)
    # what the scf.if yields: op's results read outside the versioned ops, then the inserts'
    carried = [r for r in op.results if any(use.owner.operation not in inserts for use in r.uses)] \
        + [i.result for i in inserts]
    with ir.InsertionPoint(op), op.location:
        branch = scf.IfOp(_full(plan), [v.type for v in carried], has_else=True)
    mapping = {}
    with ir.InsertionPoint(branch.then_block), op.location:
        for link in chain:
            operands = [mapping.get(v, v) for v in link.operands]
            for (owner, index), bounds in plan.items():
                if owner == link:
                    operands[index] = tensor.CastOp(_static_type(operands[index].type, bounds),
                                                    operands[index]).result
            clone = link.clone()
            for index, value in enumerate(operands):
                clone.operands[index] = value
            for result, cloned, init in zip(link.results, clone.results, _inits(link)):
                cloned.set_type(operands[init].type)
                mapping[result] = cloned
        full_op = clone
        for result in op.results:
            mapping[result] = tensor.CastOp(result.type, mapping[result]).result
        for insert in inserts:
            copy = insert.clone()
            copy.operands[0] = mapping[insert.operands[0]]
            mapping[insert.result] = copy.result
        scf.YieldOp([mapping[v] for v in carried])
    for value, outer in zip(carried, branch.results):
        for user, number in [(u.owner.operation, u.operand_number) for u in value.uses
                             if u.owner.operation not in inserts]:
            user.operands[number] = outer
    with ir.InsertionPoint(branch.else_block), op.location:
        yield_op = scf.YieldOp(carried)
    for moving in chain + inserts:
        moving.move_before(yield_op)
    return full_op


class VersionFullTilesOp(TransformExt.Operation, name=NAME):
    target: ext.Operand[transform.AnyOpType]
    full: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for t in targets:
                        _check(_chain(t))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                full = [version(t) for t in targets]
                results.set_ops(op.full, [f for f in full if f is not None])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def version_full_tiles(target: ir.Value) -> ir.Value:
    """Give each op of `target` a static version for its full tiles (module docstring);
    returns the full versions."""
    return VersionFullTilesOp(target).full


__all__ = ["VersionFullTilesOp", "version_full_tiles"]
