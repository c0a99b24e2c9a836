"""--runtime-checks: MLIR's runtime verification plus bounds checks of every vector access;
a bad access stops the process with the op and its location, correct kernels are unchanged."""

import pytest
import torch

from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.errors import KernelError
from lighthouse.targets.runtime_checks import add_vector_bounds_checks
from tests.conftest import EXAMPLES, run_cli
from tests.transform_ext.helpers import check as filecheck

GATHER = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, i):
        return x[i]
def get_inputs():
    return [torch.randn(10, 4), torch.tensor([1, 3, 2])]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("runtime_checks", [False, True])
def test_an_out_of_range_gather_index_is_a_kernel_error(kernel_file, runtime_checks):
    """torch raises on x[i] with i out of range; the kernel reports it (the read itself is
    clamped, so nothing leaves the tensor) and the call raises, with or without checks;
    in-range indices (negative ones too) run."""
    compiled = compile_kernel(kernel_file(GATHER), runtime_checks=runtime_checks)
    x = torch.randn(10, 4)
    for index in (10**9, 10, -11):
        with pytest.raises(KernelError, match="index out of range: dimension 0 of a 10x4 "
                                              "tensor has size 10"):
            compiled.run(x, torch.tensor([1, index, 2]))
    for index in (9, -10):
        (out,) = compiled.run(x, torch.tensor([1, index, 2]))
        assert torch.equal(out, x[torch.tensor([1, index, 2])])


def test_examples_pass_with_runtime_checks():
    """No false alarms on the families' kernels (edges: masked tiles, gathers, packs)."""
    cases = [("softmax.py", {"N": 7, "C": 100}, False), ("matmul.py", {"N": 77}, False),
             ("cross_entropy.py", {"N": 13, "C": 300}, True),
             ("attention.py", {"B": 1, "H": 2, "S": 70, "D": 16, "IS_CAUSAL": True}, False)]
    for name, overrides, backward in cases:
        compiled = compile_kernel(EXAMPLES / name, overrides=overrides, backward=backward,
                                  runtime_checks=True)
        for report in compiled.check():
            assert report.ok, f"{name}: {report}"


def test_vector_accesses_get_bounds_asserts():
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse("""
          func.func @f(%m: memref<8x20xf32>, %i: index, %j: index, %idx: vector<4xindex>,
                       %mask: vector<4xi1>, %pad: vector<4xf32>) -> (vector<16xf32>, vector<4xf32>) {
            %c0 = arith.constant 0 : index
            %p = arith.constant 0.0 : f32
            %a = vector.load %m[%i, %j] : memref<8x20xf32>, vector<16xf32>
            %t = vector.transfer_read %m[%i, %j], %p {in_bounds = [true]} : memref<8x20xf32>, vector<16xf32>
            %u = vector.transfer_read %m[%i, %j], %p {in_bounds = [false]} : memref<8x20xf32>, vector<16xf32>
            %g = vector.gather %m[%c0, %c0] [%idx], %mask, %pad : memref<8x20xf32>, vector<4xindex>, vector<4xi1>, vector<4xf32> into vector<4xf32>
            return %a, %g : vector<16xf32>, vector<4xf32>
          }""")
        assert add_vector_bounds_checks(module) == 4
        text = str(module)
    filecheck(text, """
        CHECK: cf.assert {{.*}}vector.load
        CHECK: vector.load
        CHECK: cf.assert {{.*}}vector.transfer_read
        CHECK-SAME: in_bounds = [true]
        CHECK: vector.transfer_read
        CHECK: cf.assert {{.*}}vector.transfer_read %arg0[%arg1, %arg2], %cst : memref
        CHECK: vector.transfer_read
        CHECK: vector.reduction <and>
        CHECK: cf.assert {{.*}}vector.gather
        CHECK: vector.gather
    """)


def _in_bounds(access: str, cases) -> None:
    """Compile `access` (a vector access to %m, a memref<8x20xf32>, at [%i, %j]) with its
    bounds check and assert the check's verdict for each ((i, j), expected)."""
    import ctypes

    from torch_mlir.execution_engine import ExecutionEngine

    from schedules.common import run_passes

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(f"""
          func.func @ok(%i: index, %j: index) -> i1 attributes {{llvm.emit_c_interface}} {{
            %m = memref.alloca() : memref<8x20xf32>
            %c0 = arith.constant 0 : index
            {access}
            %t = arith.constant true
            return %t : i1
          }}""")
        add_vector_bounds_checks(module)
        # the assert becomes a branch on the condition; read the condition back instead
        cond = [op for op in module.body.operations[0].regions[0].blocks[0].operations
                if op.operation.name == "cf.assert"][0].operands[0]
        func = module.body.operations[0]
        ret = func.regions[0].blocks[0].operations[len(func.regions[0].blocks[0].operations) - 1]
        ret.operation.operands[0] = cond
        assert_op = [op for op in func.regions[0].blocks[0].operations
                     if op.operation.name == "cf.assert"][0]
        assert_op.operation.erase()
        run_passes(module, "canonicalize, expand-strided-metadata, finalize-memref-to-llvm, "
                           "convert-vector-to-llvm, convert-arith-to-llvm, convert-func-to-llvm, "
                           "reconcile-unrealized-casts")
        engine = ExecutionEngine(module)
        for (i, j), want in cases:
            res, ci, cj = ctypes.c_bool(), ctypes.c_int64(i), ctypes.c_int64(j)
            engine.invoke("ok", ctypes.pointer(ci), ctypes.pointer(cj), ctypes.pointer(res))
            assert res.value == want, (i, j)


def test_the_in_bounds_condition_is_exact():
    """vector<16> at column j of 20 columns: j = 4 passes, j = 5 fails (and a negative row)."""
    _in_bounds("%v = vector.load %m[%i, %j] : memref<8x20xf32>, vector<16xf32>",
               [((0, 4), True), ((7, 4), True), ((0, 5), False), ((-1, 0), False),
                ((8, 0), False)])


def test_a_load_of_whole_rows_is_checked_by_rows():
    """vector<40> at [i, 0] of 20 columns reads rows i and i + 1 (upstream's fold of a
    gather linearized over the buffer): i = 6 passes, 7 and -1 fail; at a column that is
    not a constant 0 it is a spill past the row, and fails."""
    _in_bounds("%v = vector.load %m[%i, %c0] : memref<8x20xf32>, vector<40xf32>",
               [((0, 0), True), ((6, 0), True), ((7, 0), False), ((-1, 0), False)])
    _in_bounds("%v = vector.load %m[%i, %j] : memref<8x20xf32>, vector<40xf32>",
               [((0, 0), False), ((6, 0), False)])
    _in_bounds("%v = vector.load %m[%i, %c0] : memref<8x20xf32>, vector<30xf32>",
               [((0, 0), False)])


def test_runtime_checks_need_the_cpu_target():
    r = run_cli(EXAMPLES / "matmul_f16.py", "--target", "xegpu", "--runtime-checks")
    assert r.returncode == 2
    assert "--runtime-checks needs the cpu target" in r.stderr


def test_a_copy_into_a_view_with_a_strided_unit_dim_runs_with_runtime_checks(kernel_file):
    """A grouped bf16 transposed convolution copies its input into a view whose unit last
    dim has stride 2: memref.copy's lowering calls memrefCopy for it (not contiguous by its
    rule), which the JIT lacks; such copies become loops (a fuzzer finding: the JIT failed
    with 'Unknown function main' and the schedule fell back)."""
    path = kernel_file("""
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.ConvTranspose3d(8, 16, (2, 5, 1), stride=(1, 2, 2), padding=(1, 0, 0),
                                             dilation=(1, 2, 1), groups=8, bias=False).to(torch.bfloat16)

    def forward(self, x):
        return self.conv(x)

def get_inputs():
    return [torch.randn(3, 8, 6, 2, 1, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)]

def get_init_inputs():
    return []
""")
    compiled = compile_kernel(path, runtime_checks=True)
    assert compiled.family.name == "convolution" and not compiled.notes, compiled.notes
    assert all(r.ok for r in compiled.check())


SORT_DIM_0 = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        values, _ = torch.sort(x, dim=0, descending=True)
        return values * torch.arange(1.0, 8.0)
def get_inputs():
    return [torch.randn(7, 7, generator=torch.Generator().manual_seed(0))]
def get_init_inputs():
    return []
"""


def test_the_gradient_of_a_sort_along_dim_0_runs_with_runtime_checks(kernel_file):
    """Its scatter back to the input's positions reads the [7, 7] indices as one vector of
    49 (a gather of consecutive indices folded into a load): the check takes it by rows."""
    compiled = compile_kernel(kernel_file(SORT_DIM_0), backward=True, runtime_checks=True)
    for report in compiled.check():
        assert report.ok, str(report)
