"""The part of a fuzz case that runs in a child process (see `isolate.run_isolated`).

`run_case` compiles one kernel file with lighthouse, runs it, compares every result with
torch by the `--check` rule (`Compiled.check`) and returns a plain dict (it must pickle)
saying what happened. The child's stdout and stderr (MLIR's runtime-verification messages,
faulthandler's traceback of a segfault) go to `log_path`, with `@@ phase NAME` lines marking
how far it got, so the parent can tell where a child that died without a result was.
"""

from __future__ import annotations

import faulthandler
import inspect
import os
import re
import resource
import sys
import traceback

# frames of these packages locate a Python exception raised by the compiler
COMPILER_PACKAGES = ("lighthouse", "schedules", "transform_ext")


def compile_options() -> dict:
    """Options every fuzz case compiles with: runtime checks when compile_kernel has them."""
    from lighthouse.compile import compile_kernel

    if "runtime_checks" in inspect.signature(compile_kernel).parameters:
        return {"runtime_checks": True}
    return {}


def _mark(what: str) -> None:
    print(f"@@ {what}", flush=True)


def run_case(path: str, backward: bool, log_path: str, schedule: str | None = None) -> dict:
    """The outcome of one case (see the module docstring), with the CPU seconds it took
    (`cpu_seconds`: the child's own, whatever else runs on the machine). FUZZ_ROUTE=
    torch.compile compiles the kernel file's model with torch.compile(backend="lighthouse",
    strict) instead of compile_kernel (`_run_case_compiled`)."""
    if os.environ.get("FUZZ_ROUTE") == "torch.compile":
        result = _run_case_compiled(path, backward, log_path)
    else:
        result = _run_case(path, backward, log_path, schedule)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {**result, "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2)}


def _run_case(path: str, backward: bool, log_path: str, schedule: str | None) -> dict:
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable(file=sys.stderr)
    from lighthouse import compile as driver
    from lighthouse.errors import LighthouseError

    _announce_family(driver)
    _mark("phase compile")
    try:
        compiled = driver.compile_kernel(path, backward=backward, schedule=schedule,
                                         **compile_options())
    except LighthouseError as exc:
        return {"status": "error", "phase": "compile", "type": type(exc).__name__,
                "message": str(exc), "honest": honest_refusal(exc, path, backward)}
    except Exception as exc:
        return {"status": "exception", "phase": "compile", **_describe(exc)}
    result = {"family": compiled.family.name, "notes": list(compiled.notes)}
    _mark("phase run")
    try:
        results = compiled.run()
    except LighthouseError as exc:
        return {**result, "status": "error", "phase": "run", "type": type(exc).__name__,
                "message": str(exc), "honest": False}
    except Exception as exc:
        return {**result, "status": "exception", "phase": "run", **_describe(exc)}
    _mark("phase check")
    try:
        reports = compiled.check(results)
        failing = [i for i, r in enumerate(reports) if not r.ok]
        expected = compiled.imported.reference() if failing else ()
    except Exception as exc:
        return {**result, "status": "exception", "phase": "check", **_describe(exc)}
    result["reports"] = [str(r) for r in reports]
    result["mismatches"] = [_mismatch(reports[i], results[i], expected[i]) for i in failing]
    result["status"] = "mismatch" if failing else "ok"
    if failing:
        result["offset_only"] = _passes_without_offsets(compiled)
        result["exact_agrees"] = _matches_exact_results(compiled, results, expected, backward)
    return result


def _run_case_compiled(path: str, backward: bool, log_path: str) -> dict:
    """The case through torch.compile(backend="lighthouse", options={"torch_fallback":
    False}): the model's outputs and (backward) the gradients of its float inputs and
    parameters, seeded by ones, against eager torch's by the --check rule. A part lighthouse
    cannot compile is an error, an honest refusal only when torch-mlir cannot lower an op
    (honest_refusal); the notes logged (a family that failed and fell back) are the case's."""
    import copy
    import logging

    import torch

    from lighthouse.compile import compare
    from lighthouse.kernel import load_kernel

    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable(file=sys.stderr)
    kernel = load_kernel(path)
    inputs = tuple(kernel.inputs)
    from lighthouse.ingress import _differentiable

    grad_pos = _differentiable(kernel.model, inputs, [i for i, t in enumerate(inputs)
                                                      if t.is_floating_point()])
    expected = _results_of(kernel.model, inputs, backward, grad_pos)
    model = copy.deepcopy(kernel.model)
    compiled = torch.compile(model, backend="lighthouse", options={"torch_fallback": False})
    notes: list[str] = []

    class Notes(logging.Handler):
        def emit(self, record):
            notes.append(record.getMessage())

    logging.getLogger("lighthouse").addHandler(Notes())

    class Compiled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return compiled(*args)

    _mark("phase compile+run")
    try:
        results = _results_of(Compiled(), inputs, backward, grad_pos)
    except Exception as exc:
        text = str(exc)
        found = re.search(r"torch-mlir cannot lower (?:torch\.)?(aten\.\w+)", text)
        honest = False
        if found is not None:
            from lighthouse.errors import IngressError

            honest = honest_refusal(IngressError(found.group(0)), path, backward)
        return {"status": "error", "phase": "compile", "type": type(exc).__name__,
                "message": text.strip().splitlines()[0][:400] if text.strip() else "",
                "honest": honest}
    _mark("phase check")
    names = [f"result{i}" for i in range(len(expected))]
    reports = [compare(n, g, w) for n, g, w in zip(names, results, expected)]
    failing = [i for i, r in enumerate(reports) if not r.ok]
    return {"family": "torch.compile", "notes": notes, "reports": [str(r) for r in reports],
            "mismatches": [_mismatch(reports[i], results[i], expected[i]) for i in failing],
            "status": "mismatch" if failing else "ok"}


def _matches_exact_results(compiled, results, expected, backward: bool) -> bool:
    """For a kernel whose results fail the check rule against torch's eager ones: whether
    each result is as right as torch's, judged against the exact result (the model and its
    float inputs in float64, rounded to the result's dtype). A result is right when it
    passes the check rule against the exact one (torch's CPU kernels are not always right:
    a bf16 matmul spreads a NaN row into its neighbour; an f32 layer norm over one element
    gives its weight a gradient of 4e-4 where the exact one is 0), or, in a kernel with
    f16/bf16 tensors, when it has the exact result's NaN and inf positions, as torch has,
    and differs from it by at most twice as much as torch does (an ill-conditioned chain,
    rounded by torch after every op and by us where the schedule stores, differs from both
    by more than the tolerance)."""
    import copy

    import torch

    from lighthouse.compile import compare

    kernel = compiled.kernel
    tensors = list(kernel.inputs) + list(kernel.model.parameters()) + list(kernel.model.buffers())
    low_precision = any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors)
    model = copy.deepcopy(kernel.model).double()
    inputs = tuple(t.detach().double() if t.is_floating_point() else t for t in kernel.inputs)
    try:
        exact = _results_of(model, inputs, backward)
    except Exception:
        return False
    if len(exact) != len(results):
        return False
    for name, got, theirs, want in zip(compiled.imported.result_names, results, expected, exact):
        want = want.to(got.dtype)
        if compare(name, got, want).ok:
            continue
        if not (low_precision and got.is_floating_point() and got.shape == want.shape and
                _same_nonfinite(got, want) and _same_nonfinite(theirs, want)):
            return False
        finite = torch.isfinite(want)
        if finite.any():
            ours_err = (got.double() - want.double())[finite].abs().max()
            torch_err = (theirs.double() - want.double())[finite].abs().max()
            if ours_err > 2 * torch_err:
                return False
    return True


def _same_nonfinite(a, b) -> bool:
    import torch

    return (torch.equal(torch.isnan(a), torch.isnan(b)) and
            torch.equal(torch.isposinf(a), torch.isposinf(b)) and
            torch.equal(torch.isneginf(a), torch.isneginf(b)))


def _results_of(model, inputs: tuple, backward: bool, grad_pos=None) -> tuple:
    """The model's results as lighthouse orders them: the outputs, then (backward) the
    gradients of the differentiable float inputs (`grad_pos`, found by probing `model` when
    None) and of the parameters, outputs seeded by ones."""
    import torch

    from lighthouse.ingress import _differentiable

    def as_tuple(out):
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)

    if not backward:
        with torch.no_grad():
            return as_tuple(model(*inputs))
    if grad_pos is None:
        grad_pos = _differentiable(model, inputs, [i for i, t in enumerate(inputs)
                                                   if t.is_floating_point()])
    wrt_inputs = [inputs[i].clone().requires_grad_(True) for i in grad_pos]
    full = list(inputs)
    for i, t in zip(grad_pos, wrt_inputs):
        full[i] = t
    wrt = wrt_inputs + [p for p in model.parameters() if p.is_floating_point()]
    with torch.enable_grad():
        outs = as_tuple(model(*full))
        live = [o for o in outs if o.requires_grad]
        grads = torch.autograd.grad(live, wrt, [torch.ones_like(o) for o in live], allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
    return tuple(o.detach() for o in outs) + tuple(g.detach() for g in grads)


def _passes_without_offsets(compiled) -> bool:
    """Whether the kernel is right on copies of its inputs that start at offset 0 of their
    storage (the runtime makes every input contiguous anyway, so a storage offset, as of
    `x[3:]`, is then the only difference)."""
    import torch

    copies = [t.clone(memory_format=torch.contiguous_format) for t in compiled.imported.args]
    if all(c.storage_offset() == t.storage_offset() for c, t in zip(copies, compiled.imported.args)):
        return False
    return all(r.ok for r in compiled.check(compiled.run(*copies)))


def _announce_family(driver) -> None:
    """Log the family the driver chooses as soon as it is chosen (before the stages run), so
    a crash or a timeout while compiling still names it."""
    choose = driver.choose_family

    def choose_and_log(*args, **kwargs):
        family = choose(*args, **kwargs)
        _mark(f"family {family.name}")
        return family

    driver.choose_family = choose_and_log


def _mismatch(report, got, want) -> dict:
    """What kind of difference a failing report is: 'shape', 'nan' (NaN or inf where torch
    has none, or the reverse), 'value' (finite values beyond the tolerance)."""
    import torch

    if got.shape != want.shape:
        kind = "shape"
    elif not want.is_floating_point():
        kind = "value"
    else:
        g, w = got.double(), want.double()
        same_nan = torch.equal(torch.isnan(g), torch.isnan(w))
        same_inf = torch.equal(torch.isinf(g) & (g > 0), torch.isinf(w) & (w > 0)) and \
            torch.equal(torch.isinf(g) & (g < 0), torch.isinf(w) & (w < 0))
        kind = "value" if same_nan and same_inf else "nan"
    return {"name": report.name, "kind": kind, "text": str(report),
            "torch_nonfinite": bool(want.is_floating_point() and want.numel()
                                    and not torch.isfinite(want).all())}


def _describe(exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if _package_of(f.filename) in COMPILER_PACKAGES]
    where = (ours or frames)[-1] if frames else None
    text = str(exc).strip()
    return {"type": type(exc).__name__, "message": text.splitlines()[0][:400] if text else "",
            "where": f"{_short_path(where.filename)}:{where.name}" if where else "?",
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


def _package_of(filename: str) -> str | None:
    parts = filename.split(os.sep)
    for part in reversed(parts[:-1]):
        if part in COMPILER_PACKAGES:
            return part
    return None


def _short_path(filename: str) -> str:
    parts = filename.split(os.sep)
    for i, part in enumerate(parts):
        if part in COMPILER_PACKAGES + ("torch", "torch_mlir"):
            return "/".join(parts[i:])
    return os.path.basename(filename)


def honest_refusal(exc, path: str, backward: bool) -> bool:
    """Whether a LighthouseError raised while compiling is an honest refusal: an IngressError
    naming an op torch-mlir cannot lower, where torch-mlir truly cannot: asked directly (with
    its own decompositions), it cannot import the forward graph either; for a backward op
    (`*_backward*`), torch has no decomposition of it that lighthouse could have used.
    Everything else (StageError, a Python exception, ...) is a compiler failure."""
    from lighthouse.errors import IngressError

    found = re.search(r"torch-mlir cannot lower (?:torch\.)?(aten\.\w+)", str(exc))
    if not isinstance(exc, IngressError) or found is None:
        return False
    op = found.group(1)
    if backward and "backward" in op:
        import torch._decomp

        decomposed = {str(getattr(k, "overloadpacket", k)) for k in torch._decomp.decomposition_table}
        return op not in decomposed
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch_mlir import fx

    from lighthouse.kernel import load_kernel

    kernel = load_kernel(path)
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            fx.export_and_import(kernel.model, *kernel.inputs, output_type="linalg-on-tensors")
    except Exception:
        return True
    return False
