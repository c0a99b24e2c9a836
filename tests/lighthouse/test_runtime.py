"""Runtime: torch tensors in and out for every supported dtype; results owned by Python."""

import gc
import weakref

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.errors import UnsupportedError


def _compile(kernel_file, body, inputs):
    return compile_kernel(kernel_file(f"""
        import torch
        class Model(torch.nn.Module):
            def forward(self, *xs):
                {body}
        def get_inputs():
            return {inputs}
        def get_init_inputs():
            return []
    """))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_float_dtypes_round_trip(kernel_file, dtype):
    c = _compile(kernel_file, "return xs[0] * 2 + 1, xs[0].sum(-1)",
                 f"[torch.randn(7, 33).to(torch.{dtype})]")
    x = torch.randn(7, 33).to(getattr(torch, dtype))
    out, total = c.run(x)
    assert out.dtype == x.dtype and total.dtype == x.dtype
    torch.testing.assert_close(out, x * 2 + 1)
    torch.testing.assert_close(total, x.sum(-1), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_integer_dtypes_round_trip(kernel_file, dtype):
    c = _compile(kernel_file, "return xs[0] * 3 - xs[1], xs[0].max(-1).values",
                 f"[torch.randint(-9, 9, (5, 17), dtype=torch.{dtype}), "
                 f"torch.randint(-9, 9, (5, 17), dtype=torch.{dtype})]")
    a = torch.randint(-100, 100, (5, 17), dtype=getattr(torch, dtype))
    b = torch.randint(-100, 100, (5, 17), dtype=getattr(torch, dtype))
    out, mx = c.run(a, b)
    assert torch.equal(out, a * 3 - b) and torch.equal(mx, a.max(-1).values)


def test_bool_in_and_out(kernel_file):
    c = _compile(kernel_file, "return xs[0] & (xs[1] > 0), torch.where(xs[0], xs[1], -xs[1])",
                 "[torch.rand(9, 40) > 0.5, torch.randn(9, 40)]")
    m = torch.rand(9, 40) > 0.3
    x = torch.randn(9, 40)
    both, picked = c.run(m, x)
    assert both.dtype == torch.bool
    assert torch.equal(both, m & (x > 0))
    assert torch.equal(picked, torch.where(m, x, -x))


def test_results_are_fresh_tensors_freed_by_python(kernel_file):
    c = _compile(kernel_file, "return xs[0] + 1", "[torch.randn(256, 256)]")
    x = torch.randn(256, 256)
    first = c.run(x)[0]
    second = c.run(x)[0]
    assert first.data_ptr() != second.data_ptr() and first.data_ptr() != x.data_ptr()
    ref = weakref.ref(first)
    del first
    gc.collect()
    assert ref() is None
    torch.testing.assert_close(second, x + 1)


def test_a_bound_call_keeps_its_kernel_alive(kernel_file):
    """A thunk from `bind` outlives the Compiled it came from: the engine that holds its
    code is not freed under it (it was, and the call jumped into freed code)."""
    x = torch.randn(64, 48)
    c = _compile(kernel_file, "return xs[0] * 2 + 1", "[torch.randn(64, 48)]")
    call = c.function.bind([x])
    del c
    gc.collect()
    other = _compile(kernel_file, "return xs[0] - 3", "[torch.randn(64, 48)]")
    torch.testing.assert_close(call()[0], x * 2 + 1)
    torch.testing.assert_close(other.run(x)[0], x - 3)


def test_wrong_argument_is_a_clear_error(kernel_file):
    c = _compile(kernel_file, "return xs[0] + 1", "[torch.randn(4, 4)]")
    with pytest.raises(UnsupportedError, match=r"argument 0: expected \[4, 4\] float32, got \[4, 5\]"):
        c.run(torch.randn(4, 5))
    with pytest.raises(UnsupportedError, match="float16"):
        c.run(torch.randn(4, 4).half())


def test_non_contiguous_inputs(kernel_file):
    c = _compile(kernel_file, "return xs[0] * xs[1]", "[torch.randn(6, 8), torch.randn(6, 8)]")
    a = torch.randn(8, 6).t()
    b = torch.randn(6, 16)[:, ::2]
    torch.testing.assert_close(c.run(a, b)[0], a * b)


def test_inputs_are_never_overwritten(kernel_file):
    # torch.add with out-of-place semantics; an input used as the destination must be copied
    c = _compile(kernel_file, "return torch.add(xs[1], xs[0]), xs[1] * 2",
                 "[torch.ones(64), torch.zeros(64)]")
    a, b = torch.ones(64), torch.zeros(64)
    a0, b0 = a.clone(), b.clone()
    out, twice = c.run(a, b)
    assert torch.equal(a, a0) and torch.equal(b, b0)
    assert torch.equal(out, a0 + b0) and torch.equal(twice, b0 * 2)


def test_inputs_that_start_inside_their_storage(kernel_file):
    """x[3:], a chunk of a fused qkv, a narrowed or transposed view: the kernel reads the
    tensor's own elements, not the start of its storage."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, a, b, c):
                return a * 2.0 + b, c.sum(-1)
        def get_inputs():
            base = torch.randn(9, 4)
            qkv = torch.randn(5, 12)
            return [base[3:8], qkv.chunk(3, dim=-1)[1], torch.randn(3, 7, 5)[1].t()]
        def get_init_inputs():
            return []
    """)
    compiled = compile_kernel(path)
    for r in compiled.check():
        assert r.ok, str(r)
    a, b, c = torch.randn(10, 4)[5:], torch.randn(5, 8)[:, 2:6], torch.randn(2, 7, 5)[1].t()
    out, total = compiled.run(a, b, c)
    assert torch.equal(out, a * 2.0 + b)
    torch.testing.assert_close(total, c.sum(-1))


CHECKED_GATHER = """
#v = affine_map<(d0) -> (d0)>
module {
  func.func @main(%x: tensor<10xf32>, %i: tensor<4xi64>) -> tensor<4xf32> {
    %c0 = arith.constant 0 : i64
    %c10 = arith.constant 10 : i64
    %c7 = arith.constant 7 : i64
    linalg.generic {indexing_maps = [#v], iterator_types = ["parallel"]} ins(%i : tensor<4xi64>) {
    ^bb0(%in: i64):
      %lo = arith.cmpi sge, %in, %c0 : i64
      cf.assert %lo, "an index is negative"
      %hi = arith.cmpi slt, %in, %c10 : i64
      cf.assert %hi, "an index is 10 or more"
      linalg.yield
    }
    linalg.generic {indexing_maps = [#v], iterator_types = ["parallel"]} ins(%i : tensor<4xi64>) {
    ^bb0(%in: i64):
      %ok = arith.cmpi ne, %in, %c7 : i64
      cf.assert %ok, "seven is not allowed"
      linalg.yield
    }
    %e = tensor.empty() : tensor<4xf32>
    %r = linalg.generic {indexing_maps = [#v, #v], iterator_types = ["parallel"]} ins(%i : tensor<4xi64>) outs(%e : tensor<4xf32>) {
    ^bb0(%in: i64, %o: f32):
      %k = arith.index_cast %in : i64 to index
      %v = tensor.extract %x[%k] : tensor<10xf32>
      linalg.yield %v : f32
    } -> tensor<4xf32>
    return %r : tensor<4xf32>
  }
}
"""


def test_kernel_reported_errors_raise_in_python_instead_of_aborting():
    """Result-less assertion generics (a schedule's run-time checks) become the error code
    the CPU kernel returns last; the runtime raises the failing check's message as a
    KernelError and the process, and the compiled function, live on."""
    from torch_mlir import ir

    import transform_ext
    from lighthouse.errors import KernelError
    from lighthouse.ingress import TensorSpec
    from lighthouse.targets.cpu import CpuTarget
    from schedules.prepare import clamp_gather_indices, kernel_error_messages

    ctx = ir.Context()
    transform_ext.load(ctx)
    module = ir.Module.parse(CHECKED_GATHER, ctx)
    target = CpuTarget(threads=1)
    with ctx, ir.Location.unknown():
        clamp_gather_indices(module)
        for stage in target.stages():
            stage.run(module)
    # the gather's own bounds check (clamp_gather_indices) comes last and wins when it fails
    assert kernel_error_messages(module) == [
        "an index is negative", "an index is 10 or more", "seven is not allowed",
        "index out of range: dimension 0 of a 10 tensor has size 10"]
    fn = target.jit(module, [TensorSpec((10,), torch.float32), TensorSpec((4,), torch.int64)],
                    [TensorSpec((4,), torch.float32)])
    x = torch.randn(10)
    good = torch.tensor([0, 9, 3, 3])
    torch.testing.assert_close(fn(x, good)[0], x[good])
    for bad, message in (([0, -1, 2, 3], "index out of range"), ([0, 1, 12, 3], "index out of range"),
                         ([0, 1, 2, 7], "seven is not allowed"), ([-5, 100, 2, 7], "index out of range")):
        with pytest.raises(KernelError, match=message):
            fn(x, torch.tensor(bad))
    torch.testing.assert_close(fn(x, good)[0], x[good])  # the next good call is unaffected


STEADY_HEAP_FAULTS = """
import resource, sys, torch
from lighthouse.runtime import steady_heap
torch.set_num_threads(1)
if sys.argv[1] == "steady":
    steady_heap()
conv = torch.nn.Conv2d(3, 96, 11, stride=4, padding=2)
x = torch.rand(8, 3, 224, 224)
with torch.no_grad():
    for _ in range(3):
        conv(x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        conv(x)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3)
"""


def test_a_steady_heap_gives_torch_no_fresh_pages_per_call():
    """KernelBench 50's convolution in torch, warmed: in a fresh process each call touched
    about 4500 fresh pages (27 ms against 16 ms with the heap steady: how the timing of
    `lighthouse-compile --bench` and of the bench came to differ); with `steady_heap`, as
    every timing sets it, none."""
    import subprocess
    import sys

    faults = {}
    for mode in ("steady", "fresh"):
        out = subprocess.run([sys.executable, "-c", STEADY_HEAP_FAULTS, mode], check=True,
                             capture_output=True, text=True)
        faults[mode] = int(out.stdout.split()[-1])
    assert faults["steady"] < 50, faults
