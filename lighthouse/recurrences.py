"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) imported as loops over one time step.

torch.export unrolls `torch.lstm` / `torch.gru` / `torch.rnn_tanh` / `torch.rnn_relu` into a
cell per layer, direction and step: KernelBench's 6-layer LSTM of 512 steps became 3072
cells, a payload no compiler stage could take in time. `RolledRecurrences()`, entered while
torch.export traces a forward, computes each layer instead as

- its input projection for all steps at once, one matmul: P = x W_ih^T + b_ih (+ b_hh for
  LSTM and RNN; for GRU only the r and z parts of b_hh, since b_hn is scaled by r);
- the recurrence over the steps, one op `lighthouse::{lstm,gru,rnn}_layer` (P, W_hh^T, h0
  [, c0 | b_hn]) -> (out, h_T [, c_T]), run backwards in time for a reverse direction;

and stacks the layers and directions as torch does (a bidirectional layer's output is the
two directions' outputs side by side; h_n lists the layers' final states, forward then
reverse). Per step t, with M_k = h W_hh,k^T the gate products:
    LSTM: i, f, g, o = s(P_0 + M_0), s(P_1 + M_1), tanh(P_2 + M_2), s(P_3 + M_3);
          c' = f c + i g, h' = o tanh(c')
    GRU:  r, z = s(P_0 + M_0), s(P_1 + M_1); n = tanh(P_2 + r (M_2 + b_hn));
          h' = (1 - z) n + z h
    RNN:  h' = tanh(P_0 + M_0) or relu(P_0 + M_0)
with s the logistic sigmoid 1 / (1 + exp(-x)).

The import (lighthouse.ingress) turns each layer op into a call of a private function
(`calls_for_layers`, before torch-mlir's lowering, which has no rule for the op), and after
the lowering the call into an scf.for over the steps (`lower_layer_calls`): per step one
matmul per gate on the running h and one elementwise linalg.generic computing the new
states, the output row inserted at its step. The schedules then tile and vectorize the
loop body like any payload; the loop stays sequential.

Taken: f32 and f64 layers on batched dense input (not a PackedSequence), without LSTM
projections (proj_size) and without dropout while training. Other layers are traced as
torch unrolls them.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

_CELLS = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}  # cell -> gates
_DTYPES = (torch.float32, torch.float64)
_CALLEE = re.compile(r"__lighthouse_(lstm|gru|rnn_tanh|rnn_relu)_(forward|reverse)_\d+$")


def _steps(count: int, reverse: bool):
    return range(count - 1, -1, -1) if reverse else range(count)


@torch.library.custom_op("lighthouse::lstm_layer", mutates_args=())
def lstm_layer(projected: torch.Tensor, weight_hh_t: torch.Tensor, h0: torch.Tensor,
               c0: torch.Tensor, reverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LSTM recurrence over P [T, B, 4H] (biases included) with W_hh^T [H, 4H]:
    (out [T, B, H], h_T, c_T)."""
    h, c, rows = h0, c0, [None] * projected.shape[0]
    for t in _steps(projected.shape[0], reverse):
        gates = projected[t] + h @ weight_hh_t
        i, f, g, o = gates.chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        rows[t] = h
    return _stacked(rows, h0), h.clone(), c.clone()


@lstm_layer.register_fake
def _lstm_layer_fake(projected, weight_hh_t, h0, c0, reverse):
    return (projected.new_empty((projected.shape[0], *h0.shape)), h0.new_empty(h0.shape),
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
def rnn_layer(projected: torch.Tensor, weight_hh_t: torch.Tensor, h0: torch.Tensor,
              nonlinearity: str, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Elman recurrence h' = act(P_t + h W_hh^T), act tanh or relu: (out [T, B, H], h_T)."""
    act = torch.tanh if nonlinearity == "tanh" else torch.relu
    h, rows = h0, [None] * projected.shape[0]
    for t in _steps(projected.shape[0], reverse):
        h = act(projected[t] + h @ weight_hh_t)
        rows[t] = h
    return _stacked(rows, h0), h.clone()


@rnn_layer.register_fake
def _rnn_layer_fake(projected, weight_hh_t, h0, nonlinearity, reverse):
    return projected.new_empty((projected.shape[0], *h0.shape)), h0.new_empty(h0.shape)


def _stacked(rows, h0):
    return torch.stack(rows) if rows else h0.new_empty((0, *h0.shape))


class RolledRecurrences(torch.overrides.TorchFunctionMode):
    """While tracing: torch.lstm / gru / rnn_tanh / rnn_relu on batched dense f32/f64 input
    as input projections and one layer op per layer and direction (module docstring)."""

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
    bidirectional, batch_first) on f32/f64, without projections or active dropout."""
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
    """torch.<cell>(...)'s results, each layer and direction through its layer op."""
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
    """One layer and direction: the projection of all steps, then the layer op."""
    w_ih, w_hh = weights[0], weights[1]
    steps, batch = x.shape[:2]

    def linear(bias):  # over the steps' rows as one [T * B, I] matrix
        return F.linear(x.reshape(steps * batch, -1), w_ih, bias).reshape(steps, batch, -1)

    b_ih, b_hh = (weights[2], weights[3]) if len(weights) == 4 else (None, None)
    hidden = w_hh.shape[1]
    weight_t = w_hh.t().contiguous()
    if cell == "gru":
        bias = None
        if b_ih is not None:
            bias = b_ih + torch.cat([b_hh[:2 * hidden], b_hh.new_zeros(hidden)])
        b_hn = b_hh[2 * hidden:] if b_hh is not None else w_hh.new_zeros(hidden)
        return torch.ops.lighthouse.gru_layer(linear(bias), weight_t, b_hn,
                                              states[0], reverse)
    bias = b_ih + b_hh if b_ih is not None else None
    projected = linear(bias)
    if cell == "lstm":
        return torch.ops.lighthouse.lstm_layer(projected, weight_t, states[0], states[1],
                                               reverse)
    return torch.ops.lighthouse.rnn_layer(projected, weight_t, states[0],
                                          "tanh" if cell == "rnn_tanh" else "relu", reverse)


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
        self.projected, self.weight_t = operands[0], operands[1]
        self.bias_hn = operands[2] if cell == "gru" else None
        self.states = operands[3:] if cell == "gru" else operands[2:]
        steps, batch, width = ir.RankedTensorType(self.projected.type).shape
        self.steps, self.batch, self.gates = steps, batch, _CELLS[cell]
        self.hidden = width // self.gates
        self.element = ir.RankedTensorType(self.projected.type).element_type

    def build(self) -> list:
        """(out, final states...) of the loop, built at the insertion point."""
        from torch_mlir import ir
        from torch_mlir.dialects import arith, scf, tensor

        idx = ir.IndexType.get()
        hidden, batch = self.hidden, self.batch
        weights = [self._slice(self.weight_t, [0, k * hidden], [hidden, hidden])
                   for k in range(self.gates)]
        out = tensor.EmptyOp([self.steps, batch, hidden], self.element).result
        lb, ub, one = (arith.ConstantOp(idx, ir.IntegerAttr.get(idx, v)).result
                       for v in (0, self.steps, 1))
        loop = scf.ForOp(lb, ub, one, [out, *self.states])
        with ir.InsertionPoint(loop.body):
            t = loop.induction_variable
            if self.reverse:
                last = arith.ConstantOp(idx, ir.IntegerAttr.get(idx, self.steps - 1)).result
                t = arith.SubIOp(last, t).result
            rows, h = loop.inner_iter_args[0], loop.inner_iter_args[1]
            projected = [self._step_slice(self.projected, t, k * hidden, [batch, hidden])
                         for k in range(self.gates)]
            products = [self._product(h, w) for w in weights]
            new_states = self._cell(projected, products, list(loop.inner_iter_args)[1:])
            written = tensor.InsertSliceOp(new_states[0], rows, [t], [], [],
                                           [ir.ShapedType.get_dynamic_stride_or_offset(), 0, 0],
                                           [1, batch, hidden], [1, 1, 1]).result
            scf.YieldOp([written, *new_states])
        return list(loop.results)

    def _slice(self, value, offsets, sizes):
        from torch_mlir import ir
        from torch_mlir.dialects import tensor

        return tensor.ExtractSliceOp(ir.RankedTensorType.get(sizes, self.element), value, [], [],
                                     [], offsets, sizes, [1] * len(sizes)).result

    def _step_slice(self, value, t, column, sizes):
        """value[t, :, column:column + sizes[1]] as [B, width]."""
        from torch_mlir import ir
        from torch_mlir.dialects import tensor

        return tensor.ExtractSliceOp(ir.RankedTensorType.get(sizes, self.element), value, [t], [],
                                     [], [ir.ShapedType.get_dynamic_stride_or_offset(), 0, column],
                                     [1, *sizes], [1, 1, 1]).result

    def _product(self, h, weight):
        """h @ weight into a zero-filled [B, H] tensor."""
        from torch_mlir import ir
        from torch_mlir.dialects import arith, linalg, tensor

        zero = arith.ConstantOp(self.element, ir.FloatAttr.get(self.element, 0.0)).result
        init = linalg.fill(zero, outs=[tensor.EmptyOp([self.batch, self.hidden],
                                                      self.element).result])
        return linalg.matmul(h, weight, outs=[init])

    def _cell(self, projected, products, states) -> list:
        """The new states from the step's projections, gate products and states."""
        from torch_mlir import ir
        from torch_mlir.dialects import arith, math, tensor

        from transform_ext.common import build_generic

        element, gates = self.element, self.gates
        inputs = projected + products + states
        identity = ir.AffineMap.get_identity(2)
        maps = [identity] * (len(inputs) + len(states))
        if self.bias_hn is not None:
            inputs.append(self.bias_hn)
            maps.insert(len(inputs) - 1, ir.AffineMap.get(2, 0, [ir.AffineDimExpr.get(1)]))
        outs = [tensor.EmptyOp([self.batch, self.hidden], element).result for _ in states]

        def constant(value):
            return arith.ConstantOp(element, ir.FloatAttr.get(element, value)).result

        def sigmoid(v):
            return arith.DivFOp(constant(1.0), arith.AddFOp(
                constant(1.0), math.ExpOp(arith.NegFOp(v).result).result).result).result

        def body(args):
            p, m = args[:gates], args[gates:2 * gates]
            pre = [arith.AddFOp(a, b).result for a, b in zip(p, m)]
            if self.cell == "lstm":
                c = args[2 * gates + 1]
                i, f, o = sigmoid(pre[0]), sigmoid(pre[1]), sigmoid(pre[3])
                g = math.TanhOp(pre[2]).result
                c_new = arith.AddFOp(arith.MulFOp(f, c).result, arith.MulFOp(i, g).result).result
                return [arith.MulFOp(o, math.TanhOp(c_new).result).result, c_new]
            if self.cell == "gru":
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
