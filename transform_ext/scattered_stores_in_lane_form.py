"""scattered_stores_in_lane_form: the scattered stores of [rows] vectors in the target ops
write their lane form, lane 0 of each row.

    transform_ext.scattered_stores_in_lane_form %gpu_func {lanes = 16}

Each xegpu.store nested in a target that writes a vector v [n] at offsets o [n] under the
mask k [n], one element per offset, becomes
    V[i, l] = v[i],  O[i, l] = o[i]       (vector.broadcast to [lanes, n], then
                                            vector.transpose to [n, lanes])
    K[i, l] = k[i] and l == 0
    xegpu.store V, dest[O], K             ([n, lanes]: each element written once, by lane 0)
so the same values reach the same addresses. On a GPU a [rows] vector reduced over a tile's
columns is held by every lane of its row (a slice of the tile's row layout), which XeGPU's
lane distribution cannot store as a [rows] vector when a subgroup holds fewer rows than it
has lanes; the [rows, lanes] form is laid out as the tile's rows (one row per instruction),
the transpose of the lane-form gathers' read (transform_ext.load_rows_in_lane_form).

Legality first: every such store (1-D value) has offsets and a mask of the value's length
(one element per offset, not chunks); else a silenceable failure naming it, nothing
rewritten. Stores
of other ranks are left alone. The targets stay (their nested stores change).
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform, vector

from .common import Illegal, RewritesTargets, Success, fail, ops_named, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.scattered_stores_in_lane_form"


def _row_stores(target: ir.Operation) -> list[ir.Operation]:
    return [op for op in ops_named(target, "xegpu.store")
            if ir.VectorType(op.operands[0].type).rank == 1]


def check(store: ir.Operation) -> None:
    value, _, offsets, mask = list(store.operands)[:4]
    n = ir.VectorType(value.type).shape[0]
    for what, v in (("offsets", offsets), ("mask", mask)):
        if not isinstance(v.type, ir.VectorType) or list(ir.VectorType(v.type).shape) != [n]:
            raise Illegal(store, f"its {what} are not a [{n}] vector (chunks per offset)")


def _lane_form(value: ir.Value, lanes: int) -> ir.Value:
    """[n] -> [n, lanes], each row's value in every lane."""
    t = ir.VectorType(value.type)
    wide = vector.broadcast(ir.VectorType.get([lanes, t.shape[0]], t.element_type), value)
    return vector.transpose(ir.VectorType.get([t.shape[0], lanes], t.element_type), wide,
                            [1, 0])


def rewrite(store: ir.Operation, lanes: int) -> None:
    value, _, offsets, mask = list(store.operands)[:4]
    n = ir.VectorType(value.type).shape[0]
    with ir.InsertionPoint(store), store.location:
        index = ir.IndexType.get()
        lane = vector.broadcast(ir.VectorType.get([n, lanes], index),
                                vector.step(ir.VectorType.get([lanes], index)))
        zero = arith.constant(ir.VectorType.get([n, lanes], index),
                              ir.DenseElementsAttr.get_splat(
                                  ir.VectorType.get([n, lanes], index),
                                  ir.IntegerAttr.get(index, 0)))
        first = arith.cmpi(arith.CmpIPredicate.eq, lane, zero)
        masked = arith.andi(_lane_form(mask, lanes), first)
        store.operands[0] = _lane_form(value, lanes)
        store.operands[2] = _lane_form(offsets, lanes)
        store.operands[3] = masked


class ScatteredStoresInLaneFormOp(TransformExt.Operation, name="scattered_stores_in_lane_form"):
    target: ext.Operand[transform.AnyOpType]
    lanes: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                lanes = ir.IntegerAttr(op.lanes).value
                stores = [s for t in payload_ops(state, op.target) for s in _row_stores(t)]
                try:
                    for store in stores:
                        check(store)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for store in stores:
                    rewrite(store, lanes)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def scattered_stores_in_lane_form(target: ir.Value, lanes: int) -> ScatteredStoresInLaneFormOp:
    """Write the [rows] scattered stores nested in `target` in lane form (module docstring)."""
    return ScatteredStoresInLaneFormOp(target, ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                                  lanes))


__all__ = ["ScatteredStoresInLaneFormOp", "scattered_stores_in_lane_form"]
