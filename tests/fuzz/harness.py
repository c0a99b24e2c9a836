"""Running one fuzz case and judging it.

`check_kernel(family, source, backward)` writes the kernel file, compiles, runs and checks it
in a child process (`isolate.run_isolated`: a fork server with torch, torch-mlir and
lighthouse preloaded) with a timeout, and raises `FuzzFailure` when the case fails:
  - a result differs from torch by the `--check` rule (forward, or with backward=True),
    unless the kernel has f16/bf16 tensors and every result of ours is as right as torch's,
    judged against the exact (float64) result (`child._matches_exact_results`);
  - the child crashed (a signal, an abort from a runtime check) or ran past the timeout;
  - the compiler raised a Python exception, or a LighthouseError that is not an honest
    refusal (`child.honest_refusal`: an op torch-mlir truly cannot lower; a StageError never
    is one), or torch rejected the drawn inputs (a bug of the strategy, not of lighthouse);
  - a note says a specialized schedule failed on the payload and the driver fell back.
Each failure has a signature (its class: kind, family, stage, the message with numbers
dropped); each signature raises its own FuzzFailure subclass, so hypothesis shrinks every
distinct bug separately, and writes its (last, i.e. smallest) kernel to
tests/fuzz/failures/<family>_<hash of the signature>.py with a header giving the command
that reproduces it and the error. On hypothesis' final replay of a failure, a mismatch or
a crash is also run under `--schedule generic` and `--schedule loops`, to say whose fault
it is. Under FUZZ_SURVEY=1 (`fuzz_test`) failures do not stop the test: every case runs and
the smallest kernel of each signature is kept, unshrunk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hypothesis import event

from tests.conftest import ROOT

FUZZ_DIR = Path(__file__).resolve().parent
FAILURES = Path(os.environ.get("FUZZ_FAILURES", FUZZ_DIR / "failures"))
TIMEOUT = float(os.environ.get("FUZZ_TIMEOUT", "90"))
LOG = os.environ.get("FUZZ_LOG")  # a JSON line per case when set
SURVEY = os.environ.get("FUZZ_SURVEY") == "1"
_SURVEYED: dict[str, dict[str, tuple[int, int, Path]]] = {}  # family: signature: (cases, size, file)
FALLBACK_CRASH = "failed on this payload"  # the driver's note when a schedule crashed


class FuzzFailure(AssertionError):
    """A fuzz case failed; subclasses, one per signature, tell hypothesis apart the bugs."""


_FAILURE_TYPES: dict[str, type] = {}


def failure_type(signature: str) -> type:
    if signature not in _FAILURE_TYPES:
        digest = hashlib.sha1(signature.encode()).hexdigest()[:10]
        _FAILURE_TYPES[signature] = type(f"FuzzFailure_{digest}", (FuzzFailure,),
                                         {"signature": signature})
    return _FAILURE_TYPES[signature]


@dataclass
class Verdict:
    ok: bool
    signature: str = ""
    detail: str = ""
    family: str = "?"
    events: tuple[str, ...] = ()
    cpu_seconds: float | None = None  # the child's CPU time, when it returned


def _scratch() -> Path:
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = Path(tempfile.mkdtemp(prefix="lighthouse-fuzz-"))
    return _SCRATCH


_SCRATCH: Path | None = None


def _is_final() -> bool:
    from hypothesis.control import current_build_context

    try:
        return current_build_context().is_final
    except Exception:  # outside a hypothesis test
        return True


def run(source: str, backward: bool, name: str, schedule: str | None = None) -> tuple[Verdict, str]:
    """Compile, run and check one kernel in a child; returns the verdict and the child's log."""
    from lighthouse.benchmarks.isolate import run_isolated

    from .child import run_case

    path = _scratch() / f"{name}.py"
    path.write_text(source)
    log_path = _scratch() / f"{name}.log"
    log_path.write_text("")
    outcome = run_isolated(run_case, str(path), backward, str(log_path), schedule, timeout=TIMEOUT)
    log = log_path.read_text(errors="replace")
    verdict = judge(outcome, log, str(path), backward)
    path.unlink()
    log_path.unlink()
    if outcome.status == "ok":
        verdict.cpu_seconds = outcome.value.get("cpu_seconds")
    return verdict, log


def check_kernel(family: str, source: str, backward: bool) -> None:
    """The fuzz case: raises a FuzzFailure subclass (see the module docstring) on failure."""
    digest = hashlib.sha1(f"{source}\n{backward}".encode()).hexdigest()[:12]
    start = time.perf_counter()
    verdict, _ = run(source, backward, f"{family}_{digest}")
    seconds = time.perf_counter() - start
    event(f"schedule: {verdict.family}")
    for what in verdict.events:
        event(what)
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"family": family, "backward": backward, "case": digest,
                                "schedule": verdict.family, "ok": verdict.ok,
                                "signature": verdict.signature, "seconds": round(seconds, 2),
                                "cpu_seconds": verdict.cpu_seconds,
                                "events": list(verdict.events)}) + "\n")
    if verdict.ok:
        return
    if SURVEY:
        found = _SURVEYED.setdefault(family, {})
        count, size, written = found.get(verdict.signature, (0, None, None))
        if size is None or len(source) < size:
            written = record_failure(family, source, backward, verdict,
                                     _triage(source, backward, f"{family}_{digest}", verdict))
            size = len(source)
        found[verdict.signature] = (count + 1, size, written)
        return
    triage = _triage(source, backward, f"{family}_{digest}", verdict) if _is_final() else []
    written = record_failure(family, source, backward, verdict, triage)
    raise failure_type(verdict.signature)(
        f"{verdict.signature}\n{verdict.detail}\n" + "".join(f"{t}\n" for t in triage) +
        f"kernel file: {written.relative_to(ROOT) if written.is_relative_to(ROOT) else written}")


def _triage(source: str, backward: bool, name: str, verdict: Verdict) -> list[str]:
    """For a mismatch, a crash or a timeout: what the generic and loops schedules give."""
    if verdict.signature.split("/")[0] not in ("mismatch", "crash", "timeout", "runtime-check"):
        return []
    lines = []
    for schedule in ("generic", "loops"):
        other, _ = run(source, backward, f"{name}_{schedule}", schedule)
        lines.append(f"--schedule {schedule}: " +
                     ("check passed" if other.ok else f"{other.signature}: {other.detail}"))
    return lines


def fuzz_test(family: str, *, examples: dict | None = None):
    """Decorates a family's @given test with its settings (`examples`: the cases per profile,
    when not the default); under FUZZ_SURVEY=1 the test runs every case (a failure does not
    stop it, nothing is shrunk), keeps the smallest kernel of each failure signature, and
    fails at the end listing them."""
    from .profiles import fuzz_settings

    def decorate(test):
        test = fuzz_settings(family, examples)(test)
        if not SURVEY:
            return test

        def survey():
            test()
            found = _SURVEYED.get(family, {})
            if found:
                raise FuzzFailure(f"{sum(c for c, _, _ in found.values())} failing {family} cases, "
                                  f"{len(found)} signatures:\n" + "\n".join(
                                      f"  {count:4d}  {signature}  ({path})"
                                      for signature, (count, _, path) in sorted(found.items())))

        survey.__name__ = survey.__qualname__ = test.__name__
        survey.__doc__ = test.__doc__
        return survey

    return decorate


def reproduce_command(path: Path, backward: bool) -> str:
    from .child import compile_options

    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    if os.environ.get("FUZZ_ROUTE") == "torch.compile":
        return (f"PYTHONPATH=. python -c \"from tests.fuzz.child import _run_case_compiled as r; "
                f"print(r('{shown}', {backward}, '/dev/stdout'))\"")
    flags = " --backward" if backward else ""
    if compile_options().get("runtime_checks"):
        flags += " --runtime-checks"
    return f"PYTHONPATH=. python -m lighthouse.compile {shown} --check{flags}"


def record_failure(family: str, source: str, backward: bool, verdict: Verdict,
                   triage: list[str]) -> Path:
    FAILURES.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(verdict.signature.encode()).hexdigest()[:10]
    path = FAILURES / f"{family}_{digest}.py"
    header = [f"# lighthouse fuzz failure, family {family} ({'forward+backward' if backward else 'forward'})",
              f"# reproduce: {reproduce_command(path, backward)}",
              f"# signature: {verdict.signature}"]
    header += [f"# {line}" for text in [verdict.detail, *triage] for line in text.splitlines()]
    path.write_text("\n".join(header) + "\n" + source)
    return path


# -- judging an outcome --------------------------------------------------------------------

def _normalize(text: str, kernel_path: str) -> str:
    text = text.replace(kernel_path, "KERNEL")
    text = re.sub(r"/\S*/lighthouse-fuzz-\w+/\S+\.py", "KERNEL", text)
    text = re.sub(r"loc\([^)]*\)", "loc", text)
    text = re.sub(r"%[\w#]+", "%v", text)
    text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text[:110]


def _log_facts(log: str) -> tuple[str, str, list[str]]:
    """(last phase reached, family chosen, the log lines after the last marker)."""
    phase, family, tail = "start", "?", []
    for line in log.splitlines():
        if line.startswith("@@ phase "):
            phase, tail = line.split()[-1], []
        elif line.startswith("@@ family "):
            family = line.split()[-1]
        elif line.strip():
            tail.append(line.rstrip())
    return phase, family, tail


def _runtime_check(tail: list[str]) -> str | None:
    """'<op name>: <reason>' of an MLIR runtime-verification failure in the log, if any:
        ERROR: Runtime op verification failed
        %5 = vector.load %arg0[%c0, %4] : memref<...>, vector<16xf32>
        ^ out-of-bounds access
        Location: loc(...)"""
    at = next((i for i, ln in enumerate(tail) if "Runtime op verification failed" in ln), None)
    if at is None:
        return None
    op_line = tail[at + 1] if at + 1 < len(tail) else ""
    found = re.search(r"^\s*(?:%\S+(?:, %\S+)* = )?\"?([a-z_]+\.[a-z_.]+)", op_line)
    reason = next((ln.strip().lstrip("^").strip() for ln in tail[at:] if ln.strip().startswith("^")), "")
    return f"{found.group(1) if found else '?'}: {reason}"


_FAULTHANDLER = re.compile(r"^(Fatal Python error|Current thread|Thread 0x|Stack \(most recent|"
                          r"Extension modules:|  File |\s*\(total: \d+\))")


def _crash_text(tail: list[str]) -> str:
    """What the dying child printed (an LLVM error, a runtime check), then the innermost
    three Python frames of faulthandler's traceback."""
    said = [ln for ln in tail if not _FAULTHANDLER.match(ln)]
    frames = [ln.strip() for ln in tail if ln.startswith("  File ")][:3]
    return "\n".join([ln[:300] for ln in said[-12:]] + frames)


def judge(outcome, log: str, kernel_path: str, backward: bool) -> Verdict:
    direction = "backward" if backward else "forward"
    phase, family, tail = _log_facts(log)
    shown_tail = _crash_text(tail)
    if outcome.status == "timeout":
        return Verdict(False, f"timeout/{family}/{phase}", f"{outcome.error} (in phase {phase})",
                       family)
    if outcome.status == "crashed":
        check = _runtime_check(tail)
        if check is not None:
            return Verdict(False, f"runtime-check/{family}/{_normalize(check, kernel_path)}",
                           f"{outcome.error}\n{shown_tail}", family)
        signal = outcome.error.split(":")[0].replace("killed by ", "")
        said = [ln for ln in tail if not _FAULTHANDLER.match(ln) and ln.strip()]
        if said and re.match(r"(LLVM ERROR|Assertion|terminate called)", said[-1]):
            signal += f"/{_normalize(said[-1], kernel_path)}"
        frames = re.findall(r'^  File ".*?([^/]+)\.py", line \d+ in (\w+)', "\n".join(tail), re.M)
        if frames:  # where in Python the child died: the innermost two frames
            signal += " in " + " < ".join(f"{mod}.{fn}" for mod, fn in frames[:2])
        return Verdict(False, f"crash/{family}/{phase}/{signal}",
                       f"{outcome.error} (in phase {phase})\n{shown_tail}", family)
    if outcome.status == "raised":
        return Verdict(False, f"harness/{_normalize(outcome.error, kernel_path)}", outcome.error)
    r = outcome.value
    family = r.get("family", family)
    if r["status"] == "error":
        message = r["message"]
        if "torch rejects the example inputs" in message:
            return Verdict(False, f"invalid-case/{_normalize(message, kernel_path)}", message, family)
        if r.get("honest"):
            return Verdict(True, family=family, events=(f"refused: {_normalize(message, kernel_path)}",))
        return Verdict(False, f"{r['type']}/{r['phase']}/{_normalize(message, kernel_path)}",
                       message, family)
    if r["status"] == "exception":
        return Verdict(False, f"exception/{r['phase']}/{r['type']}/{r['where']}",
                       f"{r['type']}: {r['message']} (at {r['where']})\n{r['traceback'][-1500:]}",
                       family)
    notes = r.get("notes", [])
    events = tuple(f"note: {_normalize(n, kernel_path)}" for n in notes)
    crashed = [n for n in notes if FALLBACK_CRASH in n]
    if crashed:
        return Verdict(False, f"fallback/{_normalize(crashed[0], kernel_path)}",
                       "\n".join(crashed), family, events)
    if r["status"] == "mismatch" and r.get("exact_agrees"):
        return Verdict(True, family=family, events=events + (
            "torch's eager result is off; ours is as close to the exact (float64) one",))
    if r["status"] == "mismatch":
        kinds = sorted({m["kind"] for m in r["mismatches"]})
        if r.get("offset_only"):  # right on the same values at storage offset 0
            kinds = ["input-storage-offset"]
        return Verdict(False, f"mismatch/{family}/{direction}/{'+'.join(kinds)}",
                       "\n".join(r["reports"]), family, events)
    return Verdict(True, family=family, events=events)
