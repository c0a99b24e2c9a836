"""Each part of a split graph (lighthouse.partition) in the form its kernel is compiled from.

A part's GraphModule is traced again with the ingress's decomposition table on fake tensors
(`make_fx`), so every op is one torch-mlir lowers and an anchor becomes the graph its family
takes (lighthouse.flash_decompositions):

- attention: torch's CPU flash forward as the math backend's graph, O = softmax(S) V. Its
  second result, the per-row log-sum-exp, is read by the flash backward only. In f32 the
  kernel returns it beside O (the attention family's return_lse: lse = m + log l from the
  fused loop) and the backward reads it; in f16/bf16 (an lse rounded to them would be off)
  the backward recomputes it, so the kernel leaves it out and the part returns a NaN tensor
  of its shape in its place: a reader that did use it would see NaN, never a plausible
  wrong value.
- attention_backward: the FlashAttention-2 form (dQ, dK, dV), reading the forward's lse in
  f32, recomputing it otherwise.
- cross_entropy (`lighthouse::cross_entropy`, lighthouse.family_ops): F.cross_entropy's
  loss and, when the op computes it, its gradient seeded by ones, traced through
  `torch.func.vjp` as `--backward` imports a loss (the cross-entropy family's joint form).
- linear_cross_entropy (`lighthouse::linear_cross_entropy`): the same over F.linear's
  logits, with dh, dW, db (the linear cross-entropy family's joint form).
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
    """`graph`: placeholders are the part's inputs, outputs the values its kernel computes,
    then `extra_results` more the schedule appends (`schedule_options` ask for them, `key`
    names the options); `wrap(run)` turns the kernel's run into the part's (placing the
    extras, filling the outputs the kernel leaves out); `eager`: the part run in torch when
    its kernel cannot be compiled (None: `graph` run in torch, wrapped)."""

    graph: fx.GraphModule
    description: str
    wrap: Callable[[Callable], Callable]
    schedule_options: dict = field(default_factory=dict)
    extra_results: int = 0
    eager: fx.GraphModule | None = None

    @property
    def key(self) -> tuple:
        return tuple(sorted(self.schedule_options.items()))


def _same(run):
    return run


def decompose_part(part: Part) -> PartForm:
    from .flash_decompositions import flash_backward_given_lse

    description = part.describe()
    if part.kind in ("cross_entropy", "linear_cross_entropy"):
        return PartForm(_loss(part), description, _same)
    f32 = any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype == torch.float32
              for n in part.inputs[:1])
    if part.kind == "attention_backward" and f32:
        table = {aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
                 flash_backward_given_lse}
        return PartForm(trace(part.module, part.inputs, table=table), description, _same)
    graph = trace(part.module, part.inputs)
    if part.kind == "attention":
        return _attention_forward(part, graph, description, f32)
    return PartForm(graph, description, _same)


def trace(fn, inputs: list[fx.Node], *, functionalize: bool = False,
          table: dict | None = None) -> fx.GraphModule:
    """`fn` traced on fake tensors shaped (and strided) as the `inputs`' example values, with
    the ingress's joint decompositions (overridden by `table`); `functionalize` for a
    function that mutates (a part of AOTAutograd's graphs is functional already, and may hold
    prims views, which functionalization refuses)."""
    from .ingress import _joint_decompositions

    specs = [n.meta["val"] for n in inputs]
    examples = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
                if isinstance(v, torch.Tensor) else v for v in specs]
    if functionalize:
        fn = torch.func.functionalize(fn, remove="mutations")
    decompositions = {**_joint_decompositions(), **(table or {})}
    graph = make_fx(fn, tracing_mode="fake", decomposition_table=decompositions)(*examples)
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


def _loss(part: Part) -> fx.GraphModule:
    from .family_ops import cross_entropy_with_grad, linear_cross_entropy_with_grad

    op = part.nodes[0]
    with_grad = cross_entropy_with_grad if part.kind == "cross_entropy" \
        else linear_cross_entropy_with_grad

    def form(*values):
        env = dict(zip(part.inputs, values))
        args = [env[a] if isinstance(a, fx.Node) else a for a in op.args]
        results = with_grad(*args)
        return tuple(results[out.args[1]] for out in part.outputs)

    return trace(form, part.inputs, functionalize=True)


def _attention_forward(part: Part, graph: fx.GraphModule, description: str,
                       f32: bool) -> PartForm:
    lse = [i for i, o in enumerate(part.outputs)
           if o.target is operator.getitem and o.args[1] == 1]
    if not lse:
        return PartForm(graph, description, _same)
    (index,) = lse
    value = part.outputs[index].meta["val"]
    full = fx.GraphModule(graph, copy_graph(graph.graph))
    graph = drop_outputs(graph, {index})
    if f32:
        def place_lse(run):
            def with_lse(*inputs):
                *results, lse_value = run(*inputs)
                results.insert(index, lse_value)
                return tuple(results)

            return with_lse

        return PartForm(graph, description, place_lse, {"return_lse": True}, 1, eager=full)

    def nan_lse(run):
        def with_lse(*inputs):
            results = list(run(*inputs))
            results.insert(index, torch.full(value.shape, float("nan"), dtype=value.dtype))
            return tuple(results)

        return with_lse

    return PartForm(graph, description, nan_lse)


def copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


def drop_outputs(gm: fx.GraphModule, positions: set[int]) -> fx.GraphModule:
    """`gm` without the outputs at `positions`, and the ops only they needed."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    values = list(output.args[0])
    output.args = (tuple(v for i, v in enumerate(values) if i not in positions),)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm
