"""Schedule families and the choice among them.

A family turns a payload kind (attention, cross-entropy, matmul, ...) into the `fuse` and
`vectorize` stages. `choose_family` asks each specialized family whether the payload is its
kind (`recognize`) and, if so, whether its schedule applies (`check`); a recognized payload
that the schedule cannot take falls back to the generic family with a one-line note naming
the reason, or raises under `strict`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from .errors import ScheduleMismatch


@dataclass(frozen=True)
class Family:
    name: str
    recognize: Callable[[object], bool]
    # (module, target or None): None when the schedule applies, else the reason
    check: Callable[[object, object], str | None]
    # (payload after cleanup, target) -> the transform script (schedules.script) whose
    # named sequences are the fuse and vectorize stages; the payload is read, never
    # rewritten
    script: Callable[[object, object], object]
    # names of the results the schedule appends to the model's, given the target (whose
    # options hold the kernel file's LIGHTHOUSE dict); lighthouse.extras has their references
    extra_results: Callable[[object], tuple[str, ...]] = lambda target: ()


# The keys a kernel file's LIGHTHOUSE dict may hold besides "schedule", per family.
SCHEDULE_OPTIONS = {
    "attention": ("query_tile", "key_tile", "return_lse", "key_major", "register_tile"),
    "cross_entropy": ("row_tile", "class_tile", "lanes"),
}


def _generic_params(target):
    from schedules.generic import GenericParams

    return GenericParams(threads=target.threads, vector_tile=4 * target.f32_lanes)


def _generic_script(module, target):
    from schedules.generic import generic_script

    return generic_script(_generic_params(target))


GENERIC = Family("generic", lambda m: True, lambda m, t=None: None, _generic_script)


def _loops_script(module, target):
    from schedules.loops import loops_script

    return loops_script(module, target)


# No tiling, no vectorization: linalg straight to scalar loops. A baseline for debugging
# schedules (`--schedule loops`), never chosen automatically.
LOOPS = Family("loops", lambda m: False, lambda m, t=None: None, _loops_script)


def _matmul_script(module, target):
    """The recorded plan of the payload after cleanup on the CPU; the generic script
    elsewhere (the schedule is written for the host CPU)."""
    from schedules.generic import generic_script
    from schedules.matmul import MatmulParams, matmul_script, plan_matmul

    generic = _generic_params(target)
    if getattr(target, "name", "cpu") != "cpu":
        return generic_script(generic)

    def params_for(batch, m, n, k):
        return MatmulParams.for_shape(batch, m, n, k, threads=target.threads, lanes=target.f32_lanes)

    return matmul_script(plan_matmul(module, params_for, generic), generic)


def _matmul_recognize(module):
    from schedules.matmul import recognize

    return recognize(module)


def _matmul_check(module, target=None):
    from schedules.matmul import check

    return check(module)


# Contraction-dominated payloads (matmul, batch_matmul, linear layers, MLPs). Broad: keep it
# after the families of payloads that also contain contractions (attention, ...).
MATMUL = Family("matmul", _matmul_recognize, _matmul_check, _matmul_script)

# Specialized families register here, most specific first.
def _attention_params(target):
    """Tiles from the kernel file's LIGHTHOUSE dict, else the target's own defaults
    (`attention_tiles = (query_tile, key_tile)`, e.g. a GPU workgroup's rows), else the
    schedule's defaults."""
    from schedules.attention import AttentionParams

    options = dict(getattr(target, "options", ()))
    known = dict(zip(("query_tile", "key_tile"), getattr(target, "attention_tiles", ())))
    known["key_major"] = getattr(target, "name", "") == "cpu"
    known.update({k: options[k] for k in ("query_tile", "key_tile", "return_lse", "key_major")
                  if k in options})
    return AttentionParams(threads=getattr(target, "threads", 1), **known)


def _attention_recognize(module):
    from schedules.attention import recognize

    return recognize(module)


def _attention_check(module, target=None):
    from schedules.attention import check

    return check(module, _attention_params(target))


def _attention_script(module, target):
    """The plan read from the payload after cleanup, @vectorize on the CPU only (the XeGPU
    target vectorizes its own way)."""
    from schedules.attention import attention_script, plan_attention

    vector = None
    if getattr(target, "name", "cpu") == "cpu":
        options = dict(getattr(target, "options", ()))
        vector = _generic_params(target)
        if "register_tile" in options:
            vector = dataclasses.replace(vector, register_tile=tuple(options["register_tile"]))
    return attention_script(plan_attention(module, _attention_params(target)), vector)


def _attention_extra_results(target) -> tuple[str, ...]:
    return ("lse",) if dict(getattr(target, "options", ())).get("return_lse") else ()


ATTENTION = Family("attention", _attention_recognize, _attention_check, _attention_script,
                   _attention_extra_results)


def _cross_entropy_params(target):
    from schedules.cross_entropy import CrossEntropyParams

    options = dict(getattr(target, "options", ()))
    known = {k: options[k] for k in ("row_tile", "class_tile", "lanes") if k in options}
    return CrossEntropyParams(threads=getattr(target, "threads", 1), **known)


def _cross_entropy_recognize(module):
    from schedules.cross_entropy import recognize

    return recognize(module)


def _cross_entropy_check(module, target=None):
    from schedules.cross_entropy import check

    return check(module, _cross_entropy_params(target))


def _cross_entropy_script(module, target):
    """The plan read from the payload after cleanup (the check's, with the same params),
    @vectorize on the CPU only."""
    from schedules.cross_entropy import cross_entropy_script, plan_cross_entropy

    vector = _generic_params(target) if getattr(target, "name", "cpu") == "cpu" else None
    return cross_entropy_script(plan_cross_entropy(module, _cross_entropy_params(target)), vector)


# Before attention: attention's cheap test also accepts a log_softmax with three reductions.
CROSS_ENTROPY = Family("cross_entropy", _cross_entropy_recognize, _cross_entropy_check,
                       _cross_entropy_script)

SPECIALIZED: list[Family] = [CROSS_ENTROPY, ATTENTION, MATMUL]


def family_names() -> list[str]:
    return [f.name for f in SPECIALIZED] + [GENERIC.name, LOOPS.name]


def family_named(name: str) -> Family:
    families = {f.name: f for f in SPECIALIZED + [GENERIC, LOOPS]}
    if name not in families:
        raise ScheduleMismatch(f"unknown schedule {name!r}; known: {', '.join(families)}")
    return families[name]


def choose_family(module, *, requested: str | None = None, strict: bool = False,
                  notes: list[str] | None = None, target=None) -> Family:
    """The requested family, or the first specialized family that recognizes the payload;
    when its check fails: the generic family and a note naming the reason (an error under
    `strict`)."""
    notes = notes if notes is not None else []
    if requested is not None:
        family = family_named(requested)
    else:
        family = next((f for f in SPECIALIZED if f.recognize(module)), GENERIC)
    reason = family.check(module, target)
    if reason is None:
        return family
    message = f"the {family.name} schedule does not apply ({reason})"
    if strict:
        raise ScheduleMismatch(message)
    notes.append(f"{message}; using the generic schedule")
    return GENERIC


def fallback_family(family: Family) -> Family | None:
    """The family to try when `family`'s compile fails: generic after a specialized one,
    the scalar loops after generic, nothing after loops."""
    if family is LOOPS:
        return None
    return LOOPS if family is GENERIC else GENERIC
