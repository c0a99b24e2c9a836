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

STAGES = ["import", "cleanup", "fuse", "workgroups", "subgroups", "vectorize", "bufferize",
          "gpu-outline", "xegpu", "xegpu-layouts", "xevm", "binary"]
SMALL_MLP = {"BATCH": 64, "IN_FEATURES": 64, "HIDDEN": 128, "OUT_FEATURES": 64}
PAYLOADS = {
    "matmul_f16": ("matmul_f16.py", {"M": 64, "N": 128, "K": 96}, 1),
    "matmul_bf16": ("matmul_f16.py", {"M": 128, "N": 64, "K": 64, "DTYPE": "bfloat16"}, 1),
    "mlp_f16": ("mlp_f16.py", SMALL_MLP, 2),
}
MAD = {"f16": "intel_sub_group_f16_f16_matrix_mad_k16", "bf16": "intel_sub_group_bf16_bf16_matrix_mad_k16"}


class Lowered:
    def __init__(self, compiled, dump):
        self.compiled = compiled
        self.target = compiled.target
        self.dump = dump
        files = sorted(dump.iterdir())
        self.stage_files = {re.sub(r"^\d+-", "", f.stem): f for f in files}

    def ir(self, stage) -> ir.Module:
        ctx = ir.Context()
        ctx.allow_unregistered_dialects = True
        return ir.Module.parse(self.stage_files[stage].read_text(), ctx)


@pytest.fixture(scope="module", params=sorted(PAYLOADS))
def lowered(request, tmp_path_factory):
    file, overrides, _ = PAYLOADS[request.param]
    dump = tmp_path_factory.mktemp(request.param)
    compiled = compile_kernel(EXAMPLES / file, overrides=overrides, target="xegpu", dump_dir=dump)
    low = Lowered(compiled, dump)
    low.name = request.param
    return low


def _walk(module, name):
    found = []

    def visit(op):
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


def _const(value) -> int:
    return ir.IntegerAttr(value.owner.attributes["value"]).value


def _trips(op) -> int:
    """Product of the trip counts of the scf.for loops around `op` (constant bounds)."""
    trips, parent = 1, op.parent
    while parent is not None and parent.name != "gpu.func":
        if parent.name == "scf.for":
            lb, ub, step = (_const(v) for v in list(parent.operands)[:3])
            trips *= (ub - lb) // step
        parent = parent.parent
    return trips


def _grid(gpu_func) -> int:
    return math.prod(ir.DenseI32ArrayAttr(gpu_func.attributes["known_grid_size"]))


def _enclosing(op, name):
    parent = op.parent
    while parent is not None and parent.name != name:
        parent = parent.parent
    return parent


def _device_llvm_ir(lowered) -> str:
    module = lowered.ir("xevm")
    return "".join(spirv.device_llvm_ir(gm, 16) for gm in spirv.gpu_modules(module))


def test_every_stage_runs_in_order(lowered):
    assert lowered.compiled.pipeline.names() == STAGES
    assert list(lowered.stage_files) == ["input"] + STAGES


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
    got = 0
    for op in dpas:
        (m, k), (k2, n) = (ir.VectorType(v.type).shape for v in list(op.operands)[:2])
        assert k == k2
        assert str(ir.VectorType(op.operands[0].type).element_type) in ("f16", "bf16")
        assert str(ir.VectorType(op.results[0].type).element_type) == "f32"
        got += 2 * m * n * k * _trips(op) * _grid(_enclosing(op, "gpu.func"))
    assert got == want
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
    loops = [_enclosing(op, "scf.for") for op in _walk(xe, "xegpu.dpas")]
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


def test_softmax_is_one_row_kernel_down_to_xevm(tmp_path):
    """Softmax: one gpu.func, all its row work (max, exp, sum, div) inside one workgroup,
    2-D block loads/stores, no N x C intermediate buffer. (Its SPIR-V is not produced yet:
    the row reductions leave one-element vectors that llvm-spirv rejects.)"""
    compiled = compile_kernel(EXAMPLES / "softmax.py", overrides={"N": 64, "C": 256},
                              target="xegpu", stop_after="xevm", dump_dir=tmp_path)
    low = Lowered(compiled, tmp_path)
    xe = low.ir("xegpu-layouts")
    (func,) = _walk(xe, "gpu.func")
    assert len(_walk(func, "vector.multi_reduction")) == 2          # max and sum
    assert _walk(func, "math.exp")
    for op in _walk(func, "xegpu.load_nd") + _walk(func, "xegpu.store_nd"):
        desc = [v.type for v in op.operands if "tensor_desc" in str(v.type)][0]
        assert re.match(r"!xegpu\.tensor_desc<\d+x256xf32", str(desc)), str(desc)
    assert not _walk(xe, "gpu.alloc") and not _walk(xe, "memref.alloc")
    assert not [op for op in _walk(func, "memref.alloc")]
    assert "intel_sub_group_2d_block_read" in _device_llvm_ir(low)
    (plan,) = compiled.target.plans
    assert plan.kind == "rows" and plan.threads == plan.tiles.sg_layout[0] * 16
