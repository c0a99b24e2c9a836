"""F.cross_entropy on the XeGPU target: the loss (mean, ignore_index; f32 and bf16 logits;
weights and label smoothing) forward and forward+backward, checked through the IR of every
stage, the validated SPIR-V, and the kernel program run on the CPU.

Kernels (schedules/cross_entropy/xegpu.py): the row kernel (one gpu.func: the class dim
swept in column tiles with an online max / sum, the target gather x[i, y_i] as a scattered
load, per-row losses, and for the backward a second column loop writing d logits, the only
N x C buffer besides the logits), reductions over the rows in one-workgroup kernels (the
count that scales the gradient before it, the mean after it), and the target bounds check
in the host function before any launch. No contraction: no DPAS anywhere.
No Intel GPU here: the numerics of what the kernels compute are checked by running the
kernel program of the `workgroups` stage (the foralls with every GPU-specific rewrite:
lane-form per-row data, the row sums, the host check) on the CPU against torch.
"""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.errors import UnsupportedError
from lighthouse.ingress import TensorSpec
from lighthouse.targets import spirv
from lighthouse.targets.xegpu import XeGpuParams
from tests.lighthouse.xegpu_helpers import Lowered, dumped_stages, enclosing, walk

STAGES = ["import", "cleanup", "fuse", "workgroups", "subgroups", "vectorize", "bufferize",
          "gpu-outline", "xegpu", "xegpu-layouts", "xevm", "binary", "native"]
KERNEL = """
import torch
import torch.nn.functional as F
N, C = {N}, {C}
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.register_buffer("w", torch.rand(C, generator=g) + 0.5)
    def forward(self, x, y):
        return F.cross_entropy(x, y, weight={weight}, label_smoothing={smoothing})
def get_inputs():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, C, (N,), generator=g)
    y[::7] = -100
    return [torch.randn(N, C, generator=g, dtype=torch.{dtype}), y]
def get_init_inputs():
    return []
"""
N, C, COLUMN_TILE = 64, 512, 128
# name: (dtype, backward, weighted, label smoothing, rows per workgroup (None: chosen))
CASES = {
    "f32": ("float32", False, False, 0.0, None),
    "bf16_backward": ("bfloat16", True, False, 0.0, 8),
    "f32_backward_weight_smoothing": ("float32", True, True, 0.1, 8),
}


def _write(path, dtype, weighted, smoothing, n=N, c=C):
    path.write_text(KERNEL.format(N=n, C=c, dtype=dtype, weight="self.w" if weighted else "None",
                                  smoothing=smoothing))
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def lowered(request, tmp_path_factory):
    dtype, backward, weighted, smoothing, rows = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    kernel = _write(tmp / "loss.py", dtype, weighted, smoothing)
    compiled = compile_kernel(kernel, backward=backward, target="xegpu", dump_dir=tmp / "dump",
                              target_options={"params": XeGpuParams(rows=rows, column_tile=COLUMN_TILE)})
    low = Lowered(compiled, tmp / "dump")
    low.name, low.case, low.tmp = request.param, CASES[request.param], tmp
    return low


def _kernels(low):
    """gpu.func of each plan, by plan kind."""
    xe = low.ir("xegpu-layouts")
    funcs = walk(xe, "gpu.func")
    assert len(funcs) == len(low.plans)
    return xe, list(zip(low.plans, funcs))


def _row_kernel(low):
    xe, kernels = _kernels(low)
    (func,) = [f for p, f in kernels if p.kind == "cross_entropy"]
    return xe, func


def _shape(op, index=None):
    value = op.results[0] if index is None else op.operands[index]
    return list(ir.VectorType(value.type).shape)


def test_every_stage_runs_and_the_loss_gets_its_kernels(lowered):
    """Forward: the row kernel, then the mean over the rows. Backward: the count (it scales
    the gradient) first. One gpu.func and one launch per kernel, in that order."""
    c = lowered.compiled
    assert c.family.name == "cross_entropy"
    assert c.pipeline.names() == STAGES and list(lowered.stage_files) == dumped_stages(STAGES)
    backward = lowered.case[1]
    kinds = [p.kind for p in lowered.plans]
    assert kinds == (["row_sum", "cross_entropy", "row_sum"] if backward else ["cross_entropy", "row_sum"])
    final = lowered.ir("xegpu")
    assert len(walk(final, "gpu.func")) == len(walk(final, "gpu.launch_func")) == len(kinds)
    for plan, kernel in zip(lowered.plans, lowered.target.kernels, strict=True):
        assert kernel.kind == plan.kind
        if plan.kind == "cross_entropy":
            assert plan.tiles.column_tile == COLUMN_TILE
            assert kernel.grid == (N // plan.tiles.rows, 1, 1)
            assert plan.threads == plan.tiles.rows // 2 * 16
        else:
            assert kernel.grid == (1, 1, 1) and plan.threads == 16     # one subgroup


def test_classes_are_swept_online_in_column_tiles_with_no_n_by_c_scratch(lowered):
    """The row kernel's first loop steps over [rows, column_tile] logit tiles carrying only
    per-row vectors (running max, exp-sum, class sums); the max and sums over the classes
    are inside it. Backward: a second loop over the same tiles writes d logits straight to
    the result buffer. Buffers between kernels are [N, 16] per-row tiles and scalars: no
    N x C buffer besides the logits and d logits, no memref.alloc in any kernel."""
    xe, func = _row_kernel(lowered)
    loops = [op for op in walk(func, "scf.for") if enclosing(op, "scf.for") is None]
    backward = lowered.case[1]
    assert len(loops) == (2 if backward else 1)
    online = loops[0]
    rows = next(p for p in lowered.plans if p.kind == "cross_entropy").tiles.rows
    carried = [str(t) for t in online.results.types]
    assert carried and all(t == f"vector<{rows}xf32>" for t in carried)   # m, l, class sums
    step = list(online.operands)[2].owner
    assert ir.IntegerAttr(step.attributes["value"]).value == COLUMN_TILE
    (load,) = walk(online, "xegpu.load_nd")
    assert _shape(load)[-1] == COLUMN_TILE < C
    class_reductions = [op for op in walk(func, "vector.multi_reduction")
                        if ir.VectorType(op.operands[0].type).shape[-1] == COLUMN_TILE]
    assert len(class_reductions) >= 2 and all(enclosing(op, "scf.for") == online
                                              for op in class_reductions)
    if backward:
        (store,) = walk(loops[1], "xegpu.store_nd")
        assert _shape(store, 0)[-1] == COLUMN_TILE
        assert not loops[1].results                         # written per tile, nothing carried
        gradient = lowered.ir("gpu-outline")
        host = [op for op in walk(gradient, "func.func")][0]
        out = host.regions[0].blocks[0].arguments[-1]
        assert list(ir.MemRefType(out.type).shape) == [N, C]
    for op in walk(xe, "gpu.alloc"):
        shape = list(ir.MemRefType(op.results[0].type).shape)
        assert shape in ([N, 16], []), shape
    assert not walk(xe, "memref.alloc") or all(enclosing(op, "gpu.func") is None
                                               for op in walk(xe, "memref.alloc"))


def test_tiles_move_by_2d_block_ops_and_loops_prefetch(lowered):
    """Logit, gradient and per-row tiles: 2-D block loads / stores (no vector transfers left
    in a kernel); every loop reading tiles prefetches them; the device code calls the 2-D
    block builtins."""
    xe, kernels = _kernels(lowered)
    for plan, func in kernels:
        assert not walk(func, "vector.transfer_read") and not walk(func, "vector.transfer_write")
        tiles = walk(func, "xegpu.load_nd") + walk(func, "xegpu.store_nd")
        # every kernel moves tiles, but the count, which reads only the targets
        assert tiles or (plan.kind == "row_sum" and func is kernels[0][1])
        for op in tiles:
            desc = [v.type for v in op.operands if "tensor_desc" in str(v.type)][0]
            assert str(desc).startswith("!xegpu.tensor_desc<") and str(desc).count("x") >= 2
            assert len(_shape(op, 0 if op.name == "xegpu.store_nd" else None)) == 2
        for loop in walk(func, "scf.for"):
            if any(enclosing(o, "scf.for") == loop for o in walk(loop, "xegpu.load_nd")):
                assert walk(loop, "xegpu.prefetch_nd"), f"{plan.kind}: a tile loop without prefetch"
    device = lowered.device_llvm_ir()
    for builtin in ("2d_block_read", "2d_block_write", "2d_block_prefetch"):
        assert f"intel_sub_group_{builtin}" in device


def test_target_gather_is_a_scattered_load_and_no_dpas_is_needed(lowered):
    """x[i, y_i]: one scattered load per row (every lane of a row reads the same element of
    the logits), at an index clamped into [0, C) for memory safety only; the targets
    themselves come by a scattered load too. No one-hot product over the classes, and no
    contraction anywhere, so no DPAS."""
    xe, func = _row_kernel(lowered)
    gathers = walk(func, "xegpu.load")
    two_d = [g for g in gathers if len(_shape(g)) == 2]
    assert len(two_d) >= 2 and all(_shape(g)[1] == 16 for g in two_d)
    x_arg = [a for a in func.regions[0].blocks[0].arguments
             if list(ir.MemRefType(a.type).shape) == [N, C] and not _is_written(func, a)]
    from_x = [g for g in two_d if _base_memref(g) in x_arg]
    assert len(from_x) == 1                                   # the one gather of the logits
    index_ops = {op.name for op in _slice(from_x[0].operands[1])}
    assert {"arith.maxsi", "arith.minsi"} <= index_ops        # clamped: memory safety
    assert not walk(xe, "xegpu.dpas") and not walk(xe, "vector.contract")
    from transform_ext.analysis.structure import loop_structure

    payload = lowered.ir("cleanup")
    assert not [op for op in walk(payload, "linalg.generic") if loop_structure(op).is_contraction]


def _base_memref(load):
    owner = load.operands[0].owner
    while owner.name in ("arith.index_cast",):
        owner = owner.operands[0].owner
    assert owner.name == "memref.extract_aligned_pointer_as_index"
    return owner.operands[0]


def _is_written(func, arg):
    for op in walk(func, "xegpu.create_nd_tdesc"):
        if op.operands[0] == arg and any(u.owner.name == "xegpu.store_nd" for u in op.results[0].uses):
            return True
    return False


def _slice(value):
    seen, pending = [], [value]
    while pending:
        v = pending.pop()
        owner = v.owner
        if not hasattr(owner, "name") or owner in seen:
            continue
        seen.append(owner)
        pending.extend(owner.operands)
    return seen


def test_mean_is_a_second_kernel_dividing_by_the_count(lowered):
    """The mean: one workgroup loops over row tiles of the [N, 16] per-row results (2-D
    block loads, lane 0 counted), reduces once, divides by the count of counted targets
    (forward: counted in the same kernel from y; backward: by the first kernel, which the
    row kernel reads too) and stores the scalar. No atomics."""
    xe, kernels = _kernels(lowered)
    backward = lowered.case[1]
    after = kernels[-1][1]
    assert kernels[-1][0].kind == "row_sum"
    assert not walk(xe, "memref.atomic_rmw") and not walk(xe, "xegpu.atomic_rmw")
    (store,) = walk(after, "memref.store")
    assert str(store.operands[0].type) in ("f32", "bf16")
    assert walk(after, "arith.divf")
    loads = walk(after, "xegpu.load_nd")
    assert loads and all(_shape(op)[1] == 16 and enclosing(op, "scf.for") is not None for op in loads)
    if backward:
        before = kernels[0][1]
        assert walk(before, "memref.store")                  # the count (total weight)
        assert walk(before, "xegpu.load")                    # y, by scattered loads
        _, rows = _row_kernel(lowered)
        assert walk(rows, "memref.load") and walk(after, "memref.load")   # the count, read
    else:
        assert any(str(ir.VectorType(op.results[0].type).element_type) == "i64"
                   for op in walk(after, "xegpu.load"))      # y, counted here


def test_host_checks_the_targets_before_any_launch(lowered):
    """The host function copies y to host memory and asserts 0 <= y < C for every counted
    target before the first kernel launch; the lowered host code aborts with the message."""
    xe = lowered.ir("xegpu-layouts")
    host = walk(xe, "func.func")[0]
    ops = [o.operation for o in host.regions[0].blocks[0].operations]
    names = [o.name for o in ops]
    first_launch = names.index("gpu.launch_func")
    copy = names.index("gpu.memcpy")
    loop = names.index("scf.for")
    assert copy < loop < first_launch
    y = host.regions[0].blocks[0].arguments[1]
    assert ops[copy].operands[1] == y
    asserts = walk(ops[loop], "cf.assert")
    assert len(asserts) == 2
    for a in asserts:
        assert f"must be in [0, {C}) or equal ignore_index" in str(a.attributes["msg"])
    text = lowered.stage_files["xevm"].read_text()
    host_text = text[text.index("llvm.func @main("):]
    host_text = host_text[:host_text.index("gpu.launch_func")]
    assert "mgpuMemcpy" in host_text and "mgpuStreamSynchronize" in host_text
    assert "@abort" in text and "@puts" in text


def test_spirv_validates_with_the_recorded_launch(lowered, tmp_path):
    target = lowered.target
    path = tmp_path / "loss.spv"
    target.write_artifact(lowered.compiled, path)
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert [k["kind"] for k in manifest["kernels"]] == [p.kind for p in lowered.plans]
    for kernel, entry, plan in zip(target.kernels, manifest["kernels"], lowered.plans):
        file = tmp_path / f"loss.{kernel.module}.spv"
        spirv.validate(file)
        (ep,) = spirv.read_spirv(file.read_bytes())["entry_points"]
        assert ep.local_size == (plan.threads, 1, 1) and ep.subgroup_size == 16
        assert entry["local_size"] == [plan.threads, 1, 1] and entry["grid"][0] == plan.tiles.grid[0]


# ------------------------------------------------------------- the kernel program on the CPU

def _program_on_cpu(low):
    """The `workgroups` stage (the kernel foralls, the host check) lowered for the CPU."""
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
    weights = [TensorSpec((C,), torch.float32) for _ in low.target.weight_specs]
    return cpu.jit(module, list(imported.arg_specs) + weights, imported.result_specs)


def _reference(x, y, w, smoothing, backward):
    x = x.detach().clone().requires_grad_(backward)
    loss = F.cross_entropy(x, y, weight=w, label_smoothing=smoothing)
    if not backward:
        return (loss,)
    loss.backward()
    return loss, x.grad


def _inputs(dtype, kind):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, C, generator=g)
    y = torch.randint(0, C, (N,), generator=g)
    y[::5] = -100
    if kind == "all_ignored":
        y[:] = -100
    elif kind == "huge":
        x = x * 1e4
    elif kind == "non_finite_in_ignored_row":
        x[5, 3], x[5, 4], x[5, 6] = float("inf"), float("nan"), -float("inf")
    return x.to(dtype), y


@pytest.mark.parametrize("kind", ["mixed", "all_ignored", "huge", "non_finite_in_ignored_row"])
def test_kernel_program_matches_torch_on_cpu(lowered, kind):
    """Numerics of the GPU kernels' program (no GPU here): ignored rows, all rows ignored
    (mean NaN, gradient exactly 0), |x| ~ 1e4, and inf / NaN logits in an ignored row (loss
    finite, that row's gradient NaN as torch's)."""
    dtype_name, backward, weighted, smoothing, _ = lowered.case
    if not hasattr(lowered, "cpu"):
        lowered.cpu = _program_on_cpu(lowered)
    dtype = getattr(torch, dtype_name)
    x, y = _inputs(dtype, kind)
    w = lowered.compiled.kernel.model.w if weighted else None
    got = lowered.cpu(x, y, *([w] if weighted else []))
    want = _reference(x, y, w, smoothing, backward)
    tol = dict(rtol=3e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=2e-4, atol=2e-4)
    if kind == "all_ignored":
        assert torch.isnan(got[0])
        if backward:
            assert torch.equal(got[1], torch.zeros_like(got[1]))
        return
    assert torch.isfinite(got[0])
    torch.testing.assert_close(got[0], want[0].to(dtype), **tol)
    if backward:
        torch.testing.assert_close(got[1], want[1].to(dtype), equal_nan=True, **tol)
        if kind == "non_finite_in_ignored_row":
            assert torch.isnan(got[1][5]).all()


HOST_CHECK = """
import sys, torch
from torch_mlir import ir
from lighthouse.ingress import TensorSpec
from lighthouse.pipeline import Pipeline
from lighthouse.targets.cpu import CpuTarget
ctx = ir.Context()
m = ir.Module.parse(open(sys.argv[1]).read(), ctx)
def unmap(op):
    if op.name == "scf.forall" and "mapping" in op.attributes:
        del op.attributes["mapping"]
    return ir.WalkResult.ADVANCE
m.operation.walk(unmap)
cpu = CpuTarget(threads=1)
with ctx, ir.Location.unknown():
    Pipeline(cpu.stages()).run(m)
f = cpu.jit(m, [TensorSpec(({N}, {C}), torch.float32), TensorSpec(({N},), torch.int64)],
            [TensorSpec((), torch.float32)])
for target in sys.argv[2:]:
    y = torch.zeros({N}, dtype=torch.int64)
    y[3] = int(target)
    print("loss", target, float(f(torch.randn({N}, {C}), y)[0]), flush=True)
"""


def test_an_out_of_range_target_stops_before_the_kernels(tmp_path):
    """The host check at work (the kernel program run on the CPU in a child process): a
    target -100 (ignored) runs, C or -1 stops the process with the check's message before
    any kernel computes a loss."""
    n, c = 16, 64
    kernel = _write(tmp_path / "loss.py", "float32", False, 0.0, n=n, c=c)
    compile_kernel(kernel, target="xegpu", stop_after="workgroups", dump_dir=tmp_path / "dump",
                   target_options={"params": XeGpuParams(column_tile=16)})
    stage = next((tmp_path / "dump").glob("*-workgroups.mlir"))
    script = tmp_path / "host_check.py"
    script.write_text(HOST_CHECK.format(N=n, C=c))
    for targets in (["-100", str(c)], ["-1"]):
        r = subprocess.run([sys.executable, str(script), str(stage), *targets],
                           capture_output=True, text=True)
        assert r.returncode != 0, r.stdout
        assert [line.split()[1] for line in r.stdout.splitlines() if line.startswith("loss")] \
            == targets[:-1]
        assert f"class indices must be in [0, {c}) or equal ignore_index" in r.stdout + r.stderr


def test_shapes_without_a_gpu_form_are_refused_by_name(tmp_path):
    """Odd rows (the row kernel holds 2 rows per subgroup) and a class count no multiple of
    16 divides (no column tile) are errors naming the dimension, at the workgroups stage."""
    kernel = _write(tmp_path / "odd.py", "float32", False, 0.0, n=63, c=1000)
    with pytest.raises(UnsupportedError, match=r"dimension 0 \(63 rows\) is not a multiple of the rows per subgroup"):
        compile_kernel(kernel, target="xegpu", stop_after="workgroups")
    with pytest.raises(UnsupportedError, match=r"dimension 1 \(1000 classes\) is not a multiple of the column tile \(128\)"):
        compile_kernel(_write(tmp_path / "c.py", "float32", False, 0.0, n=64, c=1000),
                       target="xegpu", stop_after="workgroups",
                       target_options={"params": XeGpuParams(column_tile=128)})


BATCHED = """
import torch
import torch.nn.functional as F
B, T, C = 2, 32, 512
class Model(torch.nn.Module):
    def forward(self, x, y):
        return F.cross_entropy(x.view(-1, C), y.view(-1))
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, C, generator=g), torch.randint(0, C, (B, T), generator=g)]
def get_init_inputs():
    return []
"""


def test_logits_of_a_batch_of_sequences(tmp_path):
    """[B, T, C] logits and [B, T] targets flattened by `view` (the kernels read the
    arguments through collapse_shapes): forward and backward pass spirv-val, and the kernels'
    program matches torch's autograd on the CPU with ignored targets."""
    kernel = tmp_path / "batched.py"
    kernel.write_text(BATCHED)
    compiled = compile_kernel(kernel, target="xegpu", backward=True, stop_after="binary",
                              dump_dir=tmp_path / "dump", strict=True)
    compiled.target.write_artifact(compiled, tmp_path / "loss.spv")
    for kernel_file in tmp_path.glob("loss.*.spv"):
        spirv.validate(kernel_file)
    low = Lowered(compiled, tmp_path / "dump")
    run = _program_on_cpu(low)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, 512, generator=g) * 30
    y = torch.randint(0, 512, (2, 32), generator=g)
    y[:, ::4] = -100
    leaf = x.clone().requires_grad_()
    loss = F.cross_entropy(leaf.view(-1, 512), y.view(-1))
    loss.backward()
    got_loss, got_grad = run(x, y)
    torch.testing.assert_close(got_loss, loss.detach(), rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(got_grad, leaf.grad, rtol=2e-4, atol=2e-4)
