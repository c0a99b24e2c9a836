"""The XeGPU target, checked through the IR of every stage and the validated SPIR-V.

For each payload: it lowers through every stage; every contraction is one `xegpu.dpas` and the
DPAS FLOPs (op shapes x loop trips x workgroups) equal the payload's contraction FLOPs; tile
loads/stores/prefetches are 2-D block ops (down to the 2-D block builtins of the device
code); the reduction loops carry prefetches; one gpu.func per kernel; no scratch buffer but
the inter-kernel activations; the SPIR-V passes spirv-val with the recorded local size and
subgroup size. (No Intel GPU here: numerics are the CPU target's job.)
"""

import json
import math
import re

import pytest
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.errors import UnsupportedError
from lighthouse.targets import spirv
from lighthouse.targets.xegpu import XeGpuParams
from tests.conftest import EXAMPLES, run_cli
from tests.lighthouse.xegpu_helpers import (Lowered, dumped_stages, dpas_flops, enclosing,
                                           kernel_plans, walk)

STAGES = ["import", "cleanup", "fuse", "workgroups", "subgroups", "vectorize", "bufferize",
          "gpu-outline", "xegpu", "xegpu-layouts", "xevm", "binary", "native"]
SMALL_MLP = {"BATCH": 64, "IN_FEATURES": 64, "HIDDEN": 128, "OUT_FEATURES": 64}
PAYLOADS = {
    "matmul_f16": ("matmul_f16.py", {"M": 64, "N": 128, "K": 96}, 1),
    "matmul_bf16": ("matmul_f16.py", {"M": 128, "N": 64, "K": 64, "DTYPE": "bfloat16"}, 1),
    "mlp_f16": ("mlp_f16.py", SMALL_MLP, 2),
}
MAD = {"f16": "intel_sub_group_f16_f16_matrix_mad_k16", "bf16": "intel_sub_group_bf16_bf16_matrix_mad_k16"}


@pytest.fixture(scope="module", params=sorted(PAYLOADS))
def lowered(request, tmp_path_factory):
    file, overrides, _ = PAYLOADS[request.param]
    dump = tmp_path_factory.mktemp(request.param)
    compiled = compile_kernel(EXAMPLES / file, overrides=overrides, target="xegpu", dump_dir=dump)
    low = Lowered(compiled, dump)
    low.name = request.param
    return low


def _walk(module, name):
    return walk(module, name)


def _device_llvm_ir(lowered) -> str:
    return lowered.device_llvm_ir()


def test_every_stage_runs_in_order(lowered):
    assert lowered.compiled.pipeline.names() == STAGES
    assert list(lowered.stage_files) == dumped_stages(STAGES)


def test_every_contraction_is_dpas_with_the_payload_flops(lowered):
    payload = lowered.ir("cleanup")
    from transform_ext.analysis.structure import loop_structure

    contractions = [op for op in _walk(payload, "linalg.matmul") + _walk(payload, "linalg.generic")
                    if loop_structure(op).is_contraction]
    want = sum(2 * math.prod(loop_structure(op).ranges) for op in contractions)
    xe = lowered.ir("xegpu-layouts")
    assert not _walk(xe, "vector.contract")
    dpas = _walk(xe, "xegpu.dpas")
    assert len(dpas) == len(contractions) == PAYLOADS[lowered.name][2]
    for op in dpas:
        assert str(ir.VectorType(op.operands[0].type).element_type) in ("f16", "bf16")
        assert str(ir.VectorType(op.results[0].type).element_type) == "f32"
    assert dpas_flops(xe) == want
    dtype = "bf16" if "bf16" in lowered.name else "f16"
    device = _device_llvm_ir(lowered)
    assert device.count(f"@_Z{len(MAD[dtype])}{MAD[dtype]}") >= len(dpas)


def test_tile_loads_and_stores_are_2d_block_ops(lowered):
    xe = lowered.ir("xegpu-layouts")
    for func in _walk(xe, "gpu.func"):
        assert not _walk(func, "vector.transfer_read") and not _walk(func, "vector.transfer_write")
    tiles = _walk(xe, "xegpu.load_nd") + _walk(xe, "xegpu.store_nd") + _walk(xe, "xegpu.prefetch_nd")
    assert tiles
    for op in tiles:
        desc = [v.type for v in op.operands if "tensor_desc" in str(v.type)][0]
        assert re.match(r"!xegpu\.tensor_desc<\d+x\d+x(f16|bf16|f32)", str(desc)), str(desc)
    device = _device_llvm_ir(lowered)
    assert "intel_sub_group_2d_block_read" in device
    assert "intel_sub_group_2d_block_write" in device
    assert "intel_sub_group_2d_block_prefetch" in device


def test_reduction_loops_carry_prefetches(lowered):
    xe = lowered.ir("xegpu-layouts")
    loops = [enclosing(op, "scf.for") for op in _walk(xe, "xegpu.dpas")]
    assert loops and all(loop is not None for loop in loops)
    for loop in loops:
        assert _walk(loop, "xegpu.prefetch_nd"), "a DPAS loop without prefetch"


def test_one_gpu_func_per_kernel_and_no_scratch(lowered):
    final = lowered.ir("xegpu")
    kernels = PAYLOADS[lowered.name][2]
    assert len(_walk(final, "gpu.func")) == kernels
    assert len(_walk(final, "gpu.launch_func")) == kernels
    assert not _walk(final, "memref.alloc")
    allocs = [ir.MemRefType(op.results[0].type) for op in _walk(final, "gpu.alloc")]
    if lowered.name.startswith("mlp"):  # the hidden activation between the two layers
        assert [list(t.shape) for t in allocs] == [[SMALL_MLP["BATCH"], SMALL_MLP["HIDDEN"]]]
    else:
        assert allocs == []


def test_spirv_validates_with_recorded_launch(lowered, tmp_path):
    target = lowered.target
    assert len(target.kernels) == PAYLOADS[lowered.name][2]
    path = tmp_path / "kernel.spv"
    target.write_artifact(lowered.compiled, path)
    files = [path] if len(target.kernels) == 1 else [
        tmp_path / f"kernel.{k.module}.spv" for k in target.kernels]
    manifest = json.loads(path.with_suffix(".json").read_text())
    xe = lowered.ir("xegpu")
    funcs = _walk(xe, "gpu.func")
    for file, kernel, entry, func in zip(files, target.kernels, manifest["kernels"], funcs):
        spirv.validate(file)
        info = spirv.read_spirv(file.read_bytes())
        (ep,) = info["entry_points"]
        assert ep.subgroup_size == 16 == entry["subgroup_size"]
        threads = list(ir.DenseI32ArrayAttr(func.attributes["known_block_size"]))
        assert list(ep.local_size) == threads == entry["local_size"]
        assert entry["grid"] == list(ir.DenseI32ArrayAttr(func.attributes["known_grid_size"]))
        assert "VariableLengthArrayINTEL" not in info["capabilities"]
    final = lowered.ir("binary")
    assert not _walk(final, "gpu.module")
    assert len(_walk(final, "gpu.binary")) == len(target.kernels)
    assert "bin = " in lowered.stage_files["binary"].read_text()


def test_workgroup_tile_that_does_not_divide_names_the_dimension():
    with pytest.raises(UnsupportedError, match=r"dimension m \(64\) is not a multiple of the workgroup tile \(48\)"):
        compile_kernel(EXAMPLES / "matmul_f16.py", overrides={"M": 64, "N": 64, "K": 64},
                       target="xegpu", target_options={"params": XeGpuParams(wg=(48, 64))},
                       stop_after="workgroups")


def test_dpas_depth_mismatch_names_k():
    with pytest.raises(UnsupportedError, match=r"dimension k \(40\) is not a multiple"):
        compile_kernel(EXAMPLES / "matmul_f16.py", overrides={"M": 64, "N": 64, "K": 40},
                       target="xegpu", stop_after="workgroups")


def test_f32_operands_are_refused_naming_them_and_dpas_types():
    """DPAS multiplies f16/bf16; an f32 x f32 matmul (examples/matmul.py) is refused in one
    line naming both operands, not with an internal error."""
    with pytest.raises(UnsupportedError, match=r"DPAS multiplies f16 or bf16 operands, but "
                       r"A \(argument 0\) is f32 and B \(argument 1\) is f32; pass float16"):
        compile_kernel(EXAMPLES / "matmul.py", overrides={"N": 64}, target="xegpu",
                       stop_after="workgroups")
    r = run_cli(EXAMPLES / "matmul.py", "--set", "N=64", "--target", "xegpu")
    assert r.returncode == 2 and "DPAS multiplies f16 or bf16" in r.stderr
    assert "Traceback" not in r.stderr and "epilogue rank" not in r.stderr


POOLING = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, x):
        return {expr}
def get_inputs():
    return [torch.randn({shape}, dtype=torch.float16)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("expr, shape, op", [
    ("F.max_pool1d(x, 4, 4)", "2, 16, 64", "linalg.pooling_nchw_max"),
    ("torch.relu(F.avg_pool2d(x, 2))", "2, 16, 32, 32", "linalg.pooling_nchw_sum"),
    ("F.max_pool3d(x, 2, 2)", "2, 4, 8, 8, 32", "linalg.generic")])
def test_poolings_are_refused_naming_the_op(kernel_file, expr, shape, op):
    """A pooling has no XeGPU kernel yet: one line naming it, not the vectorizer's internal
    error after both schedules failed."""
    path = kernel_file(POOLING.format(expr=expr, shape=shape))
    with pytest.raises(UnsupportedError, match=rf"xegpu: {op} at .*: a pooling window has no GPU lowering"):
        compile_kernel(path, target="xegpu", stop_after="workgroups")


def test_contraction_without_epilogue_lowers_to_dpas(kernel_file, tmp_path):
    """16-bit inputs widened to f32 and an f32 result: the contraction itself is the root
    of the workgroup tiling (no epilogue), one DPAS kernel with validated SPIR-V."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, a, b):
                return a.float() @ b.float()
        def get_inputs():
            return [torch.randn(64, 96, dtype=torch.float16), torch.randn(96, 128, dtype=torch.float16)]
        def get_init_inputs():
            return []
        """)
    compiled = compile_kernel(path, target="xegpu", dump_dir=tmp_path / "dump")
    low = Lowered(compiled, tmp_path / "dump")
    xe = low.ir("xegpu-layouts")
    (dpas,) = _walk(xe, "xegpu.dpas")
    assert str(ir.VectorType(dpas.operands[0].type).element_type) == "f16"
    assert dpas_flops(xe) == 2 * 64 * 96 * 128
    spv = tmp_path / "k.spv"
    low.target.write_artifact(compiled, spv)
    spirv.validate(spv)


def test_params_are_validated():
    with pytest.raises(UnsupportedError, match="wg must be two positive sizes"):
        XeGpuParams(wg=(0, 16))
    with pytest.raises(UnsupportedError, match="k_tile must be positive"):
        XeGpuParams(k_tile=-16)


def test_cli_spirv_bitcode_and_chip(tmp_path):
    spv, bc = tmp_path / "k.spv", tmp_path / "k.bc"
    args = [EXAMPLES / "matmul_f16.py", "--set", "M=32", "--set", "N=32", "--set", "K=32",
            "--target", "xegpu"]
    r = run_cli(*args, "--chip", "pvc", "--emit", "binary", "-o", spv)
    assert r.returncode == 0, r.stderr
    spirv.validate(spv)
    assert json.loads(spv.with_suffix(".json").read_text())["chip"] == "pvc"
    r = run_cli(*args, "-o", bc)
    assert r.returncode == 0, r.stderr
    assert bc.read_bytes()[:4] == b"BC\xc0\xde"
    r = run_cli(*args, "--chip", "xyz")
    assert r.returncode == 2 and "unknown --chip 'xyz'" in r.stderr and "Traceback" not in r.stderr


def test_run_is_refused_without_a_gpu():
    r = run_cli(EXAMPLES / "matmul_f16.py", "--set", "M=32", "--set", "N=32", "--set", "K=32",
                "--target", "xegpu", "--run")
    assert r.returncode == 2 and "cannot run kernels on this machine" in r.stderr


def test_older_float_syntax_rounds_and_converts():
    text = ("fmul <8 x float> %a, splat (float f0x3F800000)\n"
            "fadd float %b, 6.400000e-01\nfadd half %c, f0x3C00\nfadd double %d, 2.5e-01\n"
            "%x = fadd bfloat %q, 1.5\n@.str.file.0 = constant [2 x i8] c\"1.5\"")
    assert spirv.older_float_syntax(text).split("\n") == [
        "fmul <8 x float> %a, splat (float 0x3FF0000000000000)",
        "fadd float %b, 0x3FE47AE140000000",          # 0.64 rounded to f32, as a double
        "fadd half %c, 0xH3C00",
        "fadd double %d, 2.5e-01",
        "%x = fadd bfloat %q, 0xR3FC0",
        '@.str.file.0 = constant [2 x i8] c"1.5"',
    ]


def test_newer_attributes_are_dropped_from_groups():
    text = "attributes #5 = { nocallback nocreateundeforpoison nofree }"
    out = spirv._newer_attribute(text, "<string>:1:30: error: unterminated attribute group")
    assert out == "attributes #5 = { nocallback nofree }"


SOFTMAX = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)
def get_inputs():
    return [torch.randn(64, 256, dtype=torch.{dtype})]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_softmax_is_one_row_kernel_with_validated_spirv(tmp_path, dtype):
    """Softmax: one gpu.func, all its row work (max, exp, sum, div, in f32) inside one
    workgroup, 2-D block loads/stores of the input type, no N x C intermediate buffer; the
    row reductions' one-value-per-lane vectors are scalarized so the SPIR-V validates."""
    kernel = tmp_path / "softmax.py"
    kernel.write_text(SOFTMAX.format(dtype=dtype))
    compiled = compile_kernel(kernel, target="xegpu", dump_dir=tmp_path / "dump")
    low = Lowered(compiled, tmp_path / "dump")
    xe = low.ir("xegpu-layouts")
    (func,) = _walk(xe, "gpu.func")
    assert len(_walk(func, "vector.multi_reduction")) == 2          # max and sum
    assert _walk(func, "math.exp")
    narrow = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[dtype]
    for op in _walk(func, "xegpu.load_nd") + _walk(func, "xegpu.store_nd"):
        desc = [v.type for v in op.operands if "tensor_desc" in str(v.type)][0]
        assert re.match(rf"!xegpu\.tensor_desc<\d+x256x{narrow}", str(desc)), str(desc)
    for op in _walk(func, "vector.multi_reduction"):
        assert str(ir.VectorType(op.results[0].type).element_type) == "f32"
    assert not _walk(xe, "gpu.alloc") and not _walk(xe, "memref.alloc")
    assert "intel_sub_group_2d_block_read" in _device_llvm_ir(low)
    (plan,) = kernel_plans(compiled, tmp_path / "dump")
    assert plan.kind == "rows" and plan.threads == plan.tiles.sg_layout[0] * 16
    path = tmp_path / "softmax.spv"
    compiled.target.write_artifact(compiled, path)
    spirv.validate(path)
    (ep,) = spirv.read_spirv(path.read_bytes())["entry_points"]
    assert ep.local_size == (plan.threads, 1, 1) and ep.subgroup_size == 16


def test_long_softmax_rows_run_in_column_tiles(tmp_path):
    """Rows too long for a subgroup's registers (2 x 4096 f32): the max and the exp-sum run
    as one online loop over column tiles, a second loop writes exp(x - m) / l per column
    tile; only per-row values cross tiles, the loads are prefetched a tile ahead, and the
    SPIR-V validates."""
    kernel = tmp_path / "softmax.py"
    kernel.write_text(SOFTMAX.format(dtype="float16").replace("64, 256", "64, 4096"))
    compiled = compile_kernel(kernel, target="xegpu", dump_dir=tmp_path / "dump")
    low = Lowered(compiled, tmp_path / "dump")
    (plan,) = kernel_plans(compiled, tmp_path / "dump")
    ct = plan.tiles.column_tile
    assert ct and 4096 % ct == 0 and 2 * 2 * ct * 4 <= 8 * 1024
    xe = low.ir("xegpu-layouts")
    first, second = _walk(xe, "scf.for")
    assert [str(t) for t in first.results.types] == ["vector<2xf32>", "vector<2xf32>"]   # m, l
    assert len(second.results) == 0                                   # writes each tile
    reductions = [op for op in _walk(xe, "vector.multi_reduction")]
    assert len(reductions) == 2 and all(enclosing(op, "scf.for") == first for op in reductions)
    assert [enclosing(op, "scf.for") for op in _walk(xe, "xegpu.store_nd")] == [second]
    for loop in (first, second):
        (load,) = _walk(loop, "xegpu.load_nd")
        assert list(ir.VectorType(load.results[0].type).shape)[-1] == ct
        assert _walk(loop, "xegpu.prefetch_nd")
    assert not _walk(xe, "gpu.alloc") and not _walk(xe, "memref.alloc")
    path = tmp_path / "softmax.spv"
    compiled.target.write_artifact(compiled, path)
    spirv.validate(path)


def test_log_softmax_of_the_cross_entropy_family_is_a_row_kernel(tmp_path):
    """The cross_entropy family recognizes log-softmax; on the GPU it becomes a row kernel
    (its CPU row blocks with lane-split sums are no GPU form): column loops, no N x C buffer,
    validated SPIR-V. (A loss gets kernels of its own: test_xegpu_cross_entropy.py.)"""
    compiled = compile_kernel(EXAMPLES / "log_softmax.py", overrides={"N": 64, "C": 2048},
                              target="xegpu", dump_dir=tmp_path / "dump")
    assert compiled.family.name == "cross_entropy"
    (plan,) = kernel_plans(compiled, tmp_path / "dump")
    assert plan.kind == "rows" and plan.tiles.column_tile
    low = Lowered(compiled, tmp_path / "dump")
    xe = low.ir("xegpu-layouts")
    assert len(_walk(xe, "scf.for")) == 2 and not _walk(xe, "gpu.alloc")
    path = tmp_path / "log_softmax.spv"
    compiled.target.write_artifact(compiled, path)
    spirv.validate(path)


def test_column_tile_that_does_not_divide_the_row_names_it(tmp_path):
    kernel = tmp_path / "softmax.py"
    kernel.write_text(SOFTMAX.format(dtype="float32").replace("64, 256", "64, 4096"))
    with pytest.raises(UnsupportedError, match=r"4096 columns\) is not a multiple of the column tile \(100\)"):
        compile_kernel(kernel, target="xegpu", target_options={"params": XeGpuParams(column_tile=100)},
                       stop_after="workgroups")


def test_expand_math_expands_only_the_named_ops():
    from transform_ext.expand_math import expand_math_in

    ctx = ir.Context()
    module = ir.Module.parse("""
      func.func @f(%x: vector<16xf32>, %h: f16) -> (vector<16xf32>, vector<16xf32>, f16) {
        %e = math.exp %x : vector<16xf32>
        %r = math.erf %x : vector<16xf32>
        %s = math.erf %h : f16
        return %e, %r, %s : vector<16xf32>, vector<16xf32>, f16
      }""", ctx)
    assert expand_math_in(module.operation, ops=("math.erf",)) == 2
    text = str(module)
    assert "math.erf" not in text and text.count("math.exp") == 1   # exp kept
    assert "arith.extf" in text and "arith.truncf" in text          # f16 computed in f32
    with pytest.raises(ValueError, match="no expansion of"):
        expand_math_in(module.operation, ops=("math.sin",))


def test_vectors_spirv_lacks_become_their_lanes():
    """One-element vectors (a lane's share of a row reduction) and 32-element ones (a lane's
    pieces of a tile, gathered by insertelement and read by shufflevector) have no SPIR-V
    form: elementwise ops run per lane, moves become the lane they move."""
    ctx = ir.Context()
    module = ir.Module.parse("""
      llvm.func @f(%in: vector<2xf32>, %y: f32) -> vector<2xf32> {
        %a = llvm.shufflevector %in, %in [0] : vector<2xf32>
        %b = llvm.shufflevector %in, %in [1] : vector<2xf32>
        %m = llvm.intr.maximum(%a, %b) : (vector<1xf32>, vector<1xf32>) -> vector<1xf32>
        %e = llvm.intr.exp(%m) : (vector<1xf32>) -> vector<1xf32>
        %p = llvm.mlir.poison : vector<32xf32>
        %c0 = llvm.mlir.constant(0 : i64) : i64
        %c17 = llvm.mlir.constant(17 : i64) : i64
        %s = llvm.extractelement %e[%c0 : i64] : vector<1xf32>
        %v0 = llvm.insertelement %s, %p[%c0 : i64] : vector<32xf32>
        %v1 = llvm.insertelement %y, %v0[%c17 : i64] : vector<32xf32>
        %z = llvm.mlir.constant(dense<1.0> : vector<32xf32>) : vector<32xf32>
        %w = llvm.fadd %v1, %z : vector<32xf32>
        %r = llvm.shufflevector %w, %w [0, 17] : vector<32xf32>
        llvm.return %r : vector<2xf32>
      }""", ctx)
    func = module.body.operations[0].operation
    with ctx, ir.Location.unknown():
        spirv._legalize_vector_lengths(func)
    module.operation.verify()
    body = str(module).split("{", 1)[1]
    assert "vector<32x" not in body
    assert "vector<1x" not in body
    assert body.count("llvm.intr.maximum") == 1 and body.count("llvm.intr.exp") == 1
    assert body.count("llvm.fadd") == 32 and "(f32, f32) -> f32" in body  # scalar, per lane
    with pytest.raises(Exception, match="has no SPIR-V form"):
        bad = ir.Module.parse("""
          llvm.func @g(%p: !llvm.ptr) -> f32 {
            %v = llvm.load %p : !llvm.ptr -> vector<32xf32>
            %c = llvm.mlir.constant(3 : i64) : i64
            %s = llvm.extractelement %v[%c : i64] : vector<32xf32>
            llvm.return %s : f32
          }""", ctx)
        with ctx, ir.Location.unknown():
            spirv._legalize_vector_lengths(bad.body.operations[0].operation)
