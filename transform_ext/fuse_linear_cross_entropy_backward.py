"""fuse_linear_cross_entropy_backward: the backward of a loss over linear logits without
the [N, V] logits or their gradient.

For the backward of each target function (transform_ext/analysis/
linear_cross_entropy_backward.py: S = h W^T, G = E(S, ...) elementwise, dh = G W,
dW = G^T h, and the column sums Z = reduce_n F(S, G, ...) such as db = sum_n G; any may be
missing; a transposed dh or dW is transposed once at the end), with R = `row_tile`,
T = `threads`, C = `class_tile`:

    for each block of R rows s (sequential):
        h_s, h_s^T (transposed once per block; as column panels of `panel` when given)
        scf.forall t < T over a contiguous share of the class tiles:
            dh_t = 0                                  [R, D], one per thread
            for each class tile c of the share:
                S_c^T = W_c h_s^T                     [C, R]  (recomputed: no [N, V] S;
                                                               with `stored_logits`, the
                                                               slice of S^T [V, N] instead)
                G_c^T = E(S_c^T, ...)                 [C, R]  (E's body, at the tile's rows
                                                                and classes)
                dW_c += G_c^T h_s,  Z_c = F(S_c^T, G_c^T, ...) reduced into Z_c,
                dh_t += G_c W_c
        (the last V mod C classes: one more tile after the forall)
        dh_s = sum_t dh_t
    (the last N mod R rows: one more block of their own size)

With `stored_logits`, S^T = transpose(S) is read once before the loop nest (a linalg.generic
reading the logits contraction's result), and each class tile reads its [C, R] slice of it:
once the forward's fused class loops yield the logits tiles they compute into S^T
(fuse_dependent_reduction_ops' yield_producers), the backward does two products per tile,
not three, for N x V f32 of memory.
dW and the column sums accumulate over the row blocks (each thread owns its classes: no
conflict; a column sum starts from its own init and combines with its own body); dh over the
threads' partial sums [T, R, D], the only memory besides the tiles. The layouts keep the
vector lanes along a contiguous dim in every product: S^T and G^T [classes, rows] (lanes
along the rows, h_s^T), W read in place; with `panel` = w > 0 the [K, N] right operands of
the products (h_s^T, h_s, W_c) are read as column panels [N / w, K, w] when w divides N,
so a register tile's slice is contiguous. The products multiply-add in f32 on f32 operands
(f16/bf16 h_s, h_s^T, W_c and G^T widened once per block or tile: exact, as torch's kernels
accumulate); G's tile keeps E's element type before it is widened (torch rounds d logits
to bf16 before its bf16 products). With `bf16_pairs`, bf16 operands are not widened: the
products read them as they are (each term widened in the product's body, f32 accumulator),
so their register tiles can take pairs of k as bf16 dot products
(transform_ext.contracts_to_bf16_dot_products); dh then reads G's tile transposed once per
tile, [R, C], each row's pair of classes adjacent (one broadcast load per row and pair).
With `amx` too, a product of bf16 factors whose extents (m, n, k) are multiples of 32 is
built in pairs of k for AMX tiles, loops (m, n, p, v), marked lh.amx_product
(transform_ext.common.AMX_PRODUCT): S_c^T from W_c [C, D/2, 2] in place and h_s^T as pairs
[D/2, R, 2]; dW_c from G_c^T [C, R/2, 2] in place and h_s's pairs of rows [R/2, D, 2] (both
packed once per block); dh from G_c [R, C/2, 2] and the pairs of classes of W's whole tiles
[V'/2, D, 2], packed once before the row blocks. The others (a remainder tile or block)
stay as above.
The loop over the row blocks carries the unit
attribute `lh.fused_kernel` (when it has more than one iteration): it is fused, the
schedule's later steps leave it alone.

Preconditions (checked on every target first; a violation is a silenceable failure naming
the op): one such backward; static shapes; E's and the column sums' bodies without regions,
reading S or G [rows, classes] and every other tensor through a projected map (an [N, V]
one only when it is a function argument); every reader of G is dh, dW (through transposes
of G) or a column sum; the users of the replaced results after every value the kernel
reads (it is built right after the last of them). The
results of dh, dW and the column sums are replaced; G and those ops die (canonicalize
after this op).
"""


from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, scf, tensor, transform

from .analysis.linear_cross_entropy_backward import (LinearCrossEntropyBackward,
                                                     NotLinearCrossEntropyBackward,
                                                     RowsAndClasses,
                                                     linear_cross_entropy_backward_in)
from .analysis.structure import dim_positions, loop_structure
from .common import (AMX_PRODUCT, AMX_SIDE, Illegal, RewritesTargets, Success, block_ops,
                     body_of, build_generic, clone_op, fail, payload_ops, reassociation_attr,
                     terminator, users, walk_ops)
from .contraction_in_vnni_pairs import in_pairs, transposed_pairs
from .dialect import TransformExt
from .widen_contraction_operands import extend_to_f32

NAME = "transform_ext.fuse_linear_cross_entropy_backward"
FUSED_KERNEL = "lh.fused_kernel"
DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


# ----------------------------------------------------------------------------- legality


def _insertion_point(bwd: LinearCrossEntropyBackward, ops: list[ir.Operation]) -> ir.Operation:
    """The op the kernel is built before: right after the last op defining a value that G,
    the column sums (their bodies too), h or W read; Illegal when a user of a replaced
    result comes before it."""
    position = {op: i for i, op in enumerate(ops)}
    tiled = ([bwd.gradient.op] if bwd.gradient is not None else []) + [c.op for c in bwd.column_sums]
    inits = {c.op.operands[loop_structure(c.op).num_inputs] for c in bwd.column_sums}
    for init in inits:
        _init_ops(init)  # (rebuilt at the kernel: where they are does not matter)
    values = [bwd.logits.rows, bwd.logits.weight]
    for op in tiled:
        values += [v for inner in walk_ops(op, lambda o: True) for v in inner.operands
                   if v not in inits]
    last = -1
    for value in values:
        producer = None if isinstance(value, ir.BlockArgument) else value.owner
        producer = getattr(producer, "operation", producer)
        if producer in position and producer not in tiled:
            last = max(last, position[producer])
    for op in bwd.replaced:
        for user in users(op.results[0]):
            if user in position and position[user] <= last:
                raise Illegal(user, "reads a gradient before the values the fused backward "
                                    "reads are computed")
    return ops[last + 1]


_PURE = ("tensor.empty", "linalg.fill", "arith.constant")


def _init_ops(value: ir.Value) -> list[ir.Operation]:
    """The ops computing a column sum's init from constants only (tensor.empty, fills,
    input-less generics, their constants), in order; Illegal when it reads data."""
    found: list[ir.Operation] = []

    def visit(v: ir.Value) -> None:
        if isinstance(v, ir.BlockArgument):
            raise Illegal(v.owner.owner, "a reduction over the rows starts from an argument")
        op = getattr(v.owner, "operation", v.owner)
        if op in found:
            return
        if op.name == "linalg.generic" and loop_structure(op).num_inputs == 0:
            for inner in body_of(op).operations:
                for operand in inner.operation.operands:
                    if not isinstance(operand, ir.BlockArgument) and \
                            getattr(operand.owner, "operation", operand.owner).parent != op:
                        visit(operand)
        elif op.name not in _PURE:
            raise Illegal(op, "a reduction over the rows starts from a value computed from data")
        for operand in op.operands:
            visit(operand)
        found.append(op)

    visit(value)
    return found


def plan(target: ir.Operation) -> tuple[LinearCrossEntropyBackward, ir.Operation]:
    """The backward of `target` meeting the preconditions and the op to build the kernel
    before, or Illegal."""
    if target.name != "func.func":
        raise Illegal(target, "not a function")
    try:
        bwd = linear_cross_entropy_backward_in(target.regions[0].blocks[0])
    except NotLinearCrossEntropyBackward as exc:
        raise Illegal(target, str(exc))
    tiled = ([bwd.gradient] if bwd.gradient is not None else []) + bwd.column_sums
    for item in tiled:
        if walk_ops(item.op, lambda o: o != item.op and len(o.regions) > 0):
            raise Illegal(item.op, "its body holds an op with a region")
    return bwd, _insertion_point(bwd, block_ops(target))


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


def _parallel_insert(source: ir.Value, dest: ir.Value, offsets: list, sizes: list) -> None:
    offs, static_offs = _split(offsets)
    szs, static_szs = _split(sizes)
    tensor.ParallelInsertSliceOp(source, dest, offs, szs, [], static_offs, static_szs,
                                 [1] * len(sizes))


def _zeros(shape: list[int], element: ir.Type) -> ir.Value:
    empty = tensor.EmptyOp(shape, element).result
    zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
    return linalg.fill(zero, outs=[empty])


def _map(n: int, dims: list[int]) -> ir.AffineMap:
    return ir.AffineMap.get(n, 0, [ir.AffineDimExpr.get(d) for d in dims])


def _widen(value: ir.Value) -> ir.Value:
    """A product's term in f32: bf16 terms (read unwidened for bf16 pairs) by arith.extf,
    which the vectorizer folds into the contraction."""
    if value.type == ir.F32Type.get():
        return value
    if isinstance(value.type, ir.BF16Type):
        return arith.ExtFOp(ir.F32Type.get(), value).result
    return extend_to_f32(value)


def _multiply_add(args: list[ir.Value]) -> list[ir.Value]:
    """acc + a b in f32 (f16/bf16 operands widened)."""
    a, b, acc = args
    return [arith.addf(acc, arith.mulf(_widen(a), _widen(b)))]


def _in_f32(x: ir.Value) -> ir.Value:
    """`x` widened to f32 (itself when it is f32): the products then run on f32 operands,
    each 16-bit element widened once instead of once per multiply."""
    t = ir.RankedTensorType(x.type)
    if str(t.element_type) == "f32":
        return x
    f32 = ir.F32Type.get()
    identity = ir.AffineMap.get_identity(t.rank)
    return build_generic([x], [tensor.EmptyOp(list(t.shape), f32).result], [identity, identity],
                         ["parallel"] * t.rank, lambda args: [extend_to_f32(args[0])]).results[0]


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


def _maybe_panels(b: ir.Value, width: int) -> ir.Value:
    """`b` as panels of `width` columns when they divide its columns (width > 0)."""
    n = ir.RankedTensorType(b.type).shape[1]
    return _panels(b, width) if width and n % width == 0 and n > width else b


def _product(a: ir.Value, a_rows_first: bool, b: ir.Value, acc: ir.Value) -> ir.Value:
    """acc[M, N] += sum_k A[m, k] B[k, n]: A is `a` ([M, K] when `a_rows_first`, else
    [K, M]); B is `b`, [K, N] or its panels [N / w, K, w] (then acc is read as [M, N / w, w]
    and the result reshaped back)."""
    a_dims = lambda m, k: [m, k] if a_rows_first else [k, m]
    if ir.RankedTensorType(b.type).rank == 2:
        return build_generic([a, b], [acc], [_map(3, a_dims(0, 2)), _map(3, [2, 1]), _map(3, [0, 1])],
                             ["parallel", "parallel", "reduction"], _multiply_add).results[0]
    panels, _, width = ir.RankedTensorType(b.type).shape
    rows, _ = ir.RankedTensorType(acc.type).shape
    acc_type = ir.RankedTensorType(acc.type)
    split_type = ir.RankedTensorType.get([rows, panels, width], acc_type.element_type)
    split = tensor.ExpandShapeOp(split_type, acc, reassociation_attr([[0], [1, 2]]), [],
                                 [rows, panels, width]).result
    out = build_generic([a, b], [split],
                        [_map(4, a_dims(0, 3)), _map(4, [1, 3, 2]), _map(4, [0, 1, 2])],
                        ["parallel", "parallel", "parallel", "reduction"], _multiply_add).results[0]
    return tensor.CollapseShapeOp(acc_type, out, reassociation_attr([[0], [1, 2]])).result


def _pairs_of_rows(b: ir.Value) -> ir.Value:
    """B [K, N] as pairs of its rows [K/2, N, 2], P[p, n, v] = B[2p + v, n]: an AMX
    product's second factor (VNNI)."""
    k, n = ir.RankedTensorType(b.type).shape
    element = ir.RankedTensorType(b.type).element_type
    split = tensor.ExpandShapeOp(ir.RankedTensorType.get([k // 2, 2, n], element), b,
                                 reassociation_attr([[0, 1], [2]]), [], [k // 2, 2, n]).result
    empty = tensor.EmptyOp([k // 2, n, 2], element).result
    return linalg.transpose(split, outs=[empty], permutation=[0, 2, 1]).results[0]


def _pair_product(a: ir.Value, b: ir.Value, acc: ir.Value) -> ir.Value:
    """acc[M, N] += sum_(p, v) A[m, p, v] B[p, n, v] (bf16 pairs, f32 acc), loops (m, n,
    p, v), marked AMX_PRODUCT: the CPU schedule cuts it into AMX tile steps."""
    out = build_generic([a, b], [acc], [_map(4, [0, 2, 3]), _map(4, [2, 1, 3]), _map(4, [0, 1])],
                        ["parallel", "parallel", "reduction", "reduction"], _multiply_add)
    out.attributes[AMX_PRODUCT] = ir.UnitAttr.get()
    return out.results[0]


class _ClassAccumulator:
    """A result accumulated per class over the row blocks (dW [V, D], a column sum [.., V, ..]):
    its full value, the axis of its classes."""

    def __init__(self, init: ir.Value, axis: int):
        self.init, self.axis = init, axis
        self.shape = list(ir.RankedTensorType(init.type).shape)

    def slice(self, value: ir.Value, offset, size) -> ir.Value:
        offsets = [0] * len(self.shape)
        sizes = list(self.shape)
        offsets[self.axis], sizes[self.axis] = offset, size
        return _slice(value, offsets, sizes)

    def insert(self, part: ir.Value, value: ir.Value, offset, size) -> ir.Value:
        offsets = [0] * len(self.shape)
        sizes = list(self.shape)
        offsets[self.axis], sizes[self.axis] = offset, size
        return _insert(part, value, offsets, sizes)

    def parallel_insert(self, part: ir.Value, value: ir.Value, offset, size) -> None:
        offsets = [0] * len(self.shape)
        sizes = list(self.shape)
        offsets[self.axis], sizes[self.axis] = offset, size
        _parallel_insert(part, value, offsets, sizes)


class _Kernel:
    """The loop nest of the module docstring for one backward. The carried values: dh
    (when there is one), then one _ClassAccumulator per dW and column sum."""

    def __init__(self, bwd: LinearCrossEntropyBackward, row_tile: int, class_tile: int,
                 threads: int, panel: int, bf16_pairs: bool, amx: bool = False,
                 stored_logits: bool = False):
        self.bwd = bwd
        self.stored_logits = stored_logits
        self.logits_t = None  # S^T [V, N], read per tile when `stored_logits`
        self.bf16_pairs = bf16_pairs
        self.amx = amx
        self.n, self.v, self.d = bwd.logits.shape
        self.rows = min(row_tile, self.n)
        self.classes = min(class_tile, self.v)
        self.threads = threads
        self.panel = panel
        self.f32 = ir.F32Type.get()
        self.has_dh = bwd.d_rows is not None
        self.accumulators: list[_ClassAccumulator] = []
        self.w_pairs = None  # W's whole class tiles in pairs of classes, for dh on AMX tiles

    def on_tiles(self, m: int, n: int, k: int, *factors: ir.Value) -> bool:
        """Does a product of extents (m, n, k) of bf16 `factors` run on AMX tiles (`amx`,
        every extent a multiple of AMX_SIDE)?"""
        return self.amx and not (m % AMX_SIDE or n % AMX_SIDE or k % AMX_SIDE) and all(
            isinstance(ir.RankedTensorType(f.type).element_type, ir.BF16Type) for f in factors)

    def operand(self, x: ir.Value) -> ir.Value:
        """A product's operand: `x` widened to f32, or as it is when it is bf16 and the
        products take bf16 pairs."""
        bf16 = isinstance(ir.RankedTensorType(x.type).element_type, ir.BF16Type)
        return x if self.bf16_pairs and bf16 else _in_f32(x)

    def build(self) -> list[ir.Value]:
        """dh (when there is one), dW (when there is one) and the column sums, at the
        current insertion point."""
        bwd, f32 = self.bwd, self.f32
        carried = [tensor.EmptyOp([self.n, self.d], f32).result] if self.has_dh else []
        if bwd.d_weight is not None:
            self.accumulators.append(_ClassAccumulator(_zeros([self.v, self.d], f32), 0))
        for column in bwd.column_sums:
            ls = loop_structure(column.op)
            init = column.op.operands[ls.num_inputs]
            mapping: dict = {}
            for op in _init_ops(init):  # its init, rebuilt here (from constants only)
                clone_op(op, mapping)
            axis = dim_positions(ls.output_map(0)).index(column.class_loop)
            self.accumulators.append(_ClassAccumulator(mapping[init], axis))
        carried += [a.init for a in self.accumulators]
        if self.stored_logits:
            s = bwd.logits.result
            element = ir.RankedTensorType(s.type).element_type
            self.logits_t = build_generic(
                [s], [tensor.EmptyOp([self.v, self.n], element).result],
                [_map(2, [1, 0]), _map(2, [0, 1])], ["parallel", "parallel"],
                lambda args: [args[0]]).results[0]
        weight = bwd.logits.weight
        whole = self.v - self.v % self.classes  # the classes of whole tiles
        if self.has_dh and self.on_tiles(self.rows, self.d, self.classes, weight):
            # packed once for every row block
            self.w_pairs = _pairs_of_rows(_slice(weight, [0, 0], [whole, self.d]))
        full = self.n - self.n % self.rows
        loop = scf.ForOp(_index(0), _index(full), _index(self.rows), carried)
        loop.operation.attributes[FUSED_KERNEL] = ir.UnitAttr.get()
        with ir.InsertionPoint(loop.body):
            scf.YieldOp(self.row_block(loop.induction_variable, self.rows,
                                       list(loop.inner_iter_args)))
        results = list(loop.results)
        if self.n % self.rows:
            results = self.row_block(_index(full), self.n % self.rows, results)
        return results

    def row_block(self, s0: ir.Value, rows: int, carried: list) -> list[ir.Value]:
        """One block of `rows` rows from s0: the forall over the threads' classes, the
        remainder class tile, dh_s into dh."""
        f32, d = self.f32, self.d
        dh = carried[0] if self.has_dh else None
        accumulated = carried[1:] if self.has_dh else carried
        h = self.bwd.logits.rows
        h_s = _slice(h, [s0, 0], [rows, d])
        h_type = ir.RankedTensorType(h.type).element_type
        h_t = linalg.transpose(h_s, outs=[tensor.EmptyOp([d, rows], h_type).result],
                               permutation=[1, 0]).results[0]
        block = _Block(self, s0, rows, _maybe_panels(self.operand(h_s), self.panel),
                       _maybe_panels(self.operand(h_t), self.panel))
        if self.on_tiles(self.classes, rows, d, h_s):  # S^T's and dW's second factors
            if not self.stored_logits:
                block.h_t_pairs = transposed_pairs(h_s)
            block.h_pairs = _pairs_of_rows(h_s)
        tiles = (self.v - self.v % self.classes) // self.classes
        shared = ([tensor.EmptyOp([self.threads, rows, d], f32).result] if self.has_dh else []) \
            + accumulated
        forall = scf.ForallOp([0], [self.threads], [1], shared_outs=shared)
        with ir.InsertionPoint(forall.body):
            t = forall.induction_variables[0]
            lo = arith.muli(arith.divui(arith.muli(t, _index(tiles)), _index(self.threads)),
                            _index(self.classes))
            hi = arith.muli(arith.divui(arith.muli(arith.addi(t, _index(1)), _index(tiles)),
                                        _index(self.threads)), _index(self.classes))
            size = arith.subi(hi, lo)
            outs = list(forall.inner_iter_args)
            outs_acc = outs[1:] if self.has_dh else outs
            inits = ([_zeros([rows, d], f32)] if self.has_dh else []) + \
                [a.slice(v, lo, size) for a, v in zip(self.accumulators, outs_acc)]
            loop = scf.ForOp(lo, hi, _index(self.classes), inits)
            with ir.InsertionPoint(loop.body):
                c0 = loop.induction_variable
                scf.YieldOp(block.class_tile(c0, arith.subi(c0, lo), self.classes,
                                             list(loop.inner_iter_args)))
            parts = list(loop.results)
            parallel = scf.InParallelOp()
            with ir.InsertionPoint(parallel.block):
                if self.has_dh:
                    _parallel_insert(parts[0], outs[0], [t, 0, 0], [1, rows, d])
                for a, part, out in zip(self.accumulators, parts[1:] if self.has_dh else parts,
                                        outs_acc):
                    a.parallel_insert(part, out, lo, size)
        results = list(forall.results)
        partial = results[0] if self.has_dh else None
        accumulated = results[1:] if self.has_dh else results
        rest = self.v % self.classes
        extra = None
        if rest:
            c0 = self.v - rest
            inits = ([_zeros([rows, d], f32)] if self.has_dh else []) + \
                [a.slice(v, c0, rest) for a, v in zip(self.accumulators, accumulated)]
            tile = block.class_tile(_index(c0), _index(0), rest, inits)
            extra = tile[0] if self.has_dh else None
            parts = tile[1:] if self.has_dh else tile
            accumulated = [a.insert(p, v, c0, rest)
                           for a, p, v in zip(self.accumulators, parts, accumulated)]
        result = []
        if self.has_dh:
            init = extra if extra is not None else _zeros([rows, d], f32)
            dh_s = build_generic([partial], [init], [_map(3, [0, 1, 2]), _map(3, [1, 2])],
                                 ["reduction", "parallel", "parallel"],
                                 lambda args: [arith.addf(args[1], args[0])]).results[0]
            result.append(_insert(dh_s, dh, [s0, 0], [rows, d]))
        return result + accumulated


class _Block:
    """The class tiles of one block of rows."""

    def __init__(self, kernel: _Kernel, s0: ir.Value, rows: int, h_s: ir.Value, h_t: ir.Value):
        self.k, self.s0, self.rows, self.h_s, self.h_t = kernel, s0, rows, h_s, h_t
        self.h_t_pairs = self.h_pairs = None  # h_s^T [D/2, R, 2] and h_s [R/2, D, 2]

    def class_tile(self, c0: ir.Value, local: ir.Value, classes: int, carried: list) -> list:
        """The tile of `classes` classes from c0 (at `local` in the carried accumulators):
        S^T, G^T, then dW, the column sums, dh updated; returns the carried values."""
        k = self.k
        bwd, f32, d = k.bwd, k.f32, k.d
        dh = carried[0] if k.has_dh else None
        accumulated = carried[1:] if k.has_dh else carried
        w_raw = _slice(bwd.logits.weight, [c0, 0], [classes, d])
        w_c = k.operand(w_raw)
        if k.logits_t is not None:
            s_t = _slice(k.logits_t, [c0, self.s0], [classes, self.rows])
        elif self.h_t_pairs is not None and k.on_tiles(classes, self.rows, d, w_raw):
            s_t = _pair_product(in_pairs(w_raw), self.h_t_pairs,
                                _zeros([classes, self.rows], f32))
        else:
            s_t = _product(w_c, True, self.h_t, _zeros([classes, self.rows], f32))
        tiles = {bwd.logits.result: s_t}
        if bwd.gradient is not None:
            g = bwd.gradient
            g_type = ir.RankedTensorType(g.op.results[0].type).element_type
            out = tensor.EmptyOp([classes, self.rows], g_type).result
            tiles[g.op.results[0]] = self.tile_op(g, tiles, c0, classes, out, _map(2, [0, 1]))
        result = []
        g_t = k.operand(tiles[bwd.gradient.op.results[0]]) if dh is not None or \
            bwd.d_weight is not None else None
        if dh is not None:
            if g_t.type.element_type != f32:
                # bf16 pairs of classes: G's tile transposed once, each row's pair adjacent
                rows_major = linalg.transpose(g_t, outs=[tensor.EmptyOp(
                    [self.rows, classes], g_t.type.element_type).result], permutation=[1, 0])
                if k.w_pairs is not None and k.on_tiles(self.rows, d, classes, g_t):
                    w_pairs = _slice(k.w_pairs, [arith.divui(c0, _index(2)), 0, 0],
                                     [classes // 2, d, 2])
                    result.append(_pair_product(in_pairs(rows_major.results[0]), w_pairs, dh))
                else:
                    result.append(_product(rows_major.results[0], True,
                                           _maybe_panels(w_c, k.panel), dh))
            else:
                result.append(_product(g_t, False, _maybe_panels(w_c, k.panel), dh))
        sums = iter(zip(k.accumulators, accumulated))
        if bwd.d_weight is not None:
            acc, dw = next(sums)
            if self.h_pairs is not None and k.on_tiles(classes, d, self.rows, g_t):
                dw_c = _pair_product(in_pairs(g_t), self.h_pairs, acc.slice(dw, local, classes))
            else:
                dw_c = _product(g_t, True, self.h_s, acc.slice(dw, local, classes))
            result.append(acc.insert(dw_c, dw, local, classes))
        for column, (acc, total) in zip(bwd.column_sums, sums):
            part = self.tile_op(column, tiles, c0, classes, acc.slice(total, local, classes))
            result.append(acc.insert(part, total, local, classes))
        return result

    def tile_op(self, item: RowsAndClasses, tiles: dict, c0: ir.Value, classes: int,
                out: ir.Value, out_map: ir.AffineMap | None = None) -> ir.Value:
        """`item`'s op at the tile's classes and rows, [classes, rows] (tile_op)."""
        return tile_op(item, tiles, (self.s0, self.rows), (c0, classes), out, out_map,
                       rows_major=False)


def tile_op(item: RowsAndClasses, tiles: dict, rows: tuple, classes: tuple, out: ir.Value,
            out_map: ir.AffineMap | None = None, rows_major: bool = False,
            sliced: dict | None = None, slice_fn=None) -> ir.Value:
    """`item`'s op at a tile of (origin, size) `rows` and `classes`, into `out` (through
    `out_map`, else its own output map): its loops (rows, classes) become (0, 1) when
    `rows_major`, else (1, 0); S and G read as their tiles (the values of `tiles`, laid out
    as the loops), every other input sliced to the tile along the dims it reads;
    linalg.index counts from the tile's origin. `sliced`: inputs already sliced to the tile
    (value -> its slice, or for a rank-0 input the scalar read from it, used in the body
    directly); `slice_fn(value, offsets, sizes)` slices the others (a tensor.extract_slice
    by default)."""
    slice_fn = slice_fn or _slice
    op = item.op
    ls = loop_structure(op)
    rows_at, classes_at = (0, 1) if rows_major else (1, 0)
    loop_of = {item.rows_loop: rows_at, item.class_loop: classes_at}
    origin = {item.rows_loop: rows[0], item.class_loop: classes[0]}
    extent = {item.rows_loop: rows[1], item.class_loop: classes[1]}

    def tile_map(amap: ir.AffineMap) -> ir.AffineMap:
        return ir.AffineMap.get(2, 0, [ir.AffineDimExpr.get(loop_of[ir.AffineDimExpr(e).position])
                                       if isinstance(e, ir.AffineDimExpr) else e
                                       for e in amap.results])

    inputs, maps, scalars = [], [], {}
    for i, (value, amap) in enumerate(zip(list(op.operands)[:ls.num_inputs], ls.maps)):
        if value in tiles:
            inputs.append(tiles[value])
            maps.append(_map(2, [0, 1]))
            continue
        if sliced and value in sliced and not isinstance(sliced[value].type, ir.ShapedType):
            scalars[i] = sliced[value]   # a rank-0 input read once as a scalar
            continue
        if sliced and value in sliced:
            value = sliced[value]
        elif isinstance(value.type, ir.RankedTensorType):
            offsets, sizes = [], []
            for axis, expr in enumerate(amap.results):
                if isinstance(expr, ir.AffineDimExpr):
                    offsets.append(origin[expr.position])
                    sizes.append(extent[expr.position])
                else:
                    offsets.append(0)
                    sizes.append(ir.RankedTensorType(value.type).shape[axis])
            value = slice_fn(value, offsets, sizes)
        inputs.append(value)
        maps.append(tile_map(amap))
    body = body_of(op)

    def clone(args):
        args = iter(args)
        mapping = {body.arguments[i]: scalars[i] if i in scalars else next(args)
                   for i in range(ls.num_inputs + 1)}
        for inner in list(body.operations)[:-1]:
            inner = inner.operation
            if inner.name == "linalg.index":
                dim = ir.IntegerAttr(inner.attributes["dim"]).value
                i64 = ir.IntegerType.get_signless(64)
                index = linalg.IndexOp(ir.IntegerAttr.get(i64, loop_of[dim])).result
                mapping[inner.results[0]] = arith.addi(index, origin[dim])
                continue
            clone_op(inner, mapping)
        return [mapping.get(v, v) for v in terminator(body).operands]

    iterators = ["parallel", "parallel"]
    if item.rows_loop in ls.reduction_dims:
        iterators[rows_at] = "reduction"
    out_map = out_map or tile_map(ls.output_map(0))
    return build_generic(inputs, [out], maps + [out_map], iterators, clone).results[0]


# ----------------------------------------------------------------------------- rewrite


def rewrite(bwd: LinearCrossEntropyBackward, at: ir.Operation, row_tile: int, class_tile: int,
            threads: int, panel: int, bf16_pairs: bool, amx: bool, stored_logits: bool,
            rewriter) -> None:
    with ir.InsertionPoint(at), at.location:
        results = iter(_Kernel(bwd, row_tile, class_tile, threads, panel, bf16_pairs,
                               amx, stored_logits).build())
        replaced = [(op, next(results)) for op in (bwd.d_rows, bwd.d_weight) if op is not None]
        replaced += [(column.op, next(results)) for column in bwd.column_sums]
        for i, (op, value) in enumerate(replaced):
            role = "rows" if op == bwd.d_rows else "weight"
            if op in (bwd.d_rows, bwd.d_weight) and role in bwd.transposed:
                # d(h^T) = (G W)^T, d(W^T) = (G^T h)^T
                rows, cols = ir.RankedTensorType(value.type).shape
                empty = tensor.EmptyOp([cols, rows], ir.F32Type.get()).result
                replaced[i] = (op, linalg.transpose(value, outs=[empty],
                                                    permutation=[1, 0]).results[0])
    for op, value in replaced:
        rewriter.replace_op(op, [value])
    for op in reversed(bwd.transposes):
        if not any(list(r.uses) for r in op.results):
            rewriter.erase_op(op)
    if bwd.gradient is not None and not list(bwd.gradient.op.results[0].uses):
        rewriter.erase_op(bwd.gradient.op)


class FuseLinearCrossEntropyBackwardOp(TransformExt.Operation,
                                       name="fuse_linear_cross_entropy_backward"):
    target: ext.Operand[transform.AnyOpType]
    row_tile: ir.IntegerAttr
    class_tile: ir.IntegerAttr
    threads: ir.IntegerAttr
    panel: ir.IntegerAttr
    bf16_pairs: ir.IntegerAttr  # i1
    amx: ir.IntegerAttr  # i1
    stored_logits: ir.IntegerAttr  # i1

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                rows = ir.IntegerAttr(op.row_tile).value
                classes = ir.IntegerAttr(op.class_tile).value
                threads = ir.IntegerAttr(op.threads).value
                panel = ir.IntegerAttr(op.panel).value
                bf16_pairs = bool(ir.IntegerAttr(op.bf16_pairs).value)
                amx = bf16_pairs and bool(ir.IntegerAttr(op.amx).value)
                stored = bool(ir.IntegerAttr(op.stored_logits).value)
                targets = payload_ops(state, op.target)
                try:
                    if min(rows, classes, threads) < 1 or panel < 0:
                        raise Illegal(targets[0] if targets else op.operation,
                                      f"row_tile, class_tile and threads must be >= 1 and panel "
                                      f">= 0, got {rows}, {classes}, {threads}, {panel}")
                    plans = [plan(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for bwd, at in plans:
                    rewrite(bwd, at, rows, classes, threads, panel, bf16_pairs, amx, stored,
                            rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fuse_linear_cross_entropy_backward(func_handle: ir.Value, *, row_tile: int, class_tile: int,
                                       threads: int, panel: int = 0, bf16_pairs: bool = False,
                                       amx: bool = False, stored_logits: bool = False) -> None:
    """Replace the backward of the loss over linear logits of each function of
    `func_handle` by the fused loop nest (see the module docstring)."""
    i64, i1 = ir.IntegerType.get_signless(64), ir.IntegerType.get_signless(1)
    FuseLinearCrossEntropyBackwardOp(
        func_handle, ir.IntegerAttr.get(i64, row_tile), ir.IntegerAttr.get(i64, class_tile),
        ir.IntegerAttr.get(i64, threads), ir.IntegerAttr.get(i64, panel),
        ir.IntegerAttr.get(i1, bf16_pairs), ir.IntegerAttr.get(i1, amx),
        ir.IntegerAttr.get(i1, stored_logits))


__all__ = ["FuseLinearCrossEntropyBackwardOp", "fuse_linear_cross_entropy_backward",
           "FUSED_KERNEL"]
