"""Schedule families and the choice among them.

A family turns a payload kind (attention, cross-entropy, matmul, ...) into the `fuse` and
`vectorize` stages. `choose_family` asks each specialized family whether the payload is its
kind (`recognize`) and, if so, whether its schedule applies (`check`); a recognized payload
that the schedule cannot take falls back to the generic family with a one-line note naming
the reason, or raises under `strict`. A family's parameters come from the target's
description (lighthouse.targets.description), never its name, and the kernel file's options,
in one place (`family_params`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from .errors import ScheduleMismatch, UnsupportedError


@dataclass(frozen=True)
class Family:
    name: str
    recognize: Callable[[object], bool]
    # (module, target or None): None when the schedule applies, else the reason (a payload
    # it cannot take; any other error propagates)
    check: Callable[[object, object], str | None]
    # (payload after cleanup, target) -> the transform script (schedules.script) whose
    # named sequences are the fuse and vectorize stages; the payload is read, never
    # rewritten
    script: Callable[[object, object], object]
    # names of the results the schedule appends to the model's, given the target (whose
    # options hold the kernel file's LIGHTHOUSE dict); lighthouse.extras has their references
    extra_results: Callable[[object], tuple[str, ...]] = lambda target: ()
    # how a GPU target takes the family's payload (the XeGPU target reads this, never the
    # name): "tiled" - the family's @fuse only tiles for the host, so the GPU preparation
    # replaces it and the workgroups stage makes the kernels; "loss" - the same, a loss
    # getting kernels of its own (a log-softmax alone goes the "tiled" way); "fused" - the
    # family's @fuse stays and its forall becomes the workgroup grid; None: no GPU lowering
    gpu_form: str | None = "tiled"


# The keys a kernel file's LIGHTHOUSE dict may hold besides "schedule", per family, and the
# type of their values (a tuple: a sequence of that many values of those types).
SCHEDULE_OPTIONS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "attention": {"query_tile": int, "key_tile": int, "return_lse": bool, "key_major": bool,
                  "register_tile": (int, int), "backward_tiles": (int, int, int, int)},
    "cross_entropy": {"row_tile": int, "class_tile": int, "lanes": int},
    "linear_cross_entropy": {"row_tile": int, "class_tile": int, "backward_rows": int,
                             "amx_class_tile": int, "stored_logits_bytes": int},
}


def _option_types() -> dict[str, type | tuple[type, ...]]:
    return {key: kind for options in SCHEDULE_OPTIONS.values() for key, kind in options.items()}


def _has_type(value, kind) -> bool:
    if isinstance(kind, tuple):
        return isinstance(value, (tuple, list)) and len(value) == len(kind) \
            and all(_has_type(v, k) for v, k in zip(value, kind))
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _type_name(kind) -> str:
    if isinstance(kind, tuple):
        return f"a sequence of {len(kind)} {' and '.join(sorted({_type_name(k) for k in kind}))}s"
    return kind.__name__


def parse_schedule_options(options) -> dict:
    """The schedule options of a kernel file's LIGHTHOUSE dict (or its sorted pairs) without
    "schedule", each checked against SCHEDULE_OPTIONS: an unknown key or a value of the
    wrong type is an UnsupportedError naming the key."""
    types = _option_types()
    parsed = {}
    for key, value in dict(options).items():
        if key == "schedule":
            continue
        if key not in types:
            raise UnsupportedError(f"LIGHTHOUSE option {key!r} is not a schedule option (known: "
                                   f"schedule, {', '.join(sorted(types))})")
        if not _has_type(value, types[key]):
            raise UnsupportedError(f"LIGHTHOUSE option {key!r} must be {_type_name(types[key])}, "
                                   f"got {value!r}")
        parsed[key] = tuple(value) if isinstance(types[key], tuple) else value
    return parsed


@dataclass(frozen=True)
class FamilyParams:
    """What a family's script is built from on one target. schedule: the family's own
    parameters (AttentionParams, CrossEntropyParams; for matmul a function of a
    contraction's (batch, m, n, k) giving its MatmulParams; None for generic). vector: the
    generic schedule's parameters, the tiles of the CPU @vectorize (None: the target has no
    CPU vector unit and vectorizes its own way)."""

    schedule: object
    vector: object


def _generic_params(target, options) -> FamilyParams:
    from schedules.generic import GenericParams

    cpu = target.cpu
    return FamilyParams(None, GenericParams.for_cpu(cpu, target.threads) if cpu else None)


def _matmul_params(target, options) -> FamilyParams:
    from schedules.matmul import MatmulParams

    cpu, threads, vector = target.cpu, target.threads, _generic_params(target, options).vector

    def for_shape(batch, m, n, k):
        return MatmulParams.for_cpu(batch, m, n, k, cpu, threads)

    return FamilyParams(for_shape if cpu else None, vector)


def _attention_params(target, options) -> FamilyParams:
    """Tiles from the options, else the target's own (`attention_tiles`, e.g. a GPU
    workgroup's rows, and `attention_backward_tiles`), else the schedule's defaults; scores keys-major by default where
    there is a CPU vector unit (its register tiles want the lanes along the queries)."""
    from schedules.attention import AttentionParams

    known = dict(zip(("query_tile", "key_tile"), target.attention_tiles or ()))
    if target.attention_backward_tiles is not None:
        known["backward_tiles"] = target.attention_backward_tiles
    known["key_major"] = target.cpu is not None
    known.update({k: v for k, v in options.items() if k != "register_tile"})
    vector = _generic_params(target, options).vector
    if vector is not None and "register_tile" in options:
        vector = dataclasses.replace(vector, register_tile=options["register_tile"])
    return FamilyParams(AttentionParams(threads=target.threads, **known), vector)


def _cross_entropy_params(target, options) -> FamilyParams:
    from schedules.cross_entropy import CrossEntropyParams

    cpu = target.cpu
    params = (CrossEntropyParams.for_cpu(cpu, target.threads, **options) if cpu
              else CrossEntropyParams(threads=target.threads, **options))
    return FamilyParams(params, _generic_params(target, options).vector)


def _convolution_params(target, options) -> FamilyParams:
    from schedules.convolution import ConvolutionParams

    cpu = target.cpu
    return FamilyParams(ConvolutionParams.for_cpu(cpu, target.threads) if cpu else None,
                        _generic_params(target, options).vector)


def _with_bf16_dot(vector, cpu):
    """The generic vector parameters with bf16 dot products where the CPU has them."""
    return dataclasses.replace(vector, bf16_dot=cpu.bf16_dot) if vector is not None else None


def _linear_cross_entropy_params(target, options) -> FamilyParams:
    from schedules.linear_cross_entropy import LinearCrossEntropyParams

    cpu, tiles = target.cpu, target.linear_cross_entropy_tiles
    if tiles is not None:   # the GPU form: S [N, V] in DPAS tiles, the target logit masked
        options = {"row_tile": tiles[0], "class_tile": tiles[1], "lanes": tiles[2],
                   "classes_major": False, "masked_target": True, **options}
    params = (LinearCrossEntropyParams.for_cpu(cpu, target.threads, **options) if cpu
              else LinearCrossEntropyParams(threads=target.threads, **options))
    return FamilyParams(params, _with_bf16_dot(_generic_params(target, options).vector, cpu))


_PARAMS = {"generic": _generic_params, "matmul": _matmul_params, "attention": _attention_params,
           "cross_entropy": _cross_entropy_params, "convolution": _convolution_params,
           "linear_cross_entropy": _linear_cross_entropy_params}


def family_params(family: str, target) -> FamilyParams:
    """The parameters of the family named `family` (a family with a schedule of its own, not
    loops) on `target` (None: the host CPU), in one place: defaults derived from the
    target's description (lighthouse.targets.description: its CPU's vector registers and
    caches, its threads, its attention tiles), then the family's options from the kernel
    file's LIGHTHOUSE dict (`target.options`); an option the parameters refuse is an
    UnsupportedError naming it."""
    target = target if target is not None else host_target()
    options = {k: v for k, v in parse_schedule_options(target.options).items()
               if k in SCHEDULE_OPTIONS.get(family, {})}
    try:
        return _PARAMS[family](target, options)
    except ValueError as exc:
        if not options:
            raise
        raise UnsupportedError(f"LIGHTHOUSE options of the {family} schedule: {exc}") from None


def host_target():
    """The target the families assume when given none: this machine's CPU."""
    from .targets.cpu import CpuTarget

    return CpuTarget()


def _generic_script(module, target):
    from schedules.generic import generic_script

    vector = family_params("generic", target).vector
    if vector is None:
        raise UnsupportedError("the generic schedule vectorizes for a CPU; this target has no CPU "
                               "vector unit")
    return generic_script(vector)


GENERIC = Family("generic", lambda m: True, lambda m, t=None: None, _generic_script)


def _loops_script(module, target):
    from schedules.loops import loops_script

    return loops_script(module, target)


# No tiling, no vectorization: linalg straight to scalar loops. A baseline for debugging
# schedules (`--schedule loops`), never chosen automatically.
LOOPS = Family("loops", lambda m: False, lambda m, t=None: None, _loops_script,
               gpu_form=None)


def _matmul_script(module, target):
    """The recorded plan of the payload after cleanup where the target has a CPU vector unit
    (the schedule is written for one); the generic script elsewhere."""
    from schedules.matmul import matmul_script, plan_matmul

    params = family_params("matmul", target)
    if params.schedule is None:
        return _generic_script(module, target)
    convolution = family_params("convolution", target).schedule
    return matmul_script(plan_matmul(module, params.schedule, params.vector, convolution),
                         params.vector)


def _matmul_recognize(module):
    from schedules.matmul import recognize

    return recognize(module)


def _matmul_check(module, target=None):
    from schedules.matmul import check

    return check(module)


# Contraction-dominated payloads (matmul, batch_matmul, linear layers, MLPs). Broad: keep it
# after the families of payloads that also contain contractions (attention, ...).
MATMUL = Family("matmul", _matmul_recognize, _matmul_check, _matmul_script)


def _convolution_script(module, target):
    """The recorded plan of the payload after cleanup where the target has a CPU vector unit
    (the schedule is written for one); the generic script elsewhere."""
    from schedules.convolution import convolution_script, plan_convolution
    from schedules.matmul import without_bf16_pairs

    params = family_params("convolution", target)
    if params.schedule is None:
        return _generic_script(module, target)
    matmul = family_params("matmul", target).schedule
    return convolution_script(plan_convolution(module, params.schedule, params.vector,
                                               without_bf16_pairs(matmul) if matmul else None),
                              params.vector)


def _convolution_recognize(module):
    from schedules.convolution import recognize

    return recognize(module)


def _convolution_check(module, target=None):
    from schedules.convolution import check

    return check(module)


# Convolution-dominated payloads (1-D/2-D/3-D, depthwise, grouped, transposed convolutions
# and the chains after them). Before matmul: their weight gradients hold contractions too.
CONVOLUTION = Family("convolution", _convolution_recognize, _convolution_check,
                     _convolution_script)


def _attention_recognize(module):
    from schedules.attention import recognize

    return recognize(module)


def _attention_check(module, target=None):
    from schedules.attention import check

    gpu = target is not None and target.cpu is None
    return check(module, family_params("attention", target).schedule, gpu=gpu)


def _attention_script(module, target):
    """The plan read from the payload after cleanup, @vectorize with a CPU vector unit only
    (the XeGPU target vectorizes its own way)."""
    from schedules.attention import attention_script, plan_attention

    params = family_params("attention", target)
    return attention_script(plan_attention(module, params.schedule), params.vector)


def _attention_extra_results(target) -> tuple[str, ...]:
    return ("lse",) if family_params("attention", target).schedule.return_lse else ()


ATTENTION = Family("attention", _attention_recognize, _attention_check, _attention_script,
                   _attention_extra_results, gpu_form="fused")


def _cross_entropy_recognize(module):
    from schedules.cross_entropy import recognize

    return recognize(module)


def _cross_entropy_check(module, target=None):
    from schedules.cross_entropy import check

    return check(module, family_params("cross_entropy", target).schedule)


def _cross_entropy_script(module, target):
    """The plan read from the payload after cleanup (the check's, with the same params),
    @vectorize with a CPU vector unit only."""
    from schedules.cross_entropy import cross_entropy_script, plan_cross_entropy

    params = family_params("cross_entropy", target)
    return cross_entropy_script(plan_cross_entropy(module, params.schedule), params.vector)


# Before attention: attention's cheap test also accepts a log_softmax with three reductions.
CROSS_ENTROPY = Family("cross_entropy", _cross_entropy_recognize, _cross_entropy_check,
                       _cross_entropy_script, gpu_form="loss")

def _linear_cross_entropy_recognize(module):
    from schedules.linear_cross_entropy import recognize

    return recognize(module)


def _linear_cross_entropy_check(module, target=None):
    from schedules.linear_cross_entropy import check

    return check(module, family_params("linear_cross_entropy", target).schedule)


def _linear_cross_entropy_script(module, target):
    """The plan read from the payload after cleanup (the check's, with the same params),
    @vectorize with a CPU vector unit only."""
    from schedules.linear_cross_entropy import (linear_cross_entropy_script,
                                                plan_linear_cross_entropy)

    params = family_params("linear_cross_entropy", target)
    return linear_cross_entropy_script(plan_linear_cross_entropy(module, params.schedule),
                                       params.vector)


# A loss over the logits of a linear layer (the log-softmax's max reads a matmul). Before
# attention and matmul, which would take its contractions; on a GPU its forward is a fused
# kernel (its backward is refused by its check, naming why).
LINEAR_CROSS_ENTROPY = Family("linear_cross_entropy", _linear_cross_entropy_recognize,
                              _linear_cross_entropy_check, _linear_cross_entropy_script,
                              gpu_form="fused")

SPECIALIZED: list[Family] = [LINEAR_CROSS_ENTROPY, CROSS_ENTROPY, ATTENTION, CONVOLUTION,
                             MATMUL]


def family_names() -> list[str]:
    return [f.name for f in SPECIALIZED] + [GENERIC.name, LOOPS.name]


def family_named(name: str) -> Family:
    families = {f.name: f for f in SPECIALIZED + [GENERIC, LOOPS]}
    if name not in families:
        raise ScheduleMismatch(f"unknown schedule {name!r}; known: {', '.join(families)}")
    return families[name]


def choose_family(module, *, requested: str | None = None, strict: bool = False,
                  notes: list[str] | None = None, target=None) -> Family:
    """The requested family, or the first specialized family that recognizes the payload
    and whose check takes it (a convolution with a log-sum-exp epilogue, which the
    cross-entropy family recognizes and refuses, goes on to the convolution family; on a
    target without a CPU vector unit only families with a GPU lowering take it); each that
    recognized it and refused gives a note with its check's reason; none takes it: the
    generic family. Under `strict` the first refusal is an error. `target`: the target
    compiled for (None: the host CPU)."""
    notes = notes if notes is not None else []
    if requested is not None:
        family = family_named(requested)
        reason = family.check(module, target)
        if reason is None:
            return family
        refused, family = [(family, reason)], GENERIC
    else:
        gpu = target is not None and target.cpu is None
        refused = []
        family = GENERIC
        for candidate in SPECIALIZED:
            if not candidate.recognize(module):
                continue
            if gpu and candidate.gpu_form is None:
                refused.append((candidate, candidate.check(module, target) or
                                "it has no GPU lowering"))
                continue
            reason = candidate.check(module, target)
            if reason is None:
                family = candidate
                break
            refused.append((candidate, reason))
    if refused and strict:
        first, why = refused[0]
        raise ScheduleMismatch(f"the {first.name} schedule does not apply ({why})")
    for refusal, why in refused:
        notes.append(f"the {refusal.name} schedule does not apply ({why}); using the "
                     f"{family.name} schedule")
    return family


def fallback_family(family: Family) -> Family | None:
    """The family to try when `family`'s compile fails: generic after a specialized one,
    the scalar loops after generic, nothing after loops."""
    if family is LOOPS:
        return None
    return LOOPS if family is GENERIC else GENERIC
