"""Split an ATen FX graph (as AOTAutograd hands a backend its forward, backward or inference
graph) into the kernels lighthouse compiles one by one.

A kernel family takes one kind of payload (an attention, a cross-entropy, a matmul, rows of
elementwise ops and reductions), and a model's graph holds many. The graph is cut, in its
own (topological) order, into parts:

- an *anchor*: one op a family compiles as a kernel of its own, with the `getitem`s that
  unpack its results (torch's CPU flash attention forward and backward, lighthouse's
  cross-entropy ops, a matmul; an attention written by hand, its matmuls and softmax:
  hand_written_attentions). Its kind names the family's form of it (`ANCHORS`). A
  matmul part also takes the views and transposes that only feed it (the matmul family
  folds a transposed operand into its packing; apart, a kernel would copy it) and the
  pointwise ops right after it that read it (its epilogue: bias, activation, residual);
- a *run*: the ops between two anchors, at most `max_ops` computing ops each (the generic
  schedule's compile time grows with the payload);
- *moves*: a run of views and copies only (the reshapes and transposes between two
  anchors), which torch runs as it is: a view costs nothing there, and the next kernel
  takes its input in any layout.

Every part reads values defined before it (graph inputs, constants, earlier parts' results)
and is a GraphModule of its own whose placeholders are those values and whose output is the
tuple of its values read after it. Cutting in graph order keeps the parts a chain: part i
reads only from parts before it. `Part.key` names a part's computation up to node names, so
two identical blocks of a model share one compiled kernel.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

aten = torch.ops.aten

# op -> the anchor kind: what family compiles it, in which form
ANCHORS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attention",
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "attention_backward",
    aten.mm.default: "matmul",
    aten.bmm.default: "matmul",
    aten.addmm.default: "matmul",
}

# ops that only reinterpret or copy their input: a run of them alone is "moves"
MOVES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
         aten.permute.default, aten.t.default, aten.transpose.int, aten.expand.default,
         aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
         aten.alias.default, aten.clone.default, aten.slice.Tensor, aten.select.int,
         aten.split.Tensor, aten.split_with_sizes.default, aten.detach.default,
         operator.getitem}


# views that need their input's strides: a part reads its inputs in any layout (a kernel's
# results are contiguous), so in a part they are reshapes (the same values: the graphs are
# functional)
_VIEWS = (aten.view.default, aten._unsafe_view.default)


def register_anchor(op, kind: str) -> None:
    """Make `op` an anchor of `kind` (lighthouse's own custom ops register themselves)."""
    ANCHORS[op] = kind


@dataclass
class Part:
    """One kernel's share of the graph: `kind` is an anchor kind or "run"."""

    kind: str  # an anchor kind, "run" or "moves"
    nodes: list[fx.Node]
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    module: fx.GraphModule | None = None

    @property
    def key(self) -> str:
        """The part's computation with its nodes numbered in order: equal keys, equal kernels."""
        return graph_key(self.module)

    def describe(self) -> str:
        ops = [n for n in self.nodes if n.op == "call_function" and n.target is not operator.getitem]
        shown = sorted({_op_name(n.target) for n in ops})
        more = f", ... ({len(shown)} kinds)" if len(shown) > 6 else ""
        return f"{self.kind} of {len(ops)} ops ({', '.join(shown[:6])}{more})"


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))
    return str(target).removeprefix("aten.") if hasattr(target, "overloadpacket") else name


def anchor_kind(node: fx.Node) -> str | None:
    return ANCHORS.get(node.target) if node.op == "call_function" else None


def split_graph(gm: fx.GraphModule, *, max_ops: int = 64) -> list[Part]:
    """The parts of `gm` in order (module docstring); each part's `module` is built. The
    views feeding a matmul that other ops read too are copied for it (`gm` changes)."""
    for node in list(gm.graph.nodes):
        if anchor_kind(node) == "matmul":
            _private_operand_moves(gm.graph, node)
    by_hand = hand_written_attentions(gm.graph)  # its last op -> its ops
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    parts: list[Part] = []
    run: list[fx.Node] = []
    computing = 0
    owned: set[fx.Node] = {n for ops in by_hand.values() for n in ops[:-1]}
    epilogue: Part | None = None  # the matmul part the next pointwise ops may join

    def flush():
        nonlocal run, computing
        if run:
            parts.append(Part("run" if computing else "moves", run))
        run, computing = [], 0

    for node in gm.graph.nodes:
        if node.op != "call_function" or node in owned:
            continue
        if node in by_hand:
            ops = by_hand[node]
            operands = [n for op in ops if op.target in (aten.bmm.default,)
                        for n in _feeding_moves(op, run)]
            run = [n for n in run if n not in operands]
            flush()
            members = sorted(set(operands + ops), key=lambda n: order[n])
            owned.update(members)
            parts.append(Part("attention", members))
            epilogue = None
            continue
        kind = anchor_kind(node)
        if kind is not None:
            operands = _feeding_moves(node, run) if kind == "matmul" else []
            run = [n for n in run if n not in operands]
            flush()
            members = operands + [node] + [u for u in node.users if u.target is operator.getitem]
            owned.update(members)
            parts.append(Part(kind, members))
            epilogue = parts[-1] if kind == "matmul" else None
            continue
        if epilogue is not None and _extends(epilogue, node):
            epilogue.nodes.append(node)
            owned.add(node)
            continue
        epilogue = None
        run.append(node)
        if _is_tuple(node):  # its getitems right after it: a part never passes a tuple on
            unpack = [u for u in node.users if u.target is operator.getitem]
            run += unpack
            owned.update(unpack)
        if node.target not in MOVES:
            computing += 1
            if computing >= max_ops:
                flush()
    flush()
    _link(gm, parts)
    return parts


_THROUGH = (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.expand.default, aten.alias.default, aten.clone.default,
            aten.unsqueeze.default, aten.squeeze.dim)


def hand_written_attentions(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Attention written by hand, softmax(scale and mask of Q K^T) V as batch matmuls around
    a softmax (MinGPT's `masked_fill` of a causal buffer), each as its ops in graph order,
    keyed by the last (the P V matmul): one part, which the attention family fuses instead
    of three kernels around an L x S tensor. Only where the probabilities are read by P V
    alone (a training graph saves them for the backward: left as they are)."""
    found = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten._softmax.default:
            continue
        after, cur = [], node
        while len(cur.users) == 1:
            (user,) = cur.users
            if user.target is aten.bmm.default and user.args[0] is cur:
                after.append(user)
                break
            if user.target not in _THROUGH:
                break
            after.append(user)
            cur = user
        if not after or after[-1].target is not aten.bmm.default:
            continue
        before = _scores_chain(node.args[0])
        if before is None:
            continue
        ops = before + [node] + after
        found[after[-1]] = ops
    return found


def _scores_chain(value) -> list[fx.Node] | None:
    """The ops from a batch matmul to `value` (the softmax's input) through pointwise ops and
    reshapes, each read once on the way, in order; None when there is no such matmul."""
    chain, cur = [], value
    while isinstance(cur, fx.Node) and cur.op == "call_function" and len(cur.users) == 1:
        chain.append(cur)
        if cur.target is aten.bmm.default:
            return chain[::-1]
        tags = getattr(cur.target, "tags", ())
        if cur.target not in _THROUGH and torch.Tag.pointwise not in tags:
            return None
        nodes = [a for a in cur.args if isinstance(a, fx.Node)]
        # the way to the scores: the input that is itself computed from a batch matmul
        ahead = [a for a in nodes if _reaches_bmm(a)]
        if len(ahead) != 1:
            return None
        cur = ahead[0]
    return None


def _reaches_bmm(node: fx.Node, depth: int = 8) -> bool:
    if node.op != "call_function" or depth == 0:
        return False
    if node.target is aten.bmm.default:
        return True
    return any(_reaches_bmm(a, depth - 1) for a in node.all_input_nodes)


def split_part(gm: fx.GraphModule, part: Part) -> list[Part] | None:
    """A run in two halves of its computing ops (each half's moves and getitems with it),
    linked anew; None when it is not a run of two computing ops or more."""
    computing = [n for n in part.nodes if n.target not in MOVES]
    if part.kind != "run" or len(computing) < 2:
        return None
    cut = part.nodes.index(computing[len(computing) // 2])
    while cut < len(part.nodes) and part.nodes[cut].target is operator.getitem:
        cut += 1
    halves = [Part("run", part.nodes[:cut]), Part("run", part.nodes[cut:])]
    for half in halves:
        if not any(n.target not in MOVES for n in half.nodes):
            half.kind = "moves"
    _link(gm, halves)
    return halves


def _private_operand_moves(graph: fx.Graph, anchor: fx.Node) -> None:
    """Each chain of moves feeding `anchor` read by other ops too is copied right before it
    for it alone (a view costs nothing to repeat, and the matmul takes it whole)."""
    for a in list(anchor.all_input_nodes):
        if a.op == "call_function" and a.target in MOVES and a.target is not operator.getitem \
                and len(a.users) > 1:
            with graph.inserting_before(anchor):
                copy = graph.node_copy(a)
            anchor.replace_input_with(a, copy)
            _private_operand_moves(graph, copy)


def _feeding_moves(anchor: fx.Node, run: list[fx.Node]) -> list[fx.Node]:
    """The moves of the open `run` that only feed `anchor` (directly or through each other),
    in graph order."""
    pulled: set[fx.Node] = set()
    pending = list(anchor.all_input_nodes)
    members = set(run)
    while pending:
        n = pending.pop()
        if n in pulled or n not in members or n.target not in MOVES \
                or n.target is operator.getitem:  # stays with the op whose result it unpacks
            continue
        if all(u is anchor or u in pulled for u in n.users):
            pulled.add(n)
            pending.extend(n.all_input_nodes)
    return [n for n in run if n in pulled]


def _extends(part: Part, node: fx.Node) -> bool:
    """May `node` join the matmul `part` as its epilogue: a pointwise op or a reshape reading
    the part's values, as large as the product (no broadcast beyond it), every other input
    defined before the part."""
    members = set(part.nodes)
    if not any(a in members for a in node.all_input_nodes):
        return False
    is_reshape = node.target in _VIEWS or node.target is aten.reshape.default
    tags = getattr(node.target, "tags", ())
    if not is_reshape and (torch.Tag.pointwise not in tags or _is_tuple(node)
                           or torch.Tag.nondeterministic_seeded in tags):
        return False  # not elementwise, several results, or random (dropout: run apart)
    product = next(n for n in part.nodes if anchor_kind(n) == "matmul").meta.get("val")
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and isinstance(product, torch.Tensor) \
        and value.numel() == product.numel()


def _link(gm: fx.GraphModule, parts: list[Part]) -> None:
    """Fill each part's inputs and outputs and build its GraphModule."""
    for part in parts:
        members = set(part.nodes)
        inputs: list[fx.Node] = []
        for n in part.nodes:
            for a in n.all_input_nodes:
                if a not in members and a not in inputs:
                    inputs.append(a)
        part.inputs = inputs
        part.outputs = [n for n in part.nodes
                        if any(u not in members for u in n.users)
                        and not (n.target is not operator.getitem and _is_tuple(n))]
        part.module = _sub_module(gm, part)


def _is_tuple(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _sub_module(gm: fx.GraphModule, part: Part) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(part.inputs):
        p = graph.placeholder(f"in{i}")
        p.meta = dict(node.meta)
        env[node] = p
    for node in part.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.target in _VIEWS:
            env[node].target = aten.reshape.default
    graph.output(tuple(env[n] for n in part.outputs))
    return fx.GraphModule(gm, graph)


def graph_key(gm: fx.GraphModule) -> str:
    """A text naming `gm`'s computation: ops, constants and the wiring by position, and the
    shape and dtype of every value (node names left out)."""
    index: dict[fx.Node, int] = {}
    lines = []

    def ref(a):
        if isinstance(a, fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(ref(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{ref(v)}" for k, v in sorted(a.items())) + "}"
        return repr(a)

    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        val = node.meta.get("val")
        spec = (f"{list(val.shape)}:{val.dtype}" if isinstance(val, torch.Tensor)
                else type(val).__name__)
        target = node.target if node.op != "call_function" else _op_name(node.target)
        if node.op == "placeholder":
            target = "in"
        lines.append(f"{node.op} {target} {ref(node.args)} {ref(node.kwargs)} {spec}")
    return "\n".join(lines)
