"""The host CPU target: bufferize, lower to LLVM, JIT with ExecutionEngine(opt_level=3).

Stages after a schedule's `vectorize`:
  bufferize  run-time checks turned into the kernel-reported error code (lighthouse.runtime),
             one-shot bufferization (identity layouts at function boundaries), the matmul
             schedule's bf16 register-tile loops on AMX tiles when the host has them
             (transform_ext.contraction_loops_to_amx_tiles), results
             turned into out-parameters the kernel writes directly (also through a
             reshape: transform_ext.write_results_in_place), vector ops lowered to 1-D
             (contractions to outer products and FMAs; a load wider than a vector register
             that is only read element by element to scalar loads), scf.forall ->
             scf.parallel.
  llvm       loops -> OpenMP (libiomp5 from the intel-openmp wheel), f32 exp/log/log1p/
             expm1/tanh/erf expanded to polynomials (asinh/acosh/atanh through them), f64
             log1p/expm1/erf/asinh/acosh/atanh as C library calls, everything to the LLVM
             dialect.
The JIT targets the host CPU, so AVX-512 is used where the machine has it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

from torch_mlir import ir
from torch_mlir.dialects import arith, linalg, transform
from torch_mlir.dialects.bufferization import LayoutMapOption
from torch_mlir.dialects.transform import bufferization as tbuf
from torch_mlir.dialects.transform import loop
from torch_mlir.dialects.transform import vector as tvec

import transform_ext
from transform_ext.common import defining_op
from transform_ext.contraction_loops_to_amx_tiles import contraction_loops_to_amx_tiles
from transform_ext.expand_math import expand_math_in
from transform_ext.drop_unit_reduction_dims_of_contracts import drop_unit_reduction_dims_of_contracts
from transform_ext.order_contract_multiplicands import order_contract_multiplicands
from transform_ext.unmask_extremum_reductions import unmask_extremum_reductions
from transform_ext.write_results_in_place import write_results_in_place

from schedules.common import apply_patterns, canonicalize, foreach, match, run_passes, run_schedule
from schedules.prepare import checks_to_error_code, kernel_error_messages

from ..errors import UnsupportedError
from ..pipeline import Stage
from ..runtime import allow_amx_tiles
from .bf16_vectors import (bf16_memory_as_i16, odd_bf16_conversions_as_integer_ops,
                           odd_bf16_vectors_as_i16)
from .concat_pieces import innermost_concats_as_inserts
from .description import CpuDescription, host_cpu, host_cpu_flags
from .index_compares import narrow_iota_compares
from .libm_calls import f64_math_as_libm_calls
from .prefetch import (prefetch_next_accumulators, prefetch_next_page_strided_loads,
                       prefetch_next_reread_tiles)
from .runtime_checks import add_vector_bounds_checks
from .self_copies import drop_self_copies
from .streaming_stores import fence_streaming_stores, stream_large_results
from .transpose_blocks import transposes_in_16x16_blocks, transposes_of_row_pairs
from .vector_accumulators import reductions_into_vector_accumulators
from .workspace import allocations_into_workspace, crowded_functions, workspace_bytes


@lru_cache(maxsize=1)
def openmp_runtime() -> str:
    """Path of libiomp5.so from the intel-openmp wheel (installed under <prefix>/lib)."""
    candidates = [Path(sys.prefix) / "lib" / "libiomp5.so"]
    candidates += [Path(p).parent.parent.parent / "libiomp5.so" for p in sys.path if p.endswith("site-packages")]
    for c in candidates:
        if c.is_file():
            return str(c)
    raise UnsupportedError("libiomp5.so not found: install the intel-openmp wheel (pip install -e .)")


# How long the OpenMP workers spin after a parallel region before they sleep (KMP_BLOCKTIME,
# unless the environment sets it). A kernel's next region, or its next call back to back,
# finds them awake; a program that goes on with other work loses at most this much of a
# core. Waking a sleeping worker costs 50-100 us on this project's VMs, more than a small
# kernel's work: with no spin, a [96, 1000] softmax took 0.18 ms on 2 threads against 0.05
# on one. (torch's libgomp spins for milliseconds by default.)
SPIN_BEFORE_SLEEP = "200us"


def configure_openmp_runtime() -> None:
    """The runtime's settings, before it loads (it reads them once): the spin above, and no
    warnings on stderr."""
    os.environ.setdefault("KMP_BLOCKTIME", SPIN_BEFORE_SLEEP)
    os.environ.setdefault("KMP_WARNINGS", "0")


@dataclass(frozen=True)
class CpuTarget:
    """threads: OpenMP threads of the compiled kernels (default: all cores).
    options: schedule parameters from the kernel file's LIGHTHOUSE dict, as sorted pairs.
    runtime_checks: compile with MLIR's `generate-runtime-verification`: an out-of-bounds
    load or store, an invalid subview or reshape stops the process with the op and its
    location instead of corrupting memory (slower; for debugging and fuzzing).
    cpu: what the schedules know of the CPU (lighthouse.targets.description; default: this
    machine's). The code is JIT-compiled for the host CPU whatever `cpu` says."""

    threads: int = field(default_factory=lambda: host_cpu().threads)
    name: str = "cpu"
    options: tuple = ()
    runtime_checks: bool = False
    cpu: CpuDescription = field(default_factory=host_cpu)
    # the attention schedule chooses its own tiles on the CPU, its backward in one pass
    attention_tiles: ClassVar[tuple[int, int] | None] = None
    attention_backward_tiles: ClassVar[tuple[int, int, int, int] | None] = None
    linear_cross_entropy_tiles: ClassVar[tuple[int, int, int] | None] = None

    def __post_init__(self):
        if self.threads < 1:
            raise UnsupportedError(f"--threads must be >= 1, got {self.threads}")

    def stages(self) -> list[Stage]:
        return [
            Stage("bufferize", lambda m: bufferize(m, register_bytes=self.cpu.vector_bits // 8,
                                                    l2_bytes=self.cpu.l2_bytes),
                  "one-shot bufferize, out-params, vector lowering"),
            Stage("llvm", lambda m: lower_to_llvm(m, self.threads, runtime_checks=self.runtime_checks,
                                                  stream_bytes=self.cpu.stream_bytes),
                  "OpenMP, polynomials, LLVM dialect"),
        ]

    def jit(self, module: ir.Module, arg_specs, result_specs):
        from torch_mlir.execution_engine import ExecutionEngine

        from ..runtime import JitFunction

        configure_openmp_runtime()
        # position-independent: the object file links into a shared library (kernel_cache)
        engine = ExecutionEngine(module, opt_level=3, shared_libs=[openmp_runtime()],
                                 enable_pic=True)
        return JitFunction(engine, arg_specs, result_specs,
                           error_messages=tuple(kernel_error_messages(module)),
                           workspace_bytes=workspace_bytes(module))


def protect_arguments(payload: ir.Module) -> None:
    """Mark function arguments read-only for bufferization: the caller's tensors are inputs,
    never scratch space (an argument used as an `outs` init is copied, not overwritten)."""
    with payload.context:
        for op in payload.body.operations:
            if op.operation.name != "func.func":
                continue
            func = op.operation
            n = len(func.regions[0].blocks[0].arguments)
            old = list(func.attributes["arg_attrs"]) if "arg_attrs" in func.attributes else [
                ir.DictAttr.get({}) for _ in range(n)]
            new = []
            for attrs in old:
                entries = {a.name: a.attr for a in ir.DictAttr(attrs)}
                entries["bufferization.writable"] = ir.BoolAttr.get(False)
                new.append(ir.DictAttr.get(entries))
            func.attributes["arg_attrs"] = ir.ArrayAttr.get(new)


def bufferize(payload: ir.Module, register_bytes: int = 64, l2_bytes: int = 0) -> None:
    """One-shot bufferization and the vector lowering for a CPU with vector registers of
    `register_bytes`; with the L2 size `l2_bytes` (0: unknown, none), passes over tiles of
    arguments larger than L2 prefetch the next tile (prefetch.prefetch_next_reread_tiles)."""
    checks_to_error_code(payload)  # run-time checks report an error code instead of aborting
    transposes_of_row_pairs(payload)  # into 16 x 16 word transposes
    transposes_in_16x16_blocks(payload)  # lowered by Shuffle16x16 below
    innermost_concats_as_inserts(payload)
    protect_arguments(payload)
    contiguous_gather_sources(payload)
    widen_mixed_reduction_contractions(payload)
    transform_ext.load(payload.context)
    amx = allow_amx_tiles()

    def body(root):
        # a masked max/min reduction with -inf/+inf in its masked-off lanes: LLVM's lowering
        # of the mask puts the smallest negative denormal there (a max of negative values
        # over a partial vector came out -1.4e-45)
        unmask_extremum_reductions(match(root, "func.func"))
        # a tensor.empty whose value is inserted into a destination (a thread's partial of
        # a reduction, parallel_insert_slice'd into the shared partials; a piece of an
        # innermost concatenation: innermost_concats_as_inserts) becomes that slice:
        # bufferized in place, not in a buffer of its own copied there
        tbuf.EliminateEmptyTensorsOp(match(root, "func.func"))
        root = tbuf.OneShotBufferizeOp(
            root, bufferize_function_boundaries=True, allow_return_allocs_from_loops=True,
            function_boundary_type_conversion=LayoutMapOption.IdentityLayoutMap).result
        func = match(root, "func.func")
        if amx:  # the matmul schedule's bf16 pair loops left for AMX tiles (when granted),
            canonicalize(func)  # once bufferization's loop-carried buffers are forwarded
            contraction_loops_to_amx_tiles(func)
        # the outer products take one reduction dim and broadcast the left multiplicand
        drop_unit_reduction_dims_of_contracts(func)
        order_contract_multiplicands(func)
        apply_patterns(func, lambda: tvec.ApplyLowerContractionPatternsOp(
            lowering_strategy=tvec.VectorContractLowering.OuterProduct))
        apply_patterns(func,
                       lambda: tvec.ApplyReorderMultiReductionPatternsOp(
                           lowering_strategy=tvec.VectorMultiReductionLowering.InnerReduction),
                       lambda: tvec.ApplyMultiReductionFlatteningPatternsOp(
                           lowering_strategy=tvec.VectorMultiReductionLowering.InnerReduction))
        apply_patterns(func, lambda: tvec.ApplyMultiReductionUnrollingPatternsOp(
            lowering_strategy=tvec.VectorMultiReductionLowering.InnerReduction))
        apply_patterns(func, tvec.ApplyTransferPermutationPatternsOp,
                       lambda: tvec.ApplyLowerTransferPatternsOp(max_transfer_rank=1))
        apply_patterns(func, tvec.ApplyLowerOuterProductPatternsOp, tvec.ApplyLowerMasksPatternsOp)
        apply_patterns(func, lambda: tvec.ApplyLowerTransposePatternsOp(
                           lowering_strategy=tvec.VectorTransposeLowering.Shuffle16x16),
                       tvec.ApplyLowerBroadcastPatternsOp,
                       tvec.ApplyLowerShapeCastPatternsOp, tvec.ApplyLowerGatherPatternsOp)
        foreach(match(root, "scf.forall"),
                lambda f: loop.ForallToParallelOp([transform.AnyOpType.get()], f))

    run_schedule(payload, body)
    # loops that carry a memref as an iter_arg forward it first: a copy's source and target,
    # and a register tile's view, are then chains of subviews of one buffer
    run_passes(payload, "canonicalize, cse")
    drop_self_copies(payload)
    prefetch_next_accumulators(payload)
    prefetch_next_page_strided_loads(payload)
    prefetch_next_reread_tiles(payload, l2_bytes)
    scalar_reads_of_wide_loads(payload)
    reassociate_vector_reductions(payload)
    reductions_into_vector_accumulators(payload, max_bytes=4 * register_bytes)
    tree_reduce_min_max(payload)
    run_passes(payload, "canonicalize, cse")
    copy_repeated_results(payload)
    run_passes(payload, "buffer-results-to-out-params{hoist-static-allocs=true modify-public-functions=true}, "
               "canonicalize")
    transform_ext.load(payload.context)
    run_schedule(payload, lambda root: write_results_in_place(match(root, "func.func")))


def scalar_reads_of_wide_loads(payload: ir.Module, lanes: int = 16) -> int:
    """A 1-D vector.load wider than one vector register (`lanes` f32) that is read only
    element by element (vector.extract of static positions: a convolution's register tile
    broadcasting each of its rows' image values) becomes one memref.load per element read:
    LLVM split such a load (18 lanes: 16 + 2), stored its pieces on the stack and reloaded
    each element, a store and a reload per step of the register tile's loop (a 3-D
    transposed convolution 1.5x slower); scalar loads become broadcasts from memory, as a
    one-register load's do. Exact: the same in-bounds elements. Returns the loads rewritten."""
    from torch_mlir.dialects import memref

    targets = []

    def visit(op):
        if op.name == "vector.load":
            vtype = op.results[0].type
            uses = list(op.results[0].uses)
            if vtype.rank == 1 and vtype.shape[0] > lanes and uses and all(
                    use.owner.name == "vector.extract" and len(use.owner.operands) == 1
                    and not isinstance(use.owner.results[0].type, ir.VectorType) for use in uses):
                targets.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        for op in targets:
            source, *indices = op.operands
            for use in list(op.results[0].uses):
                extract = use.owner
                (position,) = ir.DenseI64ArrayAttr(extract.attributes["static_position"])
                with ir.InsertionPoint(extract), extract.location:
                    last = arith.addi(indices[-1], arith.constant(ir.IndexType.get(), position))
                    value = memref.load(source, indices[:-1] + [last])
                extract.results[0].replace_all_uses_with(value)
                extract.erase()
            op.erase()
    return len(targets)


def narrow_f64_truncations_through_f32(payload: ir.Module) -> int:
    """arith.truncf from f64 to bf16 or f16 as f64 -> f32 -> bf16/f16, as torch converts a
    double to its half types (through float): LLVM lowers the direct truncation to a libcall
    (__truncdfbf2) the JIT does not have. Returns the number rewritten."""
    from torch_mlir.dialects import arith

    def element(t):
        return ir.VectorType(t).element_type if isinstance(t, ir.VectorType) else t

    found = []

    def visit(op):
        if op.name == "arith.truncf" and isinstance(element(op.operands[0].type), ir.F64Type) \
                and isinstance(element(op.results[0].type), (ir.BF16Type, ir.F16Type)):
            found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        f32 = ir.F32Type.get()
        for op in found:
            t = op.operands[0].type
            mid = ir.VectorType.get(ir.VectorType(t).shape, f32) if isinstance(t, ir.VectorType) else f32
            with ir.InsertionPoint(op), op.location:
                value = arith.truncf(op.results[0].type, arith.truncf(mid, op.operands[0]))
            op.results[0].replace_all_uses_with(value)
            op.erase()
    return len(found)


def contiguous_gather_sources(payload: ir.Module) -> int:
    """A vector.gather reading a tensor slice that is not contiguous in memory (x[:, :3] of
    a [5, 9] tensor) reads a dense copy of it instead: the vectorizer linearizes gather
    indices over the slice's own shape (row * 3 + col), which after bufferization address
    the strided view's memory (rows 9 apart) and read the wrong elements. Returns the
    number of sources copied."""
    from torch_mlir.dialects import tensor

    found = []

    def visit(op):
        if op.name == "vector.gather" and isinstance(op.operands[0].type, ir.RankedTensorType):
            source = defining_op(op.operands[0])
            if source is not None and source.name == "tensor.extract_slice" \
                    and not _contiguous_slice(source):
                found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        for op in found:
            base = op.operands[0]
            t = ir.RankedTensorType(base.type)
            with ir.InsertionPoint(op), op.location:
                empty = tensor.EmptyOp(list(t.shape), t.element_type).result
                op.operands[0] = linalg.copy(base, outs=[empty])
    return len(found)


def _contiguous_slice(op: ir.Operation) -> bool:
    """Does a static tensor.extract_slice select one contiguous run of its source's
    row-major memory (unit strides; every dim after the first one it cuts is whole; every
    dim before it of size 1)?"""
    view = op.opview
    sizes, strides = list(view.static_sizes), list(view.static_strides)
    source = ir.RankedTensorType(op.operands[0].type).shape
    if any(s != 1 for s in strides) or any(s < 0 for s in sizes) or len(sizes) != len(source):
        return False
    cut = [d for d in range(len(sizes)) if sizes[d] != source[d]]
    if not cut:
        return True
    last = cut[-1]
    return all(sizes[d] == 1 for d in range(last))


def copy_repeated_results(payload: ir.Module) -> int:
    """A buffer returned more than once (`return %y, %y`: a model returning one tensor
    twice) becomes one out-parameter, and each further result gets its own buffer written
    by a copy (buffer-results-to-out-params cannot give one buffer two out-parameters).
    Returns the number of copies added."""
    from torch_mlir.dialects import memref

    added = 0
    for func in payload.body.operations:
        if func.operation.name != "func.func" or not func.regions[0].blocks:
            continue
        for block in func.regions[0].blocks:
            ret = block.operations[len(block.operations) - 1].operation
            if ret.name != "func.return":
                continue
            seen = []
            for i, value in enumerate(list(ret.operands)):
                if not isinstance(value.type, ir.MemRefType) or not any(value == v for v in seen):
                    seen.append(value)
                    continue
                mtype = ir.MemRefType(value.type)
                with ir.InsertionPoint(ret), ret.location:
                    fresh = memref.alloc(ir.MemRefType.get(mtype.shape, mtype.element_type), [], [])
                    memref.copy(value, fresh)
                ret.operands[i] = fresh
                added += 1
    return added


def widen_mixed_reduction_contractions(payload: ir.Module) -> int:
    """A float `vector.contract` whose two operands are read through the same map (an
    elementwise product summed, such as sum x^2 of f32 x into f64 once the vectorizer folded
    the extensions into it) and are narrower than its accumulator reads them extended to
    the accumulator's type: with no outer product to form, the contract is lowered
    elementwise, which takes one element type (it would reach LLVM unlowered). The same
    products as the linalg body's extf-then-mulf. Returns the count."""
    from torch_mlir.dialects import arith

    targets = []

    def visit(op):
        if op.name == "vector.contract":
            acc = op.operands[2].type
            acc_elem = acc.element_type if isinstance(acc, ir.VectorType) else acc
            lhs = ir.VectorType(op.operands[0].type)
            maps = list(ir.ArrayAttr(op.attributes["indexing_maps"]))
            if isinstance(acc_elem, ir.FloatType) and lhs.element_type != acc_elem \
                    and str(maps[0]) == str(maps[1]):
                targets.append((op, acc_elem))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        for op, wide in targets:
            with ir.InsertionPoint(op), op.location:
                for i in (0, 1):
                    narrow = ir.VectorType(op.operands[i].type)
                    op.operands[i] = arith.extf(ir.VectorType.get(narrow.shape, wide),
                                                op.operands[i])
    return len(targets)


_REASSOCIABLE = ("add", "mul", "maximumf", "minimumf", "maxnumf", "minnumf")
_TREE = {"maximumf": "arith.maximumf", "minimumf": "arith.minimumf",
         "maxnumf": "arith.maxnumf", "minnumf": "arith.minnumf"}


def tree_reduce_min_max(payload: ir.Module, lanes: int = 16) -> int:
    """`vector.reduction <maximumf>` (and min) on a vector longer than one register become
    elementwise max/min of register-wide slices, then a log2 shuffle tree: LLVM expands
    the NaN-propagating max reduction one element after the other otherwise. Exact: max/min
    are associative and commutative, NaN still propagates. Returns the count."""
    from torch_mlir.dialects import vector

    targets = []

    def visit(op):
        # a masked reduction (inside vector.mask, whose region holds one op) stays as it is
        if op.name == "vector.reduction" and op.parent.name != "vector.mask":
            kind = str(op.attributes["kind"]).split("<")[-1].rstrip(">")
            vtype = op.operands[0].type
            if kind in _TREE and isinstance(vtype, ir.VectorType) and vtype.rank == 1 \
                    and vtype.shape[0] > 1 and (vtype.shape[0] & (vtype.shape[0] - 1)) == 0:
                targets.append((op, _TREE[kind]))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        for op, combine in targets:
            with ir.InsertionPoint(op), op.location:
                v = op.operands[0]
                n = v.type.shape[0]
                etype = v.type.element_type

                def comb(a, b):
                    return ir.Operation.create(combine, results=[a.type], operands=[a, b]).result

                width = min(n, lanes)
                part_t = ir.VectorType.get([width], etype)
                acc = None
                for start in range(0, n, width):
                    piece = vector.extract_strided_slice(part_t, v, [start], [width], [1])
                    acc = piece if acc is None else comb(acc, piece)
                step = width // 2
                while step >= 1:
                    mask = [(i + step) % width for i in range(width)]
                    acc = comb(acc, vector.shuffle(acc, acc, mask))
                    step //= 2
                result = vector.extract(acc, [], [0])
                if len(op.operands) > 1:  # the accumulator operand
                    result = comb(result, op.operands[1])
            op.results[0].replace_all_uses_with(result)
            op.erase()
    return len(targets)


def reassociate_vector_reductions(payload: ir.Module) -> int:
    """Float `vector.reduction`s of add/mul/max/min get the `reassoc` flag, so LLVM reduces a
    vector as a tree across lanes instead of one element after the other (64 dependent adds
    for a 64-wide row). max/min give the same result in any order (NaN still propagates);
    sums round differently from a sequential loop, as torch's own vectorized reductions do.
    Returns the number of ops flagged."""
    flagged = 0

    def visit(op):
        nonlocal flagged
        if op.name == "vector.reduction" and isinstance(op.results[0].type, ir.FloatType):
            kind = str(op.attributes["kind"])
            if any(f"<{k}>" in kind for k in _REASSOCIABLE):
                current = str(op.attributes["fastmath"]) if "fastmath" in op.attributes else ""
                if "reassoc" not in current:
                    flags = [f for f in current.split("<")[-1].rstrip(">").split(",")
                             if f.strip() and f.strip() != "none"] + ["reassoc"]
                    op.attributes["fastmath"] = ir.Attribute.parse(
                        f"#arith.fastmath<{','.join(f.strip() for f in flags)}>", payload.context)
                    flagged += 1
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return flagged


def promote_small_buffers_to_stack(payload: ir.Module) -> None:
    """promote-buffers-to-stack (buffers up to 128 KiB) in each function but those whose
    small top-level buffers add up to more than the stack holds (workspace.crowded_functions:
    a recurrent model unrolled over 256 steps, 15 MB of allocas, overflowed it); theirs stay
    mallocs."""
    from torch_mlir.passmanager import PassManager

    crowded = crowded_functions(payload)
    with payload.context:
        pm = PassManager.parse("func.func(promote-buffers-to-stack{max-alloc-size-in-bytes=131072 "
                               "max-rank-of-allocated-memref=8})")
        for op in payload.body.operations:
            op = op.operation
            if op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value not in crowded:
                pm.run(op)


def lower_to_llvm(payload: ir.Module, threads: int, *, runtime_checks: bool = False,
                  stream_bytes: int = 0) -> None:
    strided_copies_to_loops(payload)
    if runtime_checks:
        # before the memref ops are expanded: each load, store, subview and reshape, and
        # each vector access, gets a cf.assert naming the op and its location
        run_passes(payload, "generate-runtime-verification")
        add_vector_bounds_checks(payload)
    # scratch tiles allocated inside loops: allocate once per loop nest, on the stack when
    # small (no malloc/free per key tile); a function's small top-level buffers too, unless
    # they would crowd the stack (then they stay mallocs)
    run_passes(payload, "func.func(convert-linalg-to-loops), func.func(buffer-loop-hoisting)")
    promote_small_buffers_to_stack(payload)
    # large intermediates in one static workspace: no mmap, page faults and munmap per call
    allocations_into_workspace(payload)
    # results far larger than the caches: written to memory without reading their lines first
    stream_large_results(payload, stream_bytes)
    run_passes(payload, ", ".join([
        "buffer-deallocation-pipeline",
        f"convert-scf-to-openmp{{num-threads={threads}}}",
        "convert-vector-to-scf{full-unroll=true}",
        "lower-affine", "expand-strided-metadata", "lower-affine",
        # f16/bf16 math and arithmetic computed in f32 (LLVM's x86 backend has neither)
        "arith-expand", "func.func(math-extend-to-supported-types{target-type=f32})",
        "arith-emulate-unsupported-floats{source-types=bf16,f16 target-type=f32}",
        "canonicalize", "cse",
    ]))
    fence_streaming_stores(payload)
    expand_math_in(payload.operation, ldexp="avx512f" in host_cpu_flags())
    narrow_iota_compares(payload)  # a one-hot mask's lane indices in 32 bits
    f64_math_as_libm_calls(payload)
    narrow_f64_truncations_through_f32(payload)
    bf16_in_integers = bf16_moves_in_integers()
    odd_bf16_conversions_as_integer_ops(payload, all_lane_counts=bf16_in_integers)
    for op in payload.body.operations:  # the kernels, not the libm declarations
        if op.operation.name == "func.func" and len(op.regions[0].blocks):
            op.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get(payload.context)
    run_passes(payload, ", ".join([
        # enable-x86: the x86 dialect's ops (vdpbf16ps from the bf16 dot products)
        "finalize-memref-to-llvm", "convert-scf-to-cf", "convert-vector-to-llvm{enable-x86}",
        # cf through the generic conversion, whose type converter knows AMX tiles (carried
        # by loops), before the OpenMP regions that hold them are converted
        "convert-to-llvm{filter-dialects=cf,x86}",
        "convert-openmp-to-llvm", "convert-math-to-llvm", "convert-arith-to-llvm",
        "convert-index-to-llvm", "convert-func-to-llvm", "convert-cf-to-llvm",
        "convert-ub-to-llvm", "reconcile-unrealized-casts", "canonicalize",
    ]))
    odd_bf16_vectors_as_i16(payload, all_lane_counts=bf16_in_integers)
    bf16_memory_as_i16(payload)


def bf16_moves_in_integers() -> bool:
    """Do bf16 vectors of every lane count move and convert as integers on this host
    (lighthouse/targets/bf16_vectors.py)? Without avx512_bf16, LLVM converts to bf16 by a
    libgcc call the JIT does not resolve."""
    return "avx512_bf16" not in host_cpu_flags()


def strided_copies_to_loops(payload: ir.Module) -> None:
    """memref.copy between non-contiguous views calls `memrefCopy`, which the JIT lacks:
    rewrite those as linalg.copy, which becomes loops."""
    copies = []

    def visit(op):
        if op.name == "memref.copy" and not all(_contiguous(v.type) for v in op.operands):
            copies.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        for op in copies:
            with ir.InsertionPoint(op), op.location:
                linalg.copy(op.operands[0], outs=[op.operands[1]])
            op.erase()


def _contiguous(t: ir.MemRefType) -> bool:
    """Row-major dense (any offset) as memref.copy's lowering judges it (then a memcpy):
    the inner dims at their row-major strides, every dim outside them of size 1 (a unit dim
    among the inner ones at another stride, the view of a slice with a unit last dim, is
    not: that copy would call memrefCopy)."""
    if not t.has_static_shape:
        return False
    strides, _ = t.get_strides_and_offset()
    dims = list(zip(t.shape, strides))
    expected = 1
    while dims and dims[-1][1] == expected:
        expected *= dims.pop()[0]
    return all(size == 1 for size, _ in dims)
