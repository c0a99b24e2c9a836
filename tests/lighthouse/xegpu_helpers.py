"""Reading the stage dumps of an XeGPU compile: parsed IR per stage, op walks, DPAS FLOPs
(with loop trip counts evaluated per workgroup, so loops bounded by the block id count
right), the device LLVM IR of the kernels."""

import math
import re

from torch_mlir import ir

from lighthouse.targets import spirv
from lighthouse.targets.kernel_work import trips


class Lowered:
    def __init__(self, compiled, dump):
        self.compiled = compiled
        self.target = compiled.target
        self.dump = dump
        files = sorted(dump.iterdir())
        self.stage_files = {re.sub(r"^\d+-", "", f.stem): f for f in files}

    @property
    def plans(self) -> list:
        """The kernels the compile's script plans (kernel_plans), in launch order."""
        if not hasattr(self, "_plans"):
            self._plans = kernel_plans(self.compiled, self.dump)
        return self._plans

    def ir(self, stage) -> ir.Module:
        ctx = ir.Context()
        ctx.allow_unregistered_dialects = True
        return ir.Module.parse(self.stage_files[stage].read_text(), ctx)

    def device_llvm_ir(self) -> str:
        module = self.ir("xevm")
        return "".join(spirv.device_llvm_ir(gm, 16) for gm in spirv.gpu_modules(module))


def walk(module, name):
    found = []

    def visit(op):
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    getattr(module, "operation", module).walk(visit)
    return found


def enclosing(op, name):
    parent = op.parent
    while parent is not None and parent.name != name:
        parent = parent.parent
    return parent


def grid(gpu_func) -> tuple[int, int, int]:
    return tuple(ir.DenseI32ArrayAttr(gpu_func.attributes["known_grid_size"]))


def dpas_flops(module) -> int:
    """2 m n k of every workgroup-level xegpu.dpas, times its loop trips, summed over all
    workgroups of its kernel."""
    total = 0
    for op in walk(module, "xegpu.dpas"):
        (m, k), (k2, n) = (ir.VectorType(v.type).shape for v in list(op.operands)[:2])
        assert k == k2
        gx, gy, gz = grid(enclosing(op, "gpu.func"))
        for x in range(gx):
            for y in range(gy):
                for z in range(gz):
                    total += 2 * m * n * k * trips(op, {"x": x, "y": y, "z": z})
    return total


def payload_contraction_flops(module) -> int:
    from transform_ext.analysis.structure import loop_structure

    ops = [op for name in ("linalg.matmul", "linalg.batch_matmul", "linalg.generic")
           for op in walk(module, name) if loop_structure(op).is_contraction]
    return sum(2 * math.prod(loop_structure(op).ranges) for op in ops)


def tile_descriptor(op) -> str:
    return str([v.type for v in op.operands if "tensor_desc" in str(v.type)][0])


# The stages applied from the schedule script (--dump-dir writes each one's script beside it).
SCHEDULE_STAGES = ("fuse", "workgroups", "subgroups", "vectorize", "bufferize", "gpu-outline",
                   "xegpu", "xegpu-layouts")


def dumped_stages(stages: list[str]) -> list[str]:
    """The files --dump-dir writes for `stages` (names without their NN- prefix): the input,
    each stage's IR, and beside a schedule stage's IR its script."""
    out = ["input"]
    for stage in stages:
        out.append(stage)
        if stage in SCHEDULE_STAGES:
            out.append(f"{stage}.transform")
    return out


def kernel_plans(compiled, dump=None):
    """The kernels the compile's XeGPU script plans (lighthouse.targets.xegpu KernelPlan, in
    launch order), planned again from the payload after cleanup: the stage dump `dump`
    ('NN-cleanup.mlir' in it), else the kernel file imported again (forward)."""
    from lighthouse.compile import cleanup
    from lighthouse.ingress import import_forward

    if dump is not None:
        (path,) = [p for p in dump.iterdir() if p.name.endswith("-cleanup.mlir")]
        payload = ir.Module.parse(path.read_text(), compiled.module.context)
    else:
        payload = import_forward(compiled.kernel.model, compiled.kernel.inputs).module
        cleanup(payload)
    with payload.context, ir.Location.unknown():
        return compiled.target.schedule(compiled.family, payload).plans
