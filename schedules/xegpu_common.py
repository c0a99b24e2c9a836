"""The target-independent-shaped tail shared by every XeGPU schedule.

After a family has fused and a kernel schedule has tiled the payload into workgroup
`scf.forall`s (one forall = one GPU kernel, one iteration = one workgroup):
  vectorize      every linalg op of a workgroup tile becomes whole-tile vector ops
                 (`vectorize_children_and_apply_patterns`, type extensions folded into
                 `vector.contract`), loop-invariant accumulators are hoisted out of the
                 reduction loops, and contraction operands are narrowed to DPAS types
                 (`narrow_contract_operands`);
  bufferize      one-shot bufferization with identity layouts, results as out-parameters,
                 subviews folded into the transfers;
  outline        forall -> scf.parallel -> gpu.launch with the kernel's thread count,
                 then `gpu-kernel-outlining` (one gpu.module + gpu.func per kernel);
  to_xegpu       `convert-vector-to-xegpu` inside the kernels.
Layouts (workgroup -> subgroup -> instruction) are attached by the kernel schedules.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, transform, vector
from torch_mlir.dialects.bufferization import LayoutMapOption
from torch_mlir.dialects.transform import bufferization as tbuf
from torch_mlir.dialects.transform import loop, structured, xegpu

from .common import any_op, canonicalize, foreach, hoist_loop_invariant_subsets, match, run_passes, run_schedule

# gpu-lower-to-xevm-pipeline{xegpu-op-level=workgroup}, spelled out without its
# xevm-attach-target (the gpu-outline stage attaches the chip's target) and without the
# final gpu-module-to-binary (the binary stage), and without its two `cse` between the
# subgroup distribution and the blocking: they merge a loop's -inf initial row maximum with
# the -inf neutral element the layout propagation gives the row-max reduction, whose layout
# then decides the loop's blocked iter_args, so two chained key loops (causal attention)
# disagree on them ("different number of inits and region iter_args").
XEVM_PIPELINE = ", ".join([
    "cse", "lower-affine", "func.func(gpu-async-region)",
    "gpu.module(xegpu-propagate-layout{layout-kind=subgroup}, xegpu-wg-to-sg-distribute, "
    "lower-affine, xegpu-propagate-layout{layout-kind=inst}, xegpu-blocking, cse, "
    "xegpu-propagate-layout{layout-kind=lane}, xegpu-optimize-peephole, cse, "
    "xegpu-propagate-layout{layout-kind=lane}, xegpu-sg-to-lane-distribute, canonicalize, cse, "
    "loop-invariant-code-motion, cse, xegpu-vector-linearize, canonicalize, cse, arith-expand, "
    "convert-math-to-xevm, convert-xegpu-to-xevm, convert-gpu-to-llvm-spv{use-64bit-index=true}, "
    "math-extend-to-supported-types{extra-types=f16 target-type=f32}, "
    "arith-emulate-unsupported-floats{source-types=bf16 target-type=f32}, cse, "
    "reconcile-unrealized-casts)",
    "convert-vector-to-scf", "convert-scf-to-cf", "expand-strided-metadata", "gpu-to-llvm",
    "lower-affine",
    "convert-vector-to-llvm{force-32bit-vector-indices=true vector-contract-lowering=dot "
    "vector-transpose-lowering=eltwise}",
    "convert-to-llvm", "reconcile-unrealized-casts",
    "gpu.module(canonicalize, cse, convert-xevm-to-llvm)",
])

DPAS_TYPES = ("f16", "bf16")


def vectorize(payload: ir.Module, *, contractions: bool = True, gathers: bool = False) -> None:
    """Whole-tile vectorization of every workgroup tile (see the module docstring). Loop-
    carried tiles become vector iter_args (through the unit-dim reshapes of folded tiles),
    so no loop state lives in memory. contractions=False keeps multiply-add reductions as
    elementwise products and `vector.multi_reduction` (a kernel without DPAS: an f32
    `vector.contract` has no XeGPU form); gathers=True vectorizes n-D `tensor.extract` at
    computed indices into `vector.gather` (scattered loads)."""

    def body(root):
        func = match(root, "func.func")
        func = structured.VectorizeChildrenAndApplyPatternsOp(
            func, fold_type_extensions_into_contract=contractions,
            disable_multi_reduction_to_contract_patterns=not contractions,
            vectorize_nd_extract=gathers).result
        canonicalize(func)

    run_schedule(payload, body)
    forward_reshaped_writes(payload)
    carry_collapsed_loop_tensors(payload)
    fold_reads_of_splat_writes(payload)
    run_passes(payload, "canonicalize, cse")

    def hoist(root):
        func = match(root, "func.func")
        hoist_loop_invariant_subsets(func)
        canonicalize(func)

    run_schedule(payload, hoist)
    fold_reads_of_splat_writes(payload)
    canonicalize_contractions(payload)
    narrow_contract_operands(payload)
    run_passes(payload, "canonicalize, cse")


def _owner(value: ir.Value):
    owner = value.owner
    if isinstance(owner, ir.Block):
        return None
    return getattr(owner, "operation", owner)


def _users(value: ir.Value) -> list[ir.Operation]:
    return [getattr(u.owner, "operation", u.owner) for u in value.uses]


def carry_collapsed_loop_tensors(payload: ir.Module) -> None:
    """An scf.for tensor iter_arg read only through one `tensor.collapse_shape` and yielded
    as `tensor.expand_shape` of the same reassociation (a tile whose unit dims were folded)
    is carried collapsed: init collapsed before the loop, result expanded after it. Then the
    subset hoisting sees the tile's reads and writes and carries it as a vector."""
    from torch_mlir.dialects import tensor

    changed = True
    while changed:
        changed = False
        for loop in _ops_named(payload, "scf.for"):
            body = loop.regions[0].blocks[0]
            yielded = body.operations[len(body.operations) - 1]
            for i in range(len(loop.results)):
                arg = body.arguments[1 + i]
                if not isinstance(arg.type, ir.RankedTensorType):
                    continue
                uses = _users(arg)
                if not uses or any(u.name != "tensor.collapse_shape" for u in uses):
                    continue
                reassociation = uses[0].attributes["reassociation"]
                if any(u.attributes["reassociation"] != reassociation for u in uses):
                    continue
                expand = _owner(yielded.operands[i])
                if (expand is None or expand.name != "tensor.expand_shape"
                        or expand.attributes["reassociation"] != reassociation):
                    continue
                collapsed_type = uses[0].results[0].type
                with ir.InsertionPoint(loop), loop.location:
                    init = tensor.CollapseShapeOp(collapsed_type, loop.operands[3 + i],
                                                  reassociation).result
                loop.operands[3 + i] = init
                arg.set_type(collapsed_type)
                for u in uses:
                    u.results[0].replace_all_uses_with(arg)
                    u.erase()
                yielded.operands[i] = expand.operands[0]
                result = loop.results[i]
                wide_type = result.type
                result_uses = list(result.uses)
                result.set_type(collapsed_type)
                with ir.InsertionPoint.after(loop), loop.location:
                    wide = tensor.ExpandShapeOp(wide_type, result, reassociation, [],
                                                expand.attributes["static_output_shape"]).result
                for use in result_uses:
                    use.owner.operands[use.operand_number] = wide
                changed = True


def _splat(value: ir.Value):
    """The splat attribute of a constant vector/tensor, else None."""
    owner = _owner(value)
    if owner is None or owner.name != "arith.constant":
        return None
    attr = owner.attributes["value"]
    if isinstance(attr, ir.DenseElementsAttr) and attr.is_splat:
        return attr.get_splat_value()
    return None


def fold_reads_of_splat_writes(payload: ir.Module) -> None:
    """An in-bounds `vector.transfer_read` of a tensor wholly written by
    `vector.transfer_write` of a splat constant (possibly through reshapes) is that splat:
    the initial values of loop-carried tiles (-inf maxima, zero sums) then need no buffer."""
    with payload.context:
        for read in _ops_named(payload, "vector.transfer_read"):
            source = read.operands[0]
            owner = _owner(source)
            while owner is not None and owner.name in ("tensor.collapse_shape", "tensor.expand_shape"):
                owner = _owner(owner.operands[0])
            if owner is None or owner.name != "vector.transfer_write":
                continue
            splat = _splat(owner.operands[0])
            written = ir.VectorType(owner.operands[0].type)
            target = ir.RankedTensorType(owner.results[0].type)
            in_bounds = read.attributes["in_bounds"] if "in_bounds" in read.attributes else None
            if (splat is None or list(written.shape) != list(target.shape) or in_bounds is None
                    or not all(ir.BoolAttr(b).value for b in ir.ArrayAttr(in_bounds))):
                continue
            rtype = ir.VectorType(read.results[0].type)
            with ir.InsertionPoint(read), read.location:
                const = arith.ConstantOp(rtype, ir.DenseElementsAttr.get_splat(rtype, splat)).result
            read.results[0].replace_all_uses_with(const)
            read.erase()


def forward_reshaped_writes(payload: ir.Module) -> None:
    """`vector.transfer_read` of `tensor.expand_shape`/`collapse_shape` of a tensor wholly
    written by `vector.transfer_write` of a vector of the read's type, both in bounds at
    index 0 and both covering their whole tensor whose non-unit dims are the vector's: the
    read is the written vector (the reshapes only add or drop unit dims). Canonicalization
    forwards writes to reads only without a reshape in between."""
    def zeros(values):
        return all(_constant_int(v) == 0 for v in values)

    def covers(vtype, ttype):
        return [d for d in ttype.shape if d != 1] == [d for d in vtype.shape if d != 1]

    for read in _ops_named(payload, "vector.transfer_read"):
        owner = _owner(read.operands[0])
        reshaped = False
        while owner is not None and owner.name in ("tensor.collapse_shape", "tensor.expand_shape"):
            owner, reshaped = _owner(owner.operands[0]), True
        if not reshaped or owner is None or owner.name != "vector.transfer_write":
            continue
        value = owner.operands[0]
        rtype, vtype = ir.VectorType(read.results[0].type), ir.VectorType(value.type)
        source = ir.RankedTensorType(read.operands[0].type)
        written = ir.RankedTensorType(owner.results[0].type)
        indices_read = list(read.operands)[1:1 + source.rank]
        indices_written = list(owner.operands)[2:2 + written.rank]
        masked = (len(read.operands) > 2 + source.rank or len(owner.operands) > 2 + written.rank)
        if (masked or rtype != vtype or not zeros(indices_read) or not zeros(indices_written)
                or not covers(vtype, written) or not covers(rtype, source)):
            continue
        read.results[0].replace_all_uses_with(value)
        read.erase()


def _constant_int(value: ir.Value):
    owner = _owner(value)
    if owner is not None and owner.name == "arith.constant" and isinstance(owner.attributes["value"], ir.IntegerAttr):
        return ir.IntegerAttr(owner.attributes["value"]).value
    return None


def canonicalize_contractions(payload: ir.Module) -> None:
    """Every 2-D `vector.contract` in the DPAS form C[m, n] += A[m, k] B[k, n]: an operand
    indexed the other way round ((n, k) for B: K read as stored, for Q K^T) is transposed by a
    `vector.transpose` (the 2-D block load then reads it transposed)."""
    with payload.context:
        canonical = [ir.AffineMap.get(3, 0, [ir.AffineDimExpr.get(a), ir.AffineDimExpr.get(b)])
                     for a, b in ((0, 2), (2, 1), (0, 1))]
        swapped = [ir.AffineMap.get(3, 0, [ir.AffineDimExpr.get(b), ir.AffineDimExpr.get(a)])
                   for a, b in ((0, 2), (2, 1))]
        for op in _ops_named(payload, "vector.contract"):
            maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
            kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
            if len(maps) != 3 or maps[2] != canonical[2] or len(kinds) != 3 or "reduction" not in kinds[2]:
                continue
            changed = False
            for i in (0, 1):
                if maps[i] == swapped[i]:
                    with ir.InsertionPoint(op), op.location:
                        op.operands[i] = _transpose(op.operands[i])
                    maps[i] = canonical[i]
                    changed = True
            if changed:
                op.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(a) for a in maps])


def narrow_contract_operands(payload: ir.Module) -> None:
    """Give every `vector.contract` f16/bf16 operands with an f32 accumulator (DPAS form).

    An f32 operand that is `arith.extf` of an f16/bf16 vector, possibly transposed, is
    replaced by that vector (transposed the same way): exact. Splat factors on the way are
    pulled out of the contraction too,
        contract(extf(a) * c1, transpose(extf(b) * c2), acc)
            = contract(a, transpose(b), 0) * (c1 c2) + acc
    (SDPA's scale, applied to Q and K; acc its additive mask): exact algebra, the product is
    scaled in f32 instead of rounding a * c1 to f16. An f32 operand computed in f32 (the softmax probabilities P
    in P @ V) is truncated to the other operand's f16/bf16 type, the precision flash
    attention kernels use for P; an f32 x f32 contraction with no narrow operand has no DPAS
    form and is an error. Preconditions: accumulator and result f32."""
    with payload.context:
        for op in _ops_named(payload, "vector.contract"):
            acc = op.operands[2].type
            if not isinstance(acc, ir.VectorType) or str(acc.element_type) != "f32":
                raise ValueError(f"{op.location}: vector.contract accumulates in {acc}; DPAS "
                                 "accumulates in f32")
            splat = _splat(op.operands[2])
            zero_acc = isinstance(splat, ir.FloatAttr) and splat.value == 0.0
            narrow, computed, scale = {}, [], 1.0
            for i in (0, 1):
                value = op.operands[i]
                elem = str(ir.VectorType(value.type).element_type)
                source, transposed, factor = _narrow_source(value, True)
                if source is None:
                    computed.append(i)
                    continue
                if source != value:
                    with ir.InsertionPoint(op), op.location:
                        op.operands[i] = _transpose(source) if transposed else source
                narrow[i] = str(ir.VectorType(source.type).element_type)
                scale *= factor
            if len(computed) == 2:
                raise ValueError(f"{op.location}: vector.contract of two {elem} operands has no "
                                 "DPAS form (DPAS multiplies f16 or bf16)")
            for i in computed:
                value = op.operands[i]
                target = ir.VectorType.get(list(ir.VectorType(value.type).shape),
                                           ir.Type.parse(narrow[1 - i]))
                with ir.InsertionPoint(op), op.location:
                    op.operands[i] = arith.truncf(target, value)
            if scale != 1.0:
                result = op.results[0]
                rtype = ir.VectorType(result.type)
                uses = list(result.uses)
                acc = op.operands[2]

                def splat_of(value):
                    return arith.ConstantOp(rtype, ir.DenseElementsAttr.get_splat(
                        rtype, ir.FloatAttr.get(rtype.element_type, value))).result

                with ir.InsertionPoint(op), op.location:
                    if not zero_acc:    # the accumulator (a mask) is added after the scaling
                        op.operands[2] = splat_of(0.0)
                with ir.InsertionPoint.after(op), op.location:
                    scaled = arith.mulf(result, splat_of(scale))
                    if not zero_acc:
                        scaled = arith.addf(scaled, acc)
                for use in uses:
                    use.owner.operands[use.operand_number] = scaled


def _transpose(value: ir.Value) -> ir.Value:
    t = ir.VectorType(value.type)
    swapped = ir.VectorType.get(list(t.shape)[::-1], t.element_type)
    return vector.TransposeOp(swapped, value, [1, 0]).result


def _narrow_source(value: ir.Value, pull_scales: bool):
    """(source, transposed, scale) with value = [transpose]((extf(source) [* scale]) and
    source f16/bf16 (transposes and splat factors in any order); (None, ..) otherwise."""
    transposed, scale, current = False, 1.0, value
    while True:
        owner = _owner(current)
        if owner is None:
            break
        if owner.name == "vector.transpose" and ir.VectorType(current.type).rank == 2:
            transposed, current = not transposed, owner.operands[0]
            continue
        if pull_scales and owner.name == "arith.mulf":
            factors = [(_splat(owner.operands[b]), owner.operands[a]) for a, b in ((0, 1), (1, 0))]
            factors = [(f, v) for f, v in factors if isinstance(f, ir.FloatAttr)]
            if factors:
                scale *= factors[0][0].value
                current = factors[0][1]
                continue
        break
    if str(ir.VectorType(current.type).element_type) in DPAS_TYPES:
        return current, transposed, scale
    owner = _owner(current)
    if owner is not None and owner.name == "arith.extf":
        source = owner.operands[0]
        if str(ir.VectorType(source.type).element_type) in DPAS_TYPES:
            return source, transposed, scale
    return None, False, 1.0


def bufferize(payload: ir.Module) -> None:
    """One-shot bufferization; results become out-parameters; subviews fold into transfers."""

    def body(root):
        tbuf.EliminateEmptyTensorsOp(root)
        tbuf.OneShotBufferizeOp(root, bufferize_function_boundaries=True,
                                function_boundary_type_conversion=LayoutMapOption.IdentityLayoutMap)

    run_schedule(payload, body)
    run_passes(payload, "canonicalize, cse, "
               "buffer-results-to-out-params{hoist-static-allocs=true modify-public-functions=true}, "
               "fold-memref-alias-ops, canonicalize, cse")
    write_results_in_place(payload)
    allocs_to_device(payload)


def write_results_in_place(payload: ir.Module) -> None:
    """A result computed into a buffer and then copied whole into its out-parameter through
    a reshape (`memref.copy(memref.expand_shape(%alloc), %out)`: a unit batch dim folded
    by the schedule) is computed in the out-parameter: %alloc becomes
    `memref.collapse_shape(%out)` and the copy goes (a host-side copy of device memory
    would need a kernel of its own). Only for a function-level alloc whose other uses all
    precede the copy and an %out used by nothing else."""
    from torch_mlir.dialects import memref

    with payload.context:
        for func in payload.body.operations:
            func = func.operation
            if func.name != "func.func":
                continue
            block = func.regions[0].blocks[0]
            order = [o.operation for o in block.operations]
            for copy in [o for o in order if o.name == "memref.copy"]:
                view, out = copy.operands[0], copy.operands[1]
                reshape = _owner(view)
                if (reshape is None or reshape.name != "memref.expand_shape"
                        or not isinstance(out, ir.BlockArgument) or len(_users(out)) != 1
                        or len(_users(view)) != 1):
                    continue
                alloc = _owner(reshape.operands[0])
                if alloc is None or alloc.name != "memref.alloc" or len(alloc.operands):
                    continue
                uses = [_top_level(u, block) for u in _users(alloc.results[0]) if u != reshape]
                if any(u is None or order.index(u) > order.index(copy) for u in uses):
                    continue
                with ir.InsertionPoint(alloc), alloc.location:
                    in_place = memref.CollapseShapeOp(alloc.results[0].type, out,
                                                      reshape.attributes["reassociation"]).result
                alloc.results[0].replace_all_uses_with(in_place)
                copy.erase()
                reshape.erase()
                alloc.erase()


def _top_level(op: ir.Operation, block: ir.Block):
    """The ancestor of `op` directly in `block` (None when there is none)."""
    while op is not None:
        parent = op.parent
        if parent is not None and parent.regions and any(
                b == block for r in parent.regions for b in r.blocks):
            return op
        op = parent
    return None


def allocs_to_device(payload: ir.Module) -> None:
    """Buffers between kernels (memref.alloc at function level) live in device memory:
    gpu.alloc, freed by gpu.dealloc before the return."""
    from torch_mlir.dialects import gpu

    with payload.context:
        for func in payload.body.operations:
            func = func.operation
            if func.name != "func.func":
                continue
            block = func.regions[0].blocks[0]
            ret = block.operations[len(block.operations) - 1]
            for op in list(block.operations):
                op = op.operation
                if op.name != "memref.alloc" or len(op.operands):
                    continue
                with ir.InsertionPoint(op), op.location:
                    device = gpu.AllocOp(op.results[0].type, None, [], [], [])
                op.results[0].replace_all_uses_with(device.results[0])
                with ir.InsertionPoint(ret), op.location:
                    gpu.DeallocOp(None, [], device.results[0])
                op.erase()


def outline(payload: ir.Module, threads: list[int], chip: str) -> None:
    """Every top-level scf.forall -> gpu.launch with `threads[i]` lanes per workgroup ->
    outlined gpu.module/gpu.func; attaches the XeVM target of `chip`."""

    def to_parallel(root):
        foreach(match(root, "scf.forall"),
                lambda f: loop.ForallToParallelOp([any_op()], f))

    for forall in _ops_named(payload, "scf.forall"):
        if "mapping" in forall.attributes:   # gpu-map-parallel-loops assigns the mapping
            del forall.attributes["mapping"]
    run_schedule(payload, to_parallel)
    run_passes(payload, "func.func(gpu-map-parallel-loops, convert-parallel-loops-to-gpu), "
                        "lower-affine, canonicalize, cse")
    launches = _ops_named(payload, "gpu.launch")
    if len(launches) != len(threads):
        raise ValueError(f"expected {len(threads)} gpu.launch ops (one per workgroup forall), "
                         f"found {len(launches)}")

    def set_threads(root):
        handles = transform.SplitHandleOp([any_op()] * len(threads),
                                          match(root, "gpu.launch")).results
        for handle, count in zip(handles, threads):
            xegpu.set_gpu_launch_threads(handle, threads=[count, 1, 1])

    run_schedule(payload, set_threads)
    run_passes(payload, "func.func(lower-affine, canonicalize, gpu-launch-sink-index-computations), "
                        f"gpu-kernel-outlining, cse, xevm-attach-target{{O=3 chip={chip}}}")


def insert_loop_prefetches(gpu_func: ir.Operation, subgroups: int, inst: tuple[int, int],
                           nb_prefetch: int = 1) -> int:
    """Prefetch the tiles that the loops of a kernel read `nb_prefetch` steps ahead: before
    each loop the first steps' tiles, in the loop the tile at iv + nb_prefetch * step (2-D
    block prefetches spread over the `subgroups`, in `inst` instruction tiles). For
    `xegpu.load_nd` ops in a loop whose descriptor is loop-invariant and whose offsets are
    loop-invariant or index arithmetic on the induction variable (recomputed for the step
    ahead). (transform.xegpu.insert_prefetch refuses
    loops with dynamic bounds, e.g. causal attention's.) Returns the prefetches inserted."""
    from .xegpu_contraction import prefetch_layout

    count = 0
    if nb_prefetch < 1:
        return count
    hint = ir.Attribute.parse("#xegpu.cache_hint<cached>")
    index = ir.IndexType.get()

    def constant(value):
        return arith.ConstantOp(index, ir.IntegerAttr.get(index, value)).result

    for loop in _ops_named(gpu_func, "scf.for"):
        body = loop.regions[0].blocks[0]
        iv = body.arguments[0]
        lb, step = loop.operands[0], loop.operands[2]

        def invariant(value):
            if isinstance(value, ir.BlockArgument):
                return value.owner != body
            return not _inside(_owner(value), loop)

        def of_iv(value) -> bool:
            """Is `value` the induction variable or pure index arithmetic on it (and on
            loop invariants)?"""
            if value == iv:
                return True
            owner = _owner(value)
            if invariant(value) or owner is None or not owner.name.startswith(("arith.", "index.")):
                return False
            return all(of_iv(v) or invariant(v) for v in owner.operands) and any(
                of_iv(v) for v in owner.operands)

        def at(value, next_iv, ip_op):
            """`value` recomputed for the induction variable `next_iv` (before ip_op)."""
            if value == iv:
                return next_iv
            if not of_iv(value):
                return value
            owner = _owner(value)
            operands = [at(v, next_iv, ip_op) for v in owner.operands]
            clone = owner.clone(ir.InsertionPoint(ip_op))
            for i, v in enumerate(operands):
                clone.operands[i] = v
            return clone.results[list(owner.results).index(value)]

        for load in [o.operation for o in body.operations if o.operation.name == "xegpu.load_nd"]:
            desc, offsets = load.operands[0], list(load.operands)[1:]
            if not invariant(desc) or not any(of_iv(o) for o in offsets):
                continue
            if not all(of_iv(o) or invariant(o) for o in offsets):
                continue
            rows, cols = list(ir.VectorType(load.results[0].type).shape)[-2:]
            layout = prefetch_layout(rows, cols, subgroups, inst)
            attributes = {"const_offsets": load.attributes["const_offsets"], "l1_hint": hint,
                          "l2_hint": hint, "l3_hint": hint, "layout": ir.Attribute.parse(
                              "#xegpu.layout<" + ", ".join(f"{k} = {v}" for k, v in layout.items()) + ">")}

            def prefetch(next_iv, ip_op):
                ir.Operation.create("xegpu.prefetch_nd", attributes=attributes,
                                    operands=[desc] + [at(o, next_iv, ip_op) for o in offsets])

            with ir.InsertionPoint(loop), loop.location:
                for d in range(nb_prefetch):
                    prefetch(arith.addi(lb, arith.muli(step, constant(d))), loop)
                    count += 1
            first = body.operations[0]
            with ir.InsertionPoint(first), loop.location:
                prefetch(arith.addi(iv, arith.muli(step, constant(nb_prefetch))), first)
                count += 1
    return count


def _inside(op: ir.Operation, container: ir.Operation) -> bool:
    parent = op.parent
    while parent is not None:
        if parent == container:
            return True
        parent = parent.parent
    return False


def to_xegpu(payload: ir.Module) -> None:
    run_passes(payload, "gpu.module(gpu.func(convert-vector-to-xegpu)), cse, "
                        "gpu.module(gpu.func(loop-invariant-code-motion))")


def _ops_named(root, name: str) -> list[ir.Operation]:
    found = []

    def visit(op):
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    getattr(root, "operation", root).walk(visit)
    return found
