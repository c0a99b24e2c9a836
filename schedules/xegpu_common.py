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
from torch_mlir.dialects import arith, transform
from torch_mlir.dialects.bufferization import LayoutMapOption
from torch_mlir.dialects.transform import bufferization as tbuf
from torch_mlir.dialects.transform import loop, structured, xegpu

from .common import any_op, canonicalize, foreach, hoist_loop_invariant_subsets, match, run_passes, run_schedule

# gpu-lower-to-xevm-pipeline{xegpu-op-level=workgroup}, spelled out without its
# xevm-attach-target (the gpu-outline stage attaches the chip's target) and without the
# final gpu-module-to-binary (the binary stage).
XEVM_PIPELINE = ", ".join([
    "cse", "lower-affine", "func.func(gpu-async-region)",
    "gpu.module(xegpu-propagate-layout{layout-kind=subgroup}, xegpu-wg-to-sg-distribute, cse, "
    "lower-affine, cse, xegpu-propagate-layout{layout-kind=inst}, xegpu-blocking, cse, "
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


def vectorize(payload: ir.Module) -> None:
    """Whole-tile vectorization of every workgroup tile (see the module docstring)."""

    def body(root):
        func = match(root, "func.func")
        func = structured.VectorizeChildrenAndApplyPatternsOp(
            func, fold_type_extensions_into_contract=True).result
        canonicalize(func)
        hoist_loop_invariant_subsets(func)
        canonicalize(func)

    run_schedule(payload, body)
    narrow_contract_operands(payload)
    run_passes(payload, "canonicalize, cse")


def narrow_contract_operands(payload: ir.Module) -> None:
    """Give every `vector.contract` f16/bf16 operands with an f32 accumulator (DPAS form).

    An f32 operand that is `arith.extf` of an f16/bf16 vector is replaced by that vector
    (exact). An f32 operand computed in f32 (e.g. softmax probabilities P in P @ V) is
    truncated to the other operand's f16/bf16 type, the precision flash attention kernels use
    for P; an f32 x f32 contraction with no narrow operand has no DPAS form and is an error.
    Preconditions: accumulator and result f32."""
    contracts = []

    def visit(op):
        if op.name == "vector.contract":
            contracts.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        for op in contracts:
            acc = op.operands[2].type
            if not isinstance(acc, ir.VectorType) or str(acc.element_type) != "f32":
                raise ValueError(f"{op.location}: vector.contract accumulates in {acc}; DPAS "
                                 "accumulates in f32")
            narrow, computed = {}, []
            for i in (0, 1):
                value = op.operands[i]
                elem = str(ir.VectorType(value.type).element_type)
                if elem in DPAS_TYPES:
                    narrow[i] = elem
                    continue
                source = _extended_from(value)
                if source is not None:
                    op.operands[i] = source
                    narrow[i] = str(ir.VectorType(source.type).element_type)
                else:
                    computed.append(i)
            if len(computed) == 2:
                raise ValueError(f"{op.location}: vector.contract of two {elem} operands has no "
                                 "DPAS form (DPAS multiplies f16 or bf16)")
            for i in computed:
                other = narrow[1 - i]
                value = op.operands[i]
                target = ir.VectorType.get(list(ir.VectorType(value.type).shape),
                                           ir.Type.parse(other))
                with ir.InsertionPoint(op), op.location:
                    op.operands[i] = arith.truncf(target, value)


def _extended_from(value: ir.Value):
    """The f16/bf16 vector `value` is `arith.extf` of, else None."""
    owner = value.owner
    owner = getattr(owner, "operation", owner)
    if isinstance(owner, ir.Operation) and owner.name == "arith.extf":
        source = owner.operands[0]
        if str(ir.VectorType(source.type).element_type) in DPAS_TYPES:
            return source
    return None


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
    allocs_to_device(payload)


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


def to_xegpu(payload: ir.Module) -> None:
    run_passes(payload, "gpu.module(gpu.func(convert-vector-to-xegpu)), cse")


def _ops_named(payload: ir.Module, name: str) -> list[ir.Operation]:
    found = []

    def visit(op):
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return found
