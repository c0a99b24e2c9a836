"""Named, ordered compile stages (in the manner of Triton's `add_stages`).

A stage is a function `Module -> None` that rewrites the module in place: a named sequence of
the compile's transform script, or a pass pipeline. The pipeline runs them in order, records each stage's wall time, can stop
after any stage (`--emit NAME`) and can write every stage's IR to a directory (`--dump-dir`).
Hooks may inspect or replace a stage by name before running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from torch_mlir.ir import Location

from transform_ext.common import failure_reason

from .errors import LighthouseError, StageError, UnknownStage


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[object], None]
    doc: str = ""
    # a stage applied from the compile's transform script: the text of its named sequence,
    # written beside the stage's payload by --dump-dir
    script_text: Callable[[], str] | None = None


@dataclass
class Pipeline:
    stages: list[Stage]
    timings: dict[str, float] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def check_stage(self, name: str | None) -> None:
        if name is not None and name not in self.names():
            raise UnknownStage(f"unknown stage {name!r}; stages are: {', '.join(self.names())}")

    def run(self, module, *, stop_after: str | None = None, dump_dir: str | Path | None = None,
            on_stage: Callable[[str, object], None] | None = None):
        """Run the stages in order; return the module (rewritten in place)."""
        self.check_stage(stop_after)
        if dump_dir is not None:
            dump_dir = Path(dump_dir)
            dump_dir.mkdir(parents=True, exist_ok=True)
            (dump_dir / "00-input.mlir").write_text(str(module))
        for index, stage in enumerate(self.stages, start=1):
            start = time.perf_counter()
            diagnostics: list[str] = []

            def collect(diag):
                diagnostics.append(str(diag.message))
                return True

            handler = module.context.attach_diagnostic_handler(collect)
            try:
                with module.context, Location.unknown():
                    stage.run(module)
            except LighthouseError:
                raise
            except Exception as exc:
                raise StageError(f"stage {stage.name!r} failed: {describe_failure(exc, diagnostics)}") from exc
            finally:
                handler.detach()
            self.timings[stage.name] = time.perf_counter() - start
            if dump_dir is not None:
                (dump_dir / f"{index:02d}-{stage.name}.mlir").write_text(str(module))
                if stage.script_text is not None:
                    (dump_dir / f"{index:02d}-{stage.name}.transform.mlir").write_text(
                        stage.script_text())
            if on_stage is not None:
                on_stage(stage.name, module)
            if stage.name == stop_after:
                break
        return module


def describe_failure(exc: Exception, diagnostics: list[str]) -> str:
    """The most telling line of an MLIR failure, clean of locations: its first diagnostic,
    else the exception's first line."""
    text = str(exc)
    if "Diagnostic message" not in text and "error:" not in text and diagnostics:
        text = diagnostics[0]
    return (failure_reason(text) or type(exc).__name__)[:300]
