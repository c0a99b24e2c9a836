"""F.cross_entropy(F.linear(h, W[, b]), y) on the XeGPU target: the fused forward (bf16 and
f16 h and W, bias, class weights, ignore_index, mean and sum), checked through the IR of
every stage, the validated SPIR-V, the machine code Intel's compiler makes of it, and the
kernel program run on the CPU.

Kernels (schedules/linear_cross_entropy/xegpu.py): the row-block kernel (per workgroup 64
rows of h against every class: a loop over class tiles computing the logits tile
S = h W^T [+ b] by DPAS, in a loop over D when h and W tiles would not fit the registers,
with the running max, the rescaled exp-sum and the target logit as a masked sum over the
tile; the rows' losses leave in lane form), then the cross-entropy family's reduction
kernel (the mean or sum over the rows), and the targets' bounds check on the host. No
[N, V] buffer anywhere.
With the backward (backward=True): two more kernels, its passes (dh per block of rows, dW
and db per block of classes, every product DPAS), the per-row values crossing kernels in
lane form (the forward's row max and exp-sum, pass 1's per-row values for pass 2), checked
down to the machine code for both chips; D 64 with the passes' accumulators in registers,
D 128 and 256 (numerics) and 1024 and 4096 (machine code) in loops over D slices of 64
with the accumulators in device memory.
No Intel GPU here: the numerics of what the kernels compute are checked by running the
kernel program of the `workgroups` stage (the foralls with every GPU-specific rewrite: the
masked target sum, lane-form per-row data, the depth loop, the reduction kernel, the host
check) on the CPU against torch.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.errors import LighthouseError
from lighthouse.ingress import TensorSpec
from lighthouse.targets import ocloc, spirv
from tests.lighthouse.xegpu_helpers import Lowered, dumped_stages, walk
from tests.transform_ext.helpers import check as filecheck

STAGES = ["import", "cleanup", "fuse", "workgroups", "subgroups", "vectorize", "bufferize",
          "gpu-outline", "xegpu", "xegpu-layouts", "xevm", "binary", "native"]
KERNEL = """
import torch
import torch.nn.functional as F
N, D, V = {N}, {D}, {V}
DTYPE = torch.{dtype}
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.register_buffer("w", (torch.rand(V, generator=g) + 0.5).to(DTYPE))
    def forward(self, h, W, {bias_arg}y):
        return F.cross_entropy(F.linear(h, W{bias}), y, weight={weight},
                               label_smoothing={smoothing}, reduction="{reduction}")
def get_inputs():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, V, (N,), generator=g)
    y[::7] = -100
    h = torch.randn(N, D, generator=g).to(DTYPE)
    W = (torch.randn(V, D, generator=g) / D ** 0.5).to(DTYPE)
    b = (torch.randn(V, generator=g) / 2).to(DTYPE)
    return [h, W{bias}, y]
def get_init_inputs():
    return []
"""
# name: (dtype, N, D, V, bias, class weights, reduction, depth step of the kernel)
CASES = {
    "bf16_mean": ("bfloat16", 192, 256, 512, False, False, "mean", 64),
    "f16_bias_weight_sum": ("float16", 128, 64, 256, True, True, "sum", 64),
}


def _write(path, dtype, n, d, v, bias, weighted, reduction, smoothing=0.0):
    path.write_text(KERNEL.format(N=n, D=d, V=v, dtype=dtype, bias_arg="b, " if bias else "",
                                  bias=", b" if bias else "",
                                  weight="self.w" if weighted else "None", smoothing=smoothing,
                                  reduction=reduction))
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def lowered(request, tmp_path_factory):
    dtype, n, d, v, bias, weighted, reduction, _ = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    kernel = _write(tmp / "head.py", dtype, n, d, v, bias, weighted, reduction)
    compiled = compile_kernel(kernel, target="xegpu", dump_dir=tmp / "dump")
    low = Lowered(compiled, tmp / "dump")
    low.name, low.case, low.tmp = request.param, CASES[request.param], tmp
    return low


def _forward_kernel(low):
    (plan,) = [p for p in low.plans if p.kind == "linear_cross_entropy"]
    return plan


def test_every_stage_runs_and_the_loss_gets_its_kernels(lowered):
    """The family's fused forward as one kernel (64 rows per workgroup, 8 subgroups of 8
    rows, classes in steps of 32), then the reduction over the rows; one gpu.func and one
    launch per kernel, in that order."""
    dtype, n, d, v, *_ , depth_tile = lowered.case
    c = lowered.compiled
    assert c.family.name == "linear_cross_entropy" and not c.notes
    assert c.pipeline.names() == STAGES and list(lowered.stage_files) == dumped_stages(STAGES)
    assert [p.kind for p in lowered.plans] == ["linear_cross_entropy", "row_sum"]
    tiles = _forward_kernel(lowered).tiles
    assert (tiles.rows, tiles.sg_rows, tiles.class_tile, tiles.depth, tiles.depth_tile) == \
        (64, 8, 32, d, depth_tile)
    assert [k.grid for k in lowered.target.kernels] == [(n // 64, 1, 1), (1, 1, 1)]
    assert [k.local_size[0] for k in lowered.target.kernels] == [8 * 16, 16]
    final = lowered.ir("xegpu")
    assert len(walk(final, "gpu.func")) == len(walk(final, "gpu.launch_func")) == 2


def test_logits_tiles_are_dpas_in_the_online_class_loop(lowered):
    """FileCheck of the forward kernel after the layouts: the targets read in lane form, the
    class loop carrying the rows' max, exp-sum and target logit, the logits tile by DPAS
    on h rows split over the subgroups and a W tile read whole and transposed (in a loop
    over D when it is shorter than D), the masked target sum, the losses stored in lane
    form; then the reduction kernel."""
    dtype, n, d, v, bias, weighted, reduction, depth_tile = lowered.case
    narrow = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    depth = (f"""
        CHECK:   scf.for %{{{{.*}}}} = %{{{{.*}}}} to %{{{{.*}}}} step %{{{{.*}}}} iter_args(%{{{{.*}}}} = %{{{{.*}}}}) -> (vector<64x32xf32>)"""
             if depth_tile < d else "")
    filecheck(lowered.stage_files["xegpu-layouts"].read_text(), f"""
        CHECK: gpu.func @main_kernel(
        CHECK: xegpu.load {{{{.*}}}} -> vector<64x16xi64>
        CHECK: scf.for {{{{.*}}}} -> (vector<64xf32>, vector<64xf32>, vector<64xf32>){depth}
        CHECK:   xegpu.load_nd {{{{.*}}}}sg_layout = [8, 1], sg_data = [8, {depth_tile}]{{{{.*}}}} -> vector<64x{depth_tile}x{narrow}>
        CHECK:   xegpu.load_nd {{{{.*}}}}sg_layout = [1, 1], sg_data = [32, {depth_tile}]{{{{.*}}}}order = [0, 1]{{{{.*}}}} -> vector<32x{depth_tile}x{narrow}>
        CHECK:   xegpu.dpas {{{{.*}}}} : vector<64x{depth_tile}x{narrow}>, vector<{depth_tile}x32x{narrow}>, vector<64x32xf32> -> vector<64x32xf32>
        CHECK:   vector.multi_reduction <maximumf>
        CHECK:   math.exp
        CHECK:   vector.multi_reduction <add>
        CHECK:   arith.cmpi eq, {{{{.*}}}} : vector<64x32xindex>
        CHECK:   arith.select {{{{.*}}}} : vector<64x32xi1>, vector<64x32xf32>
        CHECK:   vector.multi_reduction <add>
        CHECK: math.log
        CHECK: xegpu.store_nd {{{{.*}}}} : vector<64x16xf32>
        CHECK-NOT: xegpu.store_nd
        CHECK: gpu.return
        CHECK: gpu.func @main_kernel(
        CHECK-NOT: xegpu.dpas
        CHECK: gpu.return
    """)


def test_no_buffer_holds_the_logits(lowered):
    """No tensor, buffer or vector of N x V elements (or V x N) exists after the fuse stage:
    the logits live in [64, 32] tiles only; the rows' losses cross kernels as [N, 16]."""
    _, n, _, v, *_ = lowered.case
    for stage in ("fuse", "workgroups", "bufferize", "xegpu-layouts"):
        text = lowered.stage_files[stage].read_text()
        assert not re.search(rf"\b({n}x{v}|{v}x{n})x", text), stage
    assert f"memref<{n}x16xf32>" in lowered.stage_files["bufferize"].read_text()


def test_spirv_validates_and_ocloc_builds_without_spills(lowered, tmp_path):
    """Every kernel's SPIR-V passes spirv-val with the launch the manifest records; Intel's
    compiler builds each for the chip with 0 bytes of GRF spill, the forward's DPAS in its
    machine code, 2-D block loads for h and W."""
    target = lowered.target
    path = tmp_path / "head.spv"
    target.write_artifact(lowered.compiled, path)
    for kernel, plan in zip(target.kernels, lowered.plans, strict=True):
        file = tmp_path / f"head.{kernel.module}.spv"
        spirv.validate(file)
        (ep,) = spirv.read_spirv(file.read_bytes())["entry_points"]
        assert ep.local_size == (plan.threads, 1, 1) and ep.subgroup_size == 16
        mc = kernel.machine
        assert mc.spill_bytes == 0, (kernel.module, mc)
        if plan.kind == "linear_cross_entropy":
            assert mc.dpas > 0 and mc.block_loads > 0, mc
        else:
            assert mc.dpas == 0


def test_pvc_builds_without_spills(tmp_path):
    """The same kernels for Ponte Vecchio (bf16, a loop over D)."""
    dtype, n, d, v, bias, weighted, reduction, _ = CASES["bf16_mean"]
    kernel = _write(tmp_path / "head.py", dtype, n, d, v, bias, weighted, reduction)
    compiled = compile_kernel(kernel, target="xegpu", target_options={"chip": "pvc"})
    kernels = compiled.target.kernels
    assert [k.kind for k in kernels] == ["linear_cross_entropy", "row_sum"]
    assert all(k.machine.spill_bytes == 0 for k in kernels), [k.machine for k in kernels]
    assert kernels[0].machine.dpas > 0


@pytest.mark.parametrize("lowered", ["f16_bias_weight_sum"], indirect=True)
def test_the_printed_script_replays_to_identical_ir(lowered, tmp_path):
    """The compile's script (the family's @fuse in its GPU form, then the XeGPU stages)
    printed and replayed gives byte-identical IR at every stage down to the SPIR-V."""
    from tests.lighthouse.test_schedule_scripts import _without_counters

    script = tmp_path / "schedule.mlir"
    script.write_text(lowered.compiled.schedule_text())
    compile_kernel(lowered.tmp / "head.py", target="xegpu", dump_dir=tmp_path / "replayed",
                   schedule_file=script, stop_after="binary")
    for stage in STAGES[:-1]:
        (replayed,) = (tmp_path / "replayed").glob(f"*-{stage}.mlir")
        assert _without_counters(replayed.read_text()) == \
            _without_counters(lowered.stage_files[stage].read_text()), stage


# ------------------------------------------------------------- the kernel program on the CPU

def _program_on_cpu(low, weights=None):
    """The `workgroups` stage (the kernel foralls, the host check) lowered for the CPU;
    `weights`: the specs of the frozen weights that became its last arguments (default:
    those the compile's binary stage recorded)."""
    from lighthouse.pipeline import Pipeline
    from lighthouse.targets.cpu import CpuTarget

    ctx = ir.Context()
    module = ir.Module.parse(low.stage_files["workgroups"].read_text(), ctx)

    def unmap(op):
        if op.name == "scf.forall" and "mapping" in op.attributes:
            del op.attributes["mapping"]
        return ir.WalkResult.ADVANCE

    module.operation.walk(unmap)
    cpu = CpuTarget(threads=2)
    with ctx, ir.Location.unknown():
        Pipeline(cpu.stages()).run(module)
    imported = low.compiled.imported
    if weights is None:
        weights = [TensorSpec(tuple(w["shape"]), low.compiled.kernel.model.w.dtype)
                   for w in low.target.weight_specs]
    return cpu.jit(module, list(imported.arg_specs) + weights, imported.result_specs)


def _inputs(dtype, n, d, v, bias, kind):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(n, d, generator=g)
    W = torch.randn(v, d, generator=g) / d ** 0.5
    b = torch.randn(v, generator=g) / 2
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    if kind == "all_ignored":
        y[:] = -100
    elif kind == "huge":
        h = h * 40
    elif kind == "edge_targets":
        y[::2], y[1::2] = 0, v - 1
    args = [h.to(dtype), W.to(dtype)] + ([b.to(dtype)] if bias else [])
    return args + [y]


@pytest.mark.parametrize("kind", ["mixed", "all_ignored", "huge", "edge_targets"])
def test_kernel_program_matches_torch_on_cpu(lowered, kind):
    """Numerics of the GPU kernels' program (no GPU here): ignored rows, all rows ignored
    (mean NaN, sum 0), logits in the hundreds, targets at the first and last class."""
    dtype_name, n, d, v, bias, weighted, reduction, _ = lowered.case
    if not hasattr(lowered, "cpu"):
        lowered.cpu = _program_on_cpu(lowered)
    dtype = getattr(torch, dtype_name)
    args = _inputs(dtype, n, d, v, bias, kind)
    w = lowered.compiled.kernel.model.w
    (got,) = lowered.cpu(*args, *([w] if weighted else []))
    want = F.cross_entropy(F.linear(*args[:-1]), args[-1], weight=w if weighted else None,
                           reduction=reduction)
    if kind == "all_ignored" and reduction == "mean":
        assert torch.isnan(got)
        return
    assert torch.isfinite(got)
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("case, reason", [
    (("float32", 128, 64, 256, False, False, "mean"),
     "h and W of type f32: DPAS multiplies f16 or bf16"),
    (("bfloat16", 128, 64, 200, False, False, "mean"),
     "the classes (200) are not a multiple of the class tile (32)"),
    (("bfloat16", 128, 64, 256, False, False, "none"),
     "per-row losses have no store form in the GPU kernels"),
    (("bfloat16", 128, 64, 256, False, False, "mean", 0.1),
     "label smoothing of f16/bf16 logits"),
    (("bfloat16", 100, 64, 256, False, False, "mean"),
     "rows per workgroup (50) is not a multiple of the rows per subgroup (8)"),
], ids=["f32", "classes_not_a_multiple", "reduction_none", "bf16_label_smoothing",
        "rows_not_a_multiple"])
def test_what_has_no_gpu_form_is_refused_by_name(tmp_path, case, reason):
    """A semantic without a lowering is an error naming it (never a wrong kernel): under
    --strict the family's reason, else the generic schedule's failure after the note."""
    kernel = _write(tmp_path / "head.py", *case)
    with pytest.raises(LighthouseError) as error:
        compile_kernel(kernel, target="xegpu", stop_after="workgroups", strict=True)
    assert reason in str(error.value)


# ------------------------------------------------------------------------------ backward
# The joint graph (backward=True): the forward's kernels, then the backward's two passes
# (schedules/linear_cross_entropy/xegpu_backward.py): dh per workgroup of 64 rows over
# class tiles of 32, dW and db per workgroup of 64 classes over row tiles of 32; S
# recomputed by DPAS in each, every product a DPAS; down to the machine code.

# D 64: a subgroup's f32 accumulator over the whole depth in registers; D 128 and 256: the
# accumulator in memory, S and the accumulation in loops over D slices of 64 (two, four)
BACKWARD_CASES = {
    "bf16_mean": ("bfloat16", 128, 64, 256, False, False, "mean"),
    "f16_sum": ("float16", 128, 64, 256, False, False, "sum"),
    "bf16_d128_mean": ("bfloat16", 128, 128, 256, False, False, "mean"),
    "f16_d256_sum": ("float16", 192, 256, 320, False, False, "sum"),
    "bf16_bias_weight_mean": ("bfloat16", 128, 64, 256, True, True, "mean"),
}
DEPTH_TILE = 64
BACKWARD_KINDS = {"mean": ["linear_cross_entropy", "row_sum", "linear_cross_entropy_dh",
                           "linear_cross_entropy_dw"],
                  "sum": ["linear_cross_entropy", "linear_cross_entropy_dh",
                          "linear_cross_entropy_dw", "row_sum"]}


@pytest.fixture(scope="module", params=sorted(BACKWARD_CASES))
def lowered_backward(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"backward_{request.param}")
    kernel = _write(tmp / "head.py", *BACKWARD_CASES[request.param])
    compiled = compile_kernel(kernel, target="xegpu", backward=True, dump_dir=tmp / "dump",
                              strict=True)
    low = Lowered(compiled, tmp / "dump")
    low.name, low.case, low.tmp = request.param, BACKWARD_CASES[request.param], tmp
    return low


def test_backward_kernels_are_two_passes_of_dpas(lowered_backward):
    """Four kernels in launch order (the passes after the reduction kernel when they read
    its count); each pass a grid of 64-row blocks of 8 subgroups, its loop's two products
    DPAS on 16-bit operands: S (h rows split over the subgroups, the step's W or h tile
    read transposed) and dh = G W or dW = G^T h (the tile read as stored), f32 accumulators
    written in the inputs' type; no [N, V] tensor, buffer or vector at any stage."""
    dtype, n, d, v, bias, weighted, reduction = lowered_backward.case
    narrow = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    assert lowered_backward.compiled.pipeline.names() == STAGES
    text = lowered_backward.stage_files["xegpu"].read_text()
    kernels = re.findall(r'lh.kernel = \{description = "[^"]*", grid = array<i64: (\d+), 1, 1>, '
                         r'kind = "(\w+)", threads = (\d+)', text)
    assert [k for _, k, _ in kernels] == BACKWARD_KINDS[reduction]
    launches = {k: (int(g), int(t)) for g, k, t in kernels}
    assert launches["linear_cross_entropy_dh"] == (n // 64, 8 * 16)
    assert launches["linear_cross_entropy_dw"] == (v // 64, 8 * 16)
    kernels = text.split("gpu.func @")[1:]
    if d > DEPTH_TILE:
        _check_depth_slices(lowered_backward, kernels, narrow)
        return
    passes = [k for k in kernels if f"-> vector<64x{d}xf32>" in k]
    assert len(passes) == 2
    for kernel, kind in zip(passes, ("dh", "dw")):
        filecheck(kernel, f"""
            CHECK: scf.for
            CHECK:   xegpu.load_nd {{{{.*}}}} -> vector<64x{d}x{narrow}>
            CHECK:   xegpu.load_nd {{{{.*}}}} -> vector<32x{d}x{narrow}>
            CHECK:   xegpu.dpas {{{{.*}}}} : vector<64x{d}x{narrow}>, vector<{d}x32x{narrow}>, vector<64x32xf32> -> vector<64x32xf32>
            CHECK:   math.exp
            CHECK:   xegpu.dpas {{{{.*}}}} : vector<64x32x{narrow}>, vector<32x{d}x{narrow}>, vector<64x{d}xf32> -> vector<64x{d}xf32>
            CHECK:   scf.yield
            CHECK: arith.truncf {{{{.*}}}} : vector<64x{d}xf32> to vector<64x{d}x{narrow}>
            CHECK: xegpu.store_nd {{{{.*}}}} : vector<64x{d}x{narrow}>
        """)
    for stage in ("fuse", "workgroups", "bufferize", "xegpu"):
        stage_text = lowered_backward.stage_files[stage].read_text()
        assert not re.search(rf"\b({n}x{v}|{v}x{n})x", stage_text), stage


def _check_depth_slices(low, kernels, narrow):
    """A pass of a head deeper than the registers: its rows' f32 accumulator zeroed, updated
    and cast in loops over D slices of 64, in its workgroup's rows of a device buffer
    (gpu.alloc [N or V, D] f32 on the host, one subview per workgroup); in each step S
    accumulated by DPAS over the D slices, then per D slice acc[:, d] += G B[:, d] by DPAS
    on the accumulator's slice (loaded, added, stored); no vector over the whole depth; the
    four loops over D not unrolled."""
    dtype, n, d, v, *_ = low.case
    t = DEPTH_TILE
    passes = [k for k in kernels if "xegpu.dpas" in k and f"memref<{t}x{d}xf32, strided" in k]
    assert len(passes) == 2
    for kernel, extent in zip(passes, (v, n)):
        filecheck(kernel, f"""
            CHECK: memref.subview {{{{.*}}}} [64, {d}] [1, 1] : memref<{{{{[0-9]+}}}}x{d}xf32> to memref<64x{d}xf32, strided<[{d}, 1], offset: ?>>
            CHECK: scf.for {{{{.*}}}} to %c{d} step %c{t}
            CHECK:   xegpu.store_nd {{{{.*}}}} : vector<64x{t}xf32>
            CHECK: scf.for {{{{.*}}}} to %c{extent} step %c32
            CHECK:   scf.for {{{{.*}}}} to %c{d} step %c{t} iter_args({{{{.*}}}}) -> (vector<64x32xf32>)
            CHECK:     xegpu.load_nd {{{{.*}}}} -> vector<64x{t}x{narrow}>
            CHECK:     xegpu.load_nd {{{{.*}}}} -> vector<32x{t}x{narrow}>
            CHECK:     xegpu.dpas {{{{.*}}}} : vector<64x{t}x{narrow}>, vector<{t}x32x{narrow}>, vector<64x32xf32> -> vector<64x32xf32>
            CHECK:   math.exp
            CHECK:   scf.for {{{{.*}}}} to %c{d} step %c{t} {{
            CHECK:     xegpu.load_nd {{{{.*}}}} -> vector<32x{t}x{narrow}>
            CHECK:     xegpu.load_nd {{{{.*}}}} -> vector<64x{t}xf32>
            CHECK:     xegpu.dpas {{{{.*}}}} : vector<64x32x{narrow}>, vector<32x{t}x{narrow}>, vector<64x{t}xf32> -> vector<64x{t}xf32>
            CHECK:     xegpu.store_nd {{{{.*}}}} : vector<64x{t}xf32>
            CHECK: scf.for {{{{.*}}}} to %c{d} step %c{t}
            CHECK:   xegpu.load_nd {{{{.*}}}} -> vector<64x{t}xf32>
            CHECK:   arith.truncf {{{{.*}}}} : vector<64x{t}xf32> to vector<64x{t}x{narrow}>
            CHECK:   xegpu.store_nd {{{{.*}}}} : vector<64x{t}x{narrow}>
        """)
        assert not re.search(rf"vector<\d+x{d}x", kernel)
        assert len(re.findall(r"llvm.loop_annotation = #loop_annotation", kernel)) == 4
    host = low.stage_files["bufferize"].read_text()
    for rows in (n, v):
        assert re.search(rf"gpu.alloc\s+\(\) : memref<{rows}x{d}xf32>", host), rows


def test_the_forward_hands_its_row_statistics_over_in_lane_form(lowered_backward):
    """The forward's kernel writes the row max and exp-sum the backward reads as [64, 16]
    lane tiles (2-D block stores beside the losses', no scattered store); the first pass
    reads them back by 2-D block loads of its rows; the count is read as a scalar (no 0-d
    vector in any kernel)."""
    text = lowered_backward.stage_files["xegpu"].read_text()
    kernels = dict(re.findall(r'kind = "(\w+)", threads = \d+ : i64\}\} \{(.*?)gpu.return',
                              text, re.S))
    forward = kernels["linear_cross_entropy"]
    assert "xegpu.store " not in forward
    assert len(re.findall(r"xegpu.store_nd [^\n]*: vector<64x16xf32>", forward)) == 3
    assert len(re.findall(r"xegpu.load_nd [^\n]*-> vector<64x16xf32>",
                          kernels["linear_cross_entropy_dh"])) == 2
    assert not re.search(r"vector<(f32|bf16|f16|i64)>", text)


def test_backward_spirv_validates_and_ocloc_builds_without_spills(lowered_backward, tmp_path):
    """Every kernel of the joint graph passes spirv-val with the launch the manifest records;
    Intel's compiler builds each for bmg with 0 bytes of GRF spill, the passes' two products
    per loop step DPAS in the machine code."""
    target = lowered_backward.compiled.target
    target.write_artifact(lowered_backward.compiled, tmp_path / "head.spv")
    kinds = []
    for kernel in target.kernels:
        spirv.validate(tmp_path / f"head.{kernel.module}.spv")
        mc = kernel.machine
        assert mc.spill_bytes == 0, (kernel.kind, mc)
        if kernel.kind in ("linear_cross_entropy_dh", "linear_cross_entropy_dw"):
            assert mc.loop_dpas >= 2 and mc.block_loads > 0 and mc.block_stores > 0, mc
        kinds.append(kernel.kind)
    assert kinds == BACKWARD_KINDS[lowered_backward.case[-1]]


@pytest.mark.parametrize("case", ["bf16_mean", "bf16_bias_weight_mean"])
def test_backward_pvc_builds_without_spills(tmp_path, case):
    """The same kernels for Ponte Vecchio (with a bias and class weights too)."""
    kernel = _write(tmp_path / "head.py", *BACKWARD_CASES[case])
    compiled = compile_kernel(kernel, target="xegpu", backward=True,
                              target_options={"chip": "pvc"})
    kernels = compiled.target.kernels
    assert [k.kind for k in kernels] == BACKWARD_KINDS["mean"]
    assert all(k.machine.spill_bytes == 0 for k in kernels), [k.machine for k in kernels]
    assert all(k.machine.dpas > 0 for k in kernels if k.kind.endswith(("_dh", "_dw")))


@pytest.mark.parametrize("n", [64, 32])
def test_backward_of_one_row_block_builds_without_spills(tmp_path, n):
    """N of one 64-row block or less (refused before as "outside the fused forward"): the
    passes in blocks and steps of N / 2 build with 0 B spill, DPAS in both."""
    kernel = _write(tmp_path / "head.py", "bfloat16", n, 64, 256, False, False, "mean")
    compiled = compile_kernel(kernel, target="xegpu", backward=True, strict=True)
    kernels = compiled.target.kernels
    assert [k.kind for k in kernels] == BACKWARD_KINDS["mean"]
    assert all(k.machine.spill_bytes == 0 for k in kernels), [k.machine for k in kernels]
    assert all(k.machine.dpas > 0 for k in kernels if k.kind.endswith(("_dh", "_dw")))


@pytest.mark.parametrize("chip, d", [("bmg", 1024), ("pvc", 4096)])
def test_backward_of_a_deep_head_builds_without_spills(tmp_path, chip, d):
    """LM-head depths: the passes in D slices of 64 build with 0 B spill, their loops over
    D kept rolled (the same machine code for any D: DPAS inside the loops, not unrolled)."""
    kernel = _write(tmp_path / "head.py", "bfloat16", 128, d, 512, False, False, "mean")
    compiled = compile_kernel(kernel, target="xegpu", backward=True, strict=True,
                              target_options={"chip": chip}, dump_dir=tmp_path / "dump")
    kernels = compiled.target.kernels
    assert [k.kind for k in kernels] == BACKWARD_KINDS["mean"]
    assert all(k.machine.spill_bytes == 0 for k in kernels), [k.machine for k in kernels]
    passes = [p.tiles for p in Lowered(compiled, tmp_path / "dump").plans
              if p.kind.endswith(("_dh", "_dw"))]
    assert [(t.depth, t.depth_tile) for t in passes] == [(d, DEPTH_TILE)] * 2
    for k in kernels:
        if k.kind.endswith(("_dh", "_dw")):
            assert 0 < k.machine.dpas < d // 16 and k.machine.loop_dpas > 0, k.machine


@pytest.mark.parametrize("d, options, reason", [
    (200, {}, "(200) is not a multiple of the DPAS depth (16)"),
    (256, {"k_tile": 48}, "depth D (256) is not a multiple of the depth tile (48)"),
], ids=["not_a_multiple_of_dpas", "depth_tile_not_dividing"])
def test_backward_depth_without_gpu_form_is_refused_by_name(tmp_path, d, options, reason):
    """A depth the DPAS slices cannot cover (or a depth tile, XeGpuParams.k_tile, that does
    not divide it) is refused naming the extents (by the forward's kernel, planned first;
    the passes check the same)."""
    from lighthouse.targets.xegpu import XeGpuParams

    kernel = _write(tmp_path / "head.py", "bfloat16", 128, d, 512, False, False, "mean")
    with pytest.raises(LighthouseError) as error:
        compile_kernel(kernel, target="xegpu", backward=True, stop_after="workgroups",
                       strict=True, target_options={"params": XeGpuParams(**options)})
    assert "linear cross-entropy" in str(error.value) and reason in str(error.value)


def test_the_passes_hand_per_row_values_over_in_lane_form(lowered_backward):
    """Pass 1 reads the targets (and the class weights w[y_n]) by lane-form gathers
    ([64, 16], one row per instruction) and writes the per-row values pass 2 reads (the row
    max, log l, the one-hot sums) as [64, 16] lane tiles; pass 2 reads a value per column
    of its tile at lane 0 or gathered at y (w[y_n]: scattered [32] loads, laid out along
    the lanes as the tile's columns), the bias of its classes by a lane-form gather, and
    writes db in lane form, lane 0 of each row (a [64, 16] scattered store, one row per
    instruction); no [rows] vector is read or written by any kernel."""
    dtype, _, _, _, bias, weighted, _ = lowered_backward.case
    narrow = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    text = lowered_backward.stage_files["xegpu-layouts"].read_text()
    kernels = {re.search(r'kind = "(\w+)"', k).group(1): k
               for k in text.split("gpu.module @")[1:]}
    dh, dw = kernels["linear_cross_entropy_dh"], kernels["linear_cross_entropy_dw"]
    row_loads = [l for l in re.findall(r"xegpu.load %[^\n]*", dh) if "-> vector<64x16x" in l]
    assert len(row_loads) == 1 + weighted and all("inst_data = [1, 16]" in l for l in row_loads)
    filecheck(dh, """
        CHECK: xegpu.load {{.*}}inst_data = [1, 16]>}> : i64, vector<64x16xindex>, vector<64x16xi1> -> vector<64x16xi64>
        CHECK: vector.multi_reduction <maxsi>, {{.*}} [1] : vector<64x16xi64> to vector<64xi64>
        CHECK: scf.for
        CHECK: xegpu.dpas
        CHECK: xegpu.dpas
    """)
    assert len(re.findall(r"xegpu.store_nd [^\n]*: vector<64x16xf32>", dh)) == 3
    stores = re.findall(r"xegpu.store %[^\n]*", text)
    assert stores == re.findall(r"xegpu.store %[^\n]*", dw) and len(stores) == bias
    assert all("inst_data = [1, 16]" in l and f": vector<64x16x{narrow}>, i64, vector<64x16xindex>"
               in l for l in stores)
    loads = re.findall(r"xegpu.load %[^\n]*", dw)
    columns = [l for l in loads if "-> vector<32x" in l]
    assert len(columns) == 4 + weighted and all("dims = [0]" in l for l in columns)
    rows = [l for l in loads if f"-> vector<64x16x{narrow}>" in l]
    assert len(rows) == bias and all("inst_data = [1, 16]" in l for l in rows)
    assert len(loads) == len(columns) + len(rows)


def _backward_program_matches_torch(low, kind):
    """The kernels' program of `low` (its `workgroups` stage) on the CPU against torch's
    autograd on the inputs of `kind`: the loss, dh, dW (and db)."""
    from lighthouse.compile import compare

    dtype_name, n, d, v, bias, weighted, reduction = low.case
    w = low.compiled.kernel.model.w
    if not hasattr(low, "cpu"):   # the class weights: its last argument
        low.cpu = _program_on_cpu(low, [TensorSpec(tuple(w.shape), w.dtype)] if weighted else [])
    args = _inputs(getattr(torch, dtype_name), n, d, v, bias, kind)
    got = low.cpu(*args, *([w] if weighted else []))
    leaves = [a.clone().requires_grad_() for a in args[:-1]]
    loss = F.cross_entropy(F.linear(*leaves), args[-1], weight=w if weighted else None,
                           reduction=reduction)
    loss.backward()
    want = [loss.detach()] + [leaf.grad for leaf in leaves]
    assert len(got) == len(want)
    for i, (g, wanted) in enumerate(zip(got, want)):
        report = compare(f"result {i}", g, wanted)
        assert report.ok, (kind, str(report))


@pytest.mark.parametrize("kind", ["mixed", "all_ignored", "huge", "edge_targets"])
def test_backward_kernel_program_matches_torch_on_cpu(lowered_backward, kind):
    """Numerics of the backward's kernels with the forward's (no GPU here): the loss, dh, dW
    (and db) against torch's autograd, with ignored rows, all rows ignored, logits in the
    hundreds, targets at the first and last class."""
    _backward_program_matches_torch(lowered_backward, kind)


# The backward's kernel program on the CPU for more semantics than the compiled cases: a
# bias alone, class weights alone, both with D in slices (the workgroups stage only: the
# kernels' numerics).
# name: (dtype, N, D, V, bias, class weights, reduction)
PROGRAM_CASES = {
    "f16_bias_sum": ("float16", 128, 64, 256, True, False, "sum"),
    "bf16_weight_mean": ("bfloat16", 192, 64, 320, False, True, "mean"),
    "bf16_d128_bias_weight_mean": ("bfloat16", 128, 128, 256, True, True, "mean"),
    # N of one 64-row block and of half a block: blocks and steps of N / 2, so that no
    # grid or loop has one trip (it would fold away with the slices its producers fuse by)
    "bf16_n64_mean": ("bfloat16", 64, 64, 256, False, False, "mean"),
    "f16_n32_bias_weight_sum": ("float16", 32, 64, 256, True, True, "sum"),
}


@pytest.fixture(scope="module", params=sorted(PROGRAM_CASES))
def backward_program(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"program_{request.param}")
    kernel = _write(tmp / "head.py", *PROGRAM_CASES[request.param])
    compiled = compile_kernel(kernel, target="xegpu", backward=True, dump_dir=tmp / "dump",
                              stop_after="workgroups", strict=True)
    low = Lowered(compiled, tmp / "dump")
    low.case = PROGRAM_CASES[request.param]
    return low


@pytest.mark.parametrize("kind", ["mixed", "all_ignored", "huge", "edge_targets"])
def test_backward_program_with_a_bias_or_class_weights_matches_torch(backward_program, kind):
    """A bias alone (db: pass 2's column sums of its classes) and class weights alone
    (w[y_n] gathered per row in pass 1, per column in pass 2): the kernels' program against
    torch's autograd, ignored rows, all rows ignored, large logits, edge targets."""
    _backward_program_matches_torch(backward_program, kind)


def test_backward_of_a_transposed_view_is_refused_by_name(tmp_path):
    """The gradient of h passed as a transposed view is the pass's dh transposed, an op with
    no kernel: refused naming it (the forward of the same view lowers)."""
    kernel = tmp_path / "head_t.py"
    kernel.write_text(KERNEL.format(N=128, D=64, V=256, dtype="bfloat16", bias_arg="",
                                    bias="", weight="None", smoothing=0.0, reduction="mean")
                      .replace("F.linear(h, W", "F.linear(h.t(), W")
                      .replace("h = torch.randn(N, D,", "h = torch.randn(D, N,"))
    compile_kernel(kernel, target="xegpu", stop_after="workgroups", strict=True)
    with pytest.raises(LighthouseError) as error:
        compile_kernel(kernel, target="xegpu", backward=True, stop_after="workgroups",
                       strict=True)
    assert "reads a pass's gradient (the transpose of the gradient of a transposed view" \
        in str(error.value)


@pytest.mark.parametrize("lowered_backward", ["f16_sum", "f16_d256_sum"], indirect=True)
def test_the_backward_script_replays_to_identical_ir(lowered_backward, tmp_path):
    """The compile's script with the backward (the two-pass fusion, the passes' workgroup
    steps and layouts; for D 256 the loops over D slices and the workgroups' accumulator
    buffers), printed and replayed, gives byte-identical IR at every stage down to the
    SPIR-V."""
    from tests.lighthouse.test_schedule_scripts import _without_counters

    compiled = lowered_backward.compiled
    script = tmp_path / "schedule.mlir"
    script.write_text(compiled.schedule_text())
    assert "transform_ext.fuse_linear_cross_entropy_backward_two_pass" in script.read_text()
    assert "transform_ext.forall_results_in_lane_form" in script.read_text()
    sliced = lowered_backward.case[2] > DEPTH_TILE
    assert ("transform_ext.match_loop_accumulators" in script.read_text()) == sliced
    assert "transform_ext.forall_allocs_to_function" in script.read_text()
    compile_kernel(lowered_backward.tmp / "head.py", target="xegpu", backward=True,
                   dump_dir=tmp_path / "replayed", schedule_file=script, stop_after="binary")
    for stage in STAGES[:-1]:
        (replayed,) = (tmp_path / "replayed").glob(f"*-{stage}.mlir")
        assert _without_counters(replayed.read_text()) == \
            _without_counters(lowered_backward.stage_files[stage].read_text()), stage


# ------------------------------------------------- [B, T, D] hidden states and [B, T] targets

HEAD_3D = """
import torch
import torch.nn.functional as F
B, T, D, V = 2, 64, 64, 256
class Model(torch.nn.Module):
    def forward(self, h, W, y):
        return F.cross_entropy(F.linear(h, W).view(-1, V), y.view(-1))
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, D, generator=g).bfloat16(),
            (torch.randn(V, D, generator=g) / 8).bfloat16(), torch.randint(0, V, (B, T), generator=g)]
def get_init_inputs():
    return []
"""


def test_hidden_states_of_a_batch_of_sequences(tmp_path):
    """A language model's head: h [B, T, D] and y [B, T] flattened by `view` (the kernel
    reads y through a collapse_shape of its argument): forward and backward build for bmg
    with 0 B spill and the kernels' program matches torch's autograd on the CPU, with
    ignored targets."""
    from lighthouse.compile import compare

    kernel = tmp_path / "head3d.py"
    kernel.write_text(HEAD_3D)
    compiled = compile_kernel(kernel, target="xegpu", backward=True, dump_dir=tmp_path / "dump",
                              strict=True)
    kernels = compiled.target.kernels
    assert [k.kind for k in kernels] == BACKWARD_KINDS["mean"]
    assert all(k.machine.spill_bytes == 0 for k in kernels), [k.machine for k in kernels]
    run = _program_on_cpu(Lowered(compiled, tmp_path / "dump"), [])
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 64, 64, generator=g).bfloat16()
    W = (torch.randn(256, 64, generator=g) / 8).bfloat16()
    y = torch.randint(0, 256, (2, 64), generator=g)
    y[:, ::3] = -100
    leaves = [h.clone().requires_grad_(), W.clone().requires_grad_()]
    loss = F.cross_entropy(F.linear(*leaves).view(-1, 256), y.view(-1))
    loss.backward()
    got = run(h, W, y)
    want = [loss.detach()] + [leaf.grad for leaf in leaves]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        report = compare(f"result {i}", a, b)
        assert report.ok, str(report)
