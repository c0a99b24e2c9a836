"""Streaming stores of large results (lighthouse.targets.streaming_stores): FileCheck of the
rewrite on hand-written loops and of what it declines, and kernels compiled with a tiny
threshold against torch (an unaligned streaming store faults, so a wrong proof crashes)."""

import dataclasses

import pytest
import torch
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.runtime import RESULT_ALIGNMENT, line_aligned_empty
from lighthouse.targets.description import STREAM_BYTES, host_cpu, with_overrides
from lighthouse.targets.streaming_stores import fence_streaming_stores, stream_large_results
from schedules.common import run_passes
from tests.transform_ext.helpers import check as filecheck
from tests.transform_ext.helpers import rewritten

TEMPLATE = """
func.func @rows(%in: memref<64x{cols}xf32>, %out: memref<64x{cols}xf32>) {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %step = arith.constant {step} : index
  %rows = arith.constant {rows} : index
  %end = arith.constant {end} : index
  %c64 = arith.constant 64 : index
  %f0 = arith.constant 0.0 : f32
  scf.parallel (%i) = (%c0) to (%c64) step (%rows) {{
    %tile = memref.subview %out[%i, 0] [{rows}, {cols}] [1, 1]
        : memref<64x{cols}xf32> to memref<{rows}x{cols}xf32, strided<[{cols}, 1], offset: ?>>
    scf.for %j = %c0 to %end step %step {{
      %v = vector.transfer_read %in[%i, %j], %f0 {{in_bounds = [true, true]}}
          : memref<64x{cols}xf32>, vector<{rows}x{lanes}xf32>
      vector.transfer_write %v, %tile[%c0, %j] {{in_bounds = [true, {in_bounds}]}}
          : vector<{rows}x{lanes}xf32>, memref<{rows}x{cols}xf32, strided<[{cols}, 1], offset: ?>>
    }}
    {extra}
    scf.reduce
  }}
  return
}}
"""
ROW = dict(cols=64, step=16, rows=1, end=64, lanes=16, in_bounds="true", extra="")
ROWS = TEMPLATE.format(**ROW)


def _streamed(source: str, min_bytes: int = 1) -> tuple[int, str]:
    return rewritten(source, lambda module: stream_large_results(module, min_bytes))


def test_a_row_of_whole_lines_at_line_offsets_is_streamed():
    count, text = _streamed(ROWS)
    assert count == 1
    filecheck(text, """
        CHECK: scf.for %[[J:.*]] = %{{.*}} step
        CHECK: %[[V:.*]] = vector.transfer_read
        CHECK: %[[ROW:.*]] = vector.extract %[[V]][0] : vector<16xf32> from vector<1x16xf32>
        CHECK: vector.store %[[ROW]], %{{.*}}[%{{.*}}, %[[J]]] {alignment = 64 : i64, nontemporal = true}
        CHECK-NOT: vector.transfer_write
    """)


def test_a_tile_of_rows_is_streamed_row_by_row():
    """A [4, 16] tile at rows i..i+3: four line stores, at rows +0 .. +3."""
    count, text = _streamed(TEMPLATE.format(**{**ROW, "rows": 4}))
    assert count == 1
    filecheck(text, """
        CHECK: vector.store %{{.*}}, %{{.*}}[%[[R:.*]], %[[J:.*]]] {alignment = 64 : i64, nontemporal = true}
        CHECK: %[[R1:.*]] = arith.addi %[[R]], %{{.*}}
        CHECK: vector.store %{{.*}}, %{{.*}}[%[[R1]], %[[J]]] {alignment = 64 : i64, nontemporal = true}
        CHECK-COUNT-2: vector.store {{.*}}nontemporal = true
        CHECK-NOT: vector.transfer_write
    """)


@pytest.mark.parametrize("change, reason", [
    (dict(step=8, lanes=8, end=64), "columns at multiples of 8 floats: 32-byte offsets, half lines"),
    (dict(step=8, end=48), "whole lines at 32-byte offsets"),
    (dict(cols=60, end=32), "rows of 60 floats: the next row starts 240 bytes on"),
    (dict(extra="%r = vector.transfer_read %out[%i, %c0], %f0 {in_bounds = [true]}"
                 " : memref<64x64xf32>, vector<16xf32>"), "the result is read"),
    (dict(in_bounds="false"), "a store that may leave the row (masked)"),
])
def test_stores_that_are_not_whole_aligned_lines_of_an_unread_result_stay(change, reason):
    count, text = _streamed(TEMPLATE.format(**{**ROW, **change}))
    assert count == 0, reason
    assert "nontemporal" not in text


def test_a_called_function_keeps_ordinary_stores():
    """Its arguments are views its caller chose, of any alignment."""
    caller = """
func.func @entry(%in: memref<64x64xf32>, %out: memref<64x64xf32>) {
  func.call @rows(%in, %out) : (memref<64x64xf32>, memref<64x64xf32>) -> ()
  return
}
"""
    assert _streamed(ROWS + caller)[0] == 0


def test_a_result_below_the_threshold_keeps_ordinary_stores():
    assert _streamed(ROWS, min_bytes=64 * 64 * 4 + 1)[0] == 0
    assert _streamed(ROWS, min_bytes=64 * 64 * 4)[0] == 1


def test_fences_end_each_parallel_region_and_the_function():
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(ROWS)
        stream_large_results(module, 1)
        run_passes(module, "convert-scf-to-openmp{num-threads=2}")
        assert fence_streaming_stores(module) == 2
        text = str(module)
    filecheck(text, """
        CHECK: omp.parallel
        CHECK: vector.store {{.*}}nontemporal = true
        CHECK: omp.yield
        CHECK: llvm.call_intrinsic "llvm.x86.sse.sfence"
        CHECK-NEXT: omp.terminator
        CHECK: llvm.call_intrinsic "llvm.x86.sse.sfence"
        CHECK-NEXT: return
    """)


KERNEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, y):
        s = torch.softmax(x, -1)
        return s, x * 2, (y * 3).t(), (x * 0.5).bfloat16(), torch.exp(y[:, :33]), s + 1
def get_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    x[3] = float("-inf"); x[5, 7] = float("nan")
    return [x, torch.randn(40, 48, generator=g)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_results_match_torch(kernel_file, threads):
    """A softmax, an elementwise map, a transposed result of rows of 40 floats (160 bytes:
    a line store on every other row would fault), a bf16 one, rows of 33 floats
    (not whole lines) and a second use of the softmax, all results above a 64-byte
    threshold: the aligned rows are streamed, the results match torch."""
    cpu = dataclasses.replace(host_cpu(), stream_bytes=64)
    compiled = compile_kernel(kernel_file(KERNEL), threads=threads, target_options={"cpu": cpu})
    text = str(compiled.module)
    assert "nontemporal" in text and "llvm.x86.sse.sfence" in text
    for report in compiled.check():
        assert report.ok, str(report)


def test_the_default_threshold_leaves_small_results_alone(kernel_file):
    cpu = dataclasses.replace(host_cpu(), stream_bytes=STREAM_BYTES)
    compiled = compile_kernel(kernel_file(KERNEL), stop_after="llvm", target_options={"cpu": cpu})
    assert "nontemporal" not in str(compiled.module)


def test_the_threshold_is_a_description_field():
    assert with_overrides(host_cpu(), "stream=32M").stream_bytes == 32 << 20
    assert with_overrides(host_cpu(), "stream=0").stream_bytes == 0


def test_results_are_allocated_line_aligned(kernel_file, monkeypatch):
    """The streaming stores' precondition: result tensors start on a line, also from an
    allocator that gives 16-byte alignment only."""
    for shape, dtype in [((3,), torch.float32), ((17, 5), torch.bfloat16), ((0,), torch.float32),
                         ((4099,), torch.float64)]:
        t = line_aligned_empty(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.data_ptr() % RESULT_ALIGNMENT == 0
    real = torch.empty

    def misaligned(shape, dtype):
        n = 1
        for d in (shape if isinstance(shape, tuple) else (shape,)):
            n *= d
        return real(n + 8, dtype=dtype)[16 // torch.tensor([], dtype=dtype).element_size():][:n] \
            .view(shape)

    monkeypatch.setattr(torch, "empty", misaligned)
    assert torch.empty((5, 3), dtype=torch.float32).data_ptr() % RESULT_ALIGNMENT == 16
    t = line_aligned_empty((5, 3), torch.float32)
    assert t.shape == (5, 3) and t.data_ptr() % RESULT_ALIGNMENT == 0
