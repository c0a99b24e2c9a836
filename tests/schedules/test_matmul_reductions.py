"""The matmul family with a reduction of the product (KernelBench level 2's Gemm + sum /
max / mean): the reduction is computed on the output tiles as they are unpacked, against
torch (odd sizes, a map before the reduction, transposed operands, a batch, columns reduced,
bf16, a second use of the product, threads), and the bufferized kernel holds no [M, N]
buffer."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from tests.transform_ext.helpers import check as filecheck

KERNEL = """
import torch
M, N, K, B = {m}, {n}, {k}, {b}
DTYPE = torch.{dtype}

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(K, N)

    def forward(self, a, b):
        return {expr}

def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({a_shape}, generator=g).to(DTYPE), torch.randn({b_shape}, generator=g).to(DTYPE)]

def get_init_inputs():
    return []
"""


def reduction_kernel(kernel_file, expr, *, m=61, n=509, k=250, b=1, dtype="float32",
                     a_shape="M, K", b_shape="K, N"):
    return kernel_file(KERNEL.format(m=m, n=n, k=k, b=b, dtype=dtype, expr=expr,
                                     a_shape=a_shape, b_shape=b_shape))


def assert_matches(compiled):
    assert compiled.family.name == "matmul", compiled.notes
    assert not compiled.notes, compiled.notes
    reports = compiled.check()
    assert reports
    for r in reports:
        assert r.ok, str(r)


def fused(path, **kwargs) -> str:
    """The bufferized IR of the compile (kernel params elided)."""
    return str(compile_kernel(path, stop_after="bufferize", **kwargs).module).split("{-#")[0]


@pytest.mark.parametrize("expr", [
    "(a @ b / 2).sum(dim=1, keepdim=True) * 1.5",                 # KernelBench 14
    "torch.sigmoid(a @ b + 0.25).sum(dim=1, keepdim=True)",        # 56
    "torch.amax(torch.relu(a @ b), dim=1)",                        # a max
    "(a @ b - 0.5).mean(dim=1, keepdim=True)",                     # 51's mean
    "(a @ b).sum(dim=0)",                                          # the rows reduced
])
@pytest.mark.parametrize("threads", [1, 2])
def test_reduction_of_the_product(kernel_file, expr, threads):
    path = reduction_kernel(kernel_file, expr)
    assert_matches(compile_kernel(path, threads=threads))


def test_the_product_is_reduced_in_its_tiles(kernel_file):
    """No [M, N] tensor after bufferization: the register tiles of C are unpacked and reduced
    in registers (the masked edge tiles too: no buffer per tile either)."""
    path = reduction_kernel(kernel_file, "torch.sigmoid(a @ b).sum(dim=1)")
    filecheck(fused(path), """
        CHECK-LABEL: func.func @main
        CHECK-NOT: 61x509xf32
        CHECK-NOT: memref.alloc(%{{.*}}) {{.*}} : memref<?x?xf32>
        CHECK: scf.parallel
        CHECK: vector.fma
        CHECK: vector.reduction <add>
        CHECK-NOT: 61x509xf32
    """)


def test_linear_layer_and_transposed_operands(kernel_file):
    """nn.Linear (x @ w.T + bias with a frozen weight) and both operands transposed."""
    linear = reduction_kernel(kernel_file, "torch.sigmoid(self.linear(a)).sum(dim=1) + b[0, :61]",
                              b_shape="K, N")
    assert_matches(compile_kernel(linear))
    transposed = reduction_kernel(kernel_file, "torch.amax(a.T @ b.T, dim=1)", a_shape="K, M",
                                  b_shape="N, K")
    assert_matches(compile_kernel(transposed))


def test_batched_product(kernel_file):
    path = reduction_kernel(kernel_file, "torch.bmm(a, b).sum(dim=-1)", m=37, n=45, k=29, b=3,
                            a_shape="B, M, K", b_shape="B, K, N")
    assert_matches(compile_kernel(path, threads=2))


def test_bf16_product_rounded_then_reduced(kernel_file):
    """torch rounds the bf16 product, then sums the bf16 values in f32 and rounds once."""
    path = reduction_kernel(kernel_file, "(a @ b).sum(dim=1)", m=40, n=72, k=64, dtype="bfloat16")
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("expr,b,a_shape,b_shape", [
    ("(a @ b).sum(dim=1)", 1, "M, K", "K, N"),
    ("(a @ b).sum(dim=2)", 2, "B, M, K", "B, K, N"),
])
def test_f16_product_of_one_tile_reduced(kernel_file, expr, b, a_shape, b_shape):
    """13 x 5 by 5 x 16 in f16 (found by the fuzzer): the reduced loop is a single tile
    and folds away, the widening of A and B is fused through the threads' forall into the
    packs (it failed, and the generic schedule took the payload)."""
    path = reduction_kernel(kernel_file, expr, m=13, n=16, k=5, b=b, dtype="float16",
                            a_shape=a_shape, b_shape=b_shape)
    assert_matches(compile_kernel(path))


def test_a_second_use_of_the_product_keeps_it(kernel_file):
    """The product is also a result: it is stored, and reduced as a separate op."""
    path = reduction_kernel(kernel_file, "(lambda c: (c.sum(dim=1), c * 2))(a @ b)")
    assert_matches(compile_kernel(path))
    filecheck(fused(path), """
        CHECK-LABEL: func.func @main
        CHECK: 61x509xf32
    """)


def test_a_logsumexp_of_two_linear_layers_refused_by_attention_is_the_matmul_familys(kernel_file):
    """KernelBench 45 (Gemm, sigmoid, Gemm, logsumexp) looks like attention to its cheap
    test; attention's check refuses it, and the choice goes on to the matmul family."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear1 = torch.nn.Linear(70, 90)
                self.linear2 = torch.nn.Linear(90, 61)
            def forward(self, x):
                return torch.logsumexp(self.linear2(torch.sigmoid(self.linear1(x))), dim=1)
        def get_inputs():
            return [torch.randn(33, 70)]
        def get_init_inputs():
            return []
        """)
    compiled = compile_kernel(path)
    assert compiled.family.name == "matmul"
    assert compiled.notes == ["the attention schedule does not apply (expected one P V "
                              "contraction after the softmax, found 0); using the matmul schedule"]
    for r in compiled.check():
        assert r.ok, str(r)
