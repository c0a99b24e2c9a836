"""Causal masks read from a buffer, rewritten as index computations before the import.

MinGPT keeps its causal mask as a registered buffer, `tril(ones(N, N))`, and masks the
scores with `bias[:, :, :T, :T] == 0`. torch.export hands the buffer over as a constant, so
the attention family would see a [T, T] tensor read per score instead of a predicate on the
query and key indices (no key tiles skipped). Here every boolean value of the exported
graph computed from buffers and constants alone, shaped [1, ..., 1, L, S], is evaluated;
when it equals the half-plane

    mask[i, j] = (j - i <= delta)    or    mask[i, j] = (j - i > delta)

for some delta, it is replaced by that comparison of two `arange`s (the form torch's own
`tril` decomposes to), which the attention family reads as a causal mask with offset delta.
Exact: the value is compared in full with the predicate before it is replaced.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten


def index_causal_masks(program) -> int:
    """Rewrite the causal boolean masks computed from buffers and constants of the
    ExportedProgram `program` (module docstring); returns the number rewritten."""
    gm = program.graph_module
    known = _constant_inputs(program)
    if not known:
        return 0
    values: dict[fx.Node, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            _from_constants(node, known, values)
    rewritten = 0
    for node, value in list(values.items()):
        # the masks read by computations on the inputs
        if not (value.dtype == torch.bool and value.dim() >= 2
                and all(d == 1 for d in value.shape[:-2])
                and any(u not in values for u in node.users)):
            continue
        form = _half_plane(value.reshape(value.shape[-2:]))
        if form is not None:
            _replace(gm.graph, node, value, *form)
            rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten


def _constant_inputs(program) -> dict[fx.Node, torch.Tensor]:
    """The placeholders holding buffers and lifted constants, with their values."""
    signature = program.graph_signature
    names = {**signature.inputs_to_buffers, **signature.inputs_to_lifted_tensor_constants}
    found = {}
    for node in program.graph_module.graph.nodes:
        if node.op != "placeholder" or node.name not in names:
            continue
        key = names[node.name]
        value = program.state_dict.get(key, program.constants.get(key))
        if isinstance(value, torch.Tensor):
            found[node] = value
    return found


def _from_constants(node: fx.Node, known: dict, values: dict) -> bool:
    """Is `node` computed from the `known` inputs alone by deterministic ops? Its value is
    stored in `values` when it is (its inputs' values are there already: graph order)."""
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags or not isinstance(node.meta.get("val"),
                                                                   torch.Tensor):
        return False
    inputs = node.all_input_nodes
    if not inputs or not all(a in known or a in values for a in inputs):
        return False
    env = {**known, **values}
    args = fx.node.map_arg(node.args, lambda a: env[a])
    kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
    try:
        value = node.target(*args, **kwargs)
    except Exception:  # an op eager torch does not run here: the graph keeps it as it is
        return False
    if isinstance(value, torch.Tensor):
        values[node] = value
    return isinstance(value, torch.Tensor)


def _half_plane(mask: torch.Tensor) -> tuple[str, int] | None:
    """("le", delta) when mask[i, j] = (j - i <= delta), ("gt", delta) when it is
    (j - i > delta), for a mask holding both values; else None."""
    rows, cols = mask.shape
    if rows < 1 or cols < 1 or bool(mask.all()) or not bool(mask.any()):
        return None
    offset = torch.arange(cols)[None, :] - torch.arange(rows)[:, None]
    for kind, first in (("le", True), ("gt", False)):
        # row 0 is true (le) or false (gt) at j = 0..delta: delta from that count
        delta = int((mask[0] == first).sum()) - 1
        want = offset <= delta if kind == "le" else offset > delta
        if torch.equal(mask, want):
            return kind, delta
    return None


def _replace(graph: fx.Graph, node: fx.Node, value: torch.Tensor, kind: str, delta: int) -> None:
    """`node` becomes compare(arange(S)[None, :] - arange(L)[:, None], delta), reshaped to
    its shape."""
    rows, cols = value.shape[-2:]
    fake_mode = node.meta["val"].fake_mode

    def add(target, args, kwargs=None):
        new = graph.call_function(target, args, kwargs or {})
        with fake_mode:
            new.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]),
                                     **fx.node.map_arg(kwargs or {}, lambda a: a.meta["val"]))
        return new

    with graph.inserting_before(node):
        keys = add(aten.arange.start_step, (0, cols, 1), {"dtype": torch.int64})
        queries = add(aten.arange.start_step, (0, rows, 1), {"dtype": torch.int64})
        offset = add(aten.sub.Tensor, (add(aten.unsqueeze.default, (keys, 0)),
                                       add(aten.unsqueeze.default, (queries, 1))))
        compare = aten.le.Scalar if kind == "le" else aten.gt.Scalar
        mask = add(aten.view.default, (add(compare, (offset, delta)), list(value.shape)))
    mask.meta = {**node.meta, "val": mask.meta["val"]}
    node.replace_all_uses_with(mask)
    graph.erase_node(node)
