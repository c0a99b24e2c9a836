"""bf16 in the scalar loops of ops the schedules leave unvectorized, and in vectors whose
rows are not whole 8-lane parts: LLVM's loop vectorizer widened their bf16 conversions to
bf16 vectors and shuffled them for strided reads, and the x86 backend aborted the process
("Cannot select: v16bf16 = X86ISD::VPERM2X128", "Do not know how to soft promote this
operator's operand!"). The fuzzer's shrunk kernels (bf16 backward of transposed
convolutions, one with a flatten + linear head; a bf16 average pooling over rows of 10) and
their neighbours, against torch; the conversions as integer ops, bit for bit against
torch's."""

import pytest
import torch
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.targets.bf16_vectors import odd_bf16_conversions_as_integer_ops
from tests.fuzz.child import _matches_exact_results
from tests.transform_ext.helpers import check as filecheck

# crashed with "Cannot select: ... v16bf16 = X86ISD::VPERM2X128"
GROUPED_TRANSPOSED_CONV = """
import torch
import torch.nn.functional as F
DTYPE = torch.bfloat16
class Model(torch.nn.Module):
    def forward(self, x0, x1, x2):
        y0 = F.conv_transpose2d(x0, x1, x2, stride=(2, 3), padding=(0, 2), dilation=(1, 1),
                                groups=12, output_padding=(1, 2))
        return F.relu(F.relu(y0))
def get_inputs():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 12, 7, 20, generator=g, dtype=DTYPE)
    x1 = torch.randn(12, 1, 2, 3, generator=g, dtype=DTYPE) * 0.707
    x2 = torch.randn(12, generator=g, dtype=DTYPE)
    return [x0, x1, x2]
def get_init_inputs():
    return []
"""

# crashed with "Do not know how to soft promote this operator's operand!"
TRANSPOSED_CONV_AND_LINEAR_HEAD = """
import torch
DTYPE = torch.bfloat16
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0 = torch.nn.ConvTranspose1d(6, 6, (3,), stride=(1,), padding=(6,), dilation=(3,),
                                              groups=6, output_padding=(0,), bias=True).to(DTYPE)
        self.fc0 = torch.nn.Linear(168, 17).to(DTYPE)
    def forward(self, x0, x1):
        return self.fc0(torch.flatten(self.conv0(x0) + x1, 1))
def get_inputs():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 6, 34, generator=g, dtype=DTYPE)
    x1 = torch.randn(1, 28, 6, generator=g, dtype=DTYPE).transpose(-2, -1)
    return [x0, x1]
def get_init_inputs():
    return []
"""

# crashed with "Do not know how to soft promote this operator's operand!": its gradient's
# vector<8x17x1xbf16> conversion reached LLVM as 136 one-lane ones
LINEAR_RESHAPED = """
import torch
DTYPE = torch.bfloat16
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0 = torch.nn.Linear(16, N, bias=False).to(DTYPE)
    def forward(self, x0):
        return self.fc0(x0).reshape(2, 8, N).reshape(2, 8 * N)
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 32, generator=g, dtype=DTYPE)[..., ::2]]
def get_init_inputs():
    return []
"""


# crashed with "Do not know how to soft promote this operator's operand!": the pooled rows of
# 10 lanes (a padded window's divisor counts the unpadded taps), extended to f32
AVERAGE_POOL_AND_MAX = """
import torch
import torch.nn.functional as F
DTYPE = torch.bfloat16
class Model(torch.nn.Module):
    def forward(self, x0):
        p0 = F.avg_pool2d(x0, (4, 10), (3, 3), (0, 1), ceil_mode=False, count_include_pad=False)
        return p0, p0.amax(-1)
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, 20, 10, generator=g, dtype=DTYPE).expand(2, 1, 20, 10)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("source", [AVERAGE_POOL_AND_MAX,
                                    AVERAGE_POOL_AND_MAX.replace("20, 10", "20, 12")],
                         ids=["rows-of-10", "rows-of-12"])
def test_fuzzer_bf16_pooling_with_ragged_rows(kernel_file, source):
    compiled = compile_kernel(kernel_file(source))
    for r in compiled.check():
        assert r.ok, str(r)


@pytest.mark.parametrize("source, dtype", [
    (GROUPED_TRANSPOSED_CONV, "bfloat16"),
    (GROUPED_TRANSPOSED_CONV, "float16"),
    (TRANSPOSED_CONV_AND_LINEAR_HEAD, "bfloat16"),
    (LINEAR_RESHAPED.replace("N", "17"), "bfloat16"),
    (LINEAR_RESHAPED.replace("N", "5"), "bfloat16"),
    (LINEAR_RESHAPED.replace("N", "24"), "bfloat16"),
], ids=["grouped-conv-transpose2d", "grouped-conv-transpose2d-f16", "conv-transpose1d-linear",
        "linear-reshaped-17", "linear-reshaped-5", "linear-reshaped-24"])
def test_fuzzer_bf16_backward_kernels_compile_and_match_torch(kernel_file, source, dtype):
    """Against torch, or where torch's own low-precision result is off (its f16 grouped
    transposed convolution's gradients are 1.4 away from the float64 ones, ours 0.001), as
    right as torch's against the float64 result (the fuzzer's rule)."""
    path = kernel_file(source.replace("torch.bfloat16", f"torch.{dtype}"))
    compiled = compile_kernel(path, backward=True)
    results = compiled.run()
    reports = compiled.check(results)
    if not all(r.ok for r in reports):
        assert _matches_exact_results(compiled, results, compiled.imported.reference(), True), \
            "; ".join(str(r) for r in reports)


CONVERSIONS = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, y):
        return (x.float() * y).to(torch.bfloat16), x * 3 + 1, y.to(torch.bfloat16)
def get_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g).to(torch.bfloat16)
    x[0] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-40])
    # ties to even both ways, a tie below 1, the largest float (rounds to inf), subnormals,
    # NaNs with payloads
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000,
                         0x00008000, 0x80018000, 0x7FC00001, 0xFFC00000, 0x00000001])
    y = torch.randn(5, 7, generator=g)
    y.view(-1)[:10] = bits.to(torch.int32).view(torch.float32)
    return [x, y.t()]
def get_init_inputs():
    return []
"""


def test_scalar_bf16_conversions_round_as_torch(kernel_file):
    """Under the loops schedule every conversion is scalar: no bf16 conversion reaches LLVM,
    and each result has torch's bits (NaNs are NaNs: torch's own payload depends on its
    code path), subnormals and overflow to inf included."""
    import importlib.util

    path = kernel_file(CONVERSIONS)
    lowered = str(compile_kernel(path, schedule="loops", stop_after="llvm").module)
    assert "llvm.fpext" not in lowered and "llvm.fptrunc" not in lowered
    spec = importlib.util.spec_from_file_location("conversions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    inputs = module.get_inputs()
    expected = module.Model()(*inputs)
    got = compile_kernel(path, schedule="loops").run()
    for ours, theirs in zip(got, expected):
        nan = torch.isnan(theirs)
        assert torch.equal(torch.isnan(ours), nan)
        assert torch.equal(ours.view(torch.int16)[~nan], theirs.view(torch.int16)[~nan])


def test_scalar_and_one_lane_bf16_conversions_become_integer_ops():
    """extf / truncf of a bf16 scalar, a vector<1xbf16>, an n-D vector whose innermost dim
    is odd and one whose rows are not whole 8-lane parts (6) become integer ops on the bits;
    a truncation to rows of 8 or 16 lanes keeps the native conversion, an extension from
    them is integer ops too (as on every lane count)."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse("""
          func.func @f(%a: bf16, %b: f32, %c: vector<1xbf16>, %d: vector<8xf32>,
                       %e: vector<4x2x1xbf16>, %f: vector<3x6xf32>, %g: vector<2x16xbf16>)
              -> (f32, bf16, vector<1xf32>, vector<8xbf16>, vector<4x2x1xf32>, vector<3x6xbf16>,
                  vector<2x16xf32>) {
            %0 = arith.extf %a : bf16 to f32
            %1 = arith.truncf %b : f32 to bf16
            %2 = arith.extf %c : vector<1xbf16> to vector<1xf32>
            %3 = arith.truncf %d : vector<8xf32> to vector<8xbf16>
            %4 = arith.extf %e : vector<4x2x1xbf16> to vector<4x2x1xf32>
            %5 = arith.truncf %f : vector<3x6xf32> to vector<3x6xbf16>
            %6 = arith.extf %g : vector<2x16xbf16> to vector<2x16xf32>
            return %0, %1, %2, %3, %4, %5, %6
              : f32, bf16, vector<1xf32>, vector<8xbf16>, vector<4x2x1xf32>, vector<3x6xbf16>,
                vector<2x16xf32>
          }""")
        assert odd_bf16_conversions_as_integer_ops(module) == 6
        module.operation.verify()
        filecheck(str(module), """
          CHECK: arith.bitcast %{{.*}} : bf16 to i16
          CHECK: arith.extui %{{.*}} : i16 to i32
          CHECK: arith.shli
          CHECK: arith.bitcast %{{.*}} : i32 to f32
          CHECK: arith.bitcast %{{.*}} : f32 to i32
          CHECK: arith.cmpf uno
          CHECK: arith.trunci %{{.*}} : i32 to i16
          CHECK: arith.bitcast %{{.*}} : i16 to bf16
          CHECK: arith.extui %{{.*}} : vector<1xi16> to vector<1xi32>
          CHECK: arith.truncf %{{.*}} : vector<8xf32> to vector<8xbf16>
          CHECK: arith.extui %{{.*}} : vector<4x2x1xi16> to vector<4x2x1xi32>
          CHECK: arith.trunci %{{.*}} : vector<3x6xi32> to vector<3x6xi16>
          CHECK: arith.extui %{{.*}} : vector<2x16xi16> to vector<2x16xi32>
          CHECK-NOT: arith.extf
          CHECK-NOT: arith.truncf
        """)
