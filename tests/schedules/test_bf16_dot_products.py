"""bf16 contractions with the AVX512-BF16 dot products (CpuDescription.bf16_dot) and without:
the matmul family (odd sizes, an odd k, transposed views, a batch, an epilogue) and the linear
cross-entropy forward and backward against torch, both ways; the lowered LLVM IR calls
vdpbf16ps exactly when the description has it. The numerics with the dot products on need a
host with avx512_bf16 (the IR tests run anywhere: the code is compiled, not run)."""

import dataclasses
import re

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.targets.description import host_cpu, host_cpu_flags
from tests.schedules.test_linear_cross_entropy import assert_matches as assert_loss_matches
from tests.schedules.test_linear_cross_entropy import kernel as loss_kernel
from tests.schedules.test_matmul import binary_kernel
from tests.transform_ext.helpers import check as filecheck

DOT = "llvm.x86.avx512bf16.dpbf16ps.512"
HOST_HAS_DOT = "avx512_bf16" in host_cpu_flags() and "avx512f" in host_cpu_flags()
needs_dot = pytest.mark.skipif(not HOST_HAS_DOT, reason="vdpbf16ps needs a host with avx512_bf16")
WAYS = [pytest.param(True, marks=needs_dot, id="dot"), pytest.param(False, id="widened")]


def cpu_options(dot: bool) -> dict:
    return {"cpu": dataclasses.replace(host_cpu(), bf16_dot=dot)}


def compile_with(path, dot: bool, **kw):
    return compile_kernel(path, target_options=cpu_options(dot), **kw)


def assert_within_an_ulp(compiled):
    """Each result within one bf16 ulp of torch's (both accumulate in f32 and round once)."""
    got = compiled.run()
    want = compiled.imported.reference()
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bfloat16
        ulp = torch.finfo(torch.bfloat16).eps * w.float().abs().clamp_min(1.0)
        assert ((g.float() - w.float()).abs() <= ulp).all()


MATMULS = [
    dict(m=96, n=96, k=96),                          # divides the register tile
    dict(m=127, n=255, k=63),                        # odd k: its last pair padded with a zero
    dict(m=9, n=33, k=17),                           # one register tile and slivers
    dict(m=300, n=200, k=1001),                      # k blocks, the last partial and odd
    dict(m=37, n=45, k=300, b=3, expr="torch.bmm(a, b)", a_shape="B, M, K", b_shape="B, K, N"),
    dict(m=40, n=72, k=33, expr="a.t() @ b", a_shape="K, M"),      # transposed views
    dict(m=40, n=72, k=33, expr="a @ b.t()", b_shape="N, K"),
    dict(m=40, n=72, k=34, expr="torch.nn.functional.gelu(a @ b) + 1"),  # epilogue
    dict(m=40, n=72, k=34, expr="(a @ b).t().contiguous()"),  # C^T folded into the unpack
    dict(m=40, n=72, k=35, expr="(a @ b) * (a @ b).sum()"),  # the product read twice
    # A packed 8 pairs per step: 23 pairs (8 + 8 + 7, the last step masked), a batch with B^T
    dict(m=33, n=40, k=46),
    dict(m=17, n=33, k=50, b=2, expr="a @ b.transpose(1, 2)", a_shape="B, M, K", b_shape="B, N, K"),
    dict(m=24, n=48, k=32, expr="(a.t() @ b).t()", a_shape="K, M"),  # A^T in, C^T out
]


@pytest.mark.parametrize("dot", WAYS)
@pytest.mark.parametrize("shape", MATMULS, ids=[f"{s['m']}x{s['n']}x{s['k']}"
                                                + ("_" + s["expr"].split("(")[0] if "expr" in s else "")
                                                for s in MATMULS])
def test_matmul_matches_torch(kernel_file, dot, shape):
    assert_product_matches(compile_with(binary_kernel(kernel_file, dtype="bfloat16", **shape), dot),
                           shape)


def assert_product_matches(compiled, shape: dict):
    """The matmul family took it; within a bf16 ulp of torch, or (an epilogue or a sum after
    the product, which round more than once) within the check's tolerance."""
    assert compiled.family.name == "matmul", compiled.notes
    if any(op in shape.get("expr", "") for op in ("gelu", "sum")):
        for report in compiled.check():
            assert report.ok, str(report)
    else:
        assert_within_an_ulp(compiled)


@pytest.mark.parametrize("dot", [True, False])
def test_matmul_llvm_ir_calls_the_dot_product_only_when_on(kernel_file, dot):
    path = binary_kernel(kernel_file, 64, 64, 65, dtype="bfloat16")
    vectorized = str(compile_with(path, dot, stop_after="vectorize").module)
    llvm = str(compile_with(path, dot, stop_after="llvm").module)
    if dot:
        filecheck(vectorized, """
            CHECK-DAG: tensor.collapse_shape {{.*}} : tensor<1x1x8x2xbf16> into tensor<1x1x16xbf16>
            CHECK-DAG: tensor.collapse_shape {{.*}} : tensor<1x1x32x2xbf16> into tensor<1x1x64xbf16>
            CHECK: x86.avx512.dot {{.*}} : vector<32xbf16> -> vector<16xf32>
        """)
        filecheck(llvm, f"CHECK: llvm.call_intrinsic \"{DOT}\"")
    else:
        assert "x86.avx512.dot" not in vectorized and DOT not in llvm
        filecheck(vectorized, "CHECK: vector.contract {{.*}} : vector<1x8xf32>, vector<1x32xf32>")


def test_matmul_packs_a_by_word_transposes_and_writes_panels_whole(kernel_file):
    """With the dot products, A (k contiguous) is packed 8 pairs per step: an [8 rows, 8
    pairs] transpose of 32-bit words, written as one 128-element run of its panel; B's two
    rows interleaved by one shuffle into one 64-element write; the register tile's step over
    a pair of k is 8 x 2 dot products on 16 accumulators, four steps per iteration of its
    loop; no packing step stores rows of 2 elements (what the transfer lowering made of an
    unflattened [NR, 2] write)."""
    path = binary_kernel(kernel_file, 64, 64, 64, dtype="bfloat16")
    vectorized = str(compile_with(path, True, stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: vector.shuffle {{.*}} : vector<64xbf16>, vector<64xbf16>
        CHECK-NEXT: tensor.collapse_shape
        CHECK-NEXT: vector.transfer_write {{.*}} : vector<64xbf16>, tensor<1x1x64xbf16>
    """)
    filecheck(vectorized, """
        CHECK: vector.transfer_read {{.*}} : tensor<8x16xbf16>, vector<8x16xbf16>
        CHECK-NEXT: vector.bitcast {{.*}} : vector<8x16xbf16> to vector<8x8xi32>
        CHECK: vector.shuffle {{.*}} : vector<64xi32>, vector<64xi32>
        CHECK: vector.transfer_write {{.*}} : vector<128xbf16>, tensor<1x128xbf16>
    """)
    filecheck(vectorized, """
        CHECK: scf.for {{.*}} -> (vector<8x32xf32>)
        CHECK-COUNT-64: x86.avx512.dot
        CHECK-NOT: x86.avx512.dot
        CHECK: scf.yield {{.*}} : vector<8x32xf32>
    """)
    assert not re.search(r"vector.transfer_write .*: vector<(8|32)x2xbf16>", vectorized)


def test_contractions_packed_in_pairs_take_larger_tiles(kernel_file):
    """With the dot products a bf16 contraction's output tiles are planned with twice the
    largest tile (pair_tiles): 512 x 512 on a 1 MiB L2 and 4 MiB L3 where f32 takes 256 x 256."""
    from lighthouse.targets.description import describe_cpu
    from schedules.matmul import MatmulParams

    cpu = describe_cpu(frozenset({"avx512f", "avx512_bf16"}), {1: 48 << 10, 2: 1 << 20, 3: 4 << 20}, 2)
    params = MatmulParams.for_cpu(1, 2048, 2048, 2048, cpu, 2)
    assert (params.tile_m, params.tile_n, params.pair_tiles) == (256, 256, (512, 512))
    assert (params.for_pairs().tile_m, params.for_pairs().tile_n) == (512, 512)
    without = MatmulParams.for_cpu(1, 2048, 2048, 2048, dataclasses.replace(cpu, bf16_dot=False), 2)
    assert without.pair_tiles is None and without.for_pairs() == without
    options = {"cpu": dataclasses.replace(host_cpu(), l2_bytes=1 << 20, l3_bytes=4 << 20,
                                          bf16_dot=True)}
    for dtype, tile in (("bfloat16", 512), ("float32", 256)):
        fused = str(compile_kernel(binary_kernel(kernel_file, 1024, 1024, 1024, dtype=dtype),
                                   target_options=options, stop_after="fuse").module)
        filecheck(fused, f"CHECK: scf.forall {{{{.*}}}} in ({1024 // tile}, {1024 // tile})")


def test_f32_matmul_is_the_same_either_way(kernel_file):
    path = binary_kernel(kernel_file, 64, 64, 64)
    texts = [str(compile_with(path, dot, stop_after="vectorize").module) for dot in (True, False)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("dot", WAYS)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("d", [24, 25], ids=["even_depth", "odd_depth"])
def test_linear_cross_entropy_matches_torch(kernel_file, dot, backward, d):
    """bf16 h and W: the logits tiles (and, backward, dW and dh) as dot products over pairs
    of the depth (an odd depth's last step one FMA); N and V do not divide the tiles."""
    path = loss_kernel(kernel_file, dtype="bfloat16", n=37, d=d, v=301)
    c = compile_with(path, dot, backward=backward)
    assert c.family.name == "linear_cross_entropy" and not c.notes, c.notes
    assert_loss_matches(c)


@pytest.mark.parametrize("dot", [True, False])
def test_linear_cross_entropy_llvm_ir_calls_the_dot_product_only_when_on(kernel_file, dot):
    path = loss_kernel(kernel_file, dtype="bfloat16", n=64, d=32, v=300)
    vectorized = str(compile_with(path, dot, backward=True, stop_after="vectorize").module)
    llvm = str(compile_with(path, dot, backward=True, stop_after="llvm").module)
    if dot:
        # forward logits, and the backward's recomputed logits, dW and dh
        assert vectorized.count("x86.avx512.dot") >= 4 * 16
        # no register tile of bf16 operands is left to the FMAs
        assert not re.search(r"vector.contract .*bf16>.* into vector<8x(1x)?32xf32>", vectorized)
        filecheck(llvm, f"CHECK: llvm.call_intrinsic \"{DOT}\"")
    else:
        assert "x86.avx512.dot" not in vectorized and DOT not in llvm


def test_description_switch_from_the_environment():
    from lighthouse.errors import UnsupportedError
    from lighthouse.targets.description import describe_cpu, with_overrides

    cpu = describe_cpu(frozenset({"avx512f", "avx512_bf16"}), {}, 2)
    assert cpu.bf16_dot
    assert not describe_cpu(frozenset({"avx512f"}), {}, 2).bf16_dot
    assert not describe_cpu(frozenset({"avx2", "avx512_bf16"}), {}, 2).bf16_dot
    assert not with_overrides(cpu, "bf16_dot=0").bf16_dot
    assert with_overrides(dataclasses.replace(cpu, bf16_dot=False), "l2=1M,bf16_dot=1").bf16_dot
    with pytest.raises(UnsupportedError, match="bf16_dot=0 or bf16_dot=1"):
        with_overrides(cpu, "bf16_dot=yes")


@pytest.mark.parametrize("dot", WAYS)
def test_bf16_mlp_with_frozen_weights_matches_torch(dot):
    """nn.Linear in bf16: torch-mlir widens x and W^T to f32 copies before an f32 matmul;
    with the dot products the matmul reads the bf16 x and W in place (the widenings and
    W's transpose folded into it) and packs them in pairs; GELU and the roundings after."""
    from tests.conftest import EXAMPLES

    c = compile_with(EXAMPLES / "mlp_f16.py", dot, overrides=dict(
        DTYPE="bfloat16", BATCH=40, IN_FEATURES=72, HIDDEN=96, OUT_FEATURES=33))
    assert c.family.name == "matmul", c.notes
    if dot:
        assert "x86.avx512.dot" in str(compile_with(
            EXAMPLES / "mlp_f16.py", dot, stop_after="vectorize", overrides=dict(
                DTYPE="bfloat16", BATCH=40, IN_FEATURES=72, HIDDEN=96, OUT_FEATURES=33)).module)
    for report in c.check():
        assert report.ok, str(report)


def test_bf16_batched_product_chain_backward_takes_the_matmul_schedule(kernel_file):
    """The other ops of a matmul payload take the generic tile sizes, whose bf16 k step
    the matmul schedule read from GenericParams (it had none: the schedule failed and fell
    back to the generic one). Found by the fuzzer."""
    path = kernel_file("""
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0 = torch.nn.Linear(3, 5, bias=False).to(torch.bfloat16)
    def forward(self, x0, x1, x2):
        return self.fc0((x0 @ x1 + x2) ** 2)
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 1, 1, generator=g).bfloat16(), torch.randn(3, 1, 3, generator=g).bfloat16(),
            torch.randn(3, 1, 3, generator=g).bfloat16()]
def get_init_inputs():
    return []
""")
    c = compile_kernel(path, backward=True, schedule="matmul", strict=True)
    for report in c.check():
        assert report.ok, str(report)
