"""Recurrent layers imported as loops over one step (lighthouse.recurrences): the rolled
form against torch's own layers in eager, the import's IR (FileCheck), and compiled models
against torch (every cell, several layers, both directions, batch_first, no biases, odd
sizes, a transposed result, a second use of a state, bf16, a layer the rolled form does not take)."""

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
    def __init__(self, hidden):
        super().__init__()
        self.lstm = _layer("lstm", layers=2, hidden=hidden)

    def forward(self, x, h, c):
        out, (h, c) = self.lstm(x, (h, c))
        return out, h, c


def _imported_lstm(hidden):
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(6, 5, 7, generator=g), *_states("lstm", _layer("lstm", hidden=hidden), 5))
    return str(import_forward(_Lstm(hidden), inputs).module)


def test_the_import_is_a_loop_of_one_product_per_step():
    """Two LSTM layers of 32: per layer, [W_ih^T; W_hh^T] in panels of 32 columns, then an
    scf.for over the 6 steps whose body puts x_t and h side by side, multiplies them with
    the panels (one [5, 4, 32] product), and computes the new h and c in one elementwise
    generic; no call or custom op is left."""
    filecheck(_imported_lstm(32), r"""
        CHECK-NOT: func.call
        CHECK-LABEL: func.func @main
        CHECK: %[[PANELS:.+]] = linalg.transpose ins(%{{.*}} : tensor<39x4x32xf32>) outs(%{{.*}} : tensor<4x39x32xf32>) permutation = [1, 0, 2]
        CHECK: scf.for %{{.*}} = %c0 to %c6 step %c1 iter_args(%{{.*}} = %{{.*}}, %[[H:.+]] = %{{.*}}, %{{.*}} = %{{.*}}) -> (tensor<6x5x32xf32>, tensor<5x32xf32>, tensor<5x32xf32>)
        CHECK: %[[X:.+]] = tensor.extract_slice %arg0[%{{.*}}, 0, 0] [1, 5, 7] [1, 1, 1] : tensor<6x5x7xf32> to tensor<5x7xf32>
        CHECK: %[[A0:.+]] = tensor.insert_slice %[[X]] into %{{.*}}[0, 0] [5, 7]
        CHECK: %[[A:.+]] = tensor.insert_slice %[[H]] into %[[A0]][0, 7] [5, 32]
        CHECK: linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "parallel", "reduction"]} ins(%[[A]], %[[PANELS]] : tensor<5x39xf32>, tensor<4x39x32xf32>)
        CHECK: linalg.yield
        CHECK-NOT: linalg.matmul
        CHECK: linalg.generic {{.*}} iterator_types = ["parallel", "parallel"]}
        CHECK-COUNT-2: math.tanh
        CHECK: tensor.insert_slice
        CHECK: scf.yield
        CHECK: tensor<4x64x32xf32>
        CHECK: scf.for
        CHECK-NOT: {{torch\.(operator|aten)|lighthouse}}
    """)


def test_a_hidden_size_off_the_panels_multiplies_by_the_weights_as_they_are():
    """13 is no multiple of 32: the step's product is a plain matmul with [W_ih^T; W_hh^T]."""
    filecheck(_imported_lstm(13), r"""
        CHECK: scf.for
        CHECK: linalg.matmul ins(%{{.*}}, %{{.*}} : tensor<5x20xf32>, tensor<20x52xf32>)
        CHECK: scf.for
        CHECK: linalg.matmul ins(%{{.*}}, %{{.*}} : tensor<5x26xf32>, tensor<26x52xf32>)
    """)


MODEL = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = torch.nn.{layer}.to(torch.{dtype})
    def forward(self, x, *states):
        out, {state} = self.rnn({x}, {states})
        return {result}
def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn({x_shape}, generator=g).to(torch.{dtype})] + [
        torch.randn({state_shape}, generator=g).to(torch.{dtype}) for _ in range({count})]
def get_init_inputs():
    return []
"""


def _model(kernel_file, layer, *, x_shape, state_shape, cell="lstm", result="out, h",
           dtype="float32", x="x"):
    lstm = cell == "lstm"
    return kernel_file(MODEL.format(layer=layer, x_shape=x_shape, state_shape=state_shape, x=x,
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


@pytest.mark.parametrize("layer,cell,x,state_shape,dtype", [
    ("LSTM(6, 32, 2)", "lstm", "x", "2, 3, 32", "float64"),
    ("GRU(6, 32, 1, batch_first=True)", "gru", "x.transpose(0, 1)", "1, 3, 32", "float32"),
    ("LSTM(6, 1, 1)", "lstm", "x[:1]", "1, 3, 1", "float32"),  # one step, a hidden size of 1
    ("LSTM(6, 32, 2)", "lstm", "x", "2, 3, 32", "bfloat16"),
    ("GRU(6, 10, 1)", "gru", "x", "1, 3, 10", "bfloat16"),
])
def test_recurrent_layers_on_the_edges_match_torch(kernel_file, layer, cell, x, state_shape,
                                                   dtype):
    """f64, an input that is a transposed view, one step of one hidden unit, bf16 (the
    layer computed in f32, its results rounded once)."""
    _assert_matches(compile_kernel(_model(kernel_file, layer, cell=cell, x=x, dtype=dtype,
                                          x_shape="5, 3, 6", state_shape=state_shape,
                                          result="out, h, c" if cell == "lstm" else "out, h")))


def test_a_long_lstm_compiles_as_one_loop_per_layer(kernel_file):
    """300 steps of 3 layers: the payload is three loops, not 900 cells (an unrolled
    import of this size took minutes); the result matches torch."""
    path = _model(kernel_file, "LSTM(8, 16, 3)", x_shape="300, 2, 8", state_shape="3, 2, 16",
                  result="out[-1], h")
    imported = compile_kernel(path, stop_after="cleanup").module
    assert str(imported).count("scf.for") == 3
    _assert_matches(compile_kernel(path))


@pytest.mark.parametrize("batch, rows", [(10, 10), (12, 12), (16, 8)])
def test_a_step_of_nine_to_twelve_rows_is_one_register_tile(kernel_file, batch, rows):
    """The step's [batch, hidden] x [hidden, 4 hidden] product: 10 rows in one register tile
    (two of 5 rows had half the accumulators and read B's vectors twice:
    KernelBench 35 ran 317 -> 214 ms, torch 228 ms), 12 in one of 12, 16 in two of 8;
    against torch."""
    path = _model(kernel_file, "LSTM(16, 64, 2)", x_shape=f"7, {batch}, 16",
                  state_shape=f"2, {batch}, 64", result="out, h, c")
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    # the register tile's column of A, one value per row
    assert f"vector<{rows}x1xf32>" in vectorized
    assert not any(f"vector<{r}x1xf32>" in vectorized for r in range(2, 13) if r != rows)
    _assert_matches(compile_kernel(path))


def test_a_layer_the_rolled_form_does_not_take_still_matches_torch(kernel_file):
    """An LSTM with projections (proj_size) is traced as torch unrolls it."""
    path = _model(kernel_file, "LSTM(6, 10, 1, proj_size=4)", x_shape="5, 3, 6",
                  state_shape="1, 3, 4", result="out, h, c")
    # c0 has the hidden size, h0 the projection's
    path.write_text(path.read_text().replace(
        "for _ in range(2)]", "for _ in range(1)] + [torch.randn(1, 3, 10, generator=g)]"))
    compiled = compile_kernel(path)
    assert "lighthouse" not in str(compiled.imported.module)
    _assert_matches(compiled)


def test_the_bench_counts_the_products_of_every_step():
    """count_flops sees torch's RNN kernels as opaque: it counts the layer ops' step
    products (LSTM: [B, I + H] x [I + H, 4H] per step) and the GRU's projection matmul."""
    from lighthouse.benchmarks.measure import count_flops

    lstm, gru = _layer("lstm", layers=2), _layer("gru", layers=1)
    x = torch.rand(6, 5, 7)

    def run(layer):
        with torch.no_grad():
            return layer(x)

    assert count_flops(lambda: run(lstm)) == 2 * 6 * 5 * ((7 + 13) + (13 + 13)) * 4 * 13
    assert count_flops(lambda: run(gru)) == 2 * 6 * 5 * (7 + 13) * 3 * 13
