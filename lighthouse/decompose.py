"""Each part of a split graph (lighthouse.partition) in the form its kernel is compiled from.

A part's GraphModule is traced again with the ingress's decomposition table on fake tensors
(`make_fx`), so every op is one torch-mlir lowers and an anchor becomes the graph its family
takes (lighthouse.flash_decompositions):

- attention: torch's CPU flash forward as the math backend's graph, O = softmax(S) V. Its
  second result, the per-row log-sum-exp, is only read by the flash backward, which
  recomputes it from the scores: the kernel does not compute it, and the part returns a
  NaN tensor of its shape in its place, so a reader that did use it would see NaN, never a
  plausible wrong value.
- attention_backward: the FlashAttention-2 recomputation form (dQ, dK, dV).
- cross_entropy (`lighthouse::cross_entropy`, lighthouse.family_ops): F.cross_entropy's
  loss and, when the op computes it, its gradient seeded by ones, traced through
  `torch.func.vjp` as `--backward` imports a loss (the cross-entropy family's joint form).
- run: the ops as they are.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from .partition import Part

aten = torch.ops.aten


@dataclass
class PartForm:
    """`graph`: placeholders are the part's inputs, outputs the values its kernel computes;
    `wrap(run)` turns the kernel's run into the part's (filling the outputs the kernel
    leaves out); `schedule_options` are given to the family (and `key` names them)."""

    graph: fx.GraphModule
    description: str
    wrap: Callable[[Callable], Callable]
    schedule_options: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return tuple(sorted(self.schedule_options.items()))


def decompose_part(part: Part) -> PartForm:
    description = part.describe()
    if part.kind == "cross_entropy":
        return PartForm(_cross_entropy(part), description, lambda run: run)
    graph = trace(part.module, part.inputs)
    if part.kind == "attention":
        return _attention_forward(part, graph, description)
    return PartForm(graph, description, lambda run: run)


def trace(fn, inputs: list[fx.Node], *, functionalize: bool = False) -> fx.GraphModule:
    """`fn` traced on fake tensors shaped (and strided) as the `inputs`' example values, with
    the ingress's joint decompositions; `functionalize` for a function that mutates (a part
    of AOTAutograd's graphs is functional already, and may hold prims views, which
    functionalization refuses)."""
    from .ingress import _joint_decompositions

    specs = [n.meta["val"] for n in inputs]
    examples = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
                if isinstance(v, torch.Tensor) else v for v in specs]
    if functionalize:
        fn = torch.func.functionalize(fn, remove="mutations")
    graph = make_fx(fn, tracing_mode="fake", decomposition_table=_joint_decompositions())(*examples)
    if functionalize and copies_as_values(graph):
        graph = make_fx(graph, tracing_mode="fake")(*examples)  # the new ops' example values
    return graph


def copies_as_values(gm: fx.GraphModule) -> int:
    """Each `copy_(dst, src)` whose destination nobody reads after it becomes the value it
    writes, src broadcast to dst's shape in dst's dtype (a decomposition run below
    functionalization, as the label-smoothed loss's, may still write into a temporary).
    Returns the number replaced; what remains is the importer's to refuse."""
    replaced = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy_.default:
            continue
        dst, src = node.args[:2]
        if dst.op == "placeholder" or any(order[u] > order[node] for u in dst.users):
            continue
        want, have = dst.meta["val"], src.meta["val"]
        with gm.graph.inserting_before(node):
            value = src
            if tuple(have.shape) != tuple(want.shape):
                value = gm.graph.call_function(aten.expand.default, (value, list(want.shape)))
            if have.dtype != want.dtype:
                value = gm.graph.call_function(aten._to_copy.default, (value,),
                                               {"dtype": want.dtype})
            else:
                value = gm.graph.call_function(aten.clone.default, (value,))
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return replaced


def _cross_entropy(part: Part) -> fx.GraphModule:
    from .family_ops import cross_entropy_with_grad

    op = part.nodes[0]

    def form(*values):
        env = dict(zip(part.inputs, values))
        args = [env[a] if isinstance(a, fx.Node) else a for a in op.args]
        results = cross_entropy_with_grad(*args)
        return tuple(results[out.args[1]] for out in part.outputs)

    return trace(form, part.inputs, functionalize=True)


def _attention_forward(part: Part, graph: fx.GraphModule, description: str) -> PartForm:
    lse = [i for i, o in enumerate(part.outputs)
           if o.target is operator.getitem and o.args[1] == 1]
    if not lse:
        return PartForm(graph, description, lambda run: run)
    (index,) = lse
    shape, dtype = part.outputs[index].meta["val"].shape, part.outputs[index].meta["val"].dtype
    graph = drop_outputs(graph, {index})

    def wrap(run):
        def with_lse(*inputs):
            results = list(run(*inputs))
            results.insert(index, torch.full(shape, float("nan"), dtype=dtype))
            return tuple(results)

        return with_lse

    return PartForm(graph, description, wrap)


def drop_outputs(gm: fx.GraphModule, positions: set[int]) -> fx.GraphModule:
    """`gm` without the outputs at `positions`, and the ops only they needed."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    values = list(output.args[0])
    output.args = (tuple(v for i, v in enumerate(values) if i not in positions),)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm
