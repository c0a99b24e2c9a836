"""fuse_linear_cross_entropy_backward: the backward of a loss over linear logits without
the [N, V] logits or their gradient.

For the backward of each target function (transform_ext/analysis/
linear_cross_entropy_backward.py: S = h W^T, G = E(S, ...) elementwise, dh = G W,
dW = G^T h, db = sum_n G; any of the three may be missing; a transposed dh or dW is
transposed once at the end), with R = `row_tile`,
T = `threads`, C = `class_tile`:

    for each block of R rows s (sequential):
        h_s, h_s^T (transposed once per block)
        scf.forall t < T over a contiguous share of the class tiles:
            dh_t = 0                                  [R, D], one per thread
            for each class tile c of the share:
                S_c^T = W_c h_s^T                     [C, R]  (recomputed: no [N, V] S)
                G_c^T = E(S_c^T, ...)                 [C, R]  (E's body, at the tile's rows
                                                                and classes)
                dW_c += G_c^T h_s,  db_c += sum_r G_c^T,  dh_t += G_c W_c
        (the last V mod C classes: one more tile after the forall)
        dh_s = sum_t dh_t
    (the last N mod R rows: one more block of their own size)

dW and db accumulate over the row blocks in f32 (each thread owns its classes: no
conflict); dh over the threads' partial sums [T, R, D], the only memory besides the tiles.
The layouts keep the vector lanes along a contiguous dim in every product: S^T and G^T
[classes, rows] (lanes along the rows, h_s^T), W read in place. The contractions
multiply-add in f32 (f16/bf16 operands widened, as torch's kernels accumulate); G keeps E's
element type (torch rounds d logits to bf16 before its bf16 products). The loop over the
row blocks carries the unit attribute `lh.fused_kernel`: it is fused, the schedule's later
steps leave it alone.

Preconditions (checked on every target first; a violation is a silenceable failure naming
the op): one such backward; static shapes; E's body without regions, E reading S [rows,
classes] and every other tensor through a projected map (an [N, V] one only when it is a
function argument); every reader of G is dh, dW (through transposes of G) or db; their
results' users after E. The results of dh, dW, db are replaced (db reshaped to its type);
G and those ops die (canonicalize after this op).
"""


from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, scf, tensor, transform

from .analysis.linear_cross_entropy_backward import (LinearCrossEntropyBackward,
                                                     NotLinearCrossEntropyBackward,
                                                     linear_cross_entropy_backward_in)
from .analysis.structure import dim_positions, loop_structure
from .common import (Illegal, RewritesTargets, Success, block_ops, body_of, build_generic,
                     clone_op, fail, payload_ops, reassociation_attr, terminator, users, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.fuse_linear_cross_entropy_backward"
FUSED_KERNEL = "lh.fused_kernel"
DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


# ----------------------------------------------------------------------------- legality


def plan(target: ir.Operation) -> LinearCrossEntropyBackward:
    """The backward of `target` meeting the preconditions, or Illegal."""
    if target.name != "func.func":
        raise Illegal(target, "not a function")
    try:
        bwd = linear_cross_entropy_backward_in(target.regions[0].blocks[0])
    except NotLinearCrossEntropyBackward as exc:
        raise Illegal(target, str(exc))
    g = bwd.gradient
    if walk_ops(g, lambda o: o != g and len(o.regions) > 0):
        raise Illegal(g, "the gradient's body holds an op with a region")
    if not loop_structure(g).is_static:
        raise Illegal(g, "the gradient has dynamic extents")
    position = {op: i for i, op in enumerate(block_ops(target))}
    for op in bwd.replaced:
        for user in users(op.results[0]):
            if user in position and position[user] < position[g]:
                raise Illegal(user, "reads a gradient before the logits' gradient is computed")
    return bwd


# ----------------------------------------------------------------------------- building


def _index(n: int) -> ir.Value:
    t = ir.IndexType.get()
    return arith.ConstantOp(t, ir.IntegerAttr.get(t, n)).result


def _split(values) -> tuple[list[ir.Value], list[int]]:
    """(dynamic values, static entries with DYNAMIC for them) of ints and index values."""
    dynamic = [v for v in values if isinstance(v, ir.Value)]
    static = [DYNAMIC if isinstance(v, ir.Value) else v for v in values]
    return dynamic, static


def _slice(value: ir.Value, offsets: list, sizes: list) -> ir.Value:
    element = ir.RankedTensorType(value.type).element_type
    shape = [DYNAMIC if isinstance(s, ir.Value) else s for s in sizes]
    offs, static_offs = _split(offsets)
    szs, static_szs = _split(sizes)
    return tensor.ExtractSliceOp(ir.RankedTensorType.get(shape, element), value, offs, szs, [],
                                 static_offs, static_szs, [1] * len(sizes)).result


def _insert(source: ir.Value, dest: ir.Value, offsets: list, sizes: list) -> ir.Value:
    offs, static_offs = _split(offsets)
    szs, static_szs = _split(sizes)
    return tensor.InsertSliceOp(source, dest, offs, szs, [], static_offs, static_szs,
                                [1] * len(sizes)).result


def _zeros(shape: list[int], element: ir.Type) -> ir.Value:
    empty = tensor.EmptyOp(shape, element).result
    zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
    return linalg.fill(zero, outs=[empty])


def _map(n: int, dims: list[int]) -> ir.AffineMap:
    return ir.AffineMap.get(n, 0, [ir.AffineDimExpr.get(d) for d in dims])


def _multiply_add(args: list[ir.Value]) -> list[ir.Value]:
    """acc + a b in f32 (f16/bf16 operands widened)."""
    f32 = ir.F32Type.get()
    a, b, acc = [v if v.type == f32 else arith.extf(f32, v) for v in args]
    return [arith.addf(acc, arith.mulf(a, b))]


def _panels(b: ir.Value, width: int) -> ir.Value:
    """B [K, N] as column panels P [N / width, K, width], P[j, k, l] = B[k, j width + l]: a
    register tile's slice of B is then contiguous (rows of B 4 KiB apart would share cache
    sets)."""
    k, n = ir.RankedTensorType(b.type).shape
    element = ir.RankedTensorType(b.type).element_type
    split = tensor.ExpandShapeOp(ir.RankedTensorType.get([k, n // width, width], element), b,
                                 reassociation_attr([[0], [1, 2]]), [], [k, n // width, width]).result
    empty = tensor.EmptyOp([n // width, k, width], element).result
    return linalg.transpose(split, outs=[empty], permutation=[1, 0, 2]).results[0]


def _product(a: ir.Value, a_rows_first: bool, b: ir.Value, acc: ir.Value) -> ir.Value:
    """acc[M, N] += sum_k A[m, k] B[k, n]: A is `a` ([M, K] when `a_rows_first`, else
    [K, M]); B is `b`, [K, N] or its panels [N / w, K, w] (then acc is read as [M, N / w, w]
    and the result reshaped back)."""
    a_dims = lambda m, k: [m, k] if a_rows_first else [k, m]
    if ir.RankedTensorType(b.type).rank == 2:
        return build_generic([a, b], [acc], [_map(3, a_dims(0, 2)), _map(3, [2, 1]), _map(3, [0, 1])],
                             ["parallel", "parallel", "reduction"], _multiply_add).results[0]
    panels, _, width = ir.RankedTensorType(b.type).shape
    rows, cols = ir.RankedTensorType(acc.type).shape
    acc_type = ir.RankedTensorType(acc.type)
    split = tensor.ExpandShapeOp(ir.RankedTensorType.get([rows, panels, width], acc_type.element_type),
                                 acc, reassociation_attr([[0], [1, 2]]), [], [rows, panels, width]).result
    out = build_generic([a, b], [split],
                        [_map(4, a_dims(0, 3)), _map(4, [1, 3, 2]), _map(4, [0, 1, 2])],
                        ["parallel", "parallel", "parallel", "reduction"], _multiply_add).results[0]
    return tensor.CollapseShapeOp(acc_type, out, reassociation_attr([[0], [1, 2]])).result


def _maybe_panels(b: ir.Value, width: int) -> ir.Value:
    """`b` as panels of `width` columns when they divide its columns (width > 0)."""
    n = ir.RankedTensorType(b.type).shape[1]
    return _panels(b, width) if width and n % width == 0 and n > width else b


class _Kernel:
    """The loop nest of the module docstring for one backward."""

    def __init__(self, bwd: LinearCrossEntropyBackward, row_tile: int, class_tile: int,
                 threads: int, panel: int):
        self.bwd = bwd
        self.panel = panel
        self.n, self.v, self.d = bwd.logits.shape
        self.rows = min(row_tile, self.n)
        self.classes = min(class_tile, self.v)
        self.threads = threads
        self.f32 = ir.F32Type.get()
        self.g_type = ir.RankedTensorType(bwd.gradient.results[0].type).element_type

    def build(self) -> tuple[ir.Value | None, ir.Value | None, ir.Value | None]:
        """(dh, dW, db) as f32 [N, D], [V, D], [V], at the current insertion point."""
        bwd, f32 = self.bwd, self.f32
        carried = []
        if bwd.d_rows is not None:
            carried.append(tensor.EmptyOp([self.n, self.d], f32).result)
        if bwd.d_weight is not None:
            carried.append(_zeros([self.v, self.d], f32))
        if bwd.d_bias is not None:
            carried.append(_zeros([self.v], f32))
        full = self.n - self.n % self.rows
        loop = scf.ForOp(_index(0), _index(full), _index(self.rows), carried)
        loop.operation.attributes[FUSED_KERNEL] = ir.UnitAttr.get()
        with ir.InsertionPoint(loop.body):
            scf.YieldOp(self.row_block(loop.induction_variable, self.rows,
                                       list(loop.inner_iter_args)))
        results = list(loop.results)
        if self.n % self.rows:
            results = self.row_block(_index(full), self.n % self.rows, results)
        it = iter(results)
        return tuple(next(it) if op is not None else None
                     for op in (bwd.d_rows, bwd.d_weight, bwd.d_bias))

    def _unpack(self, carried: list) -> tuple:
        it = iter(carried)
        bwd = self.bwd
        return tuple(next(it) if op is not None else None
                     for op in (bwd.d_rows, bwd.d_weight, bwd.d_bias))

    def row_block(self, s0: ir.Value, rows: int, carried: list) -> list[ir.Value]:
        """One block of `rows` rows from s0: the forall over the threads' classes, the
        remainder class tile, dh_s into dh."""
        bwd, f32, d = self.bwd, self.f32, self.d
        dh, dw, db = self._unpack(carried)
        h = bwd.logits.rows
        h_s = _slice(h, [s0, 0], [rows, d])
        h_type = ir.RankedTensorType(h.type).element_type
        h_t = linalg.transpose(h_s, outs=[tensor.EmptyOp([d, rows], h_type).result],
                               permutation=[1, 0]).results[0]
        block = _Block(self, s0, rows, _maybe_panels(h_s, self.panel),
                       _maybe_panels(h_t, self.panel))
        tiles = (self.v - self.v % self.classes) // self.classes
        shared = []
        if dh is not None:
            shared.append(tensor.EmptyOp([self.threads, rows, d], f32).result)
        if dw is not None:
            shared.append(dw)
        if db is not None:
            shared.append(db)
        forall = scf.ForallOp([0], [self.threads], [1], shared_outs=shared)
        with ir.InsertionPoint(forall.body):
            t = forall.induction_variables[0]
            lo = arith.muli(arith.divui(arith.muli(t, _index(tiles)), _index(self.threads)),
                            _index(self.classes))
            t1 = arith.addi(t, _index(1))
            hi = arith.muli(arith.divui(arith.muli(t1, _index(tiles)), _index(self.threads)),
                            _index(self.classes))
            size = arith.subi(hi, lo)
            outs = self._unpack(list(forall.inner_iter_args))
            inits = []
            if dh is not None:
                inits.append(_zeros([rows, d], f32))
            if dw is not None:
                inits.append(_slice(outs[1], [lo, 0], [size, d]))
            if db is not None:
                inits.append(_slice(outs[2], [lo], [size]))
            loop = scf.ForOp(lo, hi, _index(self.classes), inits)
            with ir.InsertionPoint(loop.body):
                c0 = loop.induction_variable
                local = arith.subi(c0, lo)
                scf.YieldOp(block.class_tile(c0, local, self.classes,
                                             list(loop.inner_iter_args)))
            parts = self._unpack(list(loop.results))
            parallel = scf.InParallelOp()
            with ir.InsertionPoint(parallel.block):
                if dh is not None:
                    tensor.ParallelInsertSliceOp(
                        parts[0], outs[0], [t], [], [], [DYNAMIC, 0, 0], [1, rows, d], [1, 1, 1])
                if dw is not None:
                    tensor.ParallelInsertSliceOp(parts[1], outs[1], [lo], [size], [],
                                                 [DYNAMIC, 0], [DYNAMIC, d], [1, 1])
                if db is not None:
                    tensor.ParallelInsertSliceOp(parts[2], outs[2], [lo], [size], [],
                                                 [DYNAMIC], [DYNAMIC], [1])
        partial, dw, db = self._unpack(list(forall.results))
        rest = self.v % self.classes
        extra = None
        if rest:
            c0 = self.v - rest
            inits = []
            if dh is not None:
                inits.append(_zeros([rows, d], f32))
            if dw is not None:
                inits.append(_slice(dw, [c0, 0], [rest, d]))
            if db is not None:
                inits.append(_slice(db, [c0], [rest]))
            tile = self._unpack(block.class_tile(_index(c0), _index(0), rest, inits))
            extra = tile[0]
            if dw is not None:
                dw = _insert(tile[1], dw, [c0, 0], [rest, d])
            if db is not None:
                db = _insert(tile[2], db, [c0], [rest])
        result = []
        if dh is not None:
            init = extra if extra is not None else _zeros([rows, d], f32)
            dh_s = build_generic([partial], [init], [_map(3, [0, 1, 2]), _map(3, [1, 2])],
                                 ["reduction", "parallel", "parallel"],
                                 lambda args: [arith.addf(args[1], args[0])]).results[0]
            result.append(_insert(dh_s, dh, [s0, 0], [rows, d]))
        if dw is not None:
            result.append(dw)
        if db is not None:
            result.append(db)
        return result


class _Block:
    """The class tiles of one block of rows."""

    def __init__(self, kernel: _Kernel, s0: ir.Value, rows: int, h_s: ir.Value, h_t: ir.Value):
        self.k, self.s0, self.rows, self.h_s, self.h_t = kernel, s0, rows, h_s, h_t

    def class_tile(self, c0: ir.Value, local: ir.Value, classes: int, carried: list) -> list:
        """The tile of `classes` classes from c0 (at `local` in the carried dW and db):
        S^T, G^T, then dW, db, dh updated; returns the carried values."""
        k = self.k
        bwd, f32, d, rows = k.bwd, k.f32, k.d, self.rows
        dh, dw, db = k._unpack(carried)
        w_c = _slice(bwd.logits.weight, [c0, 0], [classes, d])
        s_t = _product(w_c, True, self.h_t, _zeros([classes, rows], f32))
        g_t = self.gradient_tile(s_t, c0, classes)
        result = []
        if dh is not None:
            result.append(_product(g_t, False, _maybe_panels(w_c, k.panel), dh))
        if dw is not None:
            dw_c = _slice(dw, [local, 0], [classes, d])
            dw_c = _product(g_t, True, self.h_s, dw_c)
            result.append(_insert(dw_c, dw, [local, 0], [classes, d]))
        if db is not None:
            db_c = _slice(db, [local], [classes])
            db_c = build_generic([g_t], [db_c], [_map(2, [0, 1]), _map(2, [0])],
                                 ["parallel", "reduction"],
                                 lambda args: [arith.addf(args[1], _widen(args[0]))]).results[0]
            result.append(_insert(db_c, db, [local], [classes]))
        return result

    def gradient_tile(self, s_t: ir.Value, c0: ir.Value, classes: int) -> ir.Value:
        """G^T [classes, rows] = E at the tile's classes and rows: E's loops (rows, classes)
        become (1, 0); every input is sliced to the tile along the dims it reads (S is the
        recomputed S^T); linalg.index counts from the tile's origin."""
        k = self.k
        bwd = k.bwd
        g = bwd.gradient
        ls = loop_structure(g)
        loop_of = {bwd.rows_loop: 1, bwd.class_loop: 0}
        origin = {bwd.rows_loop: self.s0, bwd.class_loop: c0}
        extent = {bwd.rows_loop: self.rows, bwd.class_loop: classes}
        inputs, maps = [], []
        for value, amap in zip(list(g.operands)[:ls.num_inputs], ls.maps):
            if value == bwd.logits.result:
                inputs.append(s_t)
                maps.append(_map(2, [0, 1]))
                continue
            results = []
            if isinstance(value.type, ir.RankedTensorType):
                offsets, sizes = [], []
                for axis, expr in enumerate(amap.results):
                    if isinstance(expr, ir.AffineDimExpr):
                        offsets.append(origin[expr.position])
                        sizes.append(extent[expr.position])
                        results.append(ir.AffineDimExpr.get(loop_of[expr.position]))
                    else:
                        offsets.append(0)
                        sizes.append(ir.RankedTensorType(value.type).shape[axis])
                        results.append(expr)
                value = _slice(value, offsets, sizes)
            inputs.append(value)
            maps.append(ir.AffineMap.get(2, 0, results))
        out = tensor.EmptyOp([classes, self.rows], k.g_type).result
        body = body_of(g)

        def clone(args):
            mapping = {body.arguments[i]: args[i] for i in range(ls.num_inputs)}
            mapping[body.arguments[ls.num_inputs]] = args[ls.num_inputs]
            for op in list(body.operations)[:-1]:
                op = op.operation
                if op.name == "linalg.index":
                    dim = ir.IntegerAttr(op.attributes["dim"]).value
                    i64 = ir.IntegerType.get_signless(64)
                    local = linalg.IndexOp(ir.IntegerAttr.get(i64, loop_of[dim])).result
                    mapping[op.results[0]] = arith.addi(local, origin[dim])
                    continue
                clone_op(op, mapping)
            return [mapping.get(v, v) for v in terminator(body).operands]

        return build_generic(inputs, [out], maps + [_map(2, [0, 1])], ["parallel", "parallel"],
                             clone).results[0]


def _widen(value: ir.Value) -> ir.Value:
    f32 = ir.F32Type.get()
    return value if value.type == f32 else arith.extf(f32, value)


# ----------------------------------------------------------------------------- rewrite


def rewrite(bwd: LinearCrossEntropyBackward, row_tile: int, class_tile: int, threads: int,
            panel: int, rewriter) -> ir.Operation:
    g = bwd.gradient
    with ir.InsertionPoint(g), g.location:
        dh, dw, db = _Kernel(bwd, row_tile, class_tile, threads, panel).build()
        if db is not None:
            t = ir.RankedTensorType(bwd.d_bias.results[0].type)
            if t.rank != 1:  # [1, V] or [V, 1]
                db = tensor.ExpandShapeOp(t, db, reassociation_attr([list(range(t.rank))]), [],
                                          list(t.shape)).result
        for role in bwd.transposed:  # d(h^T) = (G W)^T, d(W^T) = (G^T h)^T
            value = dh if role == "rows" else dw
            rows, cols = ir.RankedTensorType(value.type).shape
            empty = tensor.EmptyOp([cols, rows], ir.F32Type.get()).result
            flipped = linalg.transpose(value, outs=[empty], permutation=[1, 0]).results[0]
            dh, dw = (flipped, dw) if role == "rows" else (dh, flipped)
    for op, value in ((bwd.d_rows, dh), (bwd.d_weight, dw), (bwd.d_bias, db)):
        if op is not None:
            rewriter.replace_op(op, [value])
    for op in reversed(bwd.transposes):
        if not any(list(r.uses) for r in op.results):
            rewriter.erase_op(op)
    if not list(g.results[0].uses):
        rewriter.erase_op(g)
    return g


class FuseLinearCrossEntropyBackwardOp(TransformExt.Operation,
                                       name="fuse_linear_cross_entropy_backward"):
    target: ext.Operand[transform.AnyOpType]
    row_tile: ir.IntegerAttr
    class_tile: ir.IntegerAttr
    threads: ir.IntegerAttr
    panel: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                rows = ir.IntegerAttr(op.row_tile).value
                classes = ir.IntegerAttr(op.class_tile).value
                threads = ir.IntegerAttr(op.threads).value
                panel = ir.IntegerAttr(op.panel).value
                targets = payload_ops(state, op.target)
                try:
                    if min(rows, classes, threads) < 1 or panel < 0:
                        raise Illegal(targets[0] if targets else op.operation,
                                      f"row_tile, class_tile and threads must be >= 1 and panel "
                                      f">= 0, got {rows}, {classes}, {threads}, {panel}")
                    plans = [plan(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for bwd in plans:
                    rewrite(bwd, rows, classes, threads, panel, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fuse_linear_cross_entropy_backward(func_handle: ir.Value, *, row_tile: int, class_tile: int,
                                       threads: int, panel: int = 0) -> None:
    """Replace the backward of the loss over linear logits of each function of
    `func_handle` by the fused loop nest (see the module docstring)."""
    i64 = ir.IntegerType.get_signless(64)
    FuseLinearCrossEntropyBackwardOp(func_handle, ir.IntegerAttr.get(i64, row_tile),
                                     ir.IntegerAttr.get(i64, class_tile),
                                     ir.IntegerAttr.get(i64, threads), ir.IntegerAttr.get(i64, panel))


__all__ = ["FuseLinearCrossEntropyBackwardOp", "fuse_linear_cross_entropy_backward",
           "FUSED_KERNEL"]
