"""The matmul family when the product is reshaped to unit dims (KernelBench level 2's
Linear + unsqueeze + 1-D pooling, `x.unsqueeze(1) @ w`, `view(B, 1, 1, N)`): reshape
propagation expands the contraction and the weight's transpose with unit dims; the transpose
is folded back to 2-D and into B's pack (no transpose of W per call), and a pooling in
windows of its stride followed by a reduction is computed on the product's register tiles.
Against torch (odd sizes, windows cut off or not dividing the register tile, other strides,
bf16, a second use of the product, two pooled layers) and FileCheck on the fused and the
bufferized IR."""

import pytest

from lighthouse.compile import compile_kernel
from tests.schedules.test_matmul_reductions import assert_matches, fused
from tests.transform_ext.helpers import check as filecheck

KERNEL = """
import torch
import torch.nn.functional as F
M, N, K = {m}, {n}, {k}
DTYPE = torch.{dtype}

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(K, N).to(DTYPE)

    def forward(self, x):
        y = self.linear(x)
        return {expr}

def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(M, K, generator=g).to(DTYPE)]

def get_init_inputs():
    return []
"""


def linear_kernel(kernel_file, expr, *, m=61, n=510, k=250, dtype="float32"):
    return kernel_file(KERNEL.format(m=m, n=n, k=k, dtype=dtype, expr=expr))


POOL_SUM = "F.max_pool1d(y.unsqueeze(1), 2).squeeze(1).sum(dim=1) * 0.5"


@pytest.mark.parametrize("expr,n", [
    (POOL_SUM, 510),                                                      # KernelBench 55
    (POOL_SUM, 509),                                                      # a window cut off
    ("(F.gelu(F.avg_pool1d(y.unsqueeze(1), 4).squeeze(1)) * 2).amax(dim=1)", 508),  # 98
    ("F.avg_pool1d(y.unsqueeze(1), 16).squeeze(1).sum(dim=1)", 70),       # a window of 16
    ("F.max_pool1d(y.t().unsqueeze(1), 2).squeeze(1).amax(dim=1)", 130),  # the rows pooled
    ("F.max_pool1d(y.unsqueeze(1), 2).squeeze(1).sum(dim=0)", 130),       # pooled dim kept
    ("F.max_pool1d(y.unsqueeze(1), 3).squeeze(1).sum(dim=1)", 130),       # 3 does not divide NR
    ("F.max_pool1d(y.unsqueeze(1), 3, 2).squeeze(1).sum(dim=1)", 130),    # stride < window
    ("torch.relu(F.max_pool1d(y.unsqueeze(1), 2).squeeze(1))", 130),      # no reduction after
    ("torch.relu(y.view(M, 1, 1, N))", 509),                              # a 4-D result
    ("y.unsqueeze(1).unsqueeze(3) * 3", 33),                              # unit dims inside
])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_layer_reshaped_to_unit_dims(kernel_file, expr, n, threads):
    assert_matches(compile_kernel(linear_kernel(kernel_file, expr, n=n), threads=threads))


def test_unsqueezed_operand_of_a_matmul(kernel_file):
    """`x.unsqueeze(1) @ w`: a batch of one-row products over a unit dim."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, x, w):
                return torch.tanh(x.unsqueeze(1) @ w.t()).squeeze(1)
        def get_inputs():
            g = torch.Generator().manual_seed(0)
            return [torch.randn(37, 130, generator=g), torch.randn(257, 130, generator=g)]
        def get_init_inputs():
            return []
    """)
    assert_matches(compile_kernel(path))


def test_two_linear_layers_each_pooled(kernel_file):
    """Two transposes and two poolings expanded with unit dims, each folded at its place."""
    path = kernel_file("""
        import torch
        import torch.nn.functional as F
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.first = torch.nn.Linear(100, 96)
                self.second = torch.nn.Linear(48, 66)
            def forward(self, x):
                h = F.max_pool1d(self.first(x).unsqueeze(1), 2).squeeze(1)
                return F.avg_pool1d(self.second(h).unsqueeze(1), 2).squeeze(1).sum(dim=1)
        def get_inputs():
            return [torch.randn(45, 100, generator=torch.Generator().manual_seed(0))]
        def get_init_inputs():
            return []
    """)
    assert_matches(compile_kernel(path))


def test_transposes_that_only_move_unit_dims(kernel_file):
    """Transposes that are copies once their unit dims are dropped ([1, M N] -> [M N, 1],
    [1, M, K] -> [M, 1, K]) fold away."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, a, b, c):
                y = (a @ b).reshape(1, -1).t()
                z = a.unsqueeze(0).transpose(0, 1) @ b
                return y * c.reshape(-1, 1), torch.tanh(z)
        def get_inputs():
            g = torch.Generator().manual_seed(0)
            return [torch.randn(40, 30, generator=g), torch.randn(30, 50, generator=g),
                    torch.randn(40, 50, generator=g)]
        def get_init_inputs():
            return []
    """)
    assert_matches(compile_kernel(path))


def test_backward_of_a_transposed_batch_of_one(kernel_file):
    """The fuzzer: the backward of x.transpose(-2, -1) @ w over a batch of one holds
    [1, K, M] -> [1, M, K] (a transpose with a unit dim) and [K, 1, M] -> [1, K, M] (a copy
    once the unit dim is dropped: left as it is); f16."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, x0, x1):
                return x0.transpose(-2, -1) @ x1
        def get_inputs():
            g = torch.Generator().manual_seed(0)
            return [torch.randn(4, 33, 65, generator=g, dtype=torch.float16)[3:],
                    (torch.randn(130, 33, generator=g, dtype=torch.float16) * 0.174).t()]
        def get_init_inputs():
            return []
    """)
    compiled = compile_kernel(path, backward=True)
    assert not compiled.notes, compiled.notes
    assert_matches(compiled)


def test_second_use_of_the_product(kernel_file):
    """The product is pooled and also returned: both outputs match."""
    path = linear_kernel(kernel_file, "(F.max_pool1d(y.unsqueeze(1), 2).squeeze(1).sum(dim=1), y * 2)",
                         n=130)
    assert_matches(compile_kernel(path))


def test_bf16_linear_layer_before_pooling(kernel_file):
    path = linear_kernel(kernel_file, POOL_SUM, n=190, dtype="bfloat16")
    assert_matches(compile_kernel(path))


def test_the_weights_transpose_folds_into_the_pack(kernel_file):
    """W^T, expanded to [K, 1, 1, N] by reshape propagation, is not a transpose of its own
    (no scf.forall copying W per call): B's pack reads W [N, K] in place, n-major."""
    module = compile_kernel(linear_kernel(kernel_file, POOL_SUM, m=64, n=512, k=256), stop_after="fuse").module
    filecheck(str(module).split("{-#")[0], """
        CHECK-LABEL: func.func @main
        CHECK-NOT: linalg.transpose
        CHECK-NOT: x1x1x512xf32
        CHECK: linalg.pack %{{.*}} outer_dims_perm = [0, 1] inner_dims_pos = [0] inner_tiles = [32] {{.*}}lh.mm_role = "pack_b"{{.*}} : tensor<32x16xf32>
        CHECK-NOT: linalg.transpose
    """)


def test_the_pooling_and_its_sum_are_computed_on_the_register_tiles(kernel_file):
    """No [M, N] product nor [M, N / 2] pooled tensor after bufferization: each 8 x 32
    register tile of C is unpacked, pooled in pairs of columns into 8 x 16 (a loop nest over
    the tile: the windowed read has no vector form) and summed in registers."""
    filecheck(fused(linear_kernel(kernel_file, POOL_SUM, m=64, n=512, k=200)), """
        CHECK-LABEL: func.func @main
        CHECK-NOT: 64x512xf32
        CHECK-NOT: 64x256xf32
        CHECK: scf.parallel
        CHECK: vector.fma
        CHECK: scf.for
        CHECK: linalg.generic {{.*}} ins(%{{.*}}, %{{.*}} : memref<8x32xf32>, memref<2xf32>) outs(%{{.*}} : memref<8x16xf32>)
        CHECK: arith.maximumf
        CHECK: vector.reduction <add>
        CHECK-NOT: 64x512xf32
        CHECK-NOT: 64x256xf32
    """)
