"""The matmul family on payloads of many contractions, scheduled in chunks
(transform_ext.outline_contraction_chunks, plan_matmul): recurrent models unrolled over
time against torch (odd sizes, the weights as inputs so that every step packs its own,
a transposed result, a second use of the last state, bf16), and the script's chunking."""

import pytest

from lighthouse.compile import compile_kernel
from schedules.matmul import CHUNK_CONTRACTIONS
from tests.schedules.test_matmul import assert_matches
from tests.transform_ext.helpers import check as filecheck

RNN = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.i2h = torch.nn.Linear({inputs} + {hidden}, {hidden}).to(torch.{dtype})
        self.h2o = torch.nn.Linear({hidden}, {outputs}).to(torch.{dtype})
    def forward(self, x, h):
        outputs = []
        for t in range(x.shape[0]):
            h = torch.tanh(self.i2h(torch.cat((x[t], h), dim=1)))
            outputs.append(self.h2o(h))
        return {result}
def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn({steps}, {batch}, {inputs}, generator=g).to(torch.{dtype}),
            torch.randn({batch}, {hidden}, generator=g).to(torch.{dtype})]
def get_init_inputs():
    return []
"""

CELL_WEIGHTS_AS_INPUTS = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, h, w, u):
        for t in range(x.shape[0]):
            h = torch.sigmoid(x[t] @ w + h @ u) * h
        return h
def get_inputs():
    g = torch.Generator().manual_seed(2)
    return [torch.randn(12, 10, 19, generator=g), torch.randn(10, 23, generator=g),
            torch.randn(19, 23, generator=g) * 0.3, torch.randn(23, 23, generator=g) * 0.3]
def get_init_inputs():
    return []
"""


def rnn(kernel_file, *, steps=10, batch=9, inputs=29, hidden=37, outputs=11,
        result="torch.stack(outputs)", dtype="float32"):
    return kernel_file(RNN.format(steps=steps, batch=batch, inputs=inputs, hidden=hidden,
                                  outputs=outputs, result=result, dtype=dtype))


@pytest.mark.parametrize("result,outputs", [
    ("torch.stack(outputs)", 19),                    # every product packed
    ("torch.stack(outputs)", 11),                    # h2o too narrow to pack: in place
    ("torch.stack(outputs).transpose(0, 1)", 11),    # a transpose after it
    ("(torch.stack(outputs), h)", 11),               # a second use of the last state
])
def test_an_rnn_of_twenty_products_matches_torch(kernel_file, result, outputs):
    compiled = compile_kernel(rnn(kernel_file, result=result, outputs=outputs))
    assert_matches(compiled)
    assert "transform_ext.outline_contraction_chunks" in compiled.schedule_text()


def test_a_cell_reading_its_weights_as_inputs_matches_torch(kernel_file):
    """The weights are arguments: every step packs them itself (no packed constant)."""
    assert_matches(compile_kernel(kernel_file(CELL_WEIGHTS_AS_INPUTS)))


def test_a_bf16_rnn_matches_torch(kernel_file):
    assert_matches(compile_kernel(rnn(kernel_file, steps=12, dtype="bfloat16")))


def test_the_chunks_are_inlined_back_after_the_fuse_stage(kernel_file):
    """Twenty products (more than CHUNK_CONTRACTIONS): outlined, scheduled, one function
    again; a short model is not chunked."""
    assert 2 * 10 > CHUNK_CONTRACTIONS
    fused = str(compile_kernel(rnn(kernel_file), stop_after="fuse", threads=1).module)
    filecheck(fused, """
        CHECK-NOT: chunk
        CHECK:     func.func @
        CHECK-NOT: call
        CHECK:     lh.mm_role = "kernel"
    """)
    short = compile_kernel(rnn(kernel_file, steps=4), stop_after="cleanup", threads=1)
    assert "outline_contraction_chunks" not in short.schedule_text()
