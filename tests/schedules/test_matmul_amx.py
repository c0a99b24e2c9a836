"""bf16 products on AMX tiles (CpuDescription.amx, MatmulParams.amx): the matmul family
against torch (one and several k blocks, one step, row blocks, a batch, B^T, an epilogue,
C^T, the product read twice, m, n or k padded to multiples of 32), the products that keep
the AVX512-BF16 path (A^T), the IR of each stage (A packed by rows, the kernel left
unvectorized, then tile loops), and the parameters. The numerics need a host with AMX (the IR tests run anywhere:
the schedule only plans for the tiles; the target rewrites the loops when the host has them)."""

import dataclasses

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.runtime import allow_amx_tiles
from lighthouse.targets.description import describe_cpu, has_amx, host_cpu, with_overrides
from schedules.matmul import AMX_PAIRS, AMX_TILE, MatmulParams
from tests.schedules.test_bf16_dot_products import assert_product_matches
from tests.schedules.test_matmul import binary_kernel
from tests.transform_ext.helpers import check as filecheck

needs_amx = pytest.mark.skipif(not allow_amx_tiles(), reason="tdpbf16ps needs a host with AMX")
SPR = {1: 48 << 10, 2: 2 << 20, 3: 480 << 20}  # this project's Sapphire Rapids host's caches


def compile_amx(path, **kw):
    cpu = dataclasses.replace(host_cpu(), bf16_dot=True, amx=True)
    return compile_kernel(path, target_options={"cpu": cpu}, **kw)


ON_TILES = [
    dict(m=96, n=96, k=96),                             # one k block, 3 x 3 register tiles
    dict(m=64, n=128, k=1024),                          # two k blocks
    dict(m=256, n=64, k=64),                            # row blocks of A
    dict(m=64, n=32, k=160, b=3, expr="torch.bmm(a, b)", a_shape="B, M, K", b_shape="B, K, N"),
    dict(m=64, n=96, k=128, expr="a @ b.t()", b_shape="N, K"),           # nn.Linear's B^T
    dict(m=64, n=64, k=32),                             # one step: no loop over k
    dict(m=64, n=64, k=64, expr="torch.nn.functional.gelu(a @ b) + 1"),  # epilogue
    dict(m=32, n=64, k=64, expr="(a @ b).t().contiguous()"),             # C^T from the unpack
    dict(m=64, n=64, k=96, expr="(a @ b) * (a @ b).sum()"),              # read twice
    # padded with zeros to multiples of 32: m, n, k, all three, with an epilogue, a batch
    dict(m=40, n=64, k=64),
    dict(m=64, n=48, k=64),
    dict(m=64, n=64, k=33),
    dict(m=100, n=200, k=300),
    dict(m=32, n=17, k=32),     # n padded by B's pack only (a padded copy of B crashed LLVM)
    dict(m=17, n=17, k=17),
    dict(m=9, n=33, k=17, expr="torch.nn.functional.gelu(a @ b) + 1"),
    dict(m=37, n=45, k=70, b=2, expr="a @ b.transpose(1, 2)", a_shape="B, M, K", b_shape="B, N, K"),
]
OFF_TILES = [
    dict(m=64, n=64, k=64, expr="a.t() @ b", a_shape="K, M"),  # A^T: rows of A not contiguous
    dict(m=40, n=72, k=33, expr="a.t() @ b", a_shape="K, M"),
]


def _id(s):
    return f"{s['m']}x{s['n']}x{s['k']}" + ("_" + s["expr"].split("(")[0].strip() if "expr" in s else "")


@needs_amx
@pytest.mark.parametrize("shape", ON_TILES + OFF_TILES, ids=[_id(s) for s in ON_TILES + OFF_TILES])
def test_matmul_matches_torch(kernel_file, shape):
    assert_product_matches(compile_amx(binary_kernel(kernel_file, dtype="bfloat16", **shape)), shape)


SOME_ON = ON_TILES[:6] + ON_TILES[-3:]


@pytest.mark.parametrize("shape,on", [(s, True) for s in SOME_ON] + [(s, False) for s in OFF_TILES],
                         ids=[_id(s) for s in SOME_ON + OFF_TILES])
def test_only_fitting_products_use_the_tiles(kernel_file, shape, on):
    """The vectorize stage leaves the kernel a linalg.generic over rows x 16 pairs (and packs
    A by rows: [M, K/2, 1, 2]) exactly when A's rows are k-contiguous (A and B padded with
    zeros first when m, n or k is no multiple of 32); otherwise the register tile's steps
    are AVX512-BF16 dot products."""
    path = binary_kernel(kernel_file, dtype="bfloat16", **shape)
    vectorized = str(compile_amx(path, stop_after="vectorize").module)
    if on:
        filecheck(vectorized, f"""
            CHECK: linalg.generic
            CHECK-SAME: tensor<{{{{(1x)?}}}}{AMX_TILE}x{AMX_PAIRS}x1x2xbf16>, tensor<{{{{(1x)?}}}}1x{AMX_PAIRS}x{AMX_TILE}x2xbf16>
            CHECK-SAME: outs({{{{.*}}}} : tensor<{{{{(1x)?}}}}{AMX_TILE}x1x1x{AMX_TILE}xf32>)
        """)
        assert "x86.avx512.dot" not in vectorized
    else:
        assert "x86.avx512.dot" in vectorized
        assert "x1x2xbf16>" not in vectorized


@pytest.mark.parametrize("shape", [
    dict(m=64, n=96, k=128, expr="a @ b.t()", b_shape="N, K"),
    # n padded to 96 by the last panel's masked reads; a batch
    dict(m=40, n=80, k=128, b=2, expr="a @ b.transpose(1, 2)", a_shape="B, M, K", b_shape="B, N, K"),
], ids=["linear", "batched_n_padded"])
def test_a_k_contiguous_b_is_packed_a_line_of_pairs_at_a_time(kernel_file, shape):
    """B = W^T of nn.Linear (W [N, K], k contiguous): each packing step reads 32 rows of W
    by 16 pairs (one 64-byte line each) and transposes the pairs as 32-bit words, where one
    pair per step gathered 32 words from 32 rows (a bf16 Linear [1024, 4096] -> 1024 on one
    thread: the pack 43% of the time, 0.61x torch; 0.91x so; a masked edge panel moves its
    elements one by one, as every panel did). Against torch on AMX hosts."""
    path = binary_kernel(kernel_file, dtype="bfloat16", **shape)
    vectorized = str(compile_amx(path, stop_after="vectorize").module)
    filecheck(vectorized, f"""
        CHECK: vector.transfer_read {{{{.*}}}} vector<{AMX_TILE}x{2 * AMX_PAIRS}xbf16>
        CHECK: vector.bitcast {{{{.*}}}} : vector<{AMX_TILE}x{2 * AMX_PAIRS}xbf16> to vector<{AMX_TILE}x{AMX_PAIRS}xi32>
    """)
    if allow_amx_tiles():
        assert_product_matches(compile_amx(path), shape)


def test_target_runs_the_loops_on_tiles(kernel_file):
    """On a host with AMX, the bufferized register tiles' loops carry 2 x 2 accumulator tiles;
    without it (or Linux's grant) the loops stay linalg (correct, scalar)."""
    path = binary_kernel(kernel_file, 64, 64, 1024, dtype="bfloat16")
    bufferized = str(compile_amx(path, stop_after="bufferize").module)
    if allow_amx_tiles():
        filecheck(bufferized, """
            CHECK-COUNT-4: x86.amx.tile_load {{.*}} into !x86.amx.tile<16x16xf32>
            CHECK: scf.for {{.*}} -> (!x86.amx.tile<16x16xf32>, !x86.amx.tile<16x16xf32>, !x86.amx.tile<16x16xf32>, !x86.amx.tile<16x16xf32>)
            CHECK-COUNT-4: x86.amx.tile_mulf
            CHECK: scf.yield
            CHECK-COUNT-4: x86.amx.tile_store
        """)
    else:
        assert "x86.amx" not in bufferized


def test_amx_parameters():
    """AMX needs bf16 dot products' pairs packing; its tiles are whole register tiles and its
    k blocks whole steps; off the description, no AMX."""
    cpu = describe_cpu(frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}), SPR, 2)
    assert cpu.amx and cpu.bf16_dot
    assert not describe_cpu(frozenset({"avx512f", "avx512_bf16", "amx_tile"}), SPR, 2).amx
    assert not describe_cpu(frozenset({"avx512f", "amx_tile", "amx_bf16"}), SPR, 2).amx
    assert not with_overrides(cpu, "amx=0").amx
    assert has_amx(frozenset({"avx512_bf16", "amx_tile", "amx_bf16"}))
    params = MatmulParams.for_cpu(1, 1000, 1000, 1000, cpu, 2)
    assert params.amx
    tiles = params.for_pairs().for_amx(1024, 2048, 1024)
    assert tiles.register == (AMX_TILE, AMX_TILE)
    assert 1024 % tiles.tile_m == 2048 % tiles.tile_n == tiles.tile_m % tiles.block_m == 0
    assert tiles.tile_m % AMX_TILE == tiles.tile_n % AMX_TILE == tiles.block_m % AMX_TILE == 0
    assert 512 % tiles.tile_k == tiles.tile_k % AMX_PAIRS == 0
    # 96 = 3 x 32 rows: tiles of 64 become 32; 160 columns: 5 x 32 (tile 128 -> 32); k 480
    # = 15 steps of 16 pairs in 240 pairs: blocks of 100 pairs -> 5 steps (80)
    odd = dataclasses.replace(params, tile_m=64, tile_n=128, block_m=64, tile_k=100, register=(8, 8),
                              pair_tiles=None).for_amx(96, 160, 480)
    assert (odd.tile_m, odd.tile_n, odd.block_m, odd.tile_k) == (32, 32, 32, 80)
    assert not MatmulParams.for_cpu(1, 1024, 1024, 1024, dataclasses.replace(cpu, amx=False), 2).amx


MLP = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(96, 160).bfloat16()
        self.fc2 = torch.nn.Linear(160, 64).bfloat16()
    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))
def get_inputs():
    return [torch.randn(70, 96).bfloat16()]
def get_init_inputs():
    return []
"""


def test_both_layers_of_a_bf16_mlp_run_on_tiles(kernel_file):
    """The second layer reads the first's rounded GELU as bf16 (its widening is not fused
    with the GELU: transform_ext.fuse_elementwise_producers), so both products take the
    tiles (before, the second one was an f32 product of widened panels)."""
    path = kernel_file(MLP)
    fused = str(compile_amx(path, stop_after="fuse").module)
    assert fused.count('lh.mm_role = "amx_kernel"') == 2
    if allow_amx_tiles():
        c = compile_amx(path)
        for report in c.check():
            assert report.ok, str(report)
