"""lighthouse from Python: `compile_module` and the AOTAutograd plumbing the torch.compile
backend (lighthouse.dynamo) shares with it.

    import lighthouse
    fast = lighthouse.compile_module(model, x, y, backward=True)
    loss = fast(x, y)          # lighthouse kernels, forward
    loss.backward()            # lighthouse kernels, backward; model's .grad filled

AOTAutograd traces the model's forward to ATen (functionalized, decomposed with the
ingress's table except the ops the partitioner keeps whole: lighthouse.partition.ANCHORS)
and, when gradients are needed, splits the joint graph into a forward and a backward graph;
each goes to lighthouse.graphs.compile_graph. Compiles are specialized: a call whose
signature (shapes, dtypes, which inputs need gradients, grad mode, the values of non-tensor
arguments) was not seen before compiles again; the compiled forms stay in memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import UnsupportedError
from .family_ops import TracingModes, torch_forms
from .graphs import CompiledGraph, GraphOptions, compile_graph

_SCALARS = (bool, int, float, type(None))


def signature(args, *, names=None) -> tuple:
    """What a compile is specialized on, for each argument; a LighthouseError names an
    argument no compile can take."""
    from .runtime import SUPPORTED_DTYPES

    key = [torch.is_grad_enabled()]
    for i, a in enumerate(args):
        label = names[i] if names else f"argument {i}"
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu":
                raise UnsupportedError(f"{label}: a tensor on {a.device}; lighthouse runs on the "
                                       f"CPU (the xegpu target builds kernels, it does not run them)")
            if a.dtype not in SUPPORTED_DTYPES:
                raise UnsupportedError(f"{label}: dtype {str(a.dtype).removeprefix('torch.')} is "
                                       f"not supported (float32, float16, bfloat16, float64, int64, "
                                       f"int32, int16, int8, bool)")
            if a.layout != torch.strided or a.is_sparse or a.is_quantized:
                raise UnsupportedError(f"{label}: a {a.layout} tensor; only dense tensors are "
                                       f"supported")
            key.append((tuple(a.shape), a.dtype, a.requires_grad))
        elif isinstance(a, _SCALARS):
            key.append((type(a), a))
        elif isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            key.append((type(a), a))
        else:
            raise UnsupportedError(f"{label}: {type(a).__name__} is not a tensor or a number")
    return tuple(key)


def aot_decompositions() -> dict:
    """The ingress's joint table without the ops kept whole for their families, nor
    `scaled_dot_product_attention` (torch's own choice of its CPU flash op, whose output
    strides the graph dynamo traced relies on)."""
    from .ingress import _joint_decompositions
    from .partition import ANCHORS

    keep = set(ANCHORS) | {torch.ops.aten.scaled_dot_product_attention.default}
    return {op: fn for op, fn in _joint_decompositions().items() if op not in keep}


@dataclass
class CompileRecord:
    """One specialization: its signature, compile seconds and compiled graphs by role
    ("forward", "backward", "inference")."""

    signature: tuple
    seconds: float = 0.0
    graphs: dict[str, CompiledGraph] = field(default_factory=dict)


def graph_compilers(options: GraphOptions, record: CompileRecord, name: str) -> dict:
    """AOTAutograd's fw/bw/inference compilers compiling with `options` into `record`."""

    def compiler(role):
        def compile_(gm, example_inputs):
            start = time.perf_counter()
            with torch_forms():
                compiled = compile_graph(gm, example_inputs, options, name=f"{name} {role}")
            record.graphs[role] = compiled
            record.seconds += time.perf_counter() - start
            return compiled

        return compile_

    return dict(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                inference_compiler=compiler("inference"))


class Specialized:
    """Calls `build(args)`'s result for each new signature of the arguments (module
    docstring); `records` holds one CompileRecord per signature."""

    def __init__(self, build: Callable[[tuple, CompileRecord], Callable], *, names=None):
        self._build = build
        self._names = names
        self._compiled: dict[tuple, Callable] = {}
        self.records: list[CompileRecord] = []

    def __call__(self, *args):
        key = signature(args, names=self._names)
        fn = self._compiled.get(key)
        if fn is None:
            record = CompileRecord(key)
            fn = self._build(args, record)
            self._compiled[key] = fn
            self.records.append(record)
        return fn(*args)


class CompiledModule:
    """`compile_module`'s result: call it as the model (positional tensors and numbers)."""

    def __init__(self, model: torch.nn.Module, options: GraphOptions, backward: bool):
        self.model = model
        self.options = options
        self.backward = backward
        self._specialized = Specialized(self._build)

    @property
    def records(self) -> list[CompileRecord]:
        return self._specialized.records

    def _state(self) -> tuple[list[str], list[torch.Tensor]]:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        state = {**params, **buffers}
        return list(state), list(state.values())

    def _build(self, args: tuple, record: CompileRecord):
        from torch._functorch.aot_autograd import aot_function

        names, _ = self._state()
        n_state = len(names)
        constants = [None if isinstance(a, torch.Tensor) else a for a in args]
        model = self.model

        def flat_forward(*flat):
            state = dict(zip(names, flat[:n_state]))
            given = iter(flat[n_state:])
            full = tuple(next(given) if c is None and isinstance(a, torch.Tensor) else c
                         for a, c in zip(args, constants))
            return torch.func.functional_call(model, state, full)

        compiled = aot_function(flat_forward, decompositions=aot_decompositions(),
                                num_params_buffers=n_state,
                                **graph_compilers(self.options, record, type(model).__name__))

        traced = False

        def run(*call_args):
            nonlocal traced
            _, state = self._state()
            tensors = [a for a in call_args if isinstance(a, torch.Tensor)]
            if traced:
                return compiled(*state, *tensors)
            with TracingModes():  # the first call traces
                out = compiled(*state, *tensors)
            traced = True
            return out

        return run

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise UnsupportedError(f"{type(self.model).__name__}: keyword arguments "
                                   f"({', '.join(kwargs)}) are not supported; pass them by position")
        if self.backward:
            return self._specialized(*args)
        with torch.no_grad():
            return self._specialized(*args)

    def describe(self) -> str:
        """Each specialization's graphs and what compiled each of their parts."""
        lines = []
        for record in self.records:
            lines.append(f"signature {record.signature[1:]}: {record.seconds:.1f} s")
            for role, graph in record.graphs.items():
                lines.append(f" {role}:")
                lines.append(graph.describe())
        return "\n".join(lines)


def compile_module(model: torch.nn.Module, *example_inputs, backward: bool = False,
                   target: str = "cpu", threads: int | None = None, schedule: str | None = None,
                   strict: bool = False, torch_fallback: bool = False,
                   **schedule_options) -> CompiledModule:
    """`model` compiled by lighthouse for the signature of `example_inputs` (compiled now),
    and again for each new one on the first call that has it. Parameters and buffers are read
    at every call (an optimizer's in-place updates are seen). backward=True: the outputs are
    differentiable and their backward runs lighthouse kernels (AOTAutograd's forward and
    backward graphs); else the call runs without autograd. schedule: force a family;
    schedule_options: the families' options (as a kernel file's LIGHTHOUSE dict);
    strict: a family that does not apply is an error; torch_fallback: a part that cannot be
    compiled runs in torch with a logged note (else its LighthouseError is raised)."""
    from .families import parse_schedule_options

    if not isinstance(model, torch.nn.Module):
        raise UnsupportedError(f"compile_module takes a torch.nn.Module, got {type(model).__name__}")
    if threads is not None and threads < 1:
        raise UnsupportedError(f"threads must be >= 1, got {threads}")
    options = GraphOptions(target=target, threads=threads, schedule=schedule,
                           schedule_options=tuple(sorted(
                               parse_schedule_options(schedule_options).items())),
                           strict=strict, torch_fallback=torch_fallback)
    compiled = CompiledModule(model, options, backward)
    if example_inputs:
        compiled(*example_inputs)
    return compiled
