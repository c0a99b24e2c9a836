"""User-facing errors: one line each, printed by the CLI without a traceback (exit 2)."""


class LighthouseError(Exception):
    """Base class; the message is a single line naming the file, op, shape or dtype at fault."""

    exit_code = 2


class KernelFileError(LighthouseError):
    """The kernel file is missing, does not follow the Model/get_inputs contract, or --set is bad."""


class IngressError(LighthouseError):
    """torch -> linalg import failed (an op torch-mlir cannot lower, dynamic shapes, ...)."""


class UnsupportedError(LighthouseError):
    """The payload uses something this compiler does not handle (dtype, op, shape)."""


class StageError(LighthouseError):
    """A stage that failed on the payload."""


class ScheduleFileError(LighthouseError):
    """A --schedule-file that cannot be read, lacks a stage, or whose transform op fails."""


class UnknownStage(StageError):
    """--emit / --stop-after named a stage the pipeline does not have."""


class ScheduleMismatch(LighthouseError):
    """A kernel-family schedule does not apply to this payload; the message says why."""


class KernelError(LighthouseError):
    """The compiled kernel found its inputs invalid at run time (e.g. a cross-entropy target
    out of range) and reported it instead of computing (lighthouse.runtime)."""


class CheckFailed(LighthouseError):
    """The compiled kernel's result differs from torch's beyond the dtype tolerance."""

    exit_code = 1
