"""python -m lighthouse.compile KERNEL.py: import, schedule, lower, run, check, time.

Library use:
    from lighthouse.compile import compile_kernel
    c = compile_kernel("examples/softmax.py", overrides={"N": 64})
    outs = c.run()                      # torch tensors
    report = c.check()                  # against torch eager
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":
    # As in lighthouse.bench: torch's libgomp threads spin about 200 us after a parallel
    # region, as ours do (lighthouse.targets.cpu.SPIN_BEFORE_SLEEP), so --bench times both
    # under the same policy. Read when torch loads libgomp, hence before `import torch`.
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

import torch

from schedules.script import IncompleteScript, ScriptError, apply_stage, parse_script, stage_text

from .errors import (CheckFailed, LighthouseError, ScheduleFileError, StageError,
                     UnknownStage, UnsupportedError)
from .families import Family, choose_family, fallback_family, family_names, parse_schedule_options
from .ingress import Imported, import_forward, import_joint
from .kernel import Kernel, load_kernel, parse_override
from .pipeline import Pipeline, Stage
from .targets.parallel_bound import on_one_thread_when_small

# (rtol, atol) per result dtype: elementwise |ours - torch| <= atol s + rtol |torch|, where
# s = max(1, rms(torch)) puts atol on the result's own scale: a sum of K terms carries
# rounding of the size of its terms, so entries that cancel to near 0 are judged against
# the scale of the result, not against 0 (f32 matmuls with K = 2048 differ by ~5e-4 at 45).
# A CPU compile reads parameters of at least this many elements (4 MiB of f32) from
# arguments, not constants: the IR, LLVM's module and the object code would each hold a copy.
WEIGHT_ARGUMENT_ELEMENTS = 1 << 20

TOLERANCES = {
    torch.float32: (2e-4, 2e-4), torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2),
}


def make_target(name: str, threads: int | None = None, *, runtime_checks: bool = False,
                **options):
    if threads is not None and threads < 1:
        raise UnsupportedError(f"--threads must be >= 1, got {threads}")
    if name == "cpu":
        from .targets.cpu import CpuTarget

        # options: CpuTarget fields, e.g. cpu=CpuDescription (what the schedules plan for)
        if threads is None:
            return CpuTarget(runtime_checks=runtime_checks, **options)
        return CpuTarget(threads=threads, runtime_checks=runtime_checks, **options)
    if runtime_checks:
        raise UnsupportedError(f"--runtime-checks needs the cpu target (the {name} kernels "
                               f"cannot run here)")
    if name == "xegpu":
        try:
            from .targets.xegpu import XeGpuTarget
        except ImportError as exc:
            raise StageError(f"the xegpu target is not available: {exc}") from exc
        return XeGpuTarget(**options)
    raise StageError(f"unknown target {name!r}; targets are: cpu, xegpu")


def with_schedule_options(target, options: dict):
    """`target` with the (parsed) schedule options `options` for the families to read."""
    if not options or not hasattr(target, "options"):
        return target
    options = tuple(sorted(options.items()))
    if dataclasses.is_dataclass(target):
        return dataclasses.replace(target, options=options)
    target.options = options
    return target


def cleanup(module) -> None:
    from schedules.prepare import cleanup as prepare

    prepare(module)


@dataclass
class ScheduleScript:
    """The compile's transform script: a user's file (`--schedule-file`), else the family's
    own, built on first use from the payload after cleanup."""

    family: Family
    target: object
    path: Path | None = None
    module: object | None = None  # the script's ir.Module once built or parsed
    # (stage, error) when the script could be built only up to that stage (IncompleteScript)
    failure: tuple | None = None

    def get(self, payload):
        if self.module is None:
            if self.path is not None:
                try:
                    self.module = parse_script(self.path, payload.context)
                except ScriptError as exc:
                    raise ScheduleFileError(str(exc)) from None
            else:
                from torch_mlir import ir

                own = getattr(self.target, "script", None)  # a target's own, if any
                with payload.context, ir.Location.unknown():
                    try:
                        self.module = own(self.family, payload) if own else None
                    except IncompleteScript as incomplete:
                        self.module = incomplete.script
                        self.failure = (incomplete.stage, incomplete.error)
                    if self.module is None:
                        self.module = self.family.script(payload, self.target)
        return self.module

    def stage(self, name: str, doc: str) -> Stage:
        """Stage `name`: the script's sequence @name ('-' spelled '_')."""
        sequence = name.replace("-", "_")   # a stage's symbol (gpu-outline: @gpu_outline)

        def run(payload):
            script = self.get(payload)
            if self.failure is not None and self.failure[0] == name:
                raise self.failure[1]
            try:
                apply_stage(payload, script, sequence)
            except ScriptError as exc:
                if self.path is None:
                    raise StageError(f"stage {name!r} failed: {exc}") from exc
                raise ScheduleFileError(str(exc)) from None

        return Stage(name, run, doc, script_text=lambda: stage_text(self.module, sequence))


def build_pipeline(family: Family, target, script: ScheduleScript | None = None) -> Pipeline:
    script = script or ScheduleScript(family, target)
    front = [
        Stage("import", lambda m: None, "torch-mlir import (linalg-on-tensors)"),
        Stage("cleanup", cleanup, "canonicalize, cse, empty loops folded, integer powers expanded, "
              "gathers clamped, i1 tensors stored as i8"),
        script.stage("fuse", f"{family.name}: fusion and tiling"),
        script.stage("vectorize", f"{family.name}: vectorization"),
    ]
    adapt = getattr(target, "adapt_front", None)  # a target may remap fuse/vectorize
    if adapt is not None:
        front = adapt(family, front, script)
    return Pipeline(front + target.stages())


@dataclass
class CheckReport:
    name: str
    max_abs: float
    max_rel: float
    ok: bool
    dtype: torch.dtype

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH"
        return (f"{self.name}: max abs err {self.max_abs:.3g}, max rel err {self.max_rel:.3g} "
                f"({str(self.dtype).removeprefix('torch.')}) {verdict}")


@dataclass
class Compiled:
    kernel: Kernel | None  # None for a graph compiled from Python (lighthouse.api)
    imported: Imported
    family: Family
    pipeline: Pipeline
    target: object
    notes: list[str] = field(default_factory=list)
    function: object | None = None  # JitFunction once fully compiled for the CPU
    result_names: list[str] = field(default_factory=list)  # the model's, then schedule extras
    script: ScheduleScript | None = None

    def schedule_text(self) -> str:
        """The complete transform script of this compile (built from the payload as it is
        after cleanup: compile with stop_after="cleanup" to print it before it runs)."""
        text = str(self.script.get(self.module))
        if self.script.failure is not None:
            raise self.script.failure[1]
        return text

    @property
    def module(self):
        return self.imported.module

    def run(self, *args) -> tuple:
        if self.function is None:
            raise StageError("the kernel was not compiled to the end (--emit/--stop-after) or "
                             "the target cannot run here")
        return self.function(*(args or self.imported.args))

    def check(self, results: tuple | None = None) -> list[CheckReport]:
        """Every result against torch: the model's own, then the schedule's extras (their
        references in lighthouse.extras)."""
        results = results if results is not None else self.run()
        return [compare(name, got, want) for name, got, want in
                zip(self.result_names, results, self.expected())]

    def expected(self) -> list:
        """torch's value of every result (the model's, then the schedule's extras)."""
        from .extras import REFERENCES

        expected = list(self.imported.reference())
        for name in self.result_names[len(expected):]:
            if name not in REFERENCES:
                raise CheckFailed(f"{self.kernel.path}: the schedule's result {name!r} has no "
                                  f"torch reference to check it against")
            expected.append(REFERENCES[name](self.kernel.model, self.kernel.inputs))
        return expected


def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> CheckReport:
    if got.shape != want.shape:
        return CheckReport(name, float("inf"), float("inf"), False, want.dtype)
    if not want.is_floating_point():
        bad = (got != want).sum().item()
        return CheckReport(name, float(bad), float(bad), bad == 0, want.dtype)
    rtol, atol = TOLERANCES.get(want.dtype, (1e-4, 1e-4))
    g, w = got.double(), want.double()
    same_nan = torch.equal(torch.isnan(g), torch.isnan(w))
    finite = torch.isfinite(w) & torch.isfinite(g)
    same_inf = torch.equal(g[~finite & ~torch.isnan(w)], w[~finite & ~torch.isnan(w)])
    diff = (g - w).abs()[finite]
    scale = w.abs()[finite]
    max_abs = diff.max().item() if diff.numel() else 0.0
    max_rel = (diff / scale.clamp_min(1e-30)).max().item() if diff.numel() else 0.0
    size = max(1.0, scale.square().mean().sqrt().item()) if diff.numel() else 1.0
    within = bool((diff <= atol * size + rtol * scale).all()) if diff.numel() else True
    return CheckReport(name, max_abs, max_rel, same_nan and same_inf and within, want.dtype)


def compile_kernel(path, *, overrides=None, backward=False, target="cpu", threads=None,
                   schedule=None, strict=False, stop_after=None, dump_dir=None,
                   target_options=None, runtime_checks=False, schedule_file=None) -> Compiled:
    """Load, import and compile a kernel file; JIT it when the pipeline runs to the end.
    runtime_checks: bounds and shape checks in the kernel (see CpuTarget).
    schedule_file: a transform script (as --print-schedule prints it) applied instead of
    the family's own; its failure is an error, never a fallback."""
    start = time.perf_counter()
    target_obj = make_target(target, threads, runtime_checks=runtime_checks,
                             **(target_options or {}))
    kernel = load_kernel(path, overrides or {})
    try:
        schedule_options = parse_schedule_options(kernel.config)
    except UnsupportedError as exc:
        raise UnsupportedError(f"{kernel.path}: {exc}") from None
    target_obj = with_schedule_options(target_obj, schedule_options)
    if backward:
        importer = import_joint
    elif getattr(target_obj, "cpu", None) is not None:
        importer = functools.partial(import_forward, weights_as_arguments=WEIGHT_ARGUMENT_ELEMENTS)
    else:
        importer = import_forward
    return compile_payload(lambda: importer(kernel.model, kernel.inputs, name=str(kernel.path)),
                           name=str(kernel.path), target=target_obj,
                           schedule=schedule or kernel.config.get("schedule"), strict=strict,
                           stop_after=stop_after, dump_dir=dump_dir, schedule_file=schedule_file,
                           kernel=kernel, start=start)


def compile_payload(importer, *, name: str, target, schedule=None, strict=False, stop_after=None,
                    dump_dir=None, schedule_file=None, kernel: Kernel | None = None,
                    start: float | None = None) -> Compiled:
    """Compile the payload `importer()` imports (an Imported) with the family `schedule`
    names or the one that recognizes it, on `target` (a target object); JIT it when the
    pipeline runs to the end. A family whose stages fail falls back to the next one
    (fallback_family) with a note, the payload imported again, except under `strict` or
    with a `schedule_file`."""
    start = time.perf_counter() if start is None else start
    imported = importer()
    notes: list[str] = []
    target = on_one_thread_when_small(imported.module, target, notes)
    family = choose_family(imported.module, requested=schedule, strict=strict, notes=notes,
                           target=target)
    import_seconds = time.perf_counter() - start
    first_failure = None
    while True:
        try:
            return _lower(name, kernel, imported, family, target, notes, stop_after=stop_after,
                          dump_dir=dump_dir, import_seconds=import_seconds,
                          schedule_file=schedule_file)
        except StageError as exc:
            # A schedule that takes a payload must compile it: a failure is a compiler bug,
            # reported as a note while the next family compiles the payload (never under
            # --strict). The payload is imported again: the failed stages rewrote it.
            first_failure = first_failure or exc
            fallback = fallback_family(family)
            if strict or schedule_file or fallback is None or isinstance(exc, UnknownStage):
                raise first_failure
            notes.append(f"the {family.name} schedule failed on this payload ({exc}); "
                         f"using the {fallback.name} schedule")
            family = fallback
            imported = importer()
        except LighthouseError as exc:
            # the notes so far (a family that did not apply) go with the error
            error = first_failure if first_failure is not None else exc
            for note in notes:
                error.add_note(note)
            if first_failure is not None:  # the fallback cannot take it either: the cause
                raise first_failure from None
            raise


def _lower(name, kernel, imported, family, target_obj, notes, *, stop_after, dump_dir,
           import_seconds, schedule_file=None) -> Compiled:
    """Run the stages of `family` on the imported payload; JIT it when they all ran."""
    script = ScheduleScript(family, target_obj, Path(schedule_file) if schedule_file else None)
    pipeline = build_pipeline(family, target_obj, script)
    pipeline.check_stage(stop_after)
    result_specs = list(imported.result_specs)

    def after_stage(stage, module):
        # a schedule may add results (attention's log-sum-exp): read them from the signature
        # it leaves (the model's own keep their torch dtypes: bool is stored as i8 by then)
        if stage == "vectorize":
            scheduled = _tensor_result_specs(module, name)
            result_specs[len(imported.result_specs):] = scheduled[len(imported.result_specs):]

    pipeline.run(imported.module, stop_after=stop_after, dump_dir=dump_dir, on_stage=after_stage)
    pipeline.timings["import"] = import_seconds
    compiled = Compiled(kernel, imported, family, pipeline, target_obj, notes, script=script)
    extra = len(result_specs) - len(imported.result_names)
    named = list(family.extra_results(target_obj))
    compiled.result_names = imported.result_names + (
        named if len(named) == extra else [f"extra{i}" for i in range(max(0, extra))])
    # stopped after a stage, even the last: no JIT (the lowered IR of code the host cannot
    # run, AVX512-BF16 dot products on an AVX2 host, is still read)
    if stop_after is None and hasattr(target_obj, "jit"):
        jit_start = time.perf_counter()
        try:
            compiled.function = target_obj.jit(imported.module, imported.arg_specs, result_specs)
        except LighthouseError:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise StageError(f"the JIT failed: {first}") from exc
        pipeline.timings["jit"] = time.perf_counter() - jit_start
    return compiled


def _tensor_result_specs(module, name: str):
    from torch_mlir import ir

    from .ingress import _spec_of_type

    func = next(op for op in module.body.operations if op.operation.name == "func.func")
    fn_type = ir.TypeAttr(func.attributes["function_type"]).value
    return [_spec_of_type(t, name, f"result {i}") for i, t in enumerate(fn_type.results)]


def bench(compiled: Compiled, *, rounds: int = 10, threads: int | None = None) -> tuple[float, float]:
    """Median seconds per call: ours and torch eager, measured alternately in this process;
    with `threads` (ours compiled for that many), torch runs on as many."""
    from .runtime import time_alternately

    ours = compiled.function.bind(compiled.imported.args)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return time_alternately(ours, compiled.imported.reference, rounds=rounds)
    finally:
        torch.set_num_threads(before)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lighthouse.compile",
                                description="Compile a PyTorch kernel file with MLIR transform schedules.")
    p.add_argument("kernel", help="kernel file (Model, get_inputs, get_init_inputs)")
    p.add_argument("--target", default="cpu", choices=["cpu", "xegpu"])
    p.add_argument("--run", action="store_true", help="run the compiled kernel on get_inputs()")
    p.add_argument("--check", action="store_true", help="compare with torch; exit 1 on mismatch")
    p.add_argument("--bench", action="store_true",
                   help="median time of ours and of torch eager (on --threads threads each)")
    p.add_argument("--emit", metavar="STAGE", help="print the IR after STAGE and stop")
    p.add_argument("--stop-after", metavar="STAGE", help="stop after STAGE (no JIT)")
    p.add_argument("--dump-dir", metavar="DIR",
                   help="write every stage's IR (and a scheduled stage's script) to DIR")
    p.add_argument("--print-schedule", action="store_true",
                   help="print the complete transform script the compile would apply and exit")
    p.add_argument("--schedule-file", metavar="FILE",
                   help="apply this transform script (as --print-schedule prints it) instead "
                        "of the family's")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="override a module global of the kernel file (repeatable)")
    p.add_argument("--backward", action="store_true", help="compile the joint forward+backward graph")
    p.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    p.add_argument("--runtime-checks", action="store_true",
                   help="bounds/shape checks in the kernel: a bad access stops with the op and its location")
    p.add_argument("--schedule", help=f"force a schedule family ({', '.join(family_names())})")
    p.add_argument("--strict", action="store_true", help="a schedule that does not apply is an error")
    p.add_argument("--chip", help="xegpu: target chip (bmg or pvc)")
    p.add_argument("--report", action="store_true",
                   help="xegpu: per kernel the native code's GRF mode, instructions, spills, "
                        "DPAS, 2-D block IO and a static time estimate against the chip's peak")
    p.add_argument("-o", "--output", metavar="FILE", help="write the final (or --emit) IR or artifact")
    p.add_argument("-v", "--verbose", action="store_true", help="stage timings and tracebacks")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except LighthouseError as exc:
        if args.verbose:
            traceback.print_exc()
        for note in getattr(exc, "__notes__", ()):
            print(f"note: {note}", file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def _main(args) -> int:
    partial = ("--emit", args.emit) if args.emit else ("--stop-after", args.stop_after)
    if partial[1] and (args.run or args.check or args.bench):
        raise StageError(f"{partial[0]} {partial[1]} leaves nothing to run: --run, --check and "
                         "--bench need the whole compile")
    overrides = dict(parse_override(o) for o in args.overrides)
    stop_after = args.emit or args.stop_after
    if args.print_schedule:
        stop_after = "cleanup"
    target_options = {"chip": args.chip} if args.chip else None
    compiled = compile_kernel(args.kernel, overrides=overrides, backward=args.backward,
                              target=args.target, threads=args.threads, schedule=args.schedule,
                              strict=args.strict, stop_after=stop_after, dump_dir=args.dump_dir,
                              target_options=target_options, runtime_checks=args.runtime_checks,
                              schedule_file=args.schedule_file)
    for note in compiled.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.print_schedule:
        text = compiled.schedule_text()
        if args.output:
            Path(args.output).write_text(text)
        else:
            print(text)
        return 0
    if args.verbose:
        print(f"schedule: {compiled.family.name}", file=sys.stderr)
        for name, seconds in compiled.pipeline.timings.items():
            print(f"  {name:<12} {seconds * 1e3:9.1f} ms", file=sys.stderr)
    if args.emit:
        emitter = getattr(compiled.target, "emit_artifact", None)  # e.g. xegpu: binary -> .spv
        if emitter is not None and emitter(compiled, args.emit, Path(args.output) if args.output else None):
            return 0
        text = str(compiled.module)
        if args.output:
            Path(args.output).write_text(text)
        else:
            print(text)
        return 0
    if args.report:
        reporter = getattr(compiled.target, "report", None)
        if reporter is None:
            raise UnsupportedError(f"--report needs --target xegpu (the {args.target} target "
                                   "has no native machine code to report)")
        print(reporter())
    if args.output:
        _write_artifact(compiled, Path(args.output))
    if args.run or args.check or args.bench:
        if compiled.function is None:
            raise StageError(f"target {args.target} cannot run kernels on this machine")
        results = compiled.run()
        if args.run:
            for name, t in zip(compiled.result_names or compiled.imported.result_names, results):
                print(f"{name}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        if args.check:
            reports = compiled.check(results)
            for r in reports:
                print(f"check {r}")
            if not all(r.ok for r in reports):
                raise CheckFailed(f"{compiled.kernel.path}: result differs from torch")
            print("check passed")
        if args.bench:
            ours, theirs = bench(compiled, threads=args.threads)
            print(f"bench {compiled.kernel.name}: ours {ours * 1e3:.3f} ms, torch {theirs * 1e3:.3f} ms, "
                  f"speedup {theirs / ours:.2f}x")
    return 0


def _write_artifact(compiled: Compiled, path: Path) -> None:
    writer = getattr(compiled.target, "write_artifact", None)
    if writer is not None:
        writer(compiled, path)
        return
    if path.suffix == ".o" and compiled.function is not None:
        compiled.function.engine.dump_to_object_file(str(path))
    else:
        path.write_text(str(compiled.module))


if __name__ == "__main__":
    sys.exit(main())
