"""python -m lighthouse.bench: compile, check and time every kernel against torch (kernel_bench).

    python -m lighthouse.bench [--quick] [--only NAME...] [--csv F] [--json F] [--plot F.png]
    python -m lighthouse.bench --no-inductor                 # against torch eager only
    python -m lighthouse.bench KERNEL.py ...                 # your kernel files instead
    python -m lighthouse.bench --kernelbench DIR --level 1 --problems 23,24,40 --set batch_size=16
    python -m lighthouse.bench --kernelbench DIR --max-elements 4000000   # a whole level, shrunk
    python -m lighthouse.bench --kernelbench DIR --level 2 --threads 1    # one thread each side

The default suite (`benchmarks.suite`) holds the examples at realistic sizes for this
machine; `--quick` runs the same kinds at small sizes. Per kernel, in fresh child processes
(`benchmarks.isolate`, each with --timeout):
  1. compile time, check against torch (max abs error, PASS/FAIL), median time of ours, of
     torch eager and of torch.compile (inductor) of the same reference, measured in rotation
     after warm-up (inductor's compile excluded), the ratios, FLOPs and bytes
     (`benchmarks.measure`). torch.compile is on unless --no-inductor, off with --quick
     unless --inductor; a kernel it cannot take gets a note and no inductor figure;
  2. peak memory of one call of ours, then of torch, each in its own process.
At the start, the machine's FMA peak and streaming-read bandwidth are measured
(`benchmarks.limits`); each kernel's rate (GFLOP/s when compute-bound, else GB/s) is shown
as a fraction of the limit that bounds it.
A --kernelbench run ends with KernelBench's fast_p (the share of the problems that are
correct and faster than p x the baseline) for p = 0, 1, 1.5 against torch eager and
torch.compile, and the median ratios. --threads N runs ours and torch on N threads each.
The exit status is 1 when a kernel FAILs its check or hits an ERROR (compile error, crash),
2 for bad arguments, else 0 (TIMEOUT and UNSUPPORTED rows are reported, not failures).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from pathlib import Path

from .errors import KernelFileError, LighthouseError
from .kernel import parse_override


LIMITS_TIMEOUT = 300.0  # seconds for the machine-limit micro-kernels (a few seconds normally)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lighthouse.bench",
                                description="Compile, check and time kernels against torch eager.")
    p.add_argument("kernels", nargs="*", metavar="KERNEL.py",
                   help="kernel files to run instead of the default suite")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and short timing (under a minute for the suite)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run these kernels (names or globs)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="override a module global in every kernel file that defines it")
    p.add_argument("--kernelbench", metavar="DIR", help="run KernelBench problem files from DIR")
    p.add_argument("--level", type=int, default=1, help="KernelBench level (default 1)")
    p.add_argument("--problems", metavar="N,N,...", help="KernelBench problem numbers (default all)")
    p.add_argument("--max-elements", type=int, metavar="N",
                   help="halve each kernel's size globals until its inputs hold at most N "
                        "elements (the sizes used are shown per row)")
    p.add_argument("--inductor", action=argparse.BooleanOptionalAction,
                   help="also time torch.compile (inductor) of each kernel's torch reference "
                        "(default: on, off with --quick)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="threads of ours and of torch (default: all cores)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="per child process (default 900, 120 with --quick)")
    p.add_argument("--csv", metavar="FILE", help="write the rows as CSV")
    p.add_argument("--json", metavar="FILE", help="write machine, settings and rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of speedups and peak memory")
    p.add_argument("--target", choices=["cpu", "xegpu"], default="cpu",
                   help="xegpu: no GPU runs here; each kernel is compiled to machine code by "
                        "ocloc and estimated statically against the chip's peak")
    p.add_argument("--chip", action="append", choices=["bmg", "pvc"],
                   help="xegpu: the chips to compile for (repeatable; default both)")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except LighthouseError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def choose_cases(args):
    from .benchmarks import suite

    if args.kernelbench and args.kernels:
        raise KernelFileError("give kernel files or --kernelbench DIR, not both")
    if args.problems and not args.kernelbench:
        raise KernelFileError("--problems needs --kernelbench DIR")
    if args.kernelbench:
        problems = None
        if args.problems:
            try:
                problems = [int(p) for p in args.problems.split(",") if p.strip()]
            except ValueError:
                raise KernelFileError(f"--problems expects numbers like 23,24,40, got {args.problems!r}")
        cases = suite.kernelbench_cases(args.kernelbench, args.level, problems)
    elif args.kernels:
        cases = suite.file_cases(args.kernels)
    else:
        cases = suite.quick_suite() if args.quick else suite.default_suite()
    cases = suite.apply_threads(suite.select(cases, args.only), args.threads)
    overrides = dict(parse_override(o) for o in args.overrides)
    cases = suite.apply_overrides(cases, overrides)
    if args.max_elements is not None:
        cases = suite.fit_to_elements(cases, args.max_elements, set(overrides))
    return cases


def run(args) -> int:
    if args.target == "xegpu":
        return run_xegpu(args)
    from .benchmarks import report
    from .benchmarks.isolate import run_isolated
    from .benchmarks.limits import measure_limits

    cases = choose_cases(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise LighthouseError("--plot needs matplotlib: pip install -e '.[bench]'") from None
    for out in (args.csv, args.json, args.plot):
        if out and not Path(out).resolve().parent.is_dir():
            raise KernelFileError(f"{out}: the folder does not exist")
    settings = bench_settings(args)
    started = time.perf_counter()
    load_start = _load()
    print(f"lighthouse.bench: {len(cases)} kernel{'s' * (len(cases) != 1)}"
          f"{' (quick)' if args.quick else ''}"
          f"{', with torch.compile (inductor)' if settings['inductor'] else ''}; "
          f"measuring this machine's limits ...", file=sys.stderr, flush=True)
    outcome = run_isolated(measure_limits, args.quick, args.threads, timeout=LIMITS_TIMEOUT)
    limits = outcome.value if outcome.status == "ok" else None
    machine = _machine(limits, load_start)
    print(f"load average {machine['load_start']:.2f} on {machine['cores']} cores at the start"
          f"{' (other processes are running: timings are noisy)' if _busy(machine) else ''}")
    if limits is not None:
        print(limits.describe())
    else:
        print(f"machine limits not measured ({outcome.status}: {outcome.error}); "
              f"fractions of the limits are left out")
    sys.stdout.flush()

    rows = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.name} ({case.sizes or 'file sizes'}"
              f"{', backward' if case.backward else ''}) ...", end="", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        row = bench_case(case, settings, limits)
        rows.append(row)
        print(f" {_progress(row)} [{time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
        _write_files(args, rows, machine, settings, plot=False)

    print()
    print(report.table(rows, sizes=args.max_elements is not None, inductor=settings["inductor"]))
    notes = report.footnotes(rows)
    if notes:
        print()
        print(notes)
    print()
    machine["load_end"] = _load()
    print(f"{report.summary(rows)} in {time.perf_counter() - started:.0f} s "
          f"(load average {machine['load_end']:.2f} at the end)")
    if args.kernelbench:
        print(report.fast_p(rows, inductor=settings["inductor"]))
    _write_files(args, rows, machine, settings, plot=True)
    failing = [r.name for r in rows if r.status in report.FAILING]
    if failing:
        print(f"failing: {', '.join(failing)}", file=sys.stderr)
        return 1
    return 0


def run_xegpu(args) -> int:
    """The static XeGPU table (lighthouse/benchmarks/xegpu.py): every case compiled through
    the native stage for each chip, each in a child process; an error is a row of its own
    and makes the exit status 1."""
    import json

    from .benchmarks import xegpu
    from .benchmarks.isolate import run_isolated
    from .benchmarks.suite import apply_overrides, file_cases, select

    if args.kernelbench:
        raise KernelFileError("--target xegpu runs the XeGPU suite or kernel files, not --kernelbench")
    if args.kernels:
        cases = file_cases(args.kernels)
    else:
        cases = xegpu.quick_xegpu_suite() if args.quick else xegpu.xegpu_suite()
    cases = apply_overrides(select(cases, args.only),
                            dict(parse_override(o) for o in args.overrides))
    chips = args.chip or ["bmg", "pvc"]
    timeout = args.timeout or (120.0 if args.quick else 900.0)
    rows, failed = [], []
    for case in cases:
        for chip in chips:
            print(f"{case.name} on {chip} ...", end="", file=sys.stderr, flush=True)
            outcome = run_isolated(xegpu.native_rows, case, chip, timeout=timeout)
            if outcome.status == "ok":
                rows += outcome.value
                print(" ok", file=sys.stderr, flush=True)
            else:
                failed.append(f"{case.name} on {chip}: {outcome.status}: {outcome.error}")
                rows.append((case.name, chip, "-", outcome.status.upper()) + ("-",) * 9)
                print(f" {outcome.status}", file=sys.stderr, flush=True)
    print(xegpu.table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"columns": list(xegpu.COLUMNS), "rows": [list(r) for r in rows]}, indent=2))
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    return 1 if failed else 0


def bench_settings(args) -> dict:
    """The run's settings (in the JSON): the default timeout and timing budget of a full or a
    --quick run, and whether torch.compile is timed."""
    return {"quick": args.quick, "timeout_s": args.timeout or (120.0 if args.quick else 900.0),
            "max_elements": args.max_elements, "threads": args.threads,
            "timing_budget_s": 1.0 if args.quick else 10.0,
            "timing_rounds": 5 if args.quick else 10,
            "inductor": not args.quick if args.inductor is None else args.inductor}


def bench_case(case, settings: dict, limits):
    """One row: measure in a child, then peak memory of each side in its own child. When the
    measuring child crashes with torch.compile, the row is measured again without it."""
    from .benchmarks import report
    from .benchmarks.isolate import run_isolated
    from .benchmarks.measure import measure, peak_memory

    timeout = settings["timeout_s"]

    def measured(inductor: bool):
        return run_isolated(measure, case, budget_seconds=settings["timing_budget_s"],
                            rounds=settings["timing_rounds"], inductor=inductor, timeout=timeout)

    outcome = measured(settings["inductor"])
    crash = ""
    if outcome.status == "crashed" and settings["inductor"]:
        crash, outcome = outcome.error, measured(False)
    if outcome.status == "timeout":
        return report.make_row(case, "TIMEOUT", f"compile, check and timing: {outcome.error}")
    if outcome.status != "ok":
        return report.make_row(case, "ERROR", outcome.error)
    m = outcome.value
    if m["status"] not in ("PASS", "FAIL"):
        return report.make_row(case, m["status"], m["reason"])
    row = report.make_row(case, m["status"], m["reason"])
    report.fill_measurement(row, m, limits)
    if crash:
        row.notes.append(f"torch.compile (inductor) not timed: the process crashed with it "
                         f"({crash})")
    for side in ("ours", "torch"):
        mem = run_isolated(peak_memory, case, side, timeout=timeout)
        if mem.status == "ok" and "peak_bytes" in mem.value:
            setattr(row, f"{side}_peak_mb", mem.value["peak_bytes"] / 2**20)
        else:
            why = mem.error if mem.status != "ok" else mem.value.get("reason", "")
            row.notes.append(f"peak memory of {side} not measured ({mem.status}: {why})")
    return row


def _progress(row) -> str:
    if row.ours_ms is None:
        return f"{row.status}: {row.reason[:120]}"
    mem = ""
    if row.ours_peak_mb is not None and row.torch_peak_mb is not None:
        mem = f", peak {row.ours_peak_mb:.1f} MB vs {row.torch_peak_mb:.1f} MB"
    inductor = ""
    if row.inductor_ms is not None:
        inductor = f", inductor {row.inductor_ms:.3g} ms, {row.vs_inductor:.2f}x"
    return (f"{row.status} ({row.schedule}, compile {row.compile_s:.1f} s): ours {row.ours_ms:.3g} ms, "
            f"torch {row.torch_ms:.3g} ms, {row.speedup:.2f}x{inductor}{mem}")


def _machine(limits, load_start: float) -> dict:
    import torch

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "limits": limits.to_dict() if limits else None, "load_start": load_start}


def _load() -> float:
    """The 1-minute load average: other processes compete with the timed ones above ~0.5."""
    return os.getloadavg()[0]


def _busy(machine) -> bool:
    return machine["load_start"] > 0.5


def _write_files(args, rows, machine, settings, *, plot: bool) -> None:
    from .benchmarks import report

    if args.csv:
        report.write_csv(rows, args.csv)
    if args.json:
        report.write_json(rows, args.json, machine=machine, settings=settings)
    if plot and args.plot:
        limits = machine["limits"]
        title = "lighthouse vs torch eager" + (" and torch.compile (inductor)"
                                               if settings["inductor"] else "")
        if limits:
            title += (f"\n{machine['cpu']}, {limits['threads']} threads; FMA peak "
                      f"{limits['fma_gflops']:.0f} GFLOP/s, streaming read "
                      f"{limits['bandwidth_gbs']:.1f} GB/s")
        report.write_plot(rows, args.plot, title=title)


if __name__ == "__main__":
    sys.exit(main())
