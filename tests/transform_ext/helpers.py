"""Test helpers: parse a payload, apply a schedule built in Python, FileCheck the result."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from torch_mlir import ir

import transform_ext
from schedules.common import apply_schedule, build_schedule


def parse(text: str) -> ir.Module:
    ctx = ir.Context()
    with ctx:
        transform_ext.load(ctx)
        return ir.Module.parse(textwrap.dedent(text))


def rewritten(source: str, rewrite) -> tuple[object, str]:
    """Parse `source`, run `rewrite(module)` (a Python rewrite of the payload), verify the
    module: rewrite's result and the module's text."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(source)
        result = rewrite(module)
        assert module.operation.verify()
        return result, str(module)


def apply(payload: ir.Module, body) -> None:
    transform_ext.load(payload.context)
    with payload.context, ir.Location.unknown():
        apply_schedule(payload, build_schedule(body))


def apply_expect_failure(payload: ir.Module, body) -> str:
    """Apply a schedule that must fail; return the error text (payload left as is)."""
    try:
        apply(payload, body)
    except Exception as exc:  # the interpreter raises ValueError with the diagnostics
        return str(exc)
    raise AssertionError("the schedule was expected to fail")


def check(ir_text: str, checks: str) -> None:
    """Run the FileCheck tool (python filecheck) on `ir_text` with `checks` (CHECK lines)."""
    tool = Path(sys.executable).parent / "filecheck"
    with tempfile.NamedTemporaryFile("w", suffix=".checks", delete=False) as f:
        f.write(textwrap.dedent(checks))
    proc = subprocess.run([str(tool), f.name], input=str(ir_text), capture_output=True, text=True)
    Path(f.name).unlink()
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\n--- IR ---\n" + str(ir_text)


ID_ATTR = "test.id"


def tag_ops(payload_ops, start: int = 0) -> None:
    """Give each payload op a unique `test.id` (tests pick their ops by hand this way)."""
    i64 = ir.IntegerType.get_signless(64)
    for i, op in enumerate(payload_ops, start=start):
        op.attributes[ID_ATTR] = ir.IntegerAttr.get(i64, i)


def match_id(target: ir.Value, op_id: int) -> ir.Value:
    """The payload op tagged `test.id = op_id` (see `tag_ops`)."""
    from torch_mlir.dialects import transform
    from torch_mlir.dialects.transform import structured

    i64 = ir.IntegerType.get_signless(64)
    return structured.MatchOp(transform.AnyOpType.get(), target,
                              op_attrs={ID_ATTR: ir.IntegerAttr.get(i64, op_id)}).result


def clear_tags(payload: ir.Module) -> None:
    def strip(op):
        if ID_ATTR in op.attributes:
            del op.attributes[ID_ATTR]
        return ir.WalkResult.ADVANCE

    payload.operation.walk(strip)
