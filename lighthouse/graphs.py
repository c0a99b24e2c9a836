"""Compile an ATen FX graph - AOTAutograd's forward, backward or inference graph, as
torch.compile hands a backend - into a callable that runs lighthouse kernels.

The graph is split into parts (lighthouse.partition): anchors (an attention forward or
backward, a cross-entropy) and the runs of ops between them. Each part is one kernel:
imported to linalg (an anchor in the decomposed form its family takes:
lighthouse.flash_decompositions), given the family that recognizes it (choose_family, with
its fallback notes), scheduled, lowered and JIT-compiled. A part's kernel is shared by every
part with the same computation (`graph_key`), in this process. A "moves" part (views and
copies only) runs in torch.

When a part cannot be compiled (an op torch-mlir cannot import, a dtype the runtime lacks,
a failing stage) it runs in torch - its decomposed form, so what the other parts read of it
is the same - and the reason is logged once (logger "lighthouse"); with `torch_fallback`
off the error is raised instead. A run whose import fails is first split in halves, again
and again, so that only the ops torch-mlir cannot import run in torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx

from .errors import IngressError, LighthouseError, UnsupportedError
from .partition import Part, graph_key, split_graph, split_part

log = logging.getLogger("lighthouse")
_logged: set[str] = set()


def note(message: str) -> None:
    """Log `message` once per process (the same reason is not repeated per graph)."""
    if message not in _logged:
        _logged.add(message)
        log.warning(message)


@dataclass(frozen=True)
class GraphOptions:
    """How graphs are compiled: the target, its threads, a forced family (`schedule`) and the
    families' options (as a kernel file's LIGHTHOUSE dict gives them); `strict`: a family
    that does not apply is an error, not a generic kernel; `torch_fallback`: a part that
    cannot be compiled runs in torch (else its error is raised); `max_ops`: the most
    computing ops one run kernel takes."""

    target: str = "cpu"
    threads: int | None = None
    schedule: str | None = None
    schedule_options: tuple = ()
    strict: bool = False
    torch_fallback: bool = True
    max_ops: int = 64

    def make_target(self):
        from .compile import make_target, with_schedule_options
        from .families import parse_schedule_options

        target = make_target(self.target, self.threads)
        return with_schedule_options(target, parse_schedule_options(dict(self.schedule_options)))


@dataclass
class PartReport:
    """What became of one part: its kind, the family that compiled it (None: it ran in
    torch), compile seconds, whether the kernel came from the cache, and the notes."""

    kind: str
    description: str
    family: str | None
    seconds: float = 0.0
    cached: bool = False       # this process compiled the same kernel before
    from_disk: bool = False    # loaded from the disk cache
    notes: list[str] = field(default_factory=list)


@dataclass
class Kernel:
    """A part's compiled form: `run(*inputs)` -> the part's outputs, in order."""

    run: Callable[..., tuple]
    family: str | None
    notes: list[str]
    seconds: float
    from_disk: bool = False  # loaded from the disk cache (lighthouse.kernel_cache)
    import_failed: bool = False  # runs in torch: an op torch-mlir cannot import


_CACHE: dict[tuple, Kernel] = {}


class CompiledGraph:
    """The parts' kernels run in order; called AOTAutograd's boxed way (one list of inputs,
    cleared) or with the inputs as arguments. Values are dropped after their last reader."""

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule, parts: list[Part], kernels: list[Kernel],
                 reports: list[PartReport]):
        self.reports = reports
        slots: dict[fx.Node, int] = {}
        self._constants: list[tuple[int, object]] = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                slots[node] = len(slots)
        self._inputs = len(slots)
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                slots[node] = len(slots)
                self._constants.append((slots[node], _attribute(gm, node.target)))
        for part in parts:
            for out in part.outputs:
                slots[out] = len(slots)
        self._size = len(slots)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        self._results = [slots[a] if isinstance(a, fx.Node) else ("value", a)
                         for a in _flat(output.args[0])]
        self._tuple = isinstance(output.args[0], (tuple, list))
        last_use: dict[int, int] = {}
        for i, part in enumerate(parts):
            for a in part.inputs:
                last_use[slots[a]] = i
        kept = {r for r in self._results if isinstance(r, int)}
        drops: list[list[int]] = [[] for _ in parts]
        for slot, i in last_use.items():
            if slot not in kept:
                drops[i].append(slot)
        self._steps = [(k.run, [slots[a] for a in p.inputs], [slots[o] for o in p.outputs], d)
                       for p, k, d in zip(parts, kernels, drops)]

    def __call__(self, *args):
        boxed = len(args) == 1 and isinstance(args[0], list)
        given = args[0] if boxed else list(args)
        if len(given) != self._inputs:
            raise LighthouseError(f"the compiled graph takes {self._inputs} inputs, got {len(given)}")
        env: list = list(given) + [None] * (self._size - self._inputs)
        if boxed:
            given.clear()
        for slot, value in self._constants:
            env[slot] = value
        for run, ins, outs, drops in self._steps:
            results = run(*(env[i] for i in ins))
            for slot, value in zip(outs, results):
                env[slot] = value
            for slot in drops:
                env[slot] = None
        results = [env[r] if isinstance(r, int) else r[1] for r in self._results]
        return results if boxed or self._tuple else results[0]

    def describe(self) -> str:
        lines = []
        for r in self.reports:
            how = r.family or "torch"
            extra = " (cached)" if r.cached else f" ({r.seconds:.2f} s" + \
                (", from the disk cache)" if r.from_disk else ")") if r.family else ""
            lines.append(f"  {r.description}: {how}{extra}")
            lines += [f"    note: {n}" for n in r.notes]
        return "\n".join(lines)


def _flat(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _attribute(gm: fx.GraphModule, target: str):
    obj = gm
    for name in target.split("."):
        obj = getattr(obj, name)
    return obj


def compile_graph(gm: fx.GraphModule, example_inputs=None, options: GraphOptions | None = None,
                  *, name: str = "graph") -> CompiledGraph:
    """The CompiledGraph of `gm` (module docstring). `example_inputs` are not read: the
    placeholders' `meta["val"]` give the shapes and dtypes."""
    options = options or GraphOptions()
    drop_unread_ops(gm.graph)
    pending = split_graph(gm, max_ops=options.max_ops)
    parts, kernels, reports = [], [], []
    while pending:
        part = pending.pop(0)
        kernel, report = _compile_part(part, options, f"{name} part {len(parts)}")
        halves = split_part(gm, part) if kernel.import_failed else None
        if halves:  # only the ops torch-mlir cannot import run in torch, not the whole run
            pending[:0] = halves
            continue
        if kernel.import_failed:
            for reason in kernel.notes:
                note(reason)
        parts.append(part)
        kernels.append(kernel)
        reports.append(report)
    return CompiledGraph(gm, parts, kernels, reports)


def drop_unread_ops(graph: fx.Graph) -> int:
    """Erase the ops whose results nobody reads, last first, writes and assertions aside (AOTAutograd's
    backward keeps the forward's flash attention unread, and FX's own dead-code elimination
    keeps it: the op is seeded, for its dropout)."""
    erased = 0
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is not None and (schema.is_mutable or not schema.returns):
            continue  # a write, or an op run for its effect (an assertion)
        graph.erase_node(node)
        erased += 1
    return erased


def _compile_part(part: Part, options: GraphOptions, name: str) -> tuple[Kernel, PartReport]:
    description = part.describe()
    if part.kind == "moves":
        return Kernel(part.module, None, [], 0.0), PartReport(part.kind, description, None)
    from .decompose import decompose_part

    form = decompose_part(part)
    key = (options, graph_key(form.graph), form.key)
    if key in _CACHE:
        kernel = _CACHE[key]
        return kernel, PartReport(part.kind, description, kernel.family, kernel.seconds,
                                  cached=True, notes=list(kernel.notes))
    kernel = _compile_form(form, options, name)
    _CACHE[key] = kernel
    return kernel, PartReport(part.kind, description, kernel.family, kernel.seconds,
                              from_disk=kernel.from_disk, notes=list(kernel.notes))


def _compile_form(form, options: GraphOptions, name: str) -> Kernel:
    """The kernel of a part's decomposed form (from the disk cache when it holds it), or its
    torch run with the reason noted."""
    from . import kernel_cache
    from .compile import compile_payload
    from .ingress import import_graph

    start = time.perf_counter()
    graph, outputs = _without_trivial_outputs(form.graph)
    disk_key = kernel_cache.key_of(repr(options), repr(form.key), graph_key(graph))
    stored = kernel_cache.load(disk_key) if options.target == "cpu" else None
    if stored is not None:
        function, meta = stored
        run = _assemble(function, outputs, meta["model_results"])
        return Kernel(form.wrap(run), meta["family"], meta["notes"],
                      time.perf_counter() - start, from_disk=True)
    in_torch = _eager(form.eager) if form.eager is not None else form.wrap(_eager(form.graph))
    try:
        if not any(isinstance(o, int) for o in outputs) and not form.extra_results:
            raise _NothingToCompute
        target = options.make_target()
        if form.schedule_options:
            from .compile import with_schedule_options
            from .families import parse_schedule_options

            merged = {**dict(options.schedule_options), **form.schedule_options}
            target = with_schedule_options(target, parse_schedule_options(merged))
        compiled = compile_payload(lambda: import_graph(graph, name=name), name=name,
                                   target=target, schedule=options.schedule,
                                   strict=options.strict)
        model_results = len(compiled.imported.result_specs)
        extras = len(compiled.result_names) - model_results
        if extras != form.extra_results:
            raise UnsupportedError(f"the {compiled.family.name} schedule returned {extras} "
                                   f"results besides the graph's, {form.extra_results} wanted")
    except _NothingToCompute:
        return Kernel(in_torch, None, [], time.perf_counter() - start)
    except LighthouseError as exc:
        if not options.torch_fallback:
            raise
        reason = f"{form.description}: runs in torch ({exc})"
        import_failed = isinstance(exc, IngressError)
        if not import_failed:
            note(reason)
        return Kernel(in_torch, None, [reason], time.perf_counter() - start,
                      import_failed=import_failed)
    for n in compiled.notes:
        note(f"{form.description}: {n}")
    function = compiled.function
    if options.target == "cpu" and function is not None:
        kernel_cache.store(disk_key, function, dict(family=compiled.family.name,
                                                    notes=list(compiled.notes),
                                                    model_results=model_results))
    run = _assemble(function, outputs, model_results)
    return Kernel(form.wrap(run), compiled.family.name, list(compiled.notes),
                  time.perf_counter() - start)


class _NothingToCompute(Exception):
    pass


def _eager(graph: fx.GraphModule) -> Callable[..., tuple]:
    def run(*inputs):
        with torch.no_grad():
            return tuple(graph(*inputs))

    return run


def _assemble(function, outputs: list, n_results: int) -> Callable[..., tuple]:
    """Run the kernel and place its first `n_results` results among the graph's outputs
    (("input", i) forwards input i, ("same", j) repeats output j, ("value", v) is a
    constant), then the results a schedule appends after them."""

    def run(*inputs):
        results = function(*inputs)
        out = []
        for o in outputs:
            if isinstance(o, int):
                out.append(results[o])
            elif o[0] == "input":
                out.append(inputs[o[1]])
            elif o[0] == "same":
                out.append(out[o[1]])
            else:
                out.append(o[1])
        return tuple(out) + tuple(results[n_results:])

    return run


def _without_trivial_outputs(gm: fx.GraphModule) -> tuple[fx.GraphModule, list]:
    """`gm` returning only the tensors it computes, each once, and how to rebuild its
    outputs: an int (the kernel's result), ("input", i), ("same", j) or ("value", v)."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    values = _flat(output.args[0])
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    kept: list[fx.Node] = []
    plan: list = []
    first: dict[fx.Node, int] = {}
    for j, v in enumerate(values):
        v = _through_aliases(v)
        if not isinstance(v, fx.Node):
            plan.append(("value", v))
        elif v.op == "placeholder":
            plan.append(("input", placeholders.index(v)))
        elif v in first:
            plan.append(("same", first[v]))
        else:
            first[v] = j
            plan.append(len(kept))
            kept.append(v)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "output":
            new.output(tuple(env[k] for k in kept))
        else:
            env[node] = new.node_copy(node, lambda n: env[n])
    new.eliminate_dead_code()
    return fx.GraphModule(gm, new), plan


def _through_aliases(value):
    """An output that is an alias of a value is that value (the graphs are functional)."""
    while isinstance(value, fx.Node) and value.op == "call_function" and \
            value.target in (torch.ops.aten.alias.default, torch.ops.aten.detach.default):
        value = value.args[0]
    return value


def kernels_cached() -> int:
    return len(_CACHE)


def clear_cache() -> None:
    _CACHE.clear()

