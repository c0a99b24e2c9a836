"""fuse_linear_cross_entropy_backward_two_pass: the backward of a loss over linear logits
as two kernels with no [N, V] tensor and no reduction across their parallel iterations
(the form a GPU lowers: every product a [rows, k] x [k, columns] tile product).

For the backward of each target function (transform_ext/analysis/
linear_cross_entropy_backward.py: S = h W^T, G = E(S, ...) elementwise, dh = G W,
dW = G^T h, and the column sums Z = reduce_n F(S, G, ...) such as db = sum_n G), with
R = `block`, C = `step`:

    pass 1 (when there is a dh): scf.forall over blocks of R rows s
        dh_s = 0                                   [R, D]
        for each tile c of C classes:
            S_sc = h_s W_c^T                       [R, C]  (recomputed: no [N, V] S)
            G_sc = E(S_sc, ...)                    [R, C]  (E's body at the tile)
            dh_s += G_sc W_c
    pass 2 (when there is a dW or a column sum): scf.forall over blocks of R classes c
        dW_c = 0 [R, D], Z_c = Z's init at c
        for each tile s of C rows:
            S_cs^T = W_c h_s^T                     [R, C]
            G_cs^T = E(S_cs^T, ...)                [R, C]  (E's body, rows and classes
                                                            swapped)
            dW_c += G_cs^T h_s,  Z_c = F(S_cs^T, G_cs^T, ...) reduced into Z_c

The tiles of G and the column sums compute the elementwise producers they read from the
function's arguments (a widened bias; a gather from them such as w[y_n]) on their slices
themselves, so the passes share no producer with the forward (whose kernel would otherwise
have to write it); a rank-0 input (the count or total weight) is read once per block as a
scalar, an input per row (pass 1) or per class (pass 2: the bias) once per block, before
its loop. A gather in G's or a column sum's body at an index computed from its row's
values only (the class weight w[y_n]) is first hoisted into a per-row generic they read
(transform_ext.hoist_row_gathers), placed right after what it reads: one gather per row of
a tile, not per element. Each pass's block is its
forall's iteration (a GPU workgroup), the block's own index the rows of every product
(pass 1: h's rows, pass 2: W's classes), so no sum crosses blocks;
S is recomputed in both passes (twice the forward's logits FLOPs, the price of no [N, V]
buffer and no atomics). The products read h and W in their own element type (each term
widened in the product's body, f32 accumulators: f16/bf16 operands go to DPAS as they are);
G's tile keeps E's element type (torch rounds d logits to bf16 before its bf16 products).
The foralls carry BACKWARD_PASS (1, 2) and no mapping (the target maps them). A result read
only by an elementwise op of its own (the cast of dh, dW or db to the inputs' type) is
written through it, block by block (that op is replaced); a transposed dh or dW (the
backward of a transposed view) is transposed once at the end.

Preconditions (checked on every target first; a violation is a silenceable failure naming
the op): those of fuse_linear_cross_entropy_backward (one such backward, static shapes, E's
and the column sums' bodies without regions and reading every tensor through projected
maps, the users of the replaced results after every value the kernels read); R and C
divide both N and V (no remainder blocks in this form). The results of dh, dW and the column
sums are replaced; G and those ops die (canonicalize after this op).
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, scf, tensor, transform

from .analysis.linear_cross_entropy_backward import LinearCrossEntropyBackward
from .analysis.structure import dim_positions, loop_structure
from .common import (Illegal, RewritesTargets, Success, block_ops, body_of, build_generic,
                     clone_op, defining_op, fail, payload_ops, terminator, users, walk_ops)
from .dialect import TransformExt
from .hoist_row_gathers import applies as gathers_in_tile, hoist as hoist_gathers
from .hoist_row_gathers import check as check_row_gathers
from .inline_argument_producers import computes_from_arguments
from .fuse_linear_cross_entropy_backward import (_index, _init_ops, _map,
                                                 _multiply_add, _parallel_insert, _slice, _zeros,
                                                 plan, tile_op)

NAME = "transform_ext.fuse_linear_cross_entropy_backward_two_pass"
BACKWARD_PASS = "lh.linear_ce_backward_pass"


def _product(a: ir.Value, a_dims: list[int], b: ir.Value, b_dims: list[int],
             acc: ir.Value) -> ir.Value:
    """acc[M, N] += sum_k A B, A and B read through the dims `a_dims` and `b_dims` of the
    loops (m, n, k): [0, 2] is A[m, k], [1, 2] is B[n, k] (a transposed operand)."""
    return build_generic([a, b], [acc], [_map(3, a_dims), _map(3, b_dims), _map(3, [0, 1])],
                         ["parallel", "parallel", "reduction"], _multiply_add).results[0]


def _mark(forall: scf.ForallOp, number: int) -> None:
    forall.operation.attributes[BACKWARD_PASS] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64), number)


def epilogue_of(op: ir.Operation | None) -> ir.Operation | None:
    """The elementwise op that is the only reader of `op`'s result (a cast of dh, dW or db
    to the inputs' type), when its body reads only its input element: then the pass applies
    it to each block before the block is written."""
    if op is None:
        return None
    readers = users(op.results[0])
    if len(readers) != 1 or readers[0].name != "linalg.generic":
        return None
    (reader,) = readers
    ls = loop_structure(reader)
    rank = ir.RankedTensorType(op.results[0].type).rank
    identity = ir.AffineMap.get_identity(rank)
    body = body_of(reader)
    if ls.num_inputs != 1 or ls.num_outputs != 1 or ls.reduction_dims or \
            any(m != identity for m in ls.maps) or ls.output_map(0) != identity or \
            list(body.arguments[1].uses) or any(
                o.operation.regions or o.operation.name in ("linalg.index", "tensor.extract")
                for o in body.operations):
        return None
    return reader


def _apply_epilogue(value: ir.Value, epilogue: ir.Operation | None) -> ir.Value:
    """`value` through `epilogue`'s body (itself when there is none)."""
    if epilogue is None:
        return value
    t = ir.RankedTensorType(value.type)
    element = ir.RankedTensorType(epilogue.results[0].type).element_type
    identity = ir.AffineMap.get_identity(t.rank)
    body = body_of(epilogue)

    def clone(args):
        mapping = {body.arguments[0]: args[0]}
        for inner in list(body.operations)[:-1]:
            clone_op(inner.operation, mapping)
        return [mapping.get(v, v) for v in terminator(body).operands]

    return build_generic([value], [tensor.EmptyOp(list(t.shape), element).result],
                         [identity, identity], ["parallel"] * t.rank, clone).results[0]


class _Output:
    """A result of a pass: its block (`part`, [block, ...] at `axis`) accumulated from
    `start(origin)`, written through the epilogue into an empty tensor of the final type."""

    def __init__(self, shape: list[int], axis: int, epilogue: ir.Operation | None,
                 init: ir.Value | None = None):
        self.shape, self.axis, self.epilogue, self.init = shape, axis, epilogue, init
        element = (ir.RankedTensorType(epilogue.results[0].type).element_type if epilogue
                   else ir.F32Type.get())
        self.empty = tensor.EmptyOp(shape, element).result

    def _range(self, origin, size) -> tuple[list, list]:
        offsets, sizes = [0] * len(self.shape), list(self.shape)
        offsets[self.axis], sizes[self.axis] = origin, size
        return offsets, sizes

    def start(self, origin, size) -> ir.Value:
        """The block's accumulator before the loop: zeros, or the block of the init."""
        offsets, sizes = self._range(origin, size)
        if self.init is None:
            return _zeros(sizes, ir.F32Type.get())
        return _slice(self.init, offsets, sizes)

    def finish(self, part: ir.Value) -> ir.Value:
        """The block as written: through the epilogue (before the forall's terminator)."""
        return _apply_epilogue(part, self.epilogue)

    def write(self, block: ir.Value, out: ir.Value, origin, size) -> None:
        offsets, sizes = self._range(origin, size)
        _parallel_insert(block, out, offsets, sizes)


class _TwoPass:
    """The two foralls of the module docstring for one backward."""

    def __init__(self, bwd: LinearCrossEntropyBackward, at: ir.Operation, block: int,
                 step: int):
        self.bwd, self.at = bwd, at
        self.n, self.v, self.d = bwd.logits.shape
        self.block, self.step = block, step
        self.f32 = ir.F32Type.get()
        self.epilogues = {op: None if role in bwd.transposed else epilogue_of(op)
                          for op, role in ((bwd.d_rows, "rows"), (bwd.d_weight, "weight"))
                          if op is not None}
        for column in bwd.column_sums:
            self.epilogues[column.op] = epilogue_of(column.op)

    def slice_of(self, value: ir.Value, offsets: list, sizes: list) -> ir.Value:
        """The tile [offsets, sizes] of `value`: a slice, or when `value` is computed
        elementwise from the function's arguments (identity maps; gathers from them at
        indices computed from its inputs, such as the class weight w[y_n]) that computation
        on the slices of its inputs."""
        producer = value.owner
        producer = getattr(producer, "operation", producer)
        if not isinstance(producer, ir.Operation) or producer.name != "linalg.generic" or \
                producer.parent != self.at.parent or \
                not computes_from_arguments(producer, self.at.block, gathers=True) or \
                any(o.name == "linalg.index" for o in block_ops(body_of(producer))):
            return _slice(value, offsets, sizes)
        ls = loop_structure(producer)
        rank = ir.RankedTensorType(value.type).rank
        identity = ir.AffineMap.get_identity(rank)
        body = body_of(producer)
        if ls.num_outputs != 1 or any(m != identity for m in ls.maps) or \
                ls.output_map(0) != identity or list(body.arguments[ls.num_inputs].uses):
            return _slice(value, offsets, sizes)
        inputs = [self.slice_of(v, offsets, sizes) for v in list(producer.operands)[:ls.num_inputs]]
        element = ir.RankedTensorType(value.type).element_type

        def clone(args):
            mapping = dict(zip(list(body.arguments)[:ls.num_inputs], args))
            for inner in list(body.operations)[:-1]:
                clone_op(inner.operation, mapping)
            return [mapping.get(v, v) for v in terminator(body).operands]

        return build_generic(inputs, [tensor.EmptyOp(sizes, element).result],
                             [identity] * (ls.num_inputs + 1), ["parallel"] * rank,
                             clone).results[0]

    def scalars(self) -> dict:
        """The rank-0 tensors G and the column sums read (the count or total weight), each
        read once as a scalar (at the top of a pass's block: no 0-d vectors on a GPU)."""
        read = {}
        items = ([self.bwd.gradient] if self.bwd.gradient is not None else []) + \
            self.bwd.column_sums
        for item in items:
            ls = loop_structure(item.op)
            for value in list(item.op.operands)[:ls.num_inputs]:
                if isinstance(value.type, ir.RankedTensorType) and value.type.rank == 0 \
                        and value not in read:
                    read[value] = tensor.extract(value, [])
        return read

    def vector_slices(self, origin: ir.Value, size: int, per_rows: bool) -> dict:
        """The tensors G reads per row only (`per_rows`: pass 1) or per class only (pass 2:
        the bias), sliced to the block's rows or classes (before the pass's loop: their
        producers then fuse into the block, not the loop)."""
        g = self.bwd.gradient
        if g is None:
            return {}
        along, across = (g.rows_loop, g.class_loop) if per_rows else (g.class_loop, g.rows_loop)
        ls = loop_structure(g.op)
        sliced = {}
        for value, amap in zip(list(g.op.operands)[:ls.num_inputs], ls.maps):
            dims = dim_positions(amap)
            if isinstance(value.type, ir.RankedTensorType) and across not in dims and \
                    along in dims and value not in sliced:
                t = ir.RankedTensorType(value.type)
                sliced[value] = self.slice_of(
                    value, [origin if d == along else 0 for d in dims],
                    [size if d == along else t.shape[i] for i, d in enumerate(dims)])
        return sliced

    def gradient_tile(self, s: ir.Value, rows: tuple, classes: tuple, rows_major: bool,
                      sliced: dict | None = None) -> ir.Value | None:
        """G's tile from S's tile `s` ([rows, classes] when `rows_major`, else transposed);
        None when nothing reads G."""
        g = self.bwd.gradient
        if g is None:
            return None
        shape = [rows[1], classes[1]] if rows_major else [classes[1], rows[1]]
        element = ir.RankedTensorType(g.op.results[0].type).element_type
        return tile_op(g, {self.bwd.logits.result: s}, rows, classes,
                       tensor.EmptyOp(shape, element).result, _map(2, [0, 1]), rows_major,
                       sliced, self.slice_of)

    def rows_pass(self) -> ir.Value:
        """Pass 1: dh [N, D] (f32, or its epilogue's type)."""
        h, w = self.bwd.logits.rows, self.bwd.logits.weight
        r, c, d = self.block, self.step, self.d
        output = _Output([self.n, d], 0, self.epilogues[self.bwd.d_rows])
        forall = scf.ForallOp([0], [self.n // r], [1], shared_outs=[output.empty])
        _mark(forall, 1)
        with ir.InsertionPoint(forall.body):
            s0 = arith.muli(forall.induction_variables[0], _index(r))
            h_s = _slice(h, [s0, 0], [r, d])
            per_row = {**self.scalars(), **self.vector_slices(s0, r, per_rows=True)}
            loop = scf.ForOp(_index(0), _index(self.v), _index(c), [output.start(s0, r)])
            with ir.InsertionPoint(loop.body):
                c0 = loop.induction_variable
                w_c = _slice(w, [c0, 0], [c, d])
                s = _product(h_s, [0, 2], w_c, [1, 2], _zeros([r, c], self.f32))
                g = self.gradient_tile(s, (s0, r), (c0, c), rows_major=True, sliced=per_row)
                dh = _product(g, [0, 2], w_c, [2, 1], loop.inner_iter_args[0])
                scf.YieldOp([dh])
            block = output.finish(loop.results[0])
            parallel = scf.InParallelOp()
            with ir.InsertionPoint(parallel.block):
                output.write(block, forall.inner_iter_args[0], s0, r)
        return forall.results[0]

    def classes_pass(self) -> list[ir.Value]:
        """Pass 2: dW [V, D] (when there is one), then the column sums (f32, or their
        epilogues' types)."""
        bwd = self.bwd
        h, w = bwd.logits.rows, bwd.logits.weight
        r, c, d = self.block, self.step, self.d
        outputs = []
        if bwd.d_weight is not None:
            outputs.append(_Output([self.v, d], 0, self.epilogues[bwd.d_weight]))
        for column in bwd.column_sums:
            ls = loop_structure(column.op)
            init = column.op.operands[ls.num_inputs]
            mapping: dict = {}
            for op in _init_ops(init):  # its init, rebuilt here (from constants only)
                clone_op(op, mapping)
            axis = dim_positions(ls.output_map(0)).index(column.class_loop)
            outputs.append(_Output(list(ir.RankedTensorType(init.type).shape), axis,
                                   self.epilogues[column.op], mapping[init]))
        forall = scf.ForallOp([0], [self.v // r], [1], shared_outs=[o.empty for o in outputs])
        _mark(forall, 2)
        with ir.InsertionPoint(forall.body):
            c0 = arith.muli(forall.induction_variables[0], _index(r))
            w_c = _slice(w, [c0, 0], [r, d])
            scalars = self.scalars()
            per_class = {**scalars, **self.vector_slices(c0, r, per_rows=False)}
            loop = scf.ForOp(_index(0), _index(self.n), _index(c),
                             [o.start(c0, r) for o in outputs])
            with ir.InsertionPoint(loop.body):
                s0 = loop.induction_variable
                h_s = _slice(h, [s0, 0], [c, d])
                s_t = _product(w_c, [0, 2], h_s, [1, 2], _zeros([r, c], self.f32))
                tiles = {bwd.logits.result: s_t}
                g_t = self.gradient_tile(s_t, (s0, c), (c0, r), rows_major=False,
                                         sliced=per_class)
                if g_t is not None:
                    tiles[bwd.gradient.op.results[0]] = g_t
                carried = iter(loop.inner_iter_args)
                result = []
                if bwd.d_weight is not None:
                    result.append(_product(g_t, [0, 2], h_s, [2, 1], next(carried)))
                for column, total in zip(bwd.column_sums, carried):
                    result.append(tile_op(column, tiles, (s0, c), (c0, r), total,
                                          sliced=per_class, slice_fn=self.slice_of))
                scf.YieldOp(result)
            blocks = [o.finish(part) for o, part in zip(outputs, loop.results)]
            parallel = scf.InParallelOp()
            with ir.InsertionPoint(parallel.block):
                for o, block, out in zip(outputs, blocks, forall.inner_iter_args):
                    o.write(block, out, c0, r)
        return list(forall.results)

    def build(self) -> list[ir.Value]:
        """dh (when there is one), dW (when there is one) and the column sums."""
        results = [self.rows_pass()] if self.bwd.d_rows is not None else []
        if self.bwd.d_weight is not None or self.bwd.column_sums:
            results += self.classes_pass()
        return results


def rewrite(bwd: LinearCrossEntropyBackward, at: ir.Operation, block: int, step: int,
            rewriter) -> None:
    with ir.InsertionPoint(at), at.location:
        passes = _TwoPass(bwd, at, block, step)
        results = iter(passes.build())
        replaced = [(op, next(results)) for op in (bwd.d_rows, bwd.d_weight) if op is not None]
        replaced += [(column.op, next(results)) for column in bwd.column_sums]
        for i, (op, value) in enumerate(replaced):
            role = "rows" if op == bwd.d_rows else "weight"
            if op in (bwd.d_rows, bwd.d_weight) and role in bwd.transposed:
                # d(h^T) = (G W)^T, d(W^T) = (G^T h)^T
                n, m = ir.RankedTensorType(value.type).shape
                empty = tensor.EmptyOp([m, n], ir.F32Type.get()).result
                replaced[i] = (op, linalg.transpose(value, outs=[empty],
                                                    permutation=[1, 0]).results[0])
    for op, value in replaced:
        epilogue = passes.epilogues.get(op)
        if epilogue is not None:
            rewriter.replace_op(epilogue, [value])
            rewriter.erase_op(op)
        else:
            rewriter.replace_op(op, [value])
    for op in reversed(bwd.transposes):
        if not any(list(r.uses) for r in op.results):
            rewriter.erase_op(op)
    if bwd.gradient is not None and not list(bwd.gradient.op.results[0].uses):
        rewriter.erase_op(bwd.gradient.op)


def _hoistable_gathers(bwd: LinearCrossEntropyBackward) -> list[ir.Operation]:
    """G and the column sums that gather at an index computed from their row's values only
    (the class weight w[y_n]): the passes read such a gather as a per-row vector
    (hoist_row_gathers), pass 1 per row of its tile, pass 2 per column, one gather per row
    instead of one per element."""
    items = ([bwd.gradient] if bwd.gradient is not None else []) + bwd.column_sums
    found = []
    for item in items:
        if item.rows_loop != 0 or not gathers_in_tile(item.op):
            continue
        try:
            check_row_gathers(item.op)
        except Illegal:
            continue
        found.append(item.op)
    return found


def _move_up(gathers: list[ir.Operation]) -> None:
    """Move each of `gathers` (per-row generics hoisted out of G or a column sum), with the
    tensor.empty it writes, right after the last other op of its block defining a value it
    reads, so that no reader of the gradients comes before what the passes read."""
    for gather in gathers:
        ops = block_ops(gather.block)
        position = {op: i for i, op in enumerate(ops)}
        read = [v for inner in walk_ops(gather, lambda o: True) for v in inner.operands]
        producers = [getattr(v.owner, "operation", v.owner) for v in read
                     if not isinstance(v, ir.BlockArgument)]
        empties = [p for p in producers if p in position and p.name == "tensor.empty"]
        last = max((position[p] for p in producers if p in position and p not in empties),
                   default=-1)
        if last + 1 < position[gather]:
            for op in empties + [gather]:
                op.move_before(ops[last + 1])


def check_blocks(bwd: LinearCrossEntropyBackward, target: ir.Operation, block: int,
                 step: int) -> None:
    """Illegal unless `block` and `step` divide N and V (the passes have no remainder
    blocks)."""
    n, v, _ = bwd.logits.shape
    for what, extent in (("rows", n), ("classes", v)):
        for name, tile in (("block", block), ("step", step)):
            if extent % tile:
                raise Illegal(target, f"the {what} ({extent}) are not a multiple of the "
                                      f"{name} ({tile}) of the two-pass backward")


class FuseLinearCrossEntropyBackwardTwoPassOp(
        TransformExt.Operation, name="fuse_linear_cross_entropy_backward_two_pass"):
    target: ext.Operand[transform.AnyOpType]
    block: ir.IntegerAttr
    step: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                block = ir.IntegerAttr(op.block).value
                step = ir.IntegerAttr(op.step).value
                targets = payload_ops(state, op.target)
                try:
                    if min(block, step) < 1:
                        raise Illegal(targets[0] if targets else op.operation,
                                      f"block and step must be >= 1, got {block}, {step}")
                    plans = [plan(t) for t in targets]
                    for (bwd, _), t in zip(plans, targets):
                        check_blocks(bwd, t, block, step)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for t, (bwd, at) in zip(targets, plans):
                    hoisted = _hoistable_gathers(bwd)
                    for gathering in hoisted:
                        inputs = len(gathering.opview.inputs)
                        new = hoist_gathers(gathering, rewriter)
                        _move_up([defining_op(v) for v in list(new.opview.inputs)[inputs:]])
                    if hoisted:
                        try:  # the hoisted gathers only read what G's body read
                            bwd, at = plan(t)
                        except Illegal as illegal:
                            return fail(NAME, illegal)
                    rewrite(bwd, at, block, step, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fuse_linear_cross_entropy_backward_two_pass(func_handle: ir.Value, *, block: int,
                                                step: int) -> None:
    """Replace the backward of the loss over linear logits of each function of
    `func_handle` by the two passes of the module docstring (`block` rows or classes per
    forall iteration, `step` classes or rows per loop iteration)."""
    i64 = ir.IntegerType.get_signless(64)
    FuseLinearCrossEntropyBackwardTwoPassOp(func_handle, ir.IntegerAttr.get(i64, block),
                                            ir.IntegerAttr.get(i64, step))


__all__ = ["BACKWARD_PASS", "FuseLinearCrossEntropyBackwardTwoPassOp",
           "fuse_linear_cross_entropy_backward_two_pass"]
