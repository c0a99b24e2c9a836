"""insert_loop_prefetches: the tiles a kernel's loops read by 2-D block loads are prefetched
`nb_prefetch` steps ahead.

    scf.for %iv = %lb to %ub step %s {
      %t = xegpu.load_nd %desc[f(%iv), ..] : vector<R x C x T>
      ..
    }
  =>
    xegpu.prefetch_nd %desc[f(%lb + d %s), ..]          for d = 0 .. nb_prefetch - 1
    scf.for %iv = %lb to %ub step %s {
      xegpu.prefetch_nd %desc[f(%iv + nb_prefetch %s), ..]
      %t = xegpu.load_nd %desc[f(%iv), ..]
      ..
    }

A prefetch only moves data toward the caches (cached at L1, L2 and L3), so the kernel
computes the same values. It keeps the load's constant offsets and gets the layout that
`layouts` gives the load's [R, C] tile, which spreads the prefetch over the workgroup's
subgroups; the index arithmetic on %iv is recomputed for the step ahead. (transform.xegpu.insert_prefetch refuses loops with dynamic bounds, e.g. causal
attention's.)

Sites: the xegpu.load_nd ops directly in the body of an scf.for nested in (or equal to) the
targets whose tensor descriptor is loop-invariant and whose offsets are loop-invariant or
index arithmetic (arith, index) on the induction variable, at least one of them on it;
other loads are left alone. `layouts` is a dictionary from "RxCxT" to an #xegpu.layout, or
to `unit` for a tile that is not to be prefetched; a
site whose tile has no layout there is a silenceable failure naming it (nothing inserted),
and so is nb_prefetch < 1. The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .common import (Illegal, RewritesTargets, Success, defining_op, fail, is_nested_in, ops_named,
                     payload_ops)
from .dialect import TransformExt

NAME = "transform_ext.insert_loop_prefetches"


def tile_key(rows: int, cols: int, element_type: str) -> str:
    """The key of a [rows, cols] tile of `element_type` in the `layouts` dictionary (the
    instruction tile of a prefetch depends on the element size: 2-D block rows are at
    least 32 bytes wide)."""
    return f"{rows}x{cols}x{element_type}"


class _Loop:
    """The induction-variable analysis of one scf.for."""

    def __init__(self, loop: ir.Operation):
        self.loop = loop
        self.body = loop.regions[0].blocks[0]
        self.iv = self.body.arguments[0]

    def invariant(self, value: ir.Value) -> bool:
        if isinstance(value, ir.BlockArgument):
            return value.owner != self.body
        return not is_nested_in(defining_op(value), self.loop)

    def of_iv(self, value: ir.Value) -> bool:
        """Is `value` the induction variable or pure index arithmetic on it (and on loop
        invariants)?"""
        if value == self.iv:
            return True
        owner = defining_op(value)
        if (self.invariant(value) or owner is None
                or not owner.name.startswith(("arith.", "index."))):
            return False
        return all(self.of_iv(v) or self.invariant(v) for v in owner.operands) and any(
            self.of_iv(v) for v in owner.operands)

    def at(self, value: ir.Value, next_iv: ir.Value, ip_op: ir.Operation) -> ir.Value:
        """`value` recomputed for the induction variable `next_iv` (before ip_op)."""
        if value == self.iv:
            return next_iv
        if not self.of_iv(value):
            return value
        owner = defining_op(value)
        operands = [self.at(v, next_iv, ip_op) for v in owner.operands]
        clone = owner.clone(ir.InsertionPoint(ip_op))
        for i, v in enumerate(operands):
            clone.operands[i] = v
        return clone.results[list(owner.results).index(value)]

    def sites(self) -> list[ir.Operation]:
        found = []
        loads = [o.operation for o in self.body.operations if o.operation.name == "xegpu.load_nd"]
        for load in loads:
            desc, offsets = load.operands[0], list(load.operands)[1:]
            if not self.invariant(desc) or not any(self.of_iv(o) for o in offsets):
                continue
            if not all(self.of_iv(o) or self.invariant(o) for o in offsets):
                continue
            found.append(load)
        return found


def _layout_of(load: ir.Operation, layouts: ir.DictAttr) -> ir.Attribute | None:
    vector = ir.VectorType(load.results[0].type)
    shape = list(vector.shape)
    if len(shape) < 2:
        raise Illegal(load, f"a {len(shape)}-D load has no 2-D block prefetch")
    key = tile_key(*shape[-2:], str(vector.element_type))
    if key not in layouts:
        raise Illegal(load, f"no prefetch layout for a {key} tile")
    layout = layouts[key]
    return None if isinstance(layout, ir.UnitAttr) else layout


def _prefetch(analysis: _Loop, load: ir.Operation, layout: ir.Attribute, nb_prefetch: int) -> None:
    loop, body, iv = analysis.loop, analysis.body, analysis.iv
    lb, step = loop.operands[0], loop.operands[2]
    index = ir.IndexType.get()
    hint = ir.Attribute.parse("#xegpu.cache_hint<cached>")
    desc, offsets = load.operands[0], list(load.operands)[1:]
    attributes = {"const_offsets": load.attributes["const_offsets"], "l1_hint": hint,
                  "l2_hint": hint, "l3_hint": hint, "layout": layout}

    def constant(value):
        return arith.ConstantOp(index, ir.IntegerAttr.get(index, value)).result

    def prefetch(next_iv, ip_op):
        ir.Operation.create("xegpu.prefetch_nd", attributes=attributes,
                            operands=[desc] + [analysis.at(o, next_iv, ip_op) for o in offsets])

    with ir.InsertionPoint(loop), loop.location:
        for d in range(nb_prefetch):
            prefetch(arith.addi(lb, arith.muli(step, constant(d))), loop)
    first = body.operations[0]
    with ir.InsertionPoint(first), loop.location:
        prefetch(arith.addi(iv, arith.muli(step, constant(nb_prefetch))), first)


class InsertLoopPrefetchesOp(TransformExt.Operation, name="insert_loop_prefetches"):
    target: ext.Operand[transform.AnyOpType]
    nb_prefetch: ir.IntegerAttr
    # an empty DictAttr is falsy, which the op builder takes for "not given"
    layouts: ir.DictAttr = ext.attribute(default_factory=lambda: ir.DictAttr.get({}))

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                nb_prefetch = ir.IntegerAttr(op.nb_prefetch).value
                layouts = ir.DictAttr(op.layouts)
                try:
                    for target in targets:
                        if nb_prefetch < 1:
                            raise Illegal(target, f"nb_prefetch = {nb_prefetch}: at least one "
                                                  "step ahead")
                        for loop in ops_named(target, "scf.for"):
                            for load in _Loop(loop).sites():
                                _layout_of(load, layouts)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    for loop in ops_named(target, "scf.for"):
                        analysis = _Loop(loop)
                        for load in analysis.sites():
                            layout = _layout_of(load, layouts)
                            if layout is not None:
                                _prefetch(analysis, load, layout, nb_prefetch)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def insert_loop_prefetches(target: ir.Value, nb_prefetch: int,
                           layouts: dict[str, ir.Attribute]) -> InsertLoopPrefetchesOp:
    """Prefetch the loop-read tiles of the kernels in `target` `nb_prefetch` steps ahead,
    with the layout `layouts[tile_key(rows, cols, element type)]` per tile."""
    i64 = ir.IntegerType.get_signless(64)
    return InsertLoopPrefetchesOp(target, ir.IntegerAttr.get(i64, nb_prefetch),
                                  layouts=ir.DictAttr.get(layouts))


__all__ = ["InsertLoopPrefetchesOp", "insert_loop_prefetches", "tile_key"]
