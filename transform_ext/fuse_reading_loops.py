"""fuse_reading_loops: a loop that reads, at its own step, only what an earlier sibling loop
wrote at that step runs inside the writing loop.

    A: %t = scf.for %i = lb to ub step s iter_args(%a = T) {
         ... %w = vector.transfer_write %v, %a[I(%i)] ...; scf.yield %w }
    B: %r = scf.for %j = lb to ub step s iter_args(%acc = X) {
         ... %x = vector.transfer_read %t[I(%j)] ... ; scf.yield %acc' }
  ->
       %t, %r = scf.for %i = lb to ub step s iter_args(%a = T, %acc = X) {
         A's body; B's body with %x = %v; scf.yield %w, %acc' }

After vectorization the key-major attention's key loop holds such a pair: the weights
E = exp(S - m) written row by row, then the row sum l += E read row by row; fused, the sum
adds each row of E while it is in registers (one load and one loop less per row).

A pair is fused when (each checked before its rewrite; a pair that is not is left as it
is: the op searches, like a pattern, and never fails):
  - A and B are scf.for ops of one block, A first, with the same bounds and step (the same
    values or equal constants);
  - A carries one tensor and writes it once per step, by a vector.transfer_write without a
    mask, in bounds, with a minor identity map, whose indices are loop-invariant except one,
    A's induction variable, along which the written vector spans at most the step: the
    steps write disjoint slices, each written once;
  - B reads A's tensor only by such reads in its own body (not nested deeper): the same
    indices with B's induction variable in A's place, the written vector's type, map and
    bounds; B carries no tensors and writes no memory;
  - what else B reads from outside is defined before A, or between A and B by ops without
    regions and without writes that do not read A's results (they move before A).
Then step i of B reads exactly the slice step i of A wrote, and nothing overwrites it later:
the fused loop computes the same values. A's result stays (other readers use it).

Targets: any ops; the loop pairs in the blocks nested in them are fused, each B with an
scf.for before it whose tensor it reads (the nearest first), until none is left. The target
handle is consumed (handles to ops nested in the targets are invalidated) and the targets
returned.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, scf, transform

from .common import (Illegal, RewritesNestedOps, Success, all_in_bounds, body_of, clone_body,
                     clone_op, constant_value, defining_op, is_nested_in, payload_ops,
                     terminator, users, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.fuse_reading_loops"
_WRITES = ("vector.transfer_write", "vector.store", "vector.scatter", "vector.maskedstore",
           "vector.compressstore", "tensor.insert", "tensor.insert_slice",
           "tensor.parallel_insert_slice", "memref.store", "memref.copy")


def _constant(value: ir.Value) -> int | None:
    attr = constant_value(value)
    return ir.IntegerAttr(attr).value if isinstance(attr, ir.IntegerAttr) else None


def _same(a: ir.Value, b: ir.Value) -> bool:
    ca = _constant(a)
    return a == b or (ca is not None and ca == _constant(b))


def _is_minor_identity(transfer: ir.Operation) -> bool:
    amap = ir.AffineMapAttr(transfer.attributes["permutation_map"]).value
    return amap == ir.AffineMap.get_minor_identity(amap.n_dims, len(amap.results))


class _Pair:
    """A (the writing loop) and B (the reading loop), checked; `hoisted`: the ops between
    them that B needs, in block order."""

    def __init__(self, a: ir.Operation, b: ir.Operation):
        self.a, self.b = a, b
        if not all(_same(x, y) for x, y in zip(a.operands[:3], b.operands[:3])):
            raise Illegal(b, "its bounds or step differ from the loop before it")
        self.write, self.position = self._write()
        self.reads = self._reads()
        self.hoisted = self._hoisted()

    def _write(self):
        a = self.a
        body = body_of(a)
        if len(a.results) != 1 or not isinstance(a.results[0].type, ir.RankedTensorType):
            raise Illegal(a, "the writing loop does not carry exactly one tensor")
        carried = body.arguments[1]
        uses = users(carried)
        yielded = terminator(body)
        if len(uses) != 1 or uses[0].name != "vector.transfer_write" \
                or uses[0].operands[1] != carried or yielded.operands[0] != uses[0].results[0]:
            raise Illegal(a, "its tensor is not written by one vector.transfer_write yielded")
        write = uses[0]
        rank = ir.RankedTensorType(carried.type).rank
        if len(write.operands) != 2 + rank or not all_in_bounds(write) \
                or not _is_minor_identity(write):
            raise Illegal(write, "the write is masked, out of bounds or permuted")
        indices = list(write.operands[2:])
        iv = body.arguments[0]
        at = [p for p, v in enumerate(indices) if v == iv]
        if len(at) != 1 or any(not _outside(v, a) for p, v in enumerate(indices) if p != at[0]):
            raise Illegal(write, "its indices are not the induction variable once and "
                                 "loop-invariant values")
        shape = ir.VectorType(write.operands[0].type).shape
        lead = rank - len(shape)
        span = shape[at[0] - lead] if at[0] >= lead else 1
        step = _constant(a.operands[2])
        if step is None or span > step:
            raise Illegal(write, "the slices of successive steps overlap")
        return write, at[0]

    def _reads(self):
        a, b = self.a, self.b
        written = self.write
        iv = body_of(b).arguments[0]
        reads = []
        for user in users(a.results[0]):
            if not is_nested_in(user, b):
                continue
            if getattr(user.parent, "operation", user.parent) != b \
                    or user.name != "vector.transfer_read" \
                    or user.operands[0] != a.results[0]:
                raise Illegal(user, "the reading loop reads the tensor otherwise than by a "
                                    "transfer_read in its body")
            indices = list(user.operands[1:-1])
            expected = list(written.operands[2:])
            expected[self.position] = iv
            if len(user.operands) != 2 + len(expected) \
                    or any(x != y for x, y in zip(indices, expected)) \
                    or user.results[0].type != written.operands[0].type \
                    or not all_in_bounds(user) or not _is_minor_identity(user):
                raise Illegal(user, "the read is not the slice the writing loop wrote at the "
                                    "same step")
            reads.append(user)
        if not reads:
            raise Illegal(b, "it does not read the loop before it")
        if any(isinstance(r.type, ir.RankedTensorType) for r in b.results):
            raise Illegal(b, "the reading loop carries a tensor")
        writes = walk_ops(b, lambda o: o.name in _WRITES or o.name.startswith("memref."))
        if writes:
            raise Illegal(writes[0], "the reading loop writes memory")
        return reads

    def _hoisted(self):
        a, b = self.a, self.b
        block_ops = [o.operation for o in a.block.operations]
        where = {op: i for i, op in enumerate(block_ops)}
        lo, hi = where[a], where[b]
        reads = set(self.reads)
        pending = list(b.operands)
        for op in walk_ops(b, lambda o: o != b):
            pending += [v for k, v in enumerate(op.operands) if not (op in reads and k == 0)]
        needed = set()
        while pending:
            v = pending.pop()
            op = defining_op(v)
            if op is None or op not in where or op in needed:
                continue
            if op == a:
                raise Illegal(b, "the reading loop reads the tensor otherwise than by the "
                                 "slices written")
            if not lo < where[op] < hi:
                continue
            if op.regions or op.name in _WRITES:
                raise Illegal(op, "the reading loop needs an op between the loops that "
                                  "cannot move before the writing loop")
            needed.add(op)
            pending.extend(op.operands)
        return [op for op in block_ops[lo + 1:hi] if op in needed]

    def fuse(self) -> None:
        a, b = self.a, self.b
        for op in self.hoisted:
            op.move_before(a)
        with ir.InsertionPoint(a), a.location:
            fused = scf.ForOp(a.operands[0], a.operands[1], a.operands[2],
                              list(a.operands[3:]) + list(b.operands[3:]))
        body = fused.body
        a_args, b_args = body_of(a).arguments, body_of(b).arguments
        mapping = {a_args[0]: body.arguments[0], b_args[0]: body.arguments[0]}
        for k, arg in enumerate(list(a_args)[1:]):
            mapping[arg] = body.arguments[1 + k]
        for k, arg in enumerate(list(b_args)[1:]):
            mapping[arg] = body.arguments[len(a_args) + k]
        with ir.InsertionPoint(body), a.location:
            yields = clone_body(a, mapping)
            value = mapping.get(self.write.operands[0], self.write.operands[0])
            for read in self.reads:
                mapping[read.results[0]] = value
            b_body = body_of(b)
            for op in [o.operation for o in b_body.operations][:-1]:
                if op not in self.reads:
                    clone_op(op, mapping)
            scf.YieldOp(yields + [mapping.get(v, v) for v in terminator(b_body).operands])
        for old, new in zip(list(a.results) + list(b.results), fused.results):
            old.replace_all_uses_with(new)
        b.erase()
        a.erase()


def _outside(value: ir.Value, loop: ir.Operation) -> bool:
    """Is `value` defined outside `loop` (not one of its block arguments nor nested ops)?"""
    op = defining_op(value)
    if op is None:
        return value.owner != body_of(loop) and not (
            isinstance(value.owner, ir.Block) and is_nested_in(value.owner.owner, loop))
    return op != loop and not is_nested_in(op, loop)


def _next_pair(root: ir.Operation) -> "_Pair | None":
    """The first legal pair in the blocks nested in `root`: each scf.for B and an scf.for
    before it in its block whose tensor B reads (the nearest first)."""
    for b in walk_ops(root, lambda o: o.name == "scf.for"):
        earlier = []
        for op in b.block.operations:
            op = op.operation
            if op == b:
                break
            if op.name == "scf.for" and any(is_nested_in(u, b) for r in op.results
                                            for u in users(r)):
                earlier.append(op)
        for a in reversed(earlier):
            try:
                return _Pair(a, b)
            except Illegal:
                continue
    return None


def fuse_reading_loops_in(root: ir.Operation) -> int:
    """Fuse the legal pairs nested in `root` until none is left; the number fused."""
    fused = 0
    while (pair := _next_pair(root)) is not None:
        pair.fuse()
        fused += 1
    return fused


class FuseReadingLoopsOp(TransformExt.Operation, name="fuse_reading_loops"):
    target: ext.Operand[transform.AnyOpType]
    transformed: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                for target in targets:
                    fuse_reading_loops_in(target)
                results.set_ops(op.transformed, targets)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesNestedOps


def fuse_reading_loops(target: ir.Value) -> ir.Value:
    """Fuse the reading loops nested in `target` into their writing loops (see the module
    docstring); the targets, whose nested ops' handles are invalidated."""
    return FuseReadingLoopsOp(target).transformed


__all__ = ["FuseReadingLoopsOp", "fuse_reading_loops", "fuse_reading_loops_in"]
