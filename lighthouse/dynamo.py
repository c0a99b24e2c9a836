"""torch.compile(model, backend="lighthouse"): the backend dynamo calls with each FX graph.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so it works
without importing lighthouse first. Each graph goes through AOTAutograd (lighthouse.api):
its forward and backward graphs - or its inference graph - are compiled by
lighthouse.graphs, specialized per call signature (a graph dynamo made dynamic is compiled
for each concrete shape it is called with). A graph AOTAutograd cannot trace runs as dynamo
gave it; a part lighthouse cannot compile runs in torch; each reason is logged once (logger
"lighthouse"), never raised into the user's program unless `strict`.

Options (`torch.compile(..., options={...})`): threads (int), schedule (a family name),
strict (bool: anything not compiled as planned - a family that does not apply, a part or a
graph run in torch - is an error), torch_fallback (bool, default True; False: a part or a
graph that cannot be compiled is an error, a family that does not apply is not), max_ops
(int: the most computing ops in one kernel of the generic runs), and the families' schedule
options (query_tile, key_tile, row_tile, ...).
"""

from __future__ import annotations

import torch

from .api import CompileRecord, Specialized, aot_decompositions, graph_compilers
from .errors import LighthouseError, UnsupportedError
from .family_ops import TracingModes
from .graphs import GraphOptions, note

_KNOWN = ("threads", "schedule", "strict", "torch_fallback", "max_ops", "target")

# every CompileRecord made by the backend in this process (examples and tests read it)
RECORDS: list[CompileRecord] = []


def graph_options(options: dict | None) -> GraphOptions:
    """The backend's options (module docstring) as GraphOptions; a bad one is an
    UnsupportedError naming it."""
    from .families import parse_schedule_options

    options = dict(options or {})
    general = {k: options.pop(k) for k in list(options) if k in _KNOWN}
    strict = general.get("strict", False)
    torch_fallback = general.get("torch_fallback", not strict)
    for name, value in (("strict", strict), ("torch_fallback", torch_fallback)):
        if not isinstance(value, bool):
            raise UnsupportedError(f"lighthouse option {name!r} must be a bool, got {value!r}")
    threads = general.get("threads")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise UnsupportedError(f"lighthouse option 'threads' must be an int >= 1, got {threads!r}")
    max_ops = general.get("max_ops", GraphOptions.max_ops)
    if not isinstance(max_ops, int) or max_ops < 1:
        raise UnsupportedError(f"lighthouse option 'max_ops' must be an int >= 1, got {max_ops!r}")
    schedule = general.get("schedule")
    if schedule is not None:
        from .families import family_named

        family_named(schedule)
    return GraphOptions(target=general.get("target", "cpu"), threads=threads, schedule=schedule,
                        schedule_options=tuple(sorted(parse_schedule_options(options).items())),
                        strict=strict, torch_fallback=torch_fallback and not strict,
                        max_ops=max_ops)


def lighthouse_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                       **_):
    """The torch.compile backend (module docstring)."""
    graph_opts = graph_options(options)

    def build(args, record: CompileRecord):
        from torch._functorch.aot_autograd import aot_module_simplified

        RECORDS.append(record)
        try:
            with TracingModes():
                return aot_module_simplified(gm, list(args), decompositions=aot_decompositions(),
                                             **graph_compilers(graph_opts, record, "graph"))
        except Exception as exc:
            if not graph_opts.torch_fallback:
                raise
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            why = reason if isinstance(exc, LighthouseError) else \
                f"AOTAutograd cannot trace it ({type(exc).__name__}: {reason})"
            note(f"a graph runs in torch: {why}")
            return gm.forward

    specialized = Specialized(build)

    def run(*args):
        try:
            return specialized(*args)
        except UnsupportedError as exc:
            if not graph_opts.torch_fallback:
                raise
            note(f"a graph runs in torch: {exc}")
            return gm.forward(*args)

    return run
