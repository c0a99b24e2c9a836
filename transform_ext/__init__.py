"""transform_ext: a Python-defined transform dialect with the ops the schedules need.

Call `transform_ext.load(context)` (idempotent per context) before building schedules that
use its ops.
"""

from .dialect import TransformExt, load

__all__ = ["TransformExt", "load"]
