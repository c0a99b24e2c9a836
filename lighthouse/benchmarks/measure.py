"""What a benchmark child process does for one case (see `isolate` for the processes).

`measure(case)`: compile (wall time of the stages after the import, JIT included; the import
itself, which also makes the inputs and runs torch once, is reported apart), run once and
check against torch (max abs/rel error over every result, pass/fail by dtype tolerance),
count the work, optionally compile torch's reference with torch.compile (inductor, see
`compile_inductor`), then time every side in rotation after warm-up
(`runtime.measure_rotating`, all in this process).

`peak_memory(case, side)`: in a fresh child, builds one side only (our compiled kernel, or
torch eager through the same reference the check uses), calls it once (warm-up: lazy
initialization of libraries is not a call's memory), then calls it again and reports the
growth of the resident set during that call: VmHWM - VmRSS, the high-water mark having
been reset just before (`/proc/self/clear_refs` = 5). Allocations of 64 KiB and more are
forced to mmap (`mallopt(M_MMAP_THRESHOLD)`) and free heap pages are released before the
baseline (`malloc_trim`), so memory freed earlier (compile, warm-up) cannot hide the
measured call's allocations by being reused while still resident. The inputs exist before
the baseline: the number is what a call adds (outputs, temporaries, workspaces).

Work: FLOPs are those of torch's matmul-like ops (`torch.utils.flop_counter`, 2 per
multiply-add) in the reference computation (SDPA through its math backend so its two
matmuls are counted), scaled by the case's useful fraction (causal masks); bytes are the
compulsory traffic: every argument and result once, plus the weights frozen into a forward
graph. A kernel is compute-bound when FLOPs/bytes exceeds the machine balance (FMA peak /
bandwidth), then its throughput is GFLOP/s against the FMA peak, else GB/s against the
streaming-read bandwidth.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import IngressError, LighthouseError, UnsupportedError
from ..runtime import AlternatingTimes, measure_rotating
from .suite import Case

# Compile failures that mean "this problem is outside what lighthouse handles": listed as
# UNSUPPORTED with the reason. Any other failure is an ERROR (a bug to fix).
UNSUPPORTED_ERRORS = (IngressError, UnsupportedError)


def compile_case(case: Case):
    from ..compile import compile_kernel

    use_threads(case)
    return compile_kernel(case.path, overrides=dict(case.overrides), backward=case.backward,
                          threads=case.threads)


def use_threads(case: Case) -> None:
    """torch's intra-op threads as many as ours when the case sets them."""
    if case.threads is not None:
        torch.set_num_threads(case.threads)


def failure(exc: LighthouseError) -> dict:
    status = "UNSUPPORTED" if isinstance(exc, UNSUPPORTED_ERRORS) else "ERROR"
    return {"status": status, "reason": str(exc)}


def measure(case: Case, *, budget_seconds: float, rounds: int, inductor: bool) -> dict:
    try:
        compiled = compile_case(case)
    except LighthouseError as exc:
        return failure(exc)
    imported = compiled.imported
    results = compiled.run()
    reports = compiled.check(results)
    del results
    flops = count_flops(imported.reference) * case.useful_flops
    traffic = compulsory_bytes(compiled, case.backward)
    notes = list(compiled.notes)
    sides = {"ours": compiled.function.bind(imported.args), "torch": imported.reference}
    inductor_compile_s = None
    if inductor:
        compiled_ref, inductor_compile_s, note = compile_inductor(compiled)
        if compiled_ref is not None:
            sides["inductor"] = compiled_ref
        if note:
            notes.append(note)
    # min_rounds=1: a kernel of several seconds per call (a KernelBench convolution) gets
    # one timed round after its warm-up, so the child stays within --timeout
    times, _ = measure_rotating(sides, budget_seconds=budget_seconds, rounds=rounds, min_rounds=1)
    ok = all(r.ok for r in reports)
    timed = {}
    for side in ("ours", "torch", "inductor"):
        rounds_of = times.get(side)
        timed[f"{side}_s"] = statistics.median(rounds_of) if rounds_of else None
        timed[f"{side}_spread"] = AlternatingTimes.spread(rounds_of) if rounds_of else None
    return {
        "status": "PASS" if ok else "FAIL",
        "reason": "" if ok else "; ".join(str(r) for r in reports if not r.ok),
        "schedule": compiled.family.name,
        "notes": notes,
        "import_s": compiled.pipeline.timings.get("import", 0.0),
        "compile_s": sum(t for stage, t in compiled.pipeline.timings.items() if stage != "import"),
        "max_abs_err": max((r.max_abs for r in reports), default=0.0),
        "max_rel_err": max((r.max_rel for r in reports), default=0.0),
        **timed,
        "inductor_compile_s": inductor_compile_s,
        "timing_rounds": len(times["ours"]),
        "flops": flops,
        "bytes": traffic,
    }


def compile_inductor(compiled) -> tuple[Callable | None, float | None, str]:
    """`torch.compile` (default backend, inductor) of the reference torch eager runs, compiled
    by its first call: (the compiled callable, that call's seconds, a note). A forward
    reference runs the model under no_grad; a backward one the model's forward and
    `autograd.grad` of its results seeded by ones (a graph break: inductor compiles the
    forward, and AOTAutograd the backward that `autograd.grad` runs). When torch.compile
    fails, no callable and the note says why; when its results differ from torch eager's
    beyond the check's tolerance, the note says that (it is timed all the same)."""
    start = time.perf_counter()
    try:
        fn = torch.compile(compiled.imported.reference)
        results = fn()
    except Exception as exc:  # any failure of torch.compile leaves the row without it
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return None, None, f"torch.compile (inductor) not timed: {type(exc).__name__}: {first}"
    seconds = time.perf_counter() - start
    bad = [str(r) for r in compiled.check(results) if not r.ok]
    note = f"torch.compile (inductor) differs from torch eager: {'; '.join(bad)}" if bad else ""
    return fn, seconds, note


def count_flops(reference) -> float:
    """FLOPs of the matmul-like aten ops `reference()` dispatches (forward and backward),
    and of the products of its recurrent layers' steps."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..recurrences import RolledRecurrences

    # recurrent layers as lighthouse's layer ops (torch's own RNN kernels are opaque)
    with sdpa_kernel(SDPBackend.MATH), RolledRecurrences(), _FlopCount() as counter:
        reference()
    return counter.flops


class _FlopCount(TorchDispatchMode):
    """Sums torch.utils.flop_counter's formulas (2 FLOPs per multiply-add) over the ops it
    knows. A plain dispatch mode: FlopCounterMode's module hooks reject autograd.grad()."""

    def __init__(self):
        from ..recurrences import layer_flops

        super().__init__()
        self.flops = 0.0
        self.layer_flops = layer_flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += float(formula(*args, **kwargs, out_val=out))
        self.flops += self.layer_flops(func, args)
        return out


def compulsory_bytes(compiled, backward: bool) -> float:
    """Arguments and results once each, plus parameters and buffers frozen into a forward
    graph (with --backward they are arguments already)."""
    specs = compiled.imported.arg_specs + compiled.imported.result_specs
    total = sum(_numel(s.shape) * _itemsize(s.dtype) for s in specs)
    if not backward:
        model = compiled.kernel.model
        total += sum(t.numel() * t.element_size()
                     for t in list(model.parameters()) + list(model.buffers()))
    return float(total)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- peak memory -------------------------------------------------------------------------

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def peak_memory(case: Case, side: str) -> dict:
    _mmap_large_allocations()
    try:
        if side == "ours":
            compiled = compile_case(case)
            args = compiled.imported.args

            def call():
                return compiled.function(*args)
        else:
            call = torch_reference(case)
    except LighthouseError as exc:
        return failure(exc)
    out = call()  # warm-up
    del out
    # our kernel's workspace is resident from its load on, not grown into during the call
    held = compiled.function.workspace_bytes if side == "ours" else 0
    return {"peak_bytes": growth_during(call) + held}


def torch_reference(case: Case):
    """torch eager on the case's inputs: the reference the check compares against."""
    from ..ingress import import_forward, import_joint
    from ..kernel import load_kernel

    use_threads(case)
    kernel = load_kernel(case.path, dict(case.overrides))
    importer = import_joint if case.backward else import_forward
    return importer(kernel.model, kernel.inputs, name=str(case.path)).reference


def growth_during(call) -> int:
    """Bytes by which the resident set grew above its level before `call` (peak - start)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap pages leave the resident set
    start = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    out = call()
    peak = _status_kb("VmHWM")
    del out
    return max(0, peak - start) * 1024


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _mmap_large_allocations() -> None:
    libc = ctypes.CDLL("libc.so.6")
    if not libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
