"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) imported as loops over one time step.

torch.export unrolls `torch.lstm` / `torch.gru` / `torch.rnn_tanh` / `torch.rnn_relu` into a
cell per layer, direction and step: KernelBench's 6-layer LSTM of 512 steps became 3072
cells, a payload no compiler stage could take in time. `RolledRecurrences()`, entered while
torch.export traces a forward, computes each layer and direction instead as one op
`lighthouse::{lstm,gru,rnn}_layer`, run backwards in time for a reverse direction, and
stacks them as torch does (a bidirectional layer's output is the two directions' outputs
side by side; h_n lists the layers' final states, forward then reverse):

- LSTM and RNN: (x, [W_ih^T; W_hh^T], b_ih + b_hh, h0 [, c0]) -> (out, h_T [, c_T]); each
  step multiplies [x_t, h] by the stacked weights, one product of K = I + H;
- GRU: (P, W_hh^T, b_hn, h0) -> (out, h_T) with P = x W_ih^T + b_ih + [b_hr, b_hz, 0], the
  projection of all steps as one matmul before the loop: its n gate scales h W_hn^T + b_hn
  by r, so x's and h's parts of it stay apart.

Per step t, with M_k the k-th gate's part of the step's product (plus bias for LSTM/RNN):
    LSTM: i, f, g, o = s(M_0), s(M_1), tanh(M_2), s(M_3); c' = f c + i g, h' = o tanh(c')
    GRU:  r, z = s(P_0 + M_0), s(P_1 + M_1); n = tanh(P_2 + r (M_2 + b_hn));
          h' = (1 - z) n + z h
    RNN:  h' = tanh(M_0) or relu(M_0)
with s the logistic sigmoid 1 / (1 + exp(-x)).

The import (lighthouse.ingress) turns each layer op into a call of a private function
(`calls_for_layers`, before torch-mlir's lowering, which has no rule for the op), and after
the lowering the call into an scf.for over the steps (`lower_layer_calls`): per step one
product of the step's operand with the weights, held in panels of PANEL columns, and one
elementwise linalg.generic computing the new states; the output row is inserted at its
step. The schedules then tile and vectorize the loop body like any payload; the loop stays
sequential. At M = batch rows the step's product runs at the FMA peak: the fused x_t
product spares the [T, B, 4H] projection's trip through memory (KernelBench's LSTM: 0.88x
torch as projection + loop, 1.05x fused).

Taken: f32, f64 and bf16 layers (computed in f32, the results rounded once) on batched
dense input (not a PackedSequence), without LSTM projections (proj_size) and without
dropout while training. Other layers are traced as torch unrolls them.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

_CELLS = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}  # cell -> gates
_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# columns per panel of the loop's weights (_Layer._weights): the f32 register tile's width
# on AVX-512 (two vectors; schedules.generic.register_tile_for)
PANEL = 32
_CALLEE = re.compile(r"__lighthouse_(lstm|gru|rnn_tanh|rnn_relu)_(forward|reverse)_\d+$")


def _steps(count: int, reverse: bool):
    return range(count - 1, -1, -1) if reverse else range(count)


@torch.library.custom_op("lighthouse::lstm_layer", mutates_args=())
def lstm_layer(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor, h0: torch.Tensor,
               c0: torch.Tensor, reverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LSTM over x [T, B, I] with [W_ih^T; W_hh^T] [I + H, 4H] and b_ih + b_hh [4H]:
    (out [T, B, H], h_T, c_T)."""
    h, c, rows = h0, c0, [None] * x.shape[0]
    for t in _steps(x.shape[0], reverse):
        i, f, g, o = (torch.cat([x[t], h], dim=1) @ weight_t + bias).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        rows[t] = h
    return _stacked(rows, h0), h.clone(), c.clone()


@lstm_layer.register_fake
def _lstm_layer_fake(x, weight_t, bias, h0, c0, reverse):
    return (x.new_empty((x.shape[0], *h0.shape)), h0.new_empty(h0.shape),
            c0.new_empty(c0.shape))


@torch.library.custom_op("lighthouse::gru_layer", mutates_args=())
def gru_layer(projected: torch.Tensor, weight_hh_t: torch.Tensor, bias_hn: torch.Tensor,
              h0: torch.Tensor, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GRU recurrence over P [T, B, 3H] (b_ih and b_hr, b_hz included) with W_hh^T [H, 3H]
    and b_hn [H]: (out [T, B, H], h_T)."""
    h, rows = h0, [None] * projected.shape[0]
    hidden = h0.shape[-1]
    for t in _steps(projected.shape[0], reverse):
        m = h @ weight_hh_t
        p = projected[t]
        r = torch.sigmoid(p[:, :hidden] + m[:, :hidden])
        z = torch.sigmoid(p[:, hidden:2 * hidden] + m[:, hidden:2 * hidden])
        n = torch.tanh(p[:, 2 * hidden:] + r * (m[:, 2 * hidden:] + bias_hn))
        h = (1 - z) * n + z * h
        rows[t] = h
    return _stacked(rows, h0), h.clone()


@gru_layer.register_fake
def _gru_layer_fake(projected, weight_hh_t, bias_hn, h0, reverse):
    return projected.new_empty((projected.shape[0], *h0.shape)), h0.new_empty(h0.shape)


@torch.library.custom_op("lighthouse::rnn_layer", mutates_args=())
def rnn_layer(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor, h0: torch.Tensor,
              nonlinearity: str, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Elman RNN h' = act([x_t, h] [W_ih^T; W_hh^T] + b_ih + b_hh), act tanh or relu:
    (out [T, B, H], h_T)."""
    act = torch.tanh if nonlinearity == "tanh" else torch.relu
    h, rows = h0, [None] * x.shape[0]
    for t in _steps(x.shape[0], reverse):
        h = act(torch.cat([x[t], h], dim=1) @ weight_t + bias)
        rows[t] = h
    return _stacked(rows, h0), h.clone()


@rnn_layer.register_fake
def _rnn_layer_fake(x, weight_t, bias, h0, nonlinearity, reverse):
    return x.new_empty((x.shape[0], *h0.shape)), h0.new_empty(h0.shape)


def _stacked(rows, h0):
    return torch.stack(rows) if rows else h0.new_empty((0, *h0.shape))


class RolledRecurrences(torch.overrides.TorchFunctionMode):
    """While tracing: torch.lstm / gru / rnn_tanh / rnn_relu on batched dense f32/f64/bf16 input
    as one layer op per layer and direction (module docstring); other calls as they are."""

    _FUNCS = {torch.lstm: "lstm", torch.gru: "gru", torch.rnn_tanh: "rnn_tanh",
              torch.rnn_relu: "rnn_relu"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cell = self._FUNCS.get(func)
        if cell is not None and not kwargs and _rollable(cell, args):
            return _rolled(cell, *args)  # the mode is off inside its own handler
        return func(*args, **kwargs)


def _rollable(cell: str, args) -> bool:
    """The dense overload (input, hx, params, has_biases, num_layers, dropout, train,
    bidirectional, batch_first) on f32/f64/bf16, without projections or active dropout."""
    if len(args) != 9 or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
        return False
    x, hx, params, has_biases, num_layers, dropout, train, bidirectional, _ = args
    states = list(hx) if cell == "lstm" else [hx]
    if x.dtype not in _DTYPES or any(not isinstance(s, torch.Tensor) or s.dtype != x.dtype
                                     or s.dim() != 3 for s in states):
        return False
    per_direction = 4 if has_biases else 2
    directions = 2 if bidirectional else 1
    if len(params) != num_layers * directions * per_direction or (train and dropout > 0):
        return False
    hidden = states[0].shape[-1]
    return all(p.dtype == x.dtype for p in params) and all(
        params[i * per_direction + 1].shape == (_CELLS[cell] * hidden, hidden)
        for i in range(num_layers * directions))


def _rolled(cell, x, hx, params, has_biases, num_layers, dropout, train, bidirectional,
            batch_first):
    """torch.<cell>(...)'s results, each layer and direction through its layer op; a bf16
    layer computed in f32 and its results rounded once (bf16 products in the loop's generic
    schedule ran at 0.04x torch's)."""
    if x.dtype == torch.bfloat16:
        wide = [t.float() for t in (hx if cell == "lstm" else [hx])]
        results = _rolled(cell, x.float(), tuple(wide) if cell == "lstm" else wide[0],
                          [p.float() for p in params], has_biases, num_layers, dropout, train,
                          bidirectional, batch_first)
        return tuple(r.to(torch.bfloat16) for r in results)
    states = list(hx) if cell == "lstm" else [hx]
    per_direction = 4 if has_biases else 2
    directions = 2 if bidirectional else 1
    layer_input = x.transpose(0, 1) if batch_first else x
    finals = [[] for _ in states]
    for layer in range(num_layers):
        outs = []
        for d in range(directions):
            k = layer * directions + d
            weights = params[k * per_direction:(k + 1) * per_direction]
            results = _direction(cell, layer_input, weights, [s[k] for s in states], d == 1)
            outs.append(results[0])
            for final, value in zip(finals, results[1:]):
                final.append(value)
        layer_input = outs[0] if directions == 1 else torch.cat(outs, dim=-1)
    out = layer_input.transpose(0, 1) if batch_first else layer_input
    return (out, *(torch.stack(f) for f in finals))


def _direction(cell, x, weights, states, reverse):
    """One layer and direction as its layer op."""
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (weights[2], weights[3]) if len(weights) == 4 else (None, None)
    hidden = w_hh.shape[1]
    if cell == "gru":
        steps, batch = x.shape[:2]
        bias = None
        if b_ih is not None:
            bias = b_ih + torch.cat([b_hh[:2 * hidden], b_hh.new_zeros(hidden)])
        # the projection of all steps as one [T * B, I] matrix
        projected = F.linear(x.reshape(steps * batch, -1), w_ih, bias).reshape(steps, batch, -1)
        b_hn = b_hh[2 * hidden:] if b_hh is not None else w_hh.new_zeros(hidden)
        return torch.ops.lighthouse.gru_layer(projected, w_hh.t().contiguous(), b_hn,
                                              states[0], reverse)
    weight_t = torch.cat([w_ih, w_hh], dim=1).t().contiguous()
    bias = b_ih + b_hh if b_ih is not None else w_ih.new_zeros(w_ih.shape[0])
    if cell == "lstm":
        return torch.ops.lighthouse.lstm_layer(x, weight_t, bias, states[0], states[1], reverse)
    return torch.ops.lighthouse.rnn_layer(x, weight_t, bias, states[0],
                                          "tanh" if cell == "rnn_tanh" else "relu", reverse)


def layer_flops(op, args) -> float:
    """The FLOPs of a layer op's step products (2 per multiply-add: T products of [B, K] x
    [K, N], [K, N] the shape of its weights), 0 for any other op."""
    if op not in (torch.ops.lighthouse.lstm_layer.default, torch.ops.lighthouse.gru_layer.default,
                  torch.ops.lighthouse.rnn_layer.default):
        return 0.0
    steps, batch = args[0].shape[:2]
    depth, width = args[1].shape
    return 2.0 * steps * batch * depth * width


def calls_for_layers(module) -> int:
    """In torch-mlir's raw import, each `torch.operator "torch.lighthouse.<cell>_layer"`
    becomes a call of a private function `__lighthouse_<cell>_<direction>_<n>` of its tensor
    operands (the lowering converts calls and signatures); returns the number replaced."""
    from torch_mlir import ir
    from torch_mlir.dialects import func

    from transform_ext.common import defining_op, walk_ops

    with module.context, ir.Location.unknown():
        layers = walk_ops(module.operation, lambda op: op.name == "torch.operator" and str(
            ir.StringAttr(op.attributes["name"]).value).startswith("torch.lighthouse."))
        for n, op in enumerate(layers):
            kind = ir.StringAttr(op.attributes["name"]).value.removeprefix("torch.lighthouse.")
            tensors = [v for v in op.operands if str(v.type).startswith("!torch.vtensor")]
            constants = [defining_op(v) for v in op.operands if v not in tensors]
            reverse = ir.BoolAttr(constants[-1].attributes["value"]).value
            cell = {"lstm_layer": "lstm", "gru_layer": "gru"}.get(kind)
            if kind == "rnn_layer":
                cell = "rnn_" + ir.StringAttr(constants[0].attributes["value"]).value
            name = f"__lighthouse_{cell}_{'reverse' if reverse else 'forward'}_{n}"
            result_types = [r.type for r in op.results]
            with ir.InsertionPoint.at_block_begin(module.body):
                func.FuncOp(name, ir.FunctionType.get([v.type for v in tensors], result_types),
                            visibility="private")
            with ir.InsertionPoint(op):
                call = func.CallOp(result_types, ir.FlatSymbolRefAttr.get(name), tensors)
            for old, new in zip(op.results, call.results):
                old.replace_all_uses_with(new)
            op.erase()
        return len(layers)


def lower_layer_calls(module) -> int:
    """After the lowering to linalg: each call of a `__lighthouse_*` function becomes the
    layer's loop over its steps, and the declarations go; returns the number of calls."""
    from torch_mlir import ir

    from transform_ext.common import walk_ops

    with module.context:
        calls = walk_ops(module.operation, lambda op: op.name == "func.call" and _CALLEE.match(
            ir.FlatSymbolRefAttr(op.attributes["callee"]).value))
        for call in calls:
            cell, direction = _CALLEE.match(
                ir.FlatSymbolRefAttr(call.attributes["callee"]).value).groups()
            with ir.InsertionPoint(call), call.location:
                results = _Layer(cell, direction == "reverse", list(call.operands)).build()
            for old, new in zip(call.results, results):
                old.replace_all_uses_with(new)
            call.erase()
        for op in list(module.body.operations):
            if op.operation.name == "func.func" and _CALLEE.match(
                    ir.StringAttr(op.attributes["sym_name"]).value):
                op.operation.erase()
        return len(calls)


class _Layer:
    """The scf.for of one layer op over its steps (module docstring)."""

    def __init__(self, cell: str, reverse: bool, operands: list):
        from torch_mlir import ir

        self.cell, self.reverse = cell, reverse
        self.sequence, self.weight_t, self.bias = operands[:3]
        self.states = operands[3:]
        self.gates = _CELLS[cell]
        shape = ir.RankedTensorType(self.weight_t.type).shape
        self.hidden = shape[1] // self.gates
        # LSTM, RNN: x_t and h in one product with [W_ih^T; W_hh^T]; GRU: h alone, P given
        self.inputs = shape[0] - self.hidden
        self.steps, self.batch = ir.RankedTensorType(self.sequence.type).shape[:2]
        self.element = ir.RankedTensorType(self.sequence.type).element_type

    def build(self) -> list:
        """(out, final states...) of the loop, built at the insertion point."""
        from torch_mlir import ir
        from torch_mlir.dialects import arith, scf, tensor

        idx = ir.IndexType.get()
        hidden, batch = self.hidden, self.batch
        weights = self._weights()
        out = tensor.EmptyOp([self.steps, batch, hidden], self.element).result
        lb, ub, one = (arith.ConstantOp(idx, ir.IntegerAttr.get(idx, v)).result
                       for v in (0, self.steps, 1))
        loop = scf.ForOp(lb, ub, one, [out, *self.states])
        with ir.InsertionPoint(loop.body):
            t = loop.induction_variable
            if self.reverse:
                last = arith.ConstantOp(idx, ir.IntegerAttr.get(idx, self.steps - 1)).result
                t = arith.SubIOp(last, t).result
            rows, states = loop.inner_iter_args[0], list(loop.inner_iter_args)[1:]
            products = self._products(self._operand(t, states[0]), weights)
            new_states = self._cell(t, products, states)
            written = tensor.InsertSliceOp(new_states[0], rows, [t], [], [],
                                           [ir.ShapedType.get_dynamic_stride_or_offset(), 0, 0],
                                           [1, batch, hidden], [1, 1, 1]).result
            scf.YieldOp([written, *new_states])
        return list(loop.results)

    def _operand(self, t, h):
        """The step's A operand: h, or [x_t, h] [B, I + H] when the product takes x_t."""
        from torch_mlir import ir
        from torch_mlir.dialects import tensor

        if not self.inputs:
            return h
        a = tensor.EmptyOp([self.batch, self.inputs + self.hidden], self.element).result
        x_t = self._step_slice(self.sequence, t, 0, [self.batch, self.inputs])
        for value, column, width in ((x_t, 0, self.inputs), (h, self.inputs, self.hidden)):
            a = tensor.InsertSliceOp(value, a, [], [], [], [0, column], [self.batch, width],
                                     [1, 1]).result
        return a

    def _slice(self, value, offsets, sizes):
        from transform_ext.common import strided_slice

        return strided_slice(value, offsets, sizes, [1] * len(sizes))

    def _step_slice(self, value, t, column, sizes):
        """value[t, :, column:column + sizes[1]] as [B, width]."""
        from torch_mlir import ir
        from torch_mlir.dialects import tensor

        return tensor.ExtractSliceOp(ir.RankedTensorType.get(sizes, self.element), value, [t], [],
                                     [], [ir.ShapedType.get_dynamic_stride_or_offset(), 0, column],
                                     [1, *sizes], [1, 1, 1]).result

    def _weights(self):
        """The product's weights [K, G H] in panels of PANEL columns [G H / PANEL, K, PANEL]
        when PANEL divides H: a register tile reads its panel in order, not a row of the
        weights 4 KiB apart per k (an LSTM step's weights streamed from L3 past the
        page-bound prefetchers); else as they are."""
        from torch_mlir import ir
        from torch_mlir.dialects import linalg, tensor

        from transform_ext.common import reassociation_attr

        depth, width = ir.RankedTensorType(self.weight_t.type).shape
        if self.hidden % PANEL:
            return self.weight_t
        panels = width // PANEL
        split = tensor.ExpandShapeOp(
            ir.RankedTensorType.get([depth, panels, PANEL], self.element), self.weight_t,
            reassociation_attr([[0], [1, 2]]), [], [depth, panels, PANEL]).result
        return linalg.transpose(split, outs=[tensor.EmptyOp([panels, depth, PANEL],
                                                            self.element).result],
                                permutation=[1, 0, 2]).results[0]

    def _products(self, a, weights) -> list:
        """Each gate's [B, H] part of a W (`_weights`) from one product into a zero-filled
        [B, G H] tensor; from panels P[j, k, n]: out[b, j, n] = sum_k a[b, k] P[j, k, n],
        read as [B, G H]."""
        from torch_mlir import ir
        from torch_mlir.dialects import arith, linalg, tensor

        from transform_ext.common import build_generic, reassociation_attr

        zero = arith.ConstantOp(self.element, ir.FloatAttr.get(self.element, 0.0)).result
        width = self.gates * self.hidden
        shape = list(ir.RankedTensorType(weights.type).shape)
        if len(shape) == 2:
            init = linalg.fill(zero, outs=[tensor.EmptyOp([self.batch, width],
                                                          self.element).result])
            product = linalg.matmul(a, weights, outs=[init])
        else:
            init = linalg.fill(zero, outs=[tensor.EmptyOp([self.batch, shape[0], PANEL],
                                                          self.element).result])
            b, j, n, k = (ir.AffineDimExpr.get(d) for d in range(4))
            maps = [ir.AffineMap.get(4, 0, dims) for dims in ([b, k], [j, k, n], [b, j, n])]
            panels = build_generic(
                [a, weights], [init], maps, ["parallel", "parallel", "parallel", "reduction"],
                lambda args: [arith.AddFOp(args[2], arith.MulFOp(args[0], args[1]).result).result])
            product = tensor.CollapseShapeOp(
                ir.RankedTensorType.get([self.batch, width], self.element), panels.result,
                reassociation_attr([[0], [1, 2]])).result
        return [self._slice(product, [0, k * self.hidden], [self.batch, self.hidden])
                for k in range(self.gates)]

    def _cell(self, t, products, states) -> list:
        """The new states from the step's gate products and states (and P_t for a GRU)."""
        from torch_mlir import ir
        from torch_mlir.dialects import arith, math, tensor

        from transform_ext.common import build_generic

        element, gates, hidden = self.element, self.gates, self.hidden
        identity = ir.AffineMap.get_identity(2)
        columns = ir.AffineMap.get(2, 0, [ir.AffineDimExpr.get(1)])
        if self.cell == "gru":  # P_t's gates, the products, h, b_hn
            inputs = [self._step_slice(self.sequence, t, k * hidden, [self.batch, hidden])
                      for k in range(gates)] + products + states + [self.bias]
            maps = [identity] * (2 * gates + 1) + [columns]
        else:  # the products, each gate's bias, the states
            inputs = products + [self._slice(self.bias, [k * hidden], [hidden])
                                 for k in range(gates)] + states
            maps = [identity] * gates + [columns] * gates + [identity] * len(states)
        outs = [tensor.EmptyOp([self.batch, hidden], element).result for _ in states]
        maps += [identity] * len(outs)

        def constant(value):
            return arith.ConstantOp(element, ir.FloatAttr.get(element, value)).result

        def sigmoid(v):
            return arith.DivFOp(constant(1.0), arith.AddFOp(
                constant(1.0), math.ExpOp(arith.NegFOp(v).result).result).result).result

        def body(args):
            pre = [arith.AddFOp(a, b).result for a, b in zip(args[:gates], args[gates:2 * gates])]
            if self.cell == "lstm":
                c = args[2 * gates + 1]
                i, f, o = sigmoid(pre[0]), sigmoid(pre[1]), sigmoid(pre[3])
                g = math.TanhOp(pre[2]).result
                c_new = arith.AddFOp(arith.MulFOp(f, c).result, arith.MulFOp(i, g).result).result
                return [arith.MulFOp(o, math.TanhOp(c_new).result).result, c_new]
            if self.cell == "gru":
                p, m = args[:gates], args[gates:2 * gates]
                h, b_hn = args[2 * gates], args[2 * gates + 1]
                r, z = sigmoid(pre[0]), sigmoid(pre[1])
                n = math.TanhOp(arith.AddFOp(p[2], arith.MulFOp(
                    r, arith.AddFOp(m[2], b_hn).result).result).result).result
                keep = arith.SubFOp(constant(1.0), z).result
                return [arith.AddFOp(arith.MulFOp(keep, n).result,
                                     arith.MulFOp(z, h).result).result]
            if self.cell == "rnn_tanh":
                return [math.TanhOp(pre[0]).result]
            return [arith.MaximumFOp(pre[0], constant(0.0)).result]

        return list(build_generic(inputs, outs, maps, ["parallel", "parallel"], body).results)
