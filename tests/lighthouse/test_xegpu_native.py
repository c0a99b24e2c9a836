"""Intel's GPU compiler in the loop: every XeGPU kernel of the suite built by ocloc (IGC) for
bmg and pvc by the native stage, checked through the machine code IGC writes.

Kernels: matmul f16, the f16 MLP's two layers, softmax, log-softmax, attention (f16 and
bf16, causal and not; forward and forward+backward: the backward's two passes), cross-entropy
forward (f32) and forward+backward (bf16; f32 with class weights and label smoothing). For each kernel on each chip:
  - it builds, in the GRF mode the native stage chose (256 only when 128 spills more), with
    at most ocloc.SPILL_BOUND bytes of spill (what IGC's `//.spill size` counts: GRF and
    flag-register spills; these kernels keep none but a few flag spills in registers);
  - the machine code issues per subgroup the DPAS the IR assigns a subgroup, and the DPAS
    the whole grid issues (the IR's work: loop trips per workgroup) times the DPAS shape's
    FLOPs are the payload's contraction FLOPs (for causal attention, those of the key tiles
    up to the diagonal);
  - every 2-D block load, store and prefetch of the IR is 2-D block IO in the machine code;
  - -o kernel.bin writes the device binaries, the manifest and the IR record the GRF mode;
  - --report prints it all with the static estimate.
The compiles of a kernel are shared by the tests of this module (one fixture per kernel and
chip). `make test` fetches ocloc first (tools/fetch-ocloc); without it these tests fail
with the fetch hint, they are not skipped.
"""

import json
import re
import subprocess
import time

import pytest
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.errors import StageError, UnsupportedError
from lighthouse.targets import ocloc, spirv
from lighthouse.targets.estimate import estimate, format_report
from lighthouse.targets.kernel_work import trips, workgroups
from lighthouse.targets.xegpu import CHIPS, XeGpuParams
from tests.conftest import EXAMPLES, ROOT, run_cli
from tests.lighthouse import test_xegpu_attention as attention
from tests.lighthouse import test_xegpu_cross_entropy as loss
from tests.lighthouse.xegpu_helpers import (Lowered, dpas_flops, payload_contraction_flops,
                                            walk)

SMALL_MLP = {"BATCH": 64, "IN_FEATURES": 64, "HIDDEN": 128, "OUT_FEATURES": 64}
# name: (how to write the kernel file, compile options)
KERNELS = {
    "matmul_f16": (EXAMPLES / "matmul_f16.py", {"overrides": {"M": 64, "N": 128, "K": 96}}),
    "mlp_f16": (EXAMPLES / "mlp_f16.py", {"overrides": SMALL_MLP}),
    "softmax": (EXAMPLES / "softmax.py", {"overrides": {"N": 64}}),
    "log_softmax": (EXAMPLES / "log_softmax.py", {"overrides": {"N": 64}}),
    "attention_f16": (("attention", 1, 2, 256, 64, "float16", False), {}),
    "attention_f16_causal": (("attention", 1, 2, 256, 64, "float16", True), {}),
    "attention_bf16": (("attention", 1, 2, 256, 64, "bfloat16", False), {}),
    "attention_bf16_causal": (("attention", 2, 2, 256, 64, "bfloat16", True), {}),
    "attention_bwd_f16": (("attention", 1, 2, 256, 64, "float16", False), {"backward": True}),
    "attention_bwd_bf16_causal": (("attention", 2, 2, 256, 64, "bfloat16", True),
                                  {"backward": True}),
    "cross_entropy": (("loss", "float32", False, 0.0), {}),
    "cross_entropy_bf16_bwd": (("loss", "bfloat16", False, 0.0), {"backward": True}),
    "cross_entropy_weight_smoothing_bwd": (("loss", "float32", True, 0.1), {"backward": True}),
}
CASES = [(name, chip) for name in KERNELS for chip in ("bmg", "pvc")]
PLATFORMS = {"bmg": "XE2", "pvc": "PVCXT"}


def _kernel_file(name, tmp):
    spec, options = KERNELS[name]
    if not isinstance(spec, tuple):
        return spec, dict(options)
    if spec[0] == "attention":
        return attention._write(tmp / "attention.py", *spec[1:]), dict(options)
    dtype, weighted, smoothing = spec[1:]
    options = dict(options)
    options["target_options"] = {"params": XeGpuParams(column_tile=loss.COLUMN_TILE)}
    return loss._write(tmp / "loss.py", dtype, weighted, smoothing), options


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{c}" for n, c in CASES])
def native(request, tmp_path_factory):
    name, chip = request.param
    tmp = tmp_path_factory.mktemp(f"{name}-{chip}")
    path, options = _kernel_file(name, tmp)
    target_options = dict(options.pop("target_options", {}), chip=chip)
    compiled = compile_kernel(path, target="xegpu", dump_dir=tmp / "dump",
                              target_options=target_options, **options)
    low = Lowered(compiled, tmp / "dump")
    low.name, low.chip, low.tmp = name, CHIPS[chip], tmp
    return low


def _funcs(low):
    """(artifact, gpu.func at xegpu-layouts) per kernel, in launch order (the parsed module
    is kept on `low`: its ops live as long as it does)."""
    low.layouts = low.ir("xegpu-layouts")
    funcs = walk(low.layouts, "gpu.func")
    assert len(funcs) == len(low.target.kernels)
    return list(zip(low.target.kernels, funcs))


def _subgroup_dpas(op) -> int:
    """DPAS instructions one subgroup issues for a workgroup-level xegpu.dpas: its share of
    the C tile (layout_cd's sg_data) over the DPAS M x N, times K over the DPAS depth."""
    (_, k), _ = (ir.VectorType(v.type).shape for v in list(op.operands)[:2])
    text = str(op.attributes["layout_cd"])
    sg_m, sg_n = (int(x) for x in text.split("sg_data = [", 1)[1].split("]", 1)[0].split(","))
    return (sg_m // 8) * (sg_n // 16) * (k // 16)


def _per_loop_step(ops) -> list[int]:
    """The DPAS a subgroup issues per step of each loop holding DPAS ops directly (the
    kernel's body counting as one loop)."""
    steps = {}
    for op in ops:
        steps[str(op.parent)] = steps.get(str(op.parent), 0) + _subgroup_dpas(op)
    return list(steps.values())


def _whole_copies(count: int, steps: list[int]) -> bool:
    """Is `count` a sum of whole copies of every loop's step, at least one each (IGC may
    unroll each loop its own number of times)?"""
    if not steps:
        return count == 0
    first, rest = steps[0], steps[1:]
    return any(_whole_copies(count - copies * first, rest)
               for copies in range(1, count // first + 1))


def test_every_kernel_builds_for_the_chip_within_the_spill_bound(native):
    for kernel in native.target.kernels:
        mc = kernel.machine
        assert mc is not None, kernel.module
        assert mc.platform == PLATFORMS[native.chip.name]
        assert mc.grf in ocloc.GRF_MODES
        assert mc.spill_bytes <= ocloc.SPILL_BOUND, (kernel.module, mc)
        assert not mc.unresolved
        assert kernel.native[:4] == b"\x7fELF"          # a zebin


def test_large_grf_only_where_128_registers_spill(native):
    """256 registers halve the threads per EU: a kernel gets them only when its build with
    128 spills (and the 256 one spills less)."""
    for kernel in native.target.kernels:
        if kernel.machine.grf == 256:
            small = ocloc.compile_spirv(kernel.spirv, native.chip.name, 128, kernel.module)
            assert small.machine.spill_bytes > kernel.machine.spill_bytes


def test_machine_code_issues_the_dpas_of_the_payload(native):
    """The machine code holds whole copies of the DPAS the IR gives a subgroup per step of
    each loop (IGC unrolls loops of a few constant trips, each loop its own number of
    times), and no more than a subgroup issues;
    over the grid (the work's loop trips per workgroup) the DPAS issued times the DPAS
    shape's FLOPs are the payload's contraction FLOPs (causal: the key tiles up to the
    diagonal)."""
    m, n, k = native.chip.dpas
    total = 0
    for kernel, func in _funcs(native):
        ops = walk(func, "xegpu.dpas")
        per_step = sum(_subgroup_dpas(op) for op in ops)
        issued = max(sum(_subgroup_dpas(op) * trips(op, block) for op in ops)
                     for block in workgroups(func))
        if per_step == 0:
            assert kernel.machine.dpas == 0, kernel.module
        else:
            assert _whole_copies(kernel.machine.dpas, _per_loop_step(ops)), \
                (kernel.module, kernel.machine.dpas)
            assert per_step <= kernel.machine.dpas <= issued, kernel.module
        assert kernel.work is not None
        total += kernel.work["flops"]
        assert estimate(kernel.work, native.chip).dpas * 2 * m * n * k == kernel.work["flops"]
    assert total == dpas_flops(native.ir("xegpu-layouts"))
    payload = payload_contraction_flops(native.ir("cleanup"))
    if native.name.startswith("attention"):
        B, H, S, D = KERNELS[native.name][0][1:5]
        forward, backward = _attention_tile_products(native, S)
        assert total == 2 * B * H * D * (forward + backward)
        if "bwd" in native.name:
            # the payload's forward (S, P V) and backward (S, dP, dV, dQ, dK) contractions,
            # the passes recompute S and dP in both, and S again for lse
            assert payload == 7 * 2 * B * H * D * S * S
        if "causal" in native.name:
            assert total < payload
        elif "bwd" not in native.name:
            assert total == payload
    else:
        assert total == payload
    if native.name.startswith(("matmul", "mlp", "attention")):
        assert total > 0


def _attention_tile_products(native, S: int) -> tuple[int, int]:
    """(query x key pairs the forward's DPAS cover times its 2 products, those of the
    backward's passes times their 4 each): every pair, or causal, those of the key tiles up
    to the diagonal (forward and pass 1: keys below the query block's end; pass 2: queries
    from the key block's start)."""
    plans = native.plans
    causal = "causal" in native.name
    qt = plans[0].tiles.query_tile
    forward = sum(qt * min(S, i0 + qt) for i0 in range(0, S, qt)) if causal else S * S
    backward = 0
    for plan in plans[1:]:
        rows = plan.tiles.rows
        if not causal:
            backward += 4 * S * S
        elif plan.kind == "attention_dq":
            backward += 4 * sum(rows * min(S, i0 + rows) for i0 in range(0, S, rows))
        else:
            backward += 4 * sum(rows * (S - j0) for j0 in range(0, S, rows))
    return 2 * forward, backward


def test_block_io_of_the_ir_is_2d_block_io_in_the_machine_code(native):
    for kernel, func in _funcs(native):
        mc = kernel.machine
        if walk(func, "xegpu.load_nd"):
            assert mc.block_loads > 0, kernel.module
        if walk(func, "xegpu.store_nd"):
            assert mc.block_stores > 0, kernel.module
        if walk(func, "xegpu.prefetch_nd"):
            assert mc.block_prefetches > 0, kernel.module
    # the kernels that move tiles: all but the loss's one-workgroup reductions over rows
    tiled = [k for k in native.target.kernels if k.kind != "row_sum"]
    assert tiled and all(k.machine.block_io for k in tiled)


def test_device_binaries_and_the_grf_mode_are_written(native):
    out = native.tmp / "kernel.bin"
    native.target.write_artifact(native.compiled, out)
    kernels = native.target.kernels
    files = [out] if len(kernels) == 1 else [out.with_name(f"kernel.{k.module}.bin") for k in kernels]
    manifest = json.loads(out.with_suffix(".json").read_text())
    for file, kernel, entry in zip(files, kernels, manifest["kernels"], strict=True):
        assert file.read_bytes() == kernel.native
        assert entry["grf"] == kernel.machine.grf
        assert entry["machine_code"]["spill_bytes"] == kernel.machine.spill_bytes
    objects = [str(op.attributes["objects"]) for op in walk(native.compiled.module, "gpu.binary")]
    assert [f"grf = {k.machine.grf} : i64" in o for k, o in zip(kernels, objects)] == \
        [True] * len(kernels)


def test_report_lists_every_kernel_with_its_estimate(native):
    text = native.target.report()
    assert native.chip.product in text and "anchor:" in text and "101.9 TFLOP/s" in text
    for kernel in native.target.kernels:
        (line,) = [ln for ln in text.splitlines() if ln.startswith(kernel.module + " ")]
        assert f" {kernel.machine.grf} " in line and f" {kernel.machine.instructions} " in line
        assert "TFLOP/s" in line if kernel.work["flops"] else "GB/s" in line


# ------------------------------------------------------------------- ocloc and the report

ASSEMBLY = """//.kernel main_kernel
//.platform XE2
//.thread_config numGRF=256, numAcc=8, numSWSB=32
//.instCount 1234
//.RA type	GRAPH_COLORING_SPILL_FF_RA
//.spill size 384
//.spill flag store 9
(W)     mov (1|M0)               r1.0<1>:ud    0x6E10CA2E:ud    //  R_SYM_ADDR_32: _Z16get_sub_group_id;
(W)     mov (1|M0)               r1.0<1>:ud    0x0:ud    //  R_SYM_ADDR_32: __INTEL_PATCH_CROSS_THREAD_OFFSET_OFF_R0;
        load_block2d.ugm.d16.a64.ca.ca (1|M0)  null:0 [r3:1]       {I@2,$8} // $42
_0_004:
        load_block2d.ugm.d32t.a64 (1|M0)  r19:8 [r118:1]           {I@1,$1} // $324
        load_block2d.ugm.d16.a64 (1|M0)  r3:4   [r120:1]           {$6} // $323
        dpas.8x8 (16|M0)         r11:f         null:f            r19:hf            r3.0:hf          {$1} // $325
(W&f0.0) dpas.8x8 (16|M0)         r11:f         r11:f             r19:hf            r3.0:hf          {$1} // $326
(W&~f0.0) jmpi                               _0_004                                                  // $840
        store_block2d.ugm.d16.a64 (1|M0)  [r5:1]  r7:4             {$2} // $400
"""


def test_parse_assembly_reads_the_header_and_counts_the_instructions():
    mc = ocloc.parse_assembly(ASSEMBLY)
    assert (mc.platform, mc.grf, mc.instructions, mc.spill_bytes, mc.flag_spills) == \
        ("XE2", 256, 1234, 384, 9)
    assert (mc.dpas, mc.block_loads, mc.block_stores, mc.block_prefetches) == (2, 2, 1, 1)
    assert mc.block_load_bytes == (8 + 4) * 64
    assert mc.unresolved == ("_Z16get_sub_group_id",)
    assert (mc.loop_instructions, mc.loop_dpas) == (5, 2)   # the loop's loads, DPAS and jump
    clean = ocloc.parse_assembly(ASSEMBLY.replace("//.spill size 384\n", ""))
    assert clean.spill_bytes == 0
    with pytest.raises(StageError, match="numGRF"):
        ocloc.parse_assembly("//.kernel k\n")


def test_a_builtin_named_without_its_parameters_is_an_unresolved_call(tmp_path):
    """MLIR names get_sub_group_id without the Itanium `v` of its empty parameter list;
    IGC then leaves an external call (a stack call no driver links). The binary stage adds
    the `v`; the native stage refuses a kernel that still calls an unknown function."""
    dump = tmp_path / "dump"
    path = attention._write(tmp_path / "attention.py", 1, 2, 256, 64, "float16", False)
    compiled = compile_kernel(path, target="xegpu", stop_after="binary", dump_dir=dump)
    (xevm,) = dump.glob("*-xevm.mlir")
    ctx = ir.Context()
    ctx.allow_unregistered_dialects = True
    module = ir.Module.parse(xevm.read_text(), ctx)
    (gm,) = spirv.gpu_modules(module)
    text = spirv.device_llvm_ir(gm, 16)
    assert "@_Z16get_sub_group_idv(" in text and "@_Z16get_sub_group_id(" not in text
    unfixed = text.replace("@_Z16get_sub_group_idv(", "@_Z16get_sub_group_id(")
    binary = spirv.to_spirv(spirv.assemble_bitcode(unfixed))
    with pytest.raises(StageError, match=r"calls _Z16get_sub_group_id, which IGC does not know"):
        ocloc.compile_spirv(binary, "bmg", 128, "kernel @main_kernel")
    (kernel,) = compiled.target.kernels
    assert not ocloc.compile_spirv(kernel.spirv, "bmg", 128, "kernel @main_kernel").machine.unresolved


def test_mangle_void_parameters_only_renames_parameterless_declarations():
    text = ("declare spir_func i32 @_Z16get_sub_group_id() #0\n"
            "declare spir_func i64 @_Z12get_group_idj(i32) #0\n"
            "declare spir_func i32 @_Z22get_sub_group_local_idv() #0\n"
            "  %1 = call spir_func i32 @_Z16get_sub_group_id() #0\n")
    out = spirv.mangle_void_parameters(text)
    assert out.count("@_Z16get_sub_group_idv()") == 2
    assert "@_Z12get_group_idj(i32)" in out and "@_Z22get_sub_group_local_idv()" in out


DYNAMIC_BOOL_LANE = """
gpu.module @k {
  llvm.func @f(%i: i64, %p: !llvm.ptr<1>) attributes {gpu.kernel} {
    %mask = llvm.mlir.constant(dense<[true, false, false, false]> : vector<4xi1>) : vector<4xi1>
    %b = llvm.extractelement %mask[%i : i64] : vector<4xi1>
    %c1 = llvm.mlir.constant(1 : i64) : i64
    %b1 = llvm.extractelement %mask[%c1 : i64] : vector<4xi1>
    %both = llvm.and %b, %b1 : i1
    %v = llvm.zext %both : i1 to i8
    llvm.store %v, %p : i8, !llvm.ptr<1>
    llvm.return
  }
}
"""


def test_a_dynamic_lane_of_a_bool_vector_is_read_through_bytes():
    """IGC 2.40 crashes (SIGSEGV) on `extractelement <N x i1> %v, %dynamic` (the loss
    kernels' lane-0 masks); the device IR reads the lane of the vector widened to i8. A
    constant lane stays as it is."""
    ctx = ir.Context()
    module = ir.Module.parse(DYNAMIC_BOOL_LANE, ctx)
    text = spirv.device_llvm_ir(spirv.gpu_modules(module)[0], 16)
    assert "extractelement <4 x i8>" in text and "trunc i8" in text
    assert "extractelement <4 x i1> <i1 true, i1 false, i1 false, i1 false>, i64 %0" not in text


def test_ocloc_is_found_in_order_env_then_path_then_the_checkout(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "ocloc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho fake\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.delenv(ocloc.ENV, raising=False)
    assert ocloc.find_ocloc() == str(fake)
    chosen = tmp_path / "chosen"
    chosen.write_text("#!/bin/sh\n")
    chosen.chmod(0o755)
    monkeypatch.setenv(ocloc.ENV, str(chosen))
    assert ocloc.find_ocloc() == str(chosen)
    monkeypatch.setenv(ocloc.ENV, str(tmp_path / "missing"))
    with pytest.raises(UnsupportedError, match="is not an executable file"):
        ocloc.find_ocloc()
    monkeypatch.delenv(ocloc.ENV)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(ocloc, "CHECKOUT_CACHE", tmp_path / "none" / "ocloc")
    with pytest.raises(UnsupportedError, match="tools/fetch-ocloc"):
        ocloc.find_ocloc()


def test_fetch_is_idempotent_and_quiet_when_cached():
    """make test runs tools/fetch-ocloc; with the compiler in place it does nothing."""
    script = ROOT / "tools" / "fetch-ocloc"
    subprocess.run([str(script)], check=True, capture_output=True)
    start = time.perf_counter()
    again = subprocess.run([str(script)], capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout == again.stderr == ""
    assert time.perf_counter() - start < 5
    assert (ROOT / ".cache" / "ocloc" / "VERSION").read_text().startswith("intel-ocloc ")


def test_estimate_counts_waves_of_workgroups_and_the_slower_of_xmx_and_dram():
    pvc = CHIPS["pvc"]
    rate = 8 * 512 * 1.55e9                      # one workgroup of >= 8 subgroups per Xe-core
    work = {"workgroups": 112, "subgroups": 16, "flops": 112 * 10**9,
            "max_workgroup_flops": 10**9, "block_bytes": 0, "io_bytes": 10**6}
    est = estimate(work, pvc)
    assert est.bound == "xmx" and est.seconds == pytest.approx(2 * 10**9 / rate)
    assert est.percent == pytest.approx(100.0)
    assert est.dpas == 112 * 10**9 // 4096
    one_more = estimate(dict(work, workgroups=113, flops=113 * 10**9), pvc)  # a third wave
    assert one_more.seconds == pytest.approx(3 * 10**9 / rate)
    few = estimate(dict(work, subgroups=2), pvc)   # 2 of the 8 XMX engines of a core busy
    assert few.percent == pytest.approx(25.0)
    stream = estimate({"workgroups": 56, "subgroups": 8, "flops": 0, "max_workgroup_flops": 0,
                       "block_bytes": 0, "io_bytes": 1228_800_000}, pvc)
    assert stream.bound == "dram" and stream.seconds == pytest.approx(1e-3)
    assert stream.percent == pytest.approx(100.0) and stream.rate == "1229 GB/s"


def test_report_without_the_native_stage_says_so():
    compiled = compile_kernel(EXAMPLES / "softmax.py", overrides={"N": 64}, target="xegpu",
                              stop_after="binary")
    with pytest.raises(StageError, match="--report needs the native stage"):
        compiled.target.report()
    assert "anchor:" in format_report([], CHIPS["bmg"])


def test_cli_report_and_device_binary(tmp_path):
    out = tmp_path / "attention.bin"
    path = attention._write(tmp_path / "attention.py", 1, 2, 256, 64, "float16", False)
    proc = run_cli(path, "--target", "xegpu", "--chip", "pvc", "--report", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "pvc (Data Center GPU Max 1100" in proc.stdout
    (row,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("main_kernel ")]
    assert " attention " in row and re.search(r"\d+% (xmx|issue)$", row)
    assert out.read_bytes()[:4] == b"\x7fELF"
    assert json.loads(out.with_suffix(".json").read_text())["kernels"][0]["grf"] in (128, 256)
    cpu = run_cli(EXAMPLES / "softmax.py", "--set", "N=64", "--report")
    assert cpu.returncode == 2 and "--report needs --target xegpu" in cpu.stderr


def test_native_reruns_from_the_binary_dump(tmp_path):
    """What the native stage needs is in the IR: run in a fresh context on the binary
    stage's dump by a fresh target, it gives the native stage's dump and the same build."""
    from lighthouse.targets.xegpu import XeGpuTarget

    dump = tmp_path / "dump"
    compiled = compile_kernel(EXAMPLES / "log_softmax.py", overrides={"N": 64}, target="xegpu",
                              target_options={"chip": "pvc"}, dump_dir=dump)
    (binary,) = dump.glob("*-binary.mlir")
    (native_dump,) = dump.glob("*-native.mlir")
    ctx = ir.Context()
    ctx.allow_unregistered_dialects = True
    module = ir.Module.parse(binary.read_text(), ctx)
    target = XeGpuTarget("pvc")
    with ctx, ir.Location.unknown():
        target.native(module)
    assert str(module) == native_dump.read_text()
    (again,), (first,) = target.kernels, compiled.target.kernels
    assert again.machine == first.machine and again.work == first.work
