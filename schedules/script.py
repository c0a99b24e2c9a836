"""A compile's schedule as one transform script.

The script is a module `attributes {transform.with_named_sequence}` holding one
`transform.named_sequence @<stage>(%root: !transform.any_op {transform.consumed})` per
schedule stage (`fuse`, `vectorize`, ...), applied by the pipeline to the payload module when
that stage runs. A stage may call named steps of the schedule (`transform.include @step`):
`@step(%root {transform.consumed}) -> !transform.any_op` returns the handle to the payload root
the next step starts from, so a stage reads as its algorithm, one step per line. A family builds it with `build_script` by a pure function of the target
description and its frozen parameters; `--print-schedule` prints it and `--schedule-file`
parses an edited copy back (`parse_script`), so a printed script replays to the same IR.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Sequence

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import interpreter

import transform_ext
from transform_ext.common import failure_reason

StageBody = Callable[[ir.Value], None]
StepBody = Callable[[ir.Value], ir.Value]


class ScriptError(ValueError):
    """A schedule script that cannot be read or lacks a stage."""


class IncompleteScript(Exception):
    """A script built only up to the stage before `stage`: planning `stage` on the trial
    raised `error`, which is the compile's failure when that stage runs (so the stages
    before it run and dump as they would)."""

    def __init__(self, script: ir.Module, stage: str, error: Exception):
        super().__init__(str(error))
        self.script, self.stage, self.error = script, stage, error


def build_script(stages: Sequence[tuple[str, StageBody]],
                 steps: Sequence[tuple[str, StepBody]] = ()) -> ir.Module:
    """A script with one named sequence per (stage name, body); `body(root)` emits the
    stage's transform ops at the current insertion point. `steps` are the named steps the
    stages call with `include_step` (defined first, in the order given); a step's body
    returns the root handle it leaves. Needs an active context."""
    module = ir.Module.create()
    module.operation.attributes["transform.with_named_sequence"] = ir.UnitAttr.get()
    any_op = transform.AnyOpType.get()
    for name, body in steps:
        with ir.InsertionPoint(module.body):
            seq = transform.NamedSequenceOp(
                name, [any_op], [any_op], arg_attrs=[{"transform.consumed": ir.UnitAttr.get()}])
        with ir.InsertionPoint(seq.body):
            transform.YieldOp([body(seq.bodyTarget)])
    for name, body in stages:
        with ir.InsertionPoint(module.body):
            seq = transform.NamedSequenceOp(
                name, [any_op], [], arg_attrs=[{"transform.consumed": ir.UnitAttr.get()}])
        with ir.InsertionPoint(seq.body):
            body(seq.bodyTarget)
            transform.YieldOp()
    return module


class StepRecorder:
    """A stage's named steps, recorded while each runs on `trial` (a copy of the payload):
    the Python that builds a step may read the copy as the previous steps left it, so the
    script holds what was decided there as plain attributes. `step` names repeat with a
    numeric suffix, and so do names in `reserved` (the sequences of another part of the
    script)."""

    def __init__(self, trial: ir.Module, reserved: Sequence[str] = ()):
        self.trial = trial
        self.steps: list[tuple[str, StepBody]] = []
        self.reserved = frozenset(reserved)

    def step(self, name: str, body: Callable[[ir.Value], object]) -> None:
        """Record `body` (emitting at the current insertion point; returning the root or
        None, when it leaves the root handle valid) and apply it to the trial."""
        taken = {n for n, _ in self.steps} | self.reserved
        unique, i = name, 1
        while unique in taken:
            unique, i = f"{name}_{i}", i + 1

        def step_body(root: ir.Value) -> ir.Value:
            after = body(root)
            return root if after is None else after

        from .common import run_schedule

        run_schedule(self.trial, step_body)
        self.steps.append((unique, step_body))

    def stage(self, after: Callable[[ir.Value], None] | None = None) -> StageBody:
        """A stage body including the recorded steps in order, then `after(root)`."""
        names = [n for n, _ in self.steps]

        def body(root: ir.Value) -> None:
            for name in names:
                root = include_step(name, root)
            if after is not None:
                after(root)

        return body


def recorded_script(steps: Sequence[tuple[str, StepBody]], vectorize: StageBody) -> ir.Module:
    """@fuse, the recorded `steps` included in order, and @vectorize: the script of a plan
    recorded on a trial (StepRecorder). Needs an active context and location."""
    names = [name for name, _ in steps]

    def fuse(root: ir.Value) -> None:
        for name in names:
            root = include_step(name, root)

    return build_script([("fuse", fuse), ("vectorize", vectorize)], list(steps))


def include_step(name: str, root: ir.Value) -> ir.Value:
    """`transform.include @name` of a step on `root` (consumed); returns the step's root."""
    any_op = transform.AnyOpType.get()
    return transform.IncludeOp([any_op], name, transform.FailurePropagationMode.Propagate,
                               [root]).results[0]


def _sequences(script: ir.Module) -> dict[str, ir.Operation]:
    found = {}
    for op in script.body.operations:
        if op.operation.name == "transform.named_sequence":
            found[ir.StringAttr(op.operation.attributes["sym_name"]).value] = op.operation
    return found


def stage_text(script: ir.Module, name: str) -> str:
    """The named sequence of one stage, as printed in the script, after the steps it
    includes (directly or through other steps)."""
    sequences = _sequences(script)
    order: list[str] = []

    def visit(seq_name: str) -> None:
        def callee(op):
            if op.name == "transform.include":
                target = ir.FlatSymbolRefAttr(op.attributes["target"]).value
                if target in sequences and target not in order:
                    visit(target)
                    order.append(target)
            return ir.WalkResult.ADVANCE

        sequences[seq_name].walk(callee)

    _sequence(script, name)  # a ScriptError naming the sequences when there is no @name
    visit(name)
    # local scope: each sequence printed alone (isolated from above, so numbered the same),
    # not from the whole script once per sequence (quadratic in a long recorded script)
    return "\n".join(sequences[n].get_asm(use_local_scope=True) for n in order + [name])


def _sequence(script: ir.Module, name: str) -> ir.Operation:
    sequences = _sequences(script)
    if name not in sequences:
        raise ScriptError(f"the schedule script has no named sequence @{name} (it has: "
                          f"{', '.join('@' + n for n in sequences) or 'none'})")
    return sequences[name]


def apply_stage(payload: ir.Module, script: ir.Module, name: str) -> None:
    """Apply the script's sequence `@name` to the payload module; on failure ScriptError
    naming the failing transform op, its location in the script and the reason."""
    sequence = _sequence(script, name)
    try:
        interpreter.apply_named_sequence(payload.operation, sequence, script)
    except Exception as exc:
        raise ScriptError(describe_failure(script, str(exc))) from exc


def describe_failure(script: ir.Module, message: str) -> str:
    """'file:line:col: <transform op> failed: <reason>' from the interpreter's message
    ('Diagnostic message at loc(...): reason ...'): the op is the first script op whose
    location the message names (a Python-defined op reports at the payload op it refused,
    and names its own location after the reason)."""
    marker = "Diagnostic message at "
    line = next((l for l in message.splitlines() if l.startswith(marker)), None)
    if line is None:
        return (message.strip().splitlines() or ["the schedule failed"])[0]
    ops_at: dict[str, str] = {}

    def visit(op):
        ops_at.setdefault(str(op.location), op.name)
        return ir.WalkResult.ADVANCE

    script.operation.walk(visit)
    locations = re.findall(r'loc\("[^"]*":\d+:\d+\)', line)
    loc = next((l for l in locations if l in ops_at), None)
    what = ops_at.get(loc, "a transform op")
    where = _location(loc) if loc else "the schedule"
    reason = failure_reason(line)
    if reason.startswith(what + ": "):
        reason = reason[len(what) + 2:]
    return f"{where}: {what} failed: {reason}"


def parse_script(path: str | Path, context: ir.Context) -> ir.Module:
    """The script in `path`, parsed in the payload's context (transform_ext loaded) and
    verified; ScriptError with the parser's first message otherwise."""
    path = Path(path)
    try:
        path.read_text()
    except OSError as exc:
        raise ScriptError(f"{path}: cannot read the schedule file ({exc.strerror})") from None
    transform_ext.load(context)
    errors: list[str] = []

    def collect(diagnostic):  # before any handler of the caller's (they may swallow them)
        if diagnostic.severity == ir.DiagnosticSeverity.ERROR:
            errors.append(f"{_location(diagnostic.location)}: {diagnostic.message}")
        return True

    handler = context.attach_diagnostic_handler(collect)
    try:
        with context:
            script = ir.Module.parseFile(str(path))
    except Exception as exc:  # MLIRError
        first = errors[0] if errors else _first_diagnostic(exc)
        raise ScriptError(first if first.startswith(str(path)) else f"{path}: {first}") \
            from None
    finally:
        handler.detach()
    if "transform.with_named_sequence" not in script.operation.attributes:
        raise ScriptError(f"{path}: not a schedule script (the module lacks the "
                          f"transform.with_named_sequence attribute)")
    return script


def _first_diagnostic(exc: Exception) -> str:
    """'file:line:col: message' of the parser's or verifier's first error."""
    diagnostics = getattr(exc, "error_diagnostics", None)
    if diagnostics:
        d = diagnostics[0]
        return f"{_location(d.location)}: {d.message}"
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    error = next((l.strip() for l in lines if l.strip().startswith("error: ")), lines[0])
    error = error.removeprefix("error: ")
    if error.startswith('"'):  # '"file":line:col: message'
        error = error[1:].replace('":', ":", 1)
    return error


def _location(loc) -> str:
    """'file:line:col' of a file location (the text of any other)."""
    text = str(loc)
    if text.startswith('loc("') and text.endswith(")"):
        return text[len('loc("'):-1].replace('":', ":", 1)
    return text
