"""Recurrent layers imported as loops over one step (lighthouse.recurrences): the rolled
form against torch's own layers in eager, the import's IR (FileCheck), and compiled models
against torch (every cell, several layers, both directions, batch_first, no biases, odd
sizes, a transposed result, a second use of a state, a layer the rolled form does not take)."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.ingress import import_forward
from lighthouse.recurrences import RolledRecurrences
from tests.transform_ext.helpers import check as filecheck

LAYERS = {
    "lstm": lambda **kw: torch.nn.LSTM(**kw),
    "gru": lambda **kw: torch.nn.GRU(**kw),
    "rnn_tanh": lambda **kw: torch.nn.RNN(nonlinearity="tanh", **kw),
    "rnn_relu": lambda **kw: torch.nn.RNN(nonlinearity="relu", **kw),
}


def _layer(cell, *, inputs=7, hidden=13, layers=2, bias=True, bidirectional=False,
           batch_first=False):
    torch.manual_seed(0)
    return LAYERS[cell](input_size=inputs, hidden_size=hidden, num_layers=layers, bias=bias,
                        bidirectional=bidirectional, batch_first=batch_first).eval()


def _states(cell, layer, batch):
    g = torch.Generator().manual_seed(3)
    shape = (layer.num_layers * (2 if layer.bidirectional else 1), batch, layer.hidden_size)
    h = torch.randn(shape, generator=g)
    return (h, torch.randn(shape, generator=g)) if cell == "lstm" else h


@pytest.mark.parametrize("cell", sorted(LAYERS))
@pytest.mark.parametrize("options", [
    {},
    {"bias": False},
    {"bidirectional": True, "batch_first": True},
    {"layers": 3, "bidirectional": True},
])
def test_the_rolled_form_is_torchs_layer(cell, options):
    """In eager: each layer as its input projection and the layer op equals torch's own
    layer (output and final states), batched and unbatched."""
    layer = _layer(cell, **options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*((5, 6) if layer.batch_first else (6, 5)), 7, generator=g)
    states = _states(cell, layer, 5)
    with torch.no_grad():
        want = layer(x, states)
        with RolledRecurrences():
            got = layer(x, states)
            unbatched = layer(x[:, 0] if not layer.batch_first else x[0])
        unbatched_want = layer(x[:, 0] if not layer.batch_first else x[0])
    for w, o in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)):
        torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-6)
    for w, o in zip(torch.utils._pytree.tree_leaves(unbatched_want),
                    torch.utils._pytree.tree_leaves(unbatched)):
        torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-6)


class _Lstm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = _layer("lstm", layers=2)

    def forward(self, x, h, c):
        out, (h, c) = self.lstm(x, (h, c))
        return out, h, c


def test_the_import_is_a_loop_of_a_product_per_gate():
    """Two LSTM layers: two projections at the top, then per layer an scf.for over the 6
    steps whose body has four [5, 13] x [13, 13] products and one elementwise generic, and
    no call or custom op is left."""
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(6, 5, 7, generator=g), *_states("lstm", _layer("lstm"), 5))
    imported = import_forward(_Lstm(), inputs)
    filecheck(str(imported.module), r"""
        CHECK-NOT: func.call
        CHECK-LABEL: func.func @main
        CHECK: linalg.matmul ins(%{{.*}}: tensor<30x7xf32>, tensor<7x52xf32>)
        CHECK: scf.for %{{.*}} = %c0 to %c6 step %c1 iter_args(%{{.*}} = %{{.*}}, %{{.*}} = %{{.*}}, %{{.*}} = %{{.*}}) -> (tensor<6x5x13xf32>, tensor<5x13xf32>, tensor<5x13xf32>)
        CHECK-COUNT-4: linalg.matmul ins(%{{.*}}, %{{.*}} : tensor<5x13xf32>, tensor<13x13xf32{{.*}}>)
        CHECK: linalg.generic
        CHECK: math.tanh
        CHECK: math.tanh
        CHECK: tensor.insert_slice
        CHECK: scf.yield
        CHECK: linalg.matmul ins(%{{.*}}: tensor<30x13xf32>, tensor<13x52xf32>)
        CHECK: scf.for
        CHECK-NOT: {{torch\.(operator|aten)|lighthouse}}
    """)


MODEL = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = torch.nn.{layer}.to(torch.{dtype})
    def forward(self, x, *states):
        out, {state} = self.rnn(x, {states})
        return {result}
def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn({x_shape}, generator=g).to(torch.{dtype})] + [
        torch.randn({state_shape}, generator=g).to(torch.{dtype}) for _ in range({count})]
def get_init_inputs():
    return []
"""


def _model(kernel_file, layer, *, x_shape, state_shape, cell="lstm", result="out, h",
           dtype="float32"):
    lstm = cell == "lstm"
    return kernel_file(MODEL.format(layer=layer, x_shape=x_shape, state_shape=state_shape,
                                    state="(h, c)" if lstm else "h",
                                    states="(states[0], states[1])" if lstm else "states[0]",
                                    count=2 if lstm else 1, result=result, dtype=dtype))


def _assert_matches(compiled):
    reports = compiled.check()
    assert reports
    for r in reports:
        assert r.ok, str(r)


@pytest.mark.parametrize("layer,cell,x_shape,state_shape,result", [
    ("LSTM(29, 37, 2, batch_first=True)", "lstm", "9, 11, 29", "2, 9, 37", "out, h, c"),
    ("LSTM(29, 37, 1)", "lstm", "11, 9, 29", "1, 9, 37", "out.transpose(0, 1), c"),
    ("GRU(29, 37, 2, bidirectional=True)", "gru", "11, 9, 29", "4, 9, 37", "out, h"),
    ("GRU(16, 32, 1, bias=False, batch_first=True)", "gru", "3, 17, 16", "1, 3, 32",
     "out[:, -1] * 2, out.sum(1), h"),
    ("RNN(29, 37, 2, nonlinearity='relu', bias=False)", "rnn", "11, 9, 29", "2, 9, 37",
     "out, h"),
    ("RNN(5, 8, 3, bidirectional=True, batch_first=True)", "rnn", "2, 4, 5", "6, 2, 8",
     "out, h"),
])
def test_a_compiled_recurrent_model_matches_torch(kernel_file, layer, cell, x_shape,
                                                  state_shape, result):
    _assert_matches(compile_kernel(_model(kernel_file, layer, cell=cell, x_shape=x_shape,
                                          state_shape=state_shape, result=result)))


def test_a_long_lstm_compiles_as_one_loop_per_layer(kernel_file):
    """300 steps of 3 layers: the payload is three loops, not 900 cells (an unrolled
    import of this size took minutes); the result matches torch."""
    path = _model(kernel_file, "LSTM(8, 16, 3)", x_shape="300, 2, 8", state_shape="3, 2, 16",
                  result="out[-1], h")
    imported = compile_kernel(path, stop_after="cleanup").module
    assert str(imported).count("linalg.matmul") == 3 + 3 * 4
    _assert_matches(compile_kernel(path))


@pytest.mark.parametrize("layer,dtype", [
    ("LSTM(6, 10, 1, proj_size=4)", "float32"),   # projections: unrolled as torch does
    ("GRU(6, 10, 1)", "bfloat16"),                # bf16: unrolled as torch does
])
def test_layers_the_rolled_form_does_not_take_still_match_torch(kernel_file, layer, dtype):
    state = "1, 3, 4" if "proj_size" in layer else "1, 3, 10"
    cell = "lstm" if layer.startswith("LSTM") else "gru"
    path = _model(kernel_file, layer, cell=cell, x_shape="5, 3, 6", state_shape=state,
                  dtype=dtype, result="out, h, c" if cell == "lstm" else "out, h")
    if "proj_size" in layer:  # c0 has the hidden size, h0 the projection's
        path.write_text(path.read_text().replace(
            "for _ in range(2)]", "for _ in range(1)] + [torch.randn(1, 3, 10, generator=g)]"))
    compiled = compile_kernel(path)
    assert "lighthouse" not in str(compiled.imported.module)
    _assert_matches(compiled)
