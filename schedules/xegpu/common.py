"""The target-independent-shaped tail shared by every XeGPU schedule, as recorded steps.

After a family has fused and a kernel schedule has tiled the payload into workgroup
`scf.forall`s (one forall = one GPU kernel, one iteration = one workgroup), each function
here records the steps of one stage of the script (schedules.script.StepRecorder: applied to
the trial copy as they are recorded, so what follows reads the IR they leave):
  vectorize      every linalg op of a workgroup tile becomes whole-tile vector ops
                 (`vectorize_children_and_apply_patterns`, type extensions folded into
                 `vector.contract`), loop-invariant accumulators are hoisted out of the
                 reduction loops, dot products per row become products and row reductions
                 (`transform_ext.split_row_dot_contracts`), and contraction operands are
                 narrowed to DPAS types (`transform_ext.narrow_contracts_for_dpas`);
  bufferize      one-shot bufferization with identity layouts, results as out-parameters
                 (written in place through a reshape), subviews folded into the transfers,
                 function-level buffers in device memory;
  outline        forall -> scf.parallel -> gpu.launch with the kernel's thread count,
                 then `gpu-kernel-outlining` (one gpu.module + gpu.func per kernel);
  to_xegpu       `convert-vector-to-xegpu` inside the kernels.
A pass pipeline of the former stages is one `transform.apply_registered_pass` per pass, on
the module or (for a nested pipeline) on the ops it was nested on.
Layouts (workgroup -> subgroup -> instruction) are attached by the kernel schedules.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.bufferization import LayoutMapOption
from torch_mlir.dialects.transform import bufferization as tbuf
from torch_mlir.dialects.transform import loop, structured, xegpu

import transform_ext
from transform_ext.allocs_to_device import allocs_to_device
from transform_ext.carry_collapsed_loop_tensors import carry_collapsed_loop_tensors
from transform_ext.common import ops_named
from transform_ext.drop_unused_results import drop_unused_results
from transform_ext.drop_forall_mapping import drop_forall_mapping
from transform_ext.fold_reads_of_splat_writes import fold_reads_of_splat_writes
from transform_ext.forall_allocs_to_function import forall_allocs_to_function
from transform_ext.forward_reshaped_writes import forward_reshaped_writes
from transform_ext import insert_loop_prefetches as loop_prefetches
from transform_ext.narrow_contracts_for_dpas import DPAS_TYPES, narrow_contracts_for_dpas
from transform_ext.split_row_dot_contracts import split_row_dot_contracts
from transform_ext.transpose_contract_operands import transpose_contract_operands
from transform_ext.split_assertions import split_assertions
from transform_ext.write_results_in_place import write_results_in_place

from ..common import (any_op, apply_passes, at_place, canonicalize, foreach,
                      hoist_loop_invariant_subsets, match, place_of)
from ..script import StepRecorder, build_script

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

__all__ = ["DPAS_TYPES", "XEVM_PIPELINE", "apply_pass", "bufferize", "gpu_preparation_script",
           "insert_loop_prefetches", "outline", "passes", "to_xegpu", "vectorize", "RowSubgroups"]


class RowSubgroups:
    """Workgroup tiles whose `rows` rows are split among subgroups of `sg_rows` rows each
    (subgroup layout [subgroups, 1]), each subgroup `subgroup_size` lanes."""

    @property
    def subgroups(self) -> int:
        return self.rows // self.sg_rows

    @property
    def sg_layout(self) -> list[int]:
        return [self.subgroups, 1]

    @property
    def threads(self) -> int:
        return self.subgroups * self.subgroup_size


def gpu_preparation(root: ir.Value) -> None:
    """The fuse stage for payloads without a fused schedule on the GPU (the workgroups stage
    tiles them): asserts split off (they block vectorization), unit dims folded, unused
    generic results (the argmax of the imported max reduction) dropped; no elementwise
    fusion, so type conversions stay visible to the contraction kernels."""
    split_assertions(root)
    root = apply_passes(root, "linalg-fold-unit-extent-dims", "canonicalize", "cse")
    drop_unused_results(match(root, "func.func"))
    apply_passes(root, "canonicalize", "cse")


def gpu_preparation_script() -> ir.Module:
    """`gpu_preparation` as the script's @fuse stage (needs an active context)."""
    return build_script([("fuse", gpu_preparation)])


def apply_pass(target: ir.Value, name: str, options: dict | None = None) -> ir.Value:
    """transform.apply_registered_pass of `name{options}` on `target` (consumed); returns
    the handle to the target after it."""
    return transform.ApplyRegisteredPassOp(any_op(), target, name, options=options).result


def passes(*names: str):
    """A step running the passes `names` in turn on the payload module."""
    return lambda root: apply_passes(root, *names)


def vectorize(rec: StepRecorder, *, contractions: bool = True, gathers: bool = False) -> None:
    """Whole-tile vectorization of every workgroup tile (see the module docstring). Loop-
    carried tiles become vector iter_args (through the unit-dim reshapes of folded tiles),
    so no loop state lives in memory. contractions=False keeps multiply-add reductions as
    elementwise products and `vector.multi_reduction` (a kernel without DPAS: an f32
    `vector.contract` has no XeGPU form); gathers=True vectorizes n-D `tensor.extract` at
    computed indices into `vector.gather` (scattered loads)."""
    transform_ext.load(rec.trial.context)

    def whole_tiles(root):
        func = match(root, "func.func")
        func = structured.VectorizeChildrenAndApplyPatternsOp(
            func, fold_type_extensions_into_contract=contractions,
            disable_multi_reduction_to_contract_patterns=not contractions,
            vectorize_nd_extract=gathers).result
        canonicalize(func)
        forward_reshaped_writes(func)
        carry_collapsed_loop_tensors(func)
        fold_reads_of_splat_writes(func)

    rec.step("vectorize_tiles", whole_tiles)
    rec.step("canonicalize", passes("canonicalize", "cse"))

    def hoist(root):
        func = match(root, "func.func")
        hoist_loop_invariant_subsets(func)
        canonicalize(func)
        fold_reads_of_splat_writes(func)
        transpose_contract_operands(func)
        split_row_dot_contracts(func)
        narrow_contracts_for_dpas(func)

    rec.step("hoist_and_narrow", hoist)
    rec.step("canonicalize", passes("canonicalize", "cse"))


def bufferize(rec: StepRecorder) -> None:
    """One-shot bufferization; results become out-parameters (written in place through a
    reshape); subviews fold into transfers; a workgroup's own buffers become its slice of a
    function-level buffer; function-level buffers live in device memory."""
    transform_ext.load(rec.trial.context)

    def one_shot(root):
        tbuf.EliminateEmptyTensorsOp(root)
        return tbuf.OneShotBufferizeOp(
            root, bufferize_function_boundaries=True,
            function_boundary_type_conversion=LayoutMapOption.IdentityLayoutMap).result

    def out_params(root):
        root = apply_passes(root, "canonicalize", "cse")
        root = apply_pass(root, "buffer-results-to-out-params",
                          {"hoist-static-allocs": True, "modify-public-functions": True})
        return apply_passes(root, "fold-memref-alias-ops", "canonicalize", "cse")

    def to_device(root):
        funcs = match(root, "func.func")
        write_results_in_place(funcs)
        forall_allocs_to_function(funcs)
        allocs_to_device(funcs)

    rec.step("one_shot_bufferize", one_shot)
    rec.step("results_to_out_params", out_params)
    rec.step("buffers_to_device", to_device)


def outline(rec: StepRecorder, threads: list[int], chip: str) -> None:
    """Every top-level scf.forall -> gpu.launch with `threads[i]` lanes per workgroup ->
    outlined gpu.module/gpu.func; attaches the XeVM target of `chip`."""
    transform_ext.load(rec.trial.context)

    def to_parallel(root):
        foralls = match(root, "scf.forall")
        drop_forall_mapping(foralls)    # gpu-map-parallel-loops assigns the mapping
        foreach(foralls, lambda f: loop.ForallToParallelOp([any_op()], f))

    def to_launches(root):
        apply_passes(match(root, "func.func"), "gpu-map-parallel-loops",
                     "convert-parallel-loops-to-gpu")
        return apply_passes(root, "lower-affine", "canonicalize", "cse")

    rec.step("foralls_to_parallel", to_parallel)
    rec.step("parallel_to_launches", to_launches)
    launches = ops_named(rec.trial, "gpu.launch")
    if len(launches) != len(threads):
        raise ValueError(f"expected {len(threads)} gpu.launch ops (one per workgroup forall), "
                         f"found {len(launches)}")
    counts = list(threads)

    def set_threads(root):
        handles = transform.SplitHandleOp([any_op()] * len(counts),
                                          match(root, "gpu.launch")).results
        for handle, count in zip(handles, counts):
            xegpu.set_gpu_launch_threads(handle, threads=[count, 1, 1])

    def outline_kernels(root):
        apply_passes(match(root, "func.func"), "lower-affine", "canonicalize",
                     "gpu-launch-sink-index-computations")
        root = apply_passes(root, "gpu-kernel-outlining", "cse")
        return apply_pass(root, "xevm-attach-target", {"O": 3, "chip": chip})

    rec.step("set_launch_threads", set_threads)
    rec.step("outline_kernels", outline_kernels)


# Narrower tiles (a boolean mask's bytes) are not prefetched: XeGPU distributes an 8-bit
# prefetch in 16-column pieces, and IGC has no 8-bit 2-D block prefetch 16 columns wide;
# nor are tiles narrower than one instruction (the attention backward's per-row vectors).
MIN_PREFETCH_BITS = 16


def insert_loop_prefetches(rec: StepRecorder, gpu_func: ir.Operation, subgroups: int,
                           inst: tuple[int, int], nb_prefetch: int = 1) -> None:
    """Prefetch the tiles that the loops of a kernel read `nb_prefetch` steps ahead
    (transform_ext.insert_loop_prefetches): 2-D block prefetches spread over the
    `subgroups`, in `inst` instruction tiles (prefetch_layout of each tile shape)."""
    from .contraction import prefetch_layout

    if nb_prefetch < 1:
        return
    transform_ext.load(gpu_func.context)
    tiles = {(*ir.VectorType(op.results[0].type).shape[-2:],
              ir.VectorType(op.results[0].type).element_type)
             for op in ops_named(gpu_func, "xegpu.load_nd")
             if ir.VectorType(op.results[0].type).rank >= 2}
    layouts = {}
    for rows, cols, element in sorted(tiles, key=str):
        key = loop_prefetches.tile_key(rows, cols, str(element))
        if element.width < MIN_PREFETCH_BITS or cols % inst[1]:
            layouts[key] = ir.UnitAttr.get()
            continue
        layout = prefetch_layout(rows, cols, subgroups, inst)
        layouts[key] = ir.Attribute.parse(
            "#xegpu.layout<" + ", ".join(f"{k} = {v}" for k, v in layout.items()) + ">")
    place = place_of(rec.trial.operation, gpu_func)

    def body(root):
        loop_prefetches.insert_loop_prefetches(at_place(root, place), nb_prefetch, layouts)

    rec.step("insert_loop_prefetches", body)


def to_xegpu(rec: StepRecorder) -> None:
    def convert(root):
        apply_passes(match(root, "gpu.func"), "convert-vector-to-xegpu")
        root = apply_passes(root, "cse")
        apply_passes(match(root, "gpu.func"), "loop-invariant-code-motion")
        return root

    rec.step("convert_vector_to_xegpu", convert)
