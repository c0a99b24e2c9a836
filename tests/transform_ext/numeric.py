"""Compile a linalg-on-tensors payload with the generic CPU schedule and run it."""

from __future__ import annotations

from torch_mlir import ir

from lighthouse.ingress import TensorSpec, _spec_of_type
from lighthouse.pipeline import Pipeline, Stage
from lighthouse.targets.cpu import CpuTarget
from schedules.generic import GenericParams, fuse_generic, vectorize_generic


def run_module(payload: ir.Module, args, *, threads: int = 2, family: str = "generic",
               cleanup: bool = True, before_vectorize=None):
    """Compile `payload` (its @main) for the CPU with the schedule of `family` and call it
    on torch tensors `args` (`cleanup`: run the cleanup stage first, as a compile does on an
    import; `before_vectorize(payload)`: a rewrite between the generic fuse and vectorize
    stages)."""
    func = next(op for op in payload.body.operations if op.operation.name == "func.func")
    fn_type = ir.TypeAttr(func.attributes["function_type"]).value
    arg_specs = [_spec_of_type(t, "payload", "arg") for t in fn_type.inputs]
    result_specs = [_spec_of_type(t, "payload", "result") for t in fn_type.results]
    target = CpuTarget(threads=threads)
    params = GenericParams(threads=threads)
    from lighthouse.compile import cleanup as cleanup_stage

    stages = [Stage("cleanup", cleanup_stage)] if cleanup else []
    if family == "generic":
        stages += [Stage("fuse", lambda m: fuse_generic(m, params))]
        if before_vectorize is not None:
            stages.append(Stage("before-vectorize", before_vectorize))
        stages += [Stage("vectorize", lambda m: vectorize_generic(m, params))]
    else:
        if before_vectorize is not None:
            raise ValueError("before_vectorize runs between the generic schedule's stages only")
        from lighthouse.families import family_named
        from schedules.script import apply_stage

        script = {}

        def stage(name):
            def run(m):
                if not script:
                    with m.context, ir.Location.unknown():
                        script["module"] = family_named(family).script(m, target)
                apply_stage(m, script["module"], name)
            return Stage(name, run)

        stages += [stage("fuse"), stage("vectorize")]
    stages += target.stages()
    Pipeline(stages).run(payload)
    return target.jit(payload, arg_specs, result_specs)(*args)


__all__ = ["run_module", "TensorSpec"]
