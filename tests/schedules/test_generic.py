"""The generic schedule's register tiles: a contraction's accumulator producer (a fill, an
elementwise op) is computed per register tile, in registers; numerics against torch."""

import re

import pytest
import torch

from lighthouse.compile import compile_kernel

KERNEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, {args}):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return {inputs}
def get_init_inputs():
    return []
"""


def _compile(kernel_file, expr, inputs, args, **kw):
    return compile_kernel(kernel_file(KERNEL.format(expr=expr, inputs=inputs, args=args)),
                          schedule="generic", **kw)


def _assert_matches(compiled):
    for report in compiled.check():
        assert report.ok, str(report)


def test_matmul_register_tiles_start_from_zero_in_registers(kernel_file):
    c = _compile(kernel_file, "a @ b", "[torch.randn(24, 40, generator=g), torch.randn(40, 64, generator=g)]",
                 "a, b")
    _assert_matches(c)
    vectorized = str(_compile(kernel_file, "a @ b", "[torch.randn(24, 40), torch.randn(40, 64)]",
                              "a, b", stop_after="vectorize").module)
    # the k loop of each 8 x 32 register tile is entered with a zero vector: no fill pass, no
    # read of the accumulator from memory
    assert re.search(r"scf\.for .* iter_args\(%\w+ = %cst\w*\) -> \(vector<8x32xf32>\)", vectorized)
    assert "vector<8x32xf32>, tensor<24x64xf32>" in vectorized  # the tile is stored once
    assert not re.search(r"vector\.transfer_read %\w+\[[^]]*\][^:]*: tensor<24x64xf32>, vector<8x32xf32>",
                         vectorized)


@pytest.mark.parametrize("expr", ["(x * y).sum()", "(x * w).sum(0)", "x @ w.unsqueeze(1)"])
def test_reductions_whose_init_is_a_fill_stay_correct(kernel_file, expr):
    # full and partial reductions (no register tile): the fill is not fused into a k tile
    _assert_matches(_compile(kernel_file, expr, "[torch.randn(7, 300, generator=g), "
                             "torch.randn(7, 300, generator=g), torch.randn(300, generator=g)]",
                             "x, y, w"))


def test_row_blocks_are_sized_for_the_cache(kernel_file):
    """Layer norm over [4096, 4096] f32 (torch-mlir computes its variance in f64): the row
    blocks are not threads x 4 = 8 blocks of 512 rows (an f64 copy of 16 MiB per block,
    streamed from memory between the passes) but 1024 blocks of 4 rows (128 KiB at f64,
    the widest type the root touches); the columns are never split (the row statistics
    would be recomputed). With few rows the threads still split an elementwise op's columns."""
    c = _compile(kernel_file, "torch.nn.functional.layer_norm(x, (4096,))",
                 "[torch.randn(4096, 4096)]", "x", stop_after="fuse")
    fused = str(c.module)
    assert re.search(r"scf\.forall \(%\w+\) = \(0\) to \(4096\) step \(4\)", fused)
    assert "tensor<4x4096xf64>" in fused and "tensor<512x4096xf64>" not in fused
    small = _compile(kernel_file, "x * 2", "[torch.randn(2, 65536)]", "x", stop_after="fuse")
    assert re.search(r"scf\.forall \(%\w+, %\w+\) = \(0, 0\) to \(2, 65536\) step \(1, 16384\)",
                     str(small.module))


@pytest.mark.parametrize("rows, cols", [(67, 4096), (64, 8192)])
def test_cache_sized_row_blocks_match_torch(kernel_file, rows, cols):
    """Prime row counts (one row per block) and blocks of a few rows, softmax and layer
    norm against torch."""
    expr = "torch.softmax(x, -1), torch.nn.functional.layer_norm(x, (x.shape[-1],))"
    _assert_matches(_compile(kernel_file, expr, f"[torch.randn({rows}, {cols}, generator=g)]", "x"))
