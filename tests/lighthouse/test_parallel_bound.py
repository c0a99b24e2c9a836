"""Small kernels run on one thread (lighthouse.targets.parallel_bound): the work estimate,
the target it picks, the threads the lowered parallel regions ask for, and results that
still match torch."""

import dataclasses
import re

import pytest

from lighthouse.compile import compile_kernel
from lighthouse.errors import UnsupportedError
from lighthouse.targets.description import PARALLEL_CYCLES, host_cpu, with_overrides
from lighthouse.targets.parallel_bound import MATH_OPS, estimated_cycles
from tests.conftest import ROOT
from tests.transform_ext.helpers import parse

SOFTMAX = ROOT / "examples" / "softmax.py"

MATMUL_THEN_EXP = """
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @f(%a: tensor<32x48xf32>, %b: tensor<48x64xf32>, %c: tensor<32x64xf32>) -> tensor<32x64xf32> {
  %p = linalg.matmul ins(%a, %b : tensor<32x48xf32>, tensor<48x64xf32>) outs(%c : tensor<32x64xf32>) -> tensor<32x64xf32>
  %e = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%p : tensor<32x64xf32>) outs(%c : tensor<32x64xf32>) {
  ^bb0(%x: f32, %o: f32):
    %y = math.exp %x : f32
    %z = arith.addf %y, %x : f32
    linalg.yield %z : f32
  } -> tensor<32x64xf32>
  return %e : tensor<32x64xf32>
}
"""

IN_A_LOOP = """
func.func @f(%a: tensor<64xf32>, %o: tensor<64xf32>) -> tensor<64xf32> {
  %lo = arith.constant 0 : index
  %hi = arith.constant 5 : index
  %st = arith.constant 2 : index
  %r = scf.for %i = %lo to %hi step %st iter_args(%acc = %o) -> tensor<64xf32> {
    %n = linalg.negf ins(%a : tensor<64xf32>) outs(%acc : tensor<64xf32>) -> tensor<64xf32>
    scf.yield %n : tensor<64xf32>
  }
  return %r : tensor<64xf32>
}
"""

DYNAMIC = """
func.func @f(%a: tensor<?xf32>, %o: tensor<?xf32>) -> tensor<?xf32> {
  %n = linalg.negf ins(%a : tensor<?xf32>) outs(%o : tensor<?xf32>) -> tensor<?xf32>
  return %n : tensor<?xf32>
}
"""


def test_the_estimate_counts_fmas_on_two_ports_and_body_ops_per_point():
    matmul = 32 * 48 * 64 / 16 / 2
    exp_add = 32 * 64 / 16 * (MATH_OPS + 1)
    assert estimated_cycles(parse(MATMUL_THEN_EXP), 16) == matmul + exp_add


def test_the_estimate_multiplies_by_a_loops_trips_and_gives_up_on_dynamic_sizes():
    assert estimated_cycles(parse(IN_A_LOOP), 16) == 3 * 64 / 16   # i = 0, 2, 4
    assert estimated_cycles(parse(DYNAMIC), 16) is None


def _num_threads_of_parallel_regions(module_text: str) -> set[int]:
    """The constant each lowered omp.parallel passes as num_threads."""
    constants = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((\d+) : i32\)", module_text))
    return {int(constants[v]) for v in re.findall(r"omp\.parallel num_threads\((%\w+)", module_text)}


def _compile(parallel_cycles: int, **kwargs):
    cpu = dataclasses.replace(host_cpu(), parallel_cycles=parallel_cycles)
    return compile_kernel(SOFTMAX, overrides={"N": 96, "C": 1000}, threads=2,
                          target_options={"cpu": cpu}, **kwargs)


def test_a_small_kernel_runs_on_one_thread_and_matches_torch():
    """A [96, 1000] softmax (about 10^5 estimated cycles) under a bound of 2^20: its
    parallel regions ask for one thread, a note says why, and it matches torch."""
    lowered = _compile(1 << 20, stop_after="llvm")
    assert lowered.target.threads == 1
    assert any("runs on one thread" in n for n in lowered.notes)
    assert _num_threads_of_parallel_regions(str(lowered.module)) == {1}
    compiled = _compile(1 << 20)
    for report in compiled.check():
        assert report.ok, str(report)


def test_a_kernel_over_the_bound_keeps_its_threads():
    for bound in (PARALLEL_CYCLES, 0):   # the default bound; 0: every kernel on all threads
        lowered = _compile(bound, stop_after="llvm")
        assert lowered.target.threads == 2
        assert not any("runs on one thread" in n for n in lowered.notes)
        assert _num_threads_of_parallel_regions(str(lowered.module)) == {2}


def test_the_bound_is_a_lighthouse_cpu_field():
    assert with_overrides(host_cpu(), "parallel_cycles=0").parallel_cycles == 0
    assert with_overrides(host_cpu(), "parallel_cycles=4096").parallel_cycles == 4096
    with pytest.raises(UnsupportedError, match="'parallel_cycles=-1' is not a valid size"):
        with_overrides(host_cpu(), "parallel_cycles=-1")


def test_a_tiny_mlp_on_one_thread_matches_torch(kernel_file):
    """A decode-sized MLP with a transposed result and a second use of it, small enough for
    one thread under the default bound."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(40, 24)
                self.b = torch.nn.Linear(24, 9)
            def forward(self, x):
                y = self.b(torch.relu(self.a(x)))
                return y.t(), y * 2
        def get_inputs():
            return [torch.randn(3, 40)]
        def get_init_inputs():
            return []
    """)
    cpu = dataclasses.replace(host_cpu(), parallel_cycles=PARALLEL_CYCLES)
    compiled = compile_kernel(path, threads=2, target_options={"cpu": cpu})
    assert compiled.target.threads == 1
    reports = compiled.check()
    assert len(reports) == 2 and all(r.ok for r in reports), [str(r) for r in reports]
