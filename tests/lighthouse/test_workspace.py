"""A CPU kernel's large intermediates in one static workspace (lighthouse.targets.workspace):
offsets packed by liveness on real IR, the buffers it must leave to malloc, and numerics of
compiled kernels whose intermediates share bytes, called again and from several threads."""

import threading

import torch
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.targets.cpu import promote_small_buffers_to_stack
from lighthouse.targets.workspace import (STACK_BYTES, allocations_into_workspace,
                                          crowded_functions, workspace_bytes)
from tests.transform_ext.helpers import check as filecheck

PAYLOAD = """
func.func @main(%x: memref<65536xf32>, %y: memref<65536xf32>) -> memref<65536xf32> {
  %c0 = arith.constant 0 : index
  %f = arith.constant 1.0 : f32
  %a = memref.alloc() {alignment = 64 : i64} : memref<65536xf32>
  %b = memref.alloc() {alignment = 64 : i64} : memref<65536xf32>
  memref.copy %x, %a : memref<65536xf32> to memref<65536xf32>
  memref.copy %a, %b : memref<65536xf32> to memref<65536xf32>
  %c = memref.alloc() {alignment = 64 : i64} : memref<256x256xf32>
  %cf = memref.collapse_shape %c [[0, 1]] : memref<256x256xf32> into memref<65536xf32>
  memref.copy %b, %cf : memref<65536xf32> to memref<65536xf32>
  %small = memref.alloc() {alignment = 64 : i64} : memref<16xf32>
  memref.store %f, %small[%c0] : memref<16xf32>
  %r = memref.alloc() {alignment = 64 : i64} : memref<65536xf32>
  memref.copy %cf, %r : memref<65536xf32> to memref<65536xf32>
  memref.copy %cf, %y : memref<65536xf32> to memref<65536xf32>
  return %r : memref<65536xf32>
}
"""


def test_buffers_share_bytes_only_when_their_live_ranges_are_disjoint():
    """a: live until b is written; b until c's view is written; c (through its collapsed
    view) to the end. a and c are disjoint: c takes a's bytes; b sits beside both. The
    16-float buffer stays a malloc, and so does r, which the function returns."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(PAYLOAD)
        assert allocations_into_workspace(module, min_bytes=1024) == 3
        assert workspace_bytes(module) == 524288
        text = str(module)
    filecheck(text, """
        CHECK: memref.global "private" @__lh_workspace_main : memref<524288xi8> = uninitialized {alignment = 64 : i64}
        CHECK: %[[WS:.*]] = memref.get_global @__lh_workspace_main
        CHECK: %[[A:.*]] = memref.view %[[WS]][%c0{{.*}}][] : memref<524288xi8> to memref<65536xf32>
        CHECK: %[[B:.*]] = memref.view %[[WS]][%c262144{{.*}}][] : memref<524288xi8> to memref<65536xf32>
        CHECK: memref.view %[[WS]][%c0{{.*}}][] : memref<524288xi8> to memref<256x256xf32>
        CHECK: memref.alloc() {{.*}} : memref<16xf32>
        CHECK: memref.alloc() {{.*}} : memref<65536xf32>
        CHECK: return
    """)


KERNEL = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.expand = nn.Conv2d(8, 48, 1, bias=False)
        self.bn = nn.BatchNorm2d(48)
        self.depthwise = nn.Conv2d(48, 48, 3, padding=1, groups=48)
        self.project = nn.Conv2d(48, 8, 1)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        h = torch.relu(self.bn(self.expand(x)))
        y = self.project(torch.nn.functional.relu6(self.depthwise(h)))
        # h read again at the end: its range spans every other intermediate's
        return y + x, h.mean(dim=1)

def get_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 8, 40, 37, generator=g)]

def get_init_inputs():
    return []
"""


def test_a_kernel_with_a_workspace_matches_torch_on_every_call_and_thread(kernel_file):
    compiled = compile_kernel(kernel_file(KERNEL), threads=1)
    lowered = str(compile_kernel(kernel_file(KERNEL), threads=1, stop_after="llvm").module)
    assert "__lh_workspace_main" in lowered
    # [2, 48, 40, 37] f32 intermediates live at once: h (to the end), and the depthwise
    # convolution's padded input or its output
    assert compiled.function.workspace_bytes >= 2 * 2 * 48 * 40 * 37 * 4
    want = compiled.expected()
    x = compiled.imported.args

    def matches(got):
        return all(torch.allclose(g, w, rtol=2e-4, atol=2e-4) for g, w in zip(got, want))

    assert matches(compiled.run(*x)) and matches(compiled.run(*x))
    # another input between two calls: no value of the first call is read by the next
    other = [torch.randn_like(t) for t in x]
    compiled.run(*other)
    assert matches(compiled.run(*x))
    results = []

    def worker():
        results.extend(matches(compiled.run(*x)) for _ in range(5))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 15


def small_buffers(count: int) -> str:
    """@main holding `count` buffers of 64 KiB in a chain of copies, and @other with one."""
    lines = ["func.func @main(%x: memref<16384xf32>, %y: memref<16384xf32>) {"]
    prev = "%x"
    for i in range(count):
        lines += [f"  %b{i} = memref.alloc() {{alignment = 64 : i64}} : memref<16384xf32>",
                  f"  memref.copy {prev}, %b{i} : memref<16384xf32> to memref<16384xf32>"]
        prev = f"%b{i}"
    lines += [f"  memref.copy {prev}, %y : memref<16384xf32> to memref<16384xf32>", "  return", "}",
              "func.func @other(%x: memref<16384xf32>) {",
              "  %a = memref.alloc() {alignment = 64 : i64} : memref<16384xf32>",
              "  memref.copy %x, %a : memref<16384xf32> to memref<16384xf32>", "  return", "}"]
    return "\n".join(lines)


def test_small_buffers_past_the_stack_budget_stay_mallocs():
    """40 buffers of 64 KiB (2.5 MiB as allocas, all live for the call: a recurrent model
    unrolled over 256 steps held 15 MB of them and overflowed the stack) stay mallocs in
    @main; @other's buffer goes on the stack; 8 of them do too."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(small_buffers(40))
        assert 40 * 65536 > STACK_BYTES
        assert crowded_functions(module) == {"main"}
        promote_small_buffers_to_stack(module)
        text = str(module)
        few = ir.Module.parse(small_buffers(8))
        assert crowded_functions(few) == set()
        promote_small_buffers_to_stack(few)
        few_text = str(few)
    filecheck(text, """
        CHECK:     func.func @main
        CHECK-NOT: memref.alloca
        CHECK-COUNT-40: memref.alloc()
        CHECK:     func.func @other
        CHECK:     memref.alloca() {{.*}} : memref<16384xf32>
    """)
    assert few_text.count("memref.alloca()") == 9 and "memref.alloc()" not in few_text


RECURRENCE = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, w):
        h = x[0]
        outputs = []
        for t in range(x.shape[0]):
            h = torch.tanh(x[t] + h @ w)
            outputs.append(h * 2)
        return torch.stack(outputs)
def get_inputs():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(40, 8, 3072, generator=g), torch.randn(3072, 3072, generator=g) * 0.02]
def get_init_inputs():
    return []
"""


def test_a_recurrence_whose_small_buffers_exceed_the_stack_matches_torch(kernel_file):
    """40 steps of [8, 3072] intermediates (96 KiB each, past the stack budget together)
    match torch, called from a thread of a 4 MiB stack (as allocas they overflowed it: a
    segmentation fault)."""
    compiled = compile_kernel(kernel_file(RECURRENCE), threads=1)
    reports = []
    default = threading.stack_size(4 * 1024 * 1024)
    try:
        thread = threading.Thread(target=lambda: reports.extend(compiled.check()))
        thread.start()
        thread.join()
    finally:
        threading.stack_size(default)
    assert reports
    for report in reports:
        assert report.ok, str(report)
