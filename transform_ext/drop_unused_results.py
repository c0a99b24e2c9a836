"""drop_unused_results: remove the results of linalg.generic ops that nothing uses.

For a generic with results r_0..r_n where r_k has no uses, rebuild it without output k:
its init operand, indexing map, body argument and yielded value go, and the body ops that
only fed the dropped value are erased. Legal when the kept yielded values do not read
output k's body argument (else dropping it would change them). The imported max reduction
of softmax also computes an i64 argmax that nothing reads; it blocks fusion and
vectorization.

Targets: every linalg.generic equal to or nested in the target ops. A target that is itself
a generic with an unused result that cannot be dropped is a silenceable failure; nested
generics with such results are left unchanged. The result handle holds the targets, with
rewritten generics replaced by their new versions.
"""


from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, transform

from .common import (Illegal, ReplacesTargets, Success, defining_op, erase_dead_body_ops, fail,
                     payload_ops, walk_ops)
from .dialect import TransformExt


def _body_slice(block: ir.Block, roots: list[ir.Value]) -> set:
    """Block arguments and ops of `block` that the values `roots` depend on."""
    seen_args: set[int] = set()
    seen_ops: list[ir.Operation] = []
    frontier = list(roots)
    while frontier:
        v = frontier.pop()
        if isinstance(v, ir.BlockArgument):
            if v.owner == block:
                seen_args.add(v.arg_number)
            continue
        owner = defining_op(v)
        if owner.parent != block.owner or owner in seen_ops:
            continue
        seen_ops.append(owner)
        frontier.extend(owner.operands)
        for region in owner.regions:
            for b in region.blocks:
                for inner in b.operations:
                    frontier.extend(inner.operands)
    return seen_args


def droppable_results(generic) -> tuple[list[int], list[int]]:
    """(results that can be dropped, unused results that cannot)."""
    generic = generic.opview
    n_in = len(generic.inputs)
    body = generic.regions[0].blocks[0]
    yield_op = body.operations[len(body.operations) - 1]
    unused = [k for k, r in enumerate(generic.results) if not list(r.uses)]
    kept = [k for k in range(len(generic.results)) if k not in unused]
    needed_args = _body_slice(body, [yield_op.operands[k] for k in kept])
    blocked = [k for k in unused if n_in + k in needed_args]
    return [k for k in unused if k not in blocked], blocked


def _rebuild(generic, drop: list[int], rewriter) -> ir.Operation:
    generic = generic.opview
    n_in = len(generic.inputs)
    keep = [k for k in range(len(generic.results)) if k not in drop]
    maps = list(generic.indexing_maps)
    new_maps = maps[:n_in] + [maps[n_in + k] for k in keep]
    outs = [generic.outputs[k] for k in keep]
    with ir.InsertionPoint(generic.operation), generic.location:
        new = linalg.GenericOp([generic.results[k].type for k in keep], list(generic.inputs), outs,
                               ir.ArrayAttr.get(new_maps), generic.iterator_types)
        old_body = generic.regions[0].blocks[0]
        arg_types = [a.type for a in old_body.arguments]
        kept_args = list(range(n_in)) + [n_in + k for k in keep]
        block = new.regions[0].blocks.append(*[arg_types[i] for i in kept_args])
        for new_i, old_i in enumerate(kept_args):
            old_body.arguments[old_i].replace_all_uses_with(block.arguments[new_i])
        old_yield = old_body.operations[len(old_body.operations) - 1]
        with ir.InsertionPoint(block):
            new_yield = linalg.YieldOp([old_yield.operands[k] for k in keep])
        for inner in list(old_body.operations)[:-1]:
            inner.operation.move_before(new_yield.operation)
        old_yield.operation.erase()
        erase_dead_body_ops(block)
    for name in ("library_call", "doc"):
        if name in generic.attributes:
            new.attributes[name] = generic.attributes[name]
    # replace_op wants one value per old result; the dropped ones are unused, so their init
    # operands (same type) stand in.
    new_results = iter(new.results)
    values = [next(new_results) if k in keep else generic.outputs[k]
              for k in range(len(generic.results))]
    rewriter.replace_op(generic.operation, values)
    return new.operation


class DropUnusedResultsOp(TransformExt.Operation, name="drop_unused_results"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                plan = []
                try:
                    for target in targets:
                        for g in walk_ops(target, lambda o: o.name == "linalg.generic"):
                            drop, blocked = droppable_results(g)
                            if blocked and g == target:
                                raise Illegal(g, f"results {blocked} are unused but the kept "
                                                 f"results read their body arguments")
                            if drop:
                                plan.append((g, drop))
                except Illegal as illegal:
                    return fail("transform_ext.drop_unused_results", illegal)
                replaced = {}
                for g, drop in plan:
                    replaced[id(g)] = _rebuild(g, drop, rewriter)
                out = [next((replaced[id(g)] for g, _ in plan if g == t), t) for t in targets]
                results.set_ops(op.result, out)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def drop_unused_results(target: ir.Value) -> ir.Value:
    """Drop unused results of the generics in `target`; returns the updated targets."""
    return DropUnusedResultsOp(target).result


__all__ = ["DropUnusedResultsOp", "drop_unused_results"]
